"""Token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.cpu_linear import Int8Weight, PackedWeight, int8_cpu_linear, packed_cpu_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [V, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Logits in float32: sampling and verification compare probabilities, so they get full precision."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [V, H]
        self.packed = PackedWeight()  # CPU fp32 only (plain attribute, see PackedWeight)
        self.int8: Int8Weight | None = None  # a drafter's weight-only int8 copy on CPU (set by layers/quant.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = int8_cpu_linear(hidden, self.weight, None, self.int8)
        if logits is not None:
            return logits  # [T, V] float32
        # fp32 CPU: oneDNN on the prepacked head won at every row count measured (scripts/cpu/bench_linear.py), so
        # it takes them all.
        logits = packed_cpu_linear(hidden, self.weight, None, self.packed, max_rows=None)
        if logits is not None:
            return logits  # [T, V]
        if hidden.device.type == "cpu" and 1 < hidden.shape[0] <= 256:
            # Without oneDNN: BLAS's skinny GEMM (a few rows against a wide vocabulary) measured slower than the
            # transposed product W @ h^T for a few to a hundred rows.
            return (self.weight @ hidden.T).T.float().contiguous()  # [T, V]
        return F.linear(hidden, self.weight).float()  # [T, V]
