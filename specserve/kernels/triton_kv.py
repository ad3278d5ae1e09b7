"""Triton KV store (reference: kernels/reference.py store_kv): k_cache[loc[t]] = k[t], v_cache[loc[t]] = v[t].

One program per token writes that token's [Hkv, D] block of K and of V (contiguous in the cache). k and v may be
strided views of the fused qkv projection. Padded tokens all write the dummy slot 0; which one wins is irrelevant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, num_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (h < num_heads)[:, None] & (d < head_dim)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kcs + h[:, None] * stride_kch + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + h[:, None] * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache, v_cache [S, Hkv, D]; loc [T] int64; k, v [T, Hkv, D]."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "store_kv needs a unit stride along head_dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc, num_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d <= 2048 else 8,
    )
