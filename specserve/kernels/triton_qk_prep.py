"""One launch per attention layer for what happens to q, k, v between the qkv projection and the attention:
optional per-head q/k RMSNorm, neox rotary on the first rot_dim dims of each head, and the K/V store (reference:
kernels/reference.py qk_norm_rope_store, the composition of rms_norm, rope_cos_sin + apply_rope and store_kv).

Grid (T, q head blocks + k head blocks + v head blocks): each program takes one token's block of q heads (normed and
rotated in place), k heads (the same, and also written into the K cache) or v heads (copied into the V cache), so
cos/sin are gathered per program and the K/V values are read once. q, k, v are strided [T, heads, D] views of the
fused projection (unit stride along D). A head is read as three tiles: dims [0, half) and [half, rot_dim), the
rotated pair, and the rest [rot_dim, D) (partial rotary), so the rotation pairs line up without shuffles.

Rounding follows the unfused ops: RMSNorm statistics in float32; with a plain weight (offset 0) the normed head is
rounded to x's dtype before the weight multiply and the product is rounded to the dtype of x * w; with a zero-centred
weight (offset 1, `(1 + w)`) the product is in float32, then rounded to x's dtype. The normed head in that dtype is
rotated in float32 and rounded to x's dtype (written back in place), then cast to the cache dtype; an FP8 cache
(k_scale / v_scale given) gets each head quantized with its own scale instead (kernels/triton_kv_fp8.py; whether the
cache is FP8 is read from its element type at compile time, so other caches compile as before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import one_wave_pdl, pdl_enter, pdl_kwargs
from specserve.kernels.triton_kv import kv_scale_args
from specserve.kernels.triton_kv_fp8 import fp8_quantize, fp8_scale, store_rows_fp8, tile_amax
from specserve.kernels.triton_rope import load_cos_sin, mrope_args

_TILE_ELEMS = 4096  # elements per head-block program: heads are packed until a program holds about this many


@triton.jit
def _normed(x, r, w_ptr, d, d_ok, x_ptr, W_OFFSET: tl.constexpr, X_ROUND: tl.constexpr):
    """RMSNorm of a head tile x [BLOCK_H, BLOCK] float32 with inverse rms r [BLOCK_H, 1] and weight dims d."""
    y = x * r
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if W_OFFSET == 0.0:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        y = y * (w + W_OFFSET)
    if X_ROUND:  # the product's dtype is x's (it is float32 only for a float32 weight on a 16-bit x)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def _rotated(x1, x2, c, s, dt, X_ROUND: tl.constexpr):
    """Neox rotary of the dims x1 and their partners x2 (float32) by cos c / sin s: (x1 c - x2 s, x2 c + x1 s) in
    float32, rounded to dt (X_ROUND) as the unfused ops materialise the rotated head. The one rotation rule of the
    prep, wherever it runs (this kernel, the qkv GEMV's epilogue, the attention kernel's prologue)."""
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if X_ROUND:
        o1 = o1.to(dt)
        o2 = o2.to(dt)
    return o1, o2


@triton.jit
def _norm_rope_heads(x_ptr, t, h0, num_heads, stride_t, stride_h, w_ptr, eps, cos, sin, half, rest, head_dim,
                     cache_ptr, slot, stride_cs, stride_ch, scale_ptr, stride_ss,
                     HAS_NORM: tl.constexpr, W_OFFSET: tl.constexpr, X_ROUND: tl.constexpr, REST: tl.constexpr,
                     STORE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                     RNE: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H - 1 of token t: normed (HAS_NORM), dims [0, 2 half) rotated, written back in place
    and (STORE) into cache row `slot` (an FP8 cache: quantized, the head's scale at scale_ptr[slot, h]). REST: the
    dims [2 half, D) are read (for the norm or the cache)."""
    h = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    i = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    h_ok = h < num_heads
    i_ok = i < half
    m_rot = h_ok[:, None] & i_ok[None, :]
    row = x_ptr + t * stride_t + h[:, None] * stride_h  # [BLOCK_H, 1]
    p1 = row + i[None, :]  # [BLOCK_H, BLOCK_HALF] dims [0, half); + half: dims [half, rot_dim)
    x1 = tl.load(p1, mask=m_rot, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=m_rot, other=0.0).to(tl.float32)
    if REST:
        j = tl.arange(0, BLOCK_REST)  # [BLOCK_REST]
        j_ok = j < rest
        m_rest = h_ok[:, None] & j_ok[None, :]
        p3 = row + 2 * half + j[None, :]  # [BLOCK_H, BLOCK_REST] dims [rot_dim, D)
        x3 = tl.load(p3, mask=m_rest, other=0.0).to(tl.float32)
    if HAS_NORM:
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_H]
        if REST:
            sq += tl.sum(x3 * x3, axis=1)
        r = tl.rsqrt(sq / head_dim + eps)[:, None]  # [BLOCK_H, 1]
        x1 = _normed(x1, r, w_ptr, i, i_ok, x_ptr, W_OFFSET, X_ROUND)
        x2 = _normed(x2, r, w_ptr + half, i, i_ok, x_ptr, W_OFFSET, X_ROUND)
        if REST:
            x3 = _normed(x3, r, w_ptr + 2 * half, j, j_ok, x_ptr, W_OFFSET, X_ROUND)
            tl.store(p3, x3.to(x_ptr.dtype.element_ty), mask=m_rest)  # (without a norm they are unchanged)
    dt = x_ptr.dtype.element_ty
    o1, o2 = _rotated(x1, x2, cos[None, :], sin[None, :], dt, X_ROUND)  # (in x's dtype, then cast to the cache's)
    tl.store(p1, o1.to(dt), mask=m_rot)
    tl.store(p1 + half, o2.to(dt), mask=m_rot)
    if STORE:
        cache_row = cache_ptr + slot * stride_cs + h[:, None] * stride_ch  # [BLOCK_H, 1]
        cdt = cache_ptr.dtype.element_ty
        if cdt.is_fp8():  # one scale over the head's three tiles (masked-out lanes are 0)
            f1, f2 = o1.to(tl.float32), o2.to(tl.float32)
            amax = tl.maximum(tile_amax(f1), tile_amax(f2))  # [BLOCK_H]
            if REST:
                amax = tl.maximum(amax, tile_amax(x3))
            sc = fp8_scale(amax, cdt)
            tl.store(cache_row + i[None, :], fp8_quantize(f1, sc, cdt, RNE), mask=m_rot)
            tl.store(cache_row + half + i[None, :], fp8_quantize(f2, sc, cdt, RNE), mask=m_rot)
            if REST:
                tl.store(cache_row + 2 * half + j[None, :], fp8_quantize(x3, sc, cdt, RNE), mask=m_rest)
            tl.store(scale_ptr + slot * stride_ss + h, sc, mask=h_ok)
        else:
            tl.store(cache_row + i[None, :], o1.to(cdt), mask=m_rot)
            tl.store(cache_row + half + i[None, :], o2.to(cdt), mask=m_rot)
            if REST:
                tl.store(cache_row + 2 * half + j[None, :], x3.to(cdt), mask=m_rest)


@triton.jit
def _copy_heads(x_ptr, t, h0, num_heads, head_dim, stride_t, stride_h, cache_ptr, slot, stride_cs, stride_ch,
                scale_ptr, stride_ss, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, RNE: tl.constexpr):
    """cache[slot, h0 + h] = x[t, h0 + h] for a block of BLOCK_H heads, cast to the cache dtype (an FP8 cache:
    quantized, each head's scale at scale_ptr[slot, h])."""
    h = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d < head_dim)[None, :]
    x = tl.load(x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :], mask=mask)
    dst = cache_ptr + slot * stride_cs + h[:, None] * stride_ch + d[None, :]  # [BLOCK_H, BLOCK_D]
    if cache_ptr.dtype.element_ty.is_fp8():
        store_rows_fp8(dst, x.to(tl.float32), mask, scale_ptr + slot * stride_ss + h, h_ok, RNE)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_prep_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, cs_ptr, pos_ptr, qw_ptr, kw_ptr, eps,
                    num_q_heads, num_kv_heads, head_dim, half, rest, sec0, sec01, num_q_blocks, num_k_blocks,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_cs, stride_pos_row, stride_pos_t,
                    k_scale_ptr, v_scale_ptr, stride_ss,
                    HAS_NORM: tl.constexpr, W_OFFSET: tl.constexpr, Q_ROUND: tl.constexpr, K_ROUND: tl.constexpr,
                    MROPE: tl.constexpr, INTERLEAVED: tl.constexpr, Q_REST: tl.constexpr, K_REST: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                    BLOCK_D: tl.constexpr, GDC: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # q head blocks, then k head blocks, then v head blocks
    pdl_enter(GDC)  # launched with PDL (one_wave_pdl): the next kernel may launch; wait for our inputs
    if part >= num_q_blocks + num_k_blocks:
        slot = tl.load(loc_ptr + t).to(tl.int64)
        h0 = (part - num_q_blocks - num_k_blocks) * BLOCK_HK
        _copy_heads(v_ptr, t, h0, num_kv_heads, head_dim, stride_vt, stride_vh, v_cache_ptr, slot, stride_vcs,
                    stride_vch, v_scale_ptr, stride_ss, BLOCK_HK, BLOCK_D, RNE)
    else:
        cos, sin = load_cos_sin(cs_ptr, pos_ptr, t, half, sec0, sec01, stride_cs, stride_pos_row, stride_pos_t,
                                MROPE, BLOCK_HALF, INTERLEAVED)
        if part >= num_q_blocks:
            slot = tl.load(loc_ptr + t).to(tl.int64)
            _norm_rope_heads(k_ptr, t, (part - num_q_blocks) * BLOCK_HK, num_kv_heads, stride_kt, stride_kh, kw_ptr,
                             eps, cos, sin, half, rest, head_dim, k_cache_ptr, slot, stride_kcs, stride_kch,
                             k_scale_ptr, stride_ss, HAS_NORM, W_OFFSET, K_ROUND, K_REST, True, BLOCK_HK, BLOCK_HALF,
                             BLOCK_REST, RNE)
        else:
            _norm_rope_heads(q_ptr, t, part * BLOCK_HQ, num_q_heads, stride_qt, stride_qh, qw_ptr,
                             eps, cos, sin, half, rest, head_dim, k_cache_ptr, t, 0, 0, k_scale_ptr, 0,
                             HAS_NORM, W_OFFSET, Q_ROUND, Q_REST, False, BLOCK_HQ, BLOCK_HALF, BLOCK_REST, RNE)


def _rounds_to_x(x: torch.Tensor, w: torch.Tensor | None, weight_offset: float) -> bool:
    """Is the reference's normed head in x's dtype? (Else float32: a float32 weight on a 16-bit x, offset 0.)"""
    if w is None or weight_offset:
        return True
    dtype = torch.promote_types(x.dtype, w.dtype)
    assert dtype in (x.dtype, torch.float32), f"q/k norm weight {w.dtype} on {x.dtype} heads"
    return dtype == x.dtype


def _block_heads(num_heads: int, head_elems: int) -> int:
    """Heads per program: a power of two, at most about _TILE_ELEMS elements, at least one head."""
    fit = max(1, _TILE_ELEMS // head_elems)
    return min(triton.next_power_of_2(num_heads), 1 << (fit.bit_length() - 1))


def qk_norm_rope_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, loc: torch.Tensor, cos_sin_cache: torch.Tensor,
                              positions: torch.Tensor, mrope_section: list[int] | None,
                              q_norm_w: torch.Tensor | None = None, k_norm_w: torch.Tensor | None = None,
                              eps: float = 1e-6, weight_offset: float = 0.0,
                              mrope_interleaved: bool = False, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k, v [T, Hkv, D]: per-head RMSNorm of q and k (weights [D], when given), rotary on the first
    rot_dim = cos_sin_cache.shape[1] dims of each head at positions [T] or [3, T] (mRoPE bands contiguous or
    interleaved: triton_rope.py), q and k written back in place;
    k_cache[loc[t]] = k[t], v_cache[loc[t]] = v[t] (caches [S, Hkv, D], loc [T] int64; an FP8 cache quantized with
    its row scales k_scale, v_scale [S, Hkv] float32). Returns (q, k).
    The launch shape depends on T and the head counts only (capturable)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "q, k, v need a unit stride along D"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    assert (q_norm_w is None) == (k_norm_w is None), "both q and k norms, or neither"
    k_scale, v_scale, stride_ss = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"rotary dim {rot_dim} vs head_dim {head_dim}"
    half, rest = rot_dim // 2, head_dim - rot_dim
    sec0, sec01, stride_pos_row = mrope_args(positions, mrope_section, half, mrope_interleaved)
    has_norm = q_norm_w is not None
    block_half = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(max(rest, 1))
    block_d = triton.next_power_of_2(head_dim)
    head_elems = max(2 * block_half + (block_rest if rest else 0), block_d)
    block_hq, block_hk = _block_heads(num_q_heads, head_elems), _block_heads(num_kv_heads, head_elems)
    num_q_blocks, num_k_blocks = triton.cdiv(num_q_heads, block_hq), triton.cdiv(num_kv_heads, block_hk)
    qw = q_norm_w.contiguous() if has_norm else q
    kw = k_norm_w.contiguous() if has_norm else k
    grid = (num_tokens, num_q_blocks + 2 * num_k_blocks)
    gdc = one_wave_pdl(q.device, grid[0] * grid[1])
    _qk_prep_kernel[grid](
        q, k, v, k_cache, v_cache, loc, cos_sin_cache, positions, qw, kw, float(eps),
        num_q_heads, num_kv_heads, head_dim, half, rest, sec0, sec01, num_q_blocks, num_k_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos_sin_cache.stride(0),
        stride_pos_row, positions.stride(-1), k_scale, v_scale, stride_ss,
        HAS_NORM=has_norm, W_OFFSET=float(weight_offset), Q_ROUND=_rounds_to_x(q, q_norm_w, weight_offset),
        K_ROUND=_rounds_to_x(k, k_norm_w, weight_offset), MROPE=positions.dim() == 2,
        INTERLEAVED=positions.dim() == 2 and mrope_interleaved,
        Q_REST=rest > 0 and has_norm, K_REST=rest > 0, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_HALF=block_half, BLOCK_REST=block_rest, BLOCK_D=block_d, GDC=gdc, RNE=not q.is_cuda, num_warps=4,
        **pdl_kwargs(gdc),
    )
    return q, k
