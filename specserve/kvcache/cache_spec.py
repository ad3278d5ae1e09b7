"""Per-layer cache specs (docs/architecture.md): what each layer of a model keeps between forwards.

A model declares `cache_specs()`: one spec per layer that keeps a cache, in layer order. A layer finds its cache
through its index among the specs of its own kind (`cache_index`), never through its global layer number: in a
hybrid model the full-attention layers 3, 7, 11 use MHA caches 0, 1, 2 and the linear-attention layers between
them recurrent-state caches 0..8. The model runner sizes one pool per kind from one memory budget
(kvcache/caches.py); only token-indexed kinds count towards the bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.batch import CacheKind


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MHACacheSpec:
    """K and V of one layer: [slots, num_kv_heads, head_dim] each."""

    num_kv_heads: int
    head_dim: int
    kind: CacheKind = CacheKind.MHA

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """In an 8-bit float dtype each (token, KV head) row of K and of V also keeps a float32 scale
        (kvcache/kv_pool.py KVPool)."""
        return 2 * self.num_kv_heads * (self.head_dim * _itemsize(dtype) + (4 if is_fp8(dtype) else 0))


# An FP8 MLA latent row keeps one float32 scale per this many values of its latent part, and one for its rope part
# (kernels/reference_latent_fp8.py, the format).
LATENT_SCALE_GROUP = 128


def latent_scale_groups(width: int, rope_dim: int) -> int:
    """Scales per FP8 MLA latent row of `width` = kv_lora_rank + rope_dim values: cdiv(kv_lora_rank, 128) latent
    groups, then one for the rope part (512 + 64 -> 5)."""
    return -(-(width - rope_dim) // LATENT_SCALE_GROUP) + (1 if rope_dim else 0)


@dataclass(frozen=True)
class LatentCacheSpec:
    """One row of `width` values per token: an MLA latent (kv_lora_rank + qk_rope_head_dim, kind MLA; rope_dim its
    last qk_rope_head_dim values) or a sparse indexer's key (index head dim, kind INDEX_KEYS)."""

    width: int
    kind: CacheKind = CacheKind.MLA
    rope_dim: int = 0

    def __post_init__(self):
        if self.kind not in (CacheKind.MLA, CacheKind.INDEX_KEYS):
            raise ValueError(f"a latent cache is MLA or INDEX_KEYS, not {self.kind}")
        if not 0 <= self.rope_dim < self.width or (self.rope_dim and self.kind is not CacheKind.MLA):
            raise ValueError(f"rope_dim {self.rope_dim}: an MLA row's last values, fewer than its width {self.width}")

    @property
    def scale_groups(self) -> int:
        """float32 scales per row in an 8-bit float dtype: an MLA latent's groups (latent_scale_groups), one per
        indexer key."""
        return latent_scale_groups(self.width, self.rope_dim) if self.kind is CacheKind.MLA else 1

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """In an 8-bit float dtype each row also keeps its float32 scales (kvcache/kv_pool.py LatentPool)."""
        return self.width * _itemsize(dtype) + (4 * self.scale_groups if is_fp8(dtype) else 0)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The state of one linear-attention layer per request row and slot: a causal-conv window and an SSM state.
    Its dtypes belong to the model (e.g. `mamba_ssm_dtype`), not to --kv-cache-dtype."""

    conv_shape: tuple[int, ...]  # e.g. (kernel_size - 1, conv_dim): the window, oldest input first (layers/gdn.py)
    ssm_shape: tuple[int, ...]  # e.g. (num_v_heads, head_k_dim, head_v_dim)
    conv_dtype: torch.dtype = torch.bfloat16
    ssm_dtype: torch.dtype = torch.float32
    kind: CacheKind = CacheKind.RECURRENT

    def bytes_per_slot(self) -> int:
        return (math.prod(self.conv_shape) * _itemsize(self.conv_dtype)
                + math.prod(self.ssm_shape) * _itemsize(self.ssm_dtype))


CacheSpec = MHACacheSpec | LatentCacheSpec | RecurrentStateSpec


def specs_of_kind(specs: list[CacheSpec], kind: CacheKind) -> list[CacheSpec]:
    return [s for s in specs if s.kind is kind]


def bytes_per_token(specs: list[CacheSpec], dtype: torch.dtype,
                    kind_dtypes: dict[CacheKind, torch.dtype] | None = None) -> int:
    """KV bytes one token costs over every token-indexed layer (recurrent layers keep no tokens); kind_dtypes: a
    kind kept in another dtype than `dtype` (e.g. fp8 indexer keys)."""
    kind_dtypes = kind_dtypes or {}
    return sum(s.bytes_per_token(kind_dtypes.get(s.kind, dtype)) for s in specs if s.kind.token_indexed)


def bytes_per_state_row(specs: list[CacheSpec], slots_per_row: int) -> int:
    """Recurrent-state bytes one request row costs (all its slots, every recurrent layer)."""
    return slots_per_row * sum(s.bytes_per_slot() for s in specs if s.kind is CacheKind.RECURRENT)
