"""The paged MHA/GQA attention layer: projects nothing itself; stores K/V and attends through the forward batch's
MHA backend, in the K/V cache `cache_index` (its index among the model's MHA layers, kvcache/cache_spec.py)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import CacheKind, ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, cache_index: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.cache_index = cache_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        out = fb.backend(CacheKind.MHA).forward(q, k, v, self, fb)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
