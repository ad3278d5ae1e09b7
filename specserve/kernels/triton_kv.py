"""Triton KV store (reference: kernels/reference.py store_kv): k_cache[loc[t]] = k[t], v_cache[loc[t]] = v[t].

One program per token writes that token's [Hkv, D] block of K and of V (contiguous in the cache). k and v may be
strided views of the fused qkv projection. Padded tokens all write the dummy slot 0; which one wins is irrelevant.

An FP8 cache (float8 k_cache / v_cache, with k_scale / v_scale [S, Hkv] float32) gets each (token, head) row
quantized with its own scale (kernels/triton_kv_fp8.py); whether it is FP8 is read from the cache's element type at
compile time, so other caches compile as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton_kv_fp8 import store_rows_fp8


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, num_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                     k_scale_ptr, v_scale_ptr, stride_ss,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, RNE: tl.constexpr):
    """k_scale_ptr, v_scale_ptr: [S, Hkv] row scales (stride_ss per slot) of an FP8 cache; unused otherwise."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d < head_dim)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kcs + h[:, None] * stride_kch + d[None, :]  # [BLOCK_H, BLOCK_D]
    v_dst = v_cache_ptr + slot * stride_vcs + h[:, None] * stride_vch + d[None, :]
    if k_cache_ptr.dtype.element_ty.is_fp8():
        store_rows_fp8(k_dst, k.to(tl.float32), mask, k_scale_ptr + slot * stride_ss + h, h_ok, RNE)
        store_rows_fp8(v_dst, v.to(tl.float32), mask, v_scale_ptr + slot * stride_ss + h, h_ok, RNE)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k_cache, v_cache [S, Hkv, D]; loc [T] int64; k, v [T, Hkv, D]; k_scale, v_scale [S, Hkv] float32: the row
    scales of an FP8 cache (required with one, unused otherwise)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "store_kv needs a unit stride along head_dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    k_scale, v_scale, stride_ss = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc, num_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_scale, v_scale, stride_ss,
        BLOCK_H=block_h, BLOCK_D=block_d, RNE=not k.is_cuda, num_warps=4 if block_h * block_d <= 2048 else 8,
    )


def kv_scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A K/V kernel's (k_scale, v_scale, scale stride per slot) arguments: the FP8 cache's [S, Hkv] float32 row
    scales, checked; for another cache placeholders the kernel never reads."""
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert k_scale is None and v_scale is None, f"row scales given for a {k_cache.dtype} cache"
        return k_cache, v_cache, 0
    assert k_scale is not None and v_scale is not None, "an FP8 K/V cache needs its row scales"
    assert v_cache.dtype == k_cache.dtype and k_scale.dtype == v_scale.dtype == torch.float32
    assert k_scale.shape == v_scale.shape == k_cache.shape[:2] and k_scale.stride() == v_scale.stride()
    assert k_scale.stride(-1) == 1
    return k_scale, v_scale, k_scale.stride(0)
