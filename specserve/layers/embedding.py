"""Token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.linear import PackedWeight, packed_cpu_linear
from specserve.layers.quant import Int8Weight, int8_cpu_linear


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
        self.int8: Int8Weight | None = None  # a drafter's weight-only int8 copy on CPU (layers/quant.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = int8_cpu_linear(hidden, self.weight, None, self.int8)
        if logits is not None:
            return logits  # [T, V] float32
        # fp32 CPU: oneDNN on the prepacked head wins at every row count measured (SmolLM2's 49k x 576 head, 2
        # threads: 1 row 8.5 -> 4.3 ms, 4 rows 19.4 -> 5.3 ms (W @ h^T below: 5.6 ms), 64 rows 38.6 -> 25.6 ms,
        # 2048 rows 853 -> 848 ms), so it takes them all.
        logits = packed_cpu_linear(hidden, self.weight, None, self.packed, max_rows=None)
        if logits is not None:
            return logits  # [T, V]
        if hidden.device.type == "cpu" and 1 < hidden.shape[0] <= 256:
            # On CPU, BLAS's skinny GEMM (a few rows against a wide vocabulary) measured 2-3x slower than the
            # transposed product W @ h^T for 2..128 rows (SmolLM2's 49k x 576 head: 24 ms -> 8 ms at 4 rows).
            return (self.weight @ hidden.T).T.float().contiguous()  # [T, V]
        return F.linear(hidden, self.weight).float()  # [T, V]
