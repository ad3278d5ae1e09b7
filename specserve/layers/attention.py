"""The attention layer: projects nothing itself; stores K/V and calls the forward batch's backend."""

from __future__ import annotations

import torch
from torch import nn

from specserve.engine.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        out = fb.attn_backend.forward(q, k, v, self, fb)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
