"""Token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.device.type == "cpu" and 1 < hidden.shape[0] <= 256:
            # On CPU, BLAS's skinny GEMM (a few rows against a wide vocabulary) measured 2-3x slower than the
            # transposed product W @ h^T for 2..128 rows (SmolLM2's 49k x 576 head: 24 ms -> 8 ms at 4 rows).
            return (self.weight @ hidden.T).T.float().contiguous()  # [T, V]
        return F.linear(hidden, self.weight).float()  # [T, V]
