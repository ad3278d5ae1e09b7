"""Triton rotary embedding, neox rotate-half, 1-D or 3-row mRoPE (reference: kernels/reference.py rope_cos_sin +
apply_rope).

One program per token rotates all q heads and all k heads of that token in place, so cos/sin are gathered once per
token. cos_sin_cache [P, D] float32 holds cos in the first half of each row and sin in the second. With mRoPE
(positions [3, T]) frequency band i of the half-dim takes its position from row 0, 1 or 2 by the sections
(s0, s1, s2): contiguous bands (sum = D/2), or interleaved as Qwen3.5 does (row 1 where i % 3 == 1 and i < 3 s1,
row 2 where i % 3 == 2 and i < 3 s2, else row 0; reference.mrope_row_of_band).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, t, num_heads, stride_t, stride_h, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """x[t, :, :half], x[t, :, half:] <- (x1 cos - x2 sin, x2 cos + x1 sin), in place."""
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask = (h < num_heads)[:, None] & (i < half)[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(cache_ptr, pos_ptr, t, half, sec0, sec01, stride_cache, stride_pos_row, stride_pos_t,
                 MROPE: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Token t's cos, sin [BLOCK_HALF] float32 (0 past half): 1-D positions, or mRoPE rows by the sections
    (sec0, sec01 as mrope_args gives them for the layout)."""
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] frequency band
    i_ok = i < half
    if MROPE:
        if INTERLEAVED:
            # band i reads row 1 (i % 3 == 1, i < 3 s1 = sec0), row 2 (i % 3 == 2, i < 3 s2 = sec01) or row 0
            pos_row = tl.where((i % 3 == 1) & (i < sec0), 1, tl.where((i % 3 == 2) & (i < sec01), 2, 0))
        else:
            # band i reads its position from row 0 (i < s0), row 1 (i < s0 + s1) or row 2
            pos_row = tl.where(i < sec0, 0, tl.where(i < sec01, 1, 2))
        pos = tl.load(pos_ptr + pos_row * stride_pos_row + t * stride_pos_t, mask=i_ok, other=0)  # [BLOCK_HALF]
        pos = pos.to(tl.int64)
    else:
        pos = tl.load(pos_ptr + t * stride_pos_t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i_ok, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + i, mask=i_ok, other=0.0)
    return cos, sin


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cache_ptr, pos_ptr, num_q_heads, num_k_heads, half, sec0, sec01,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, stride_pos_row, stride_pos_t,
                 MROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(cache_ptr, pos_ptr, t, half, sec0, sec01, stride_cache, stride_pos_row, stride_pos_t,
                            MROPE, BLOCK_HALF, INTERLEAVED)
    _rotate_heads(q_ptr, t, num_q_heads, stride_qt, stride_qh, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, t, num_k_heads, stride_kt, stride_kh, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def mrope_args(positions: torch.Tensor, mrope_section: list[int] | None, half: int,
               interleaved: bool = False) -> tuple[int, int, int]:
    """(sec0, sec01, the positions' row stride) for load_cos_sin: contiguous (s0, s0 + s1), interleaved
    (3 s1, 3 s2: the bands below them that rows 1 and 2 may take; the sections need not sum to half, as in
    transformers); 1-D positions: (half, half, 0)."""
    if positions.dim() == 1:
        return half, half, 0
    if interleaved:
        assert mrope_section is not None and len(mrope_section) == 3, "interleaved mRoPE needs 3 sections"
        return 3 * mrope_section[1], 3 * mrope_section[2], positions.stride(0)
    assert mrope_section is not None and sum(mrope_section) == half, "mRoPE sections must cover the rotary dim / 2"
    return mrope_section[0], mrope_section[0] + mrope_section[1], positions.stride(0)


def rope(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
         mrope_section: list[int] | None, mrope_interleaved: bool = False):
    """q [T, Hq, D], k [T, Hkv, D] rotated in place at positions [T] or [3, T] (mRoPE bands contiguous or
    interleaved, module docstring); returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if num_tokens == 0:
        return q, k
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rope works in place and needs a unit stride along head_dim"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    sec0, sec01, stride_pos_row = mrope_args(positions, mrope_section, half, mrope_interleaved)
    mrope = positions.dim() == 2
    num_k_heads = k.shape[1]
    block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(num_tokens,)](
        q, k, cos_sin_cache, positions, num_q_heads, num_k_heads, half, sec0, sec01,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), stride_pos_row,
        positions.stride(-1),
        MROPE=mrope, INTERLEAVED=mrope and mrope_interleaved, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half <= 4096 else 8,
    )
    return q, k
