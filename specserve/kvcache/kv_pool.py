"""Token-indexed pools of one model (target or draft). All index the same slots through the shared page table."""

from __future__ import annotations

import torch

from specserve.batch import CacheKind
from specserve.kvcache.cache_spec import LatentCacheSpec, MHACacheSpec, is_fp8


class KVPool:
    """K/V of every MHA layer: layer i (its MHA cache index) has k[i], v[i] of [num_slots, kv_heads, head_dim].

    In an 8-bit float dtype (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) each (slot, KV head) row of K and of V has its
    own float32 scale, k_scale[i], v_scale[i] of [num_slots, kv_heads] (row = stored * scale; the rule:
    kernels/reference_kv_fp8.py); else k_scale and v_scale are None. The scales are fixed allocations of the pool,
    so captured graphs read and write them through fixed pointers."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # [num_slots, kv_heads, head_dim] per layer; separate tensors so one layer's write never touches another's.
        self.k = [torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype, device=device) for _ in
                  range(num_layers)]
        self.v = [torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype, device=device) for _ in
                  range(num_layers)]
        # [num_slots, kv_heads] per layer; ones, so the zero rows of unwritten slots (dummy slot 0) read as zeros
        self.k_scale = self.v_scale = None
        if is_fp8(dtype):
            self.k_scale = [torch.ones((num_slots, num_kv_heads), dtype=torch.float32, device=device) for _ in
                            range(num_layers)]
            self.v_scale = [torch.ones((num_slots, num_kv_heads), dtype=torch.float32, device=device) for _ in
                            range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    @staticmethod
    def from_specs(specs: list[MHACacheSpec], num_slots: int, dtype: torch.dtype, device: torch.device) -> KVPool:
        shapes = {(s.num_kv_heads, s.head_dim) for s in specs}
        if len(shapes) != 1:
            raise ValueError(f"MHA layers of one model must share (kv heads, head dim); got {sorted(shapes)}")
        (heads, dim), = shapes
        return KVPool(len(specs), num_slots, heads, dim, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return MHACacheSpec(num_kv_heads, head_dim).bytes_per_token(dtype) * num_layers


class LatentPool:
    """One row per token per layer (MLA latent or indexer keys): rows[i] of [num_slots, width]. In an 8-bit float
    dtype each row has float32 scales: an MLA latent one per group of its values, scales[i] of [num_slots, groups]
    (kernels/reference_latent_fp8.py: 128 latent values a group, the rope part its own), an indexer key one,
    scales[i] of [num_slots] (row = stored * scale). Ones at init, so unwritten slots (dummy slot 0) read as zeros."""

    def __init__(self, specs: list[LatentCacheSpec], num_slots: int, dtype: torch.dtype, device: torch.device):
        self.kind = specs[0].kind
        self.num_layers = len(specs)
        self.num_slots = num_slots
        self.dtype = dtype
        self.rows = [torch.zeros((num_slots, s.width), dtype=dtype, device=device) for s in specs]
        self.scales = ([torch.ones((num_slots, s.scale_groups) if s.kind is CacheKind.MLA else num_slots,
                                   dtype=torch.float32, device=device) for s in specs] if is_fp8(dtype) else None)
