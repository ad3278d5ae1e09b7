"""The paged MHA/GQA attention layer: projects nothing itself; stores K/V and attends through the forward batch's
MHA backend, in the K/V cache `cache_index` (its index among the model's MHA layers, kvcache/cache_spec.py).

What the layer does to q and k before the store (optional per-head RMSNorms, then rotary) travels with the call as a
`QKPrep`, so the backend can run it and the K/V store as one op (kernels/ops.py qk_norm_rope_store). A layer whose
qkv projection already did both (kernels/ops.py norm_gemv_rope_store, decode rows) passes `STORED` instead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specserve.batch import CacheKind, ForwardBatch
from specserve.kernels import ops
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding


@dataclass
class QKPrep:
    """Per-head q/k RMSNorms (both or neither; one eps and one kind of weight) and rotary at positions [T] or [3, T]
    on the first rot_dim = rotary.cos_sin_cache.shape[1] dims of each head."""

    rotary: RotaryEmbedding
    positions: torch.Tensor
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __post_init__(self):
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("QKPrep takes both q and k norms, or neither")
        if self.q_norm is not None and (self.q_norm.eps, self.q_norm.zero_centered) != (self.k_norm.eps,
                                                                                        self.k_norm.zero_centered):
            raise ValueError("the q and k norms must share eps and weight convention")

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused ops, for a backend that keeps no cache: q [T, Hq, D], k [T, Hkv, D] -> normed, rotated."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(self.positions, q, k)

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              loc: torch.Tensor, fused: Callable = ops.qk_norm_rope_store, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms and rotary on q, k (written in place), then k, v stored at loc [T] (an FP8 cache: quantized with
        its row scales k_scale, v_scale [S, Hkv]), by `fused` (an ops.qk_norm_rope_store signature) -> the (q, k)
        to attend with."""
        cos_sin, positions, qw, kw, eps, offset = self.kernel_args()
        scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
        return fused(q, k, v, k_cache, v_cache, loc, cos_sin, positions, self.rotary.mrope_section, qw, kw, eps,
                     offset, mrope_interleaved=self.rotary.mrope_interleaved, **scales)

    def kernel_args(self) -> tuple:
        """(cos_sin [P, rot_dim] float32, positions as the table is read, q norm weight, k norm weight, eps,
        weight offset): what a kernel doing this prep takes (norm weights None without norms)."""
        qw = kw = None
        eps, offset = 1e-6, 0.0
        if self.q_norm is not None:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            offset = self.q_norm.weight_offset
        return (self.rotary.cos_sin_cache, self.rotary.table_positions(self.positions), qw, kw, eps, offset)


class StoredQK:
    """The prep of a layer whose q|k|v projection did it in its epilogue (kernels/ops.py norm_gemv_rope_store): q
    and k already rotated in place, k and v already stored; store() has nothing left to do."""

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              loc: torch.Tensor, fused: Callable | None = None, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


STORED = StoredQK()


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, cache_index: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.cache_index = cache_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                prep: QKPrep | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. With prep, q and k are as projected: the backend applies
        prep's norms and rotary (fused with its K/V store)."""
        out = fb.backend(CacheKind.MHA).forward(q, k, v, self, fb, prep)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def kv_caches(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k_cache, v_cache) [S, Hkv, D] in the step's paged MHA backend, for a projection that stores
        into them itself (StoredQK; decode rows only, which a cacheless training backend never runs)."""
        return fb.backend(CacheKind.MHA).layer_kv(self)

    def kv_scales(self, fb: ForwardBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This layer's (k_scale, v_scale) [S, Hkv] row scales in an FP8 cache, (None, None) otherwise: whoever
        writes kv_caches writes these too."""
        return fb.backend(CacheKind.MHA).layer_scales(self)
