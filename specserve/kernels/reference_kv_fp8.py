"""Torch reference of the FP8 KV cache (kvcache/kv_pool.py KVPool in float8_e4m3fn / float8_e5m2): the store rule
and the read. The oracle of kernels/triton_kv_fp8.py and of every Triton writer and reader of an FP8 K/V cache.

One float32 scale per (token slot, KV head) for K and for V. A row x of head_dim values is stored, in float32, as

    amax = max(|x|);  s = max(amax, 1e-10) / FMAX;  stored = fp8(clamp(x / s, -FMAX, FMAX))

(FMAX: the format's largest finite value, 448 for e4m3fn, 57344 for e5m2; torch's cast rounds to nearest even) and
read as stored * s in float32, rounded to the query's dtype. A scale per row, not per tensor: the row's largest value
maps onto FMAX, so a row of small values keeps its relative precision whatever its neighbours hold (a per-tensor
scale squeezes such rows into subnormals, which lowers speculative acceptance).
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_AMAX = 1e-10  # a row of zeros gets a tiny scale, never a division by zero


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, min_amax: float = MIN_AMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (stored [..., D] in dtype, scales [...] float32) by the rule above (min_amax: the floor of a
    row's largest magnitude; the DSA index keys' format floors at 1e-12: reference.quantise_rows_fp8)."""
    fmax = FP8_MAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(min_amax)  # [...]
    s = amax / amax.new_tensor(fmax)  # [...] a tensor divisor: reference_fp8._quantize_groups says why
    return (xf / s[..., None]).clamp(-fmax, fmax).to(dtype), s


def dequantize_kv(stored: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored [..., D] fp8, scales [...] float32 -> [..., D] in dtype (the product in float32, then rounded)."""
    return (stored.float() * scales[..., None]).to(dtype)


def store_kv_fp8(cache: torch.Tensor, scale: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """cache [S, Hkv, D] fp8, scale [S, Hkv] float32: rows x [T, Hkv, D] quantized into slots loc [T]."""
    stored, s = quantize_kv(x, cache.dtype)
    cache[loc] = stored
    scale[loc] = s
