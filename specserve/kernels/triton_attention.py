"""Triton paged attention (oracle: attention/torch_backend.py).

The KV cache of one layer is k_cache / v_cache [num_slots, Hkv, D]; the page table `table` [rows, width] int64
maps (request row, sequence index) -> slot. A query at sequence index i of request b sees keys 0..i of b.

Two kernels:
  * `fixed_width_attention` (DECODE, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_DECODE): every request has W new tokens at
    sequence indices seq_len - W .. seq_len - 1. One program per (request, KV head, KV split): the W new tokens
    times the G query heads of that KV head form the rows of one tile (GQA grouping), so each K/V block is read
    once for all of them. The key range is split over NUM_SPLITS programs ("flash decoding") so that a small batch
    with a long context still fills the GPU; the split that finishes last merges them by their log-sum-exp. The
    number of splits is a launch constant (static under CUDA graphs); each split's key range is derived from the
    live seq_len inside the kernel, so short sequences do little work in any split.
    With `prep` (AttnPrep) it also does the q/k prep of kernels/triton_qk_prep.py, so no prep launch precedes it:
    each program norms and rotates its tile's q rows in registers, and the program whose key range holds a new
    token's key norms and rotates that key, stores it and the new value into the caches, and then reads them back
    with the rest of its range (a block barrier orders its stores before its loads). Same rounding as the prep
    kernel followed by this one.
  * `varlen_attention` (EXTEND and prefill draft extend): flash-attention over a paged prefix plus causal new
    tokens. One program per (block of BLOCK_M new tokens, query head, request). Keys below the block's first query
    are visible to every row and are processed without a mask; only the diagonal band is masked.

Softmax runs in base 2 (exp2, scores pre-multiplied by scale * log2 e), statistics and accumulators in float32.
`F32_DOT` computes the products in float32: set for CPU tensors only, where the Triton interpreter's bfloat16
tl.dot is wrong (triton 3.9); probabilities are still rounded to the value dtype first, as on the GPU.

An FP8 cache (k_cache / v_cache in float8_e4m3fn or float8_e5m2, with k_scale / v_scale [S, Hkv] float32 row scales;
kernels/triton_kv_fp8.py) is dequantized inside each key tile (stored * scale in float32, rounded to q's dtype) before
the dot, and the prep's in-kernel store quantizes by the store rule. Whether the cache is FP8 is read from its element
type at compile time, so other caches compile exactly as before. Under the interpreter (F32_DOT) the roundings are
explicit (the interpreter's narrowing casts truncate), so results equal the torch reference bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.launch import one_wave_pdl, pdl_enter, pdl_kwargs
from specserve.kernels.triton_dot import dot
from specserve.kernels.triton_kv import kv_scale_args
from specserve.kernels.triton_kv_fp8 import dequantize, fp8_quantize, fp8_scale, store_rows_fp8, tile_amax
from specserve.kernels.triton_qk_prep import _normed, _rotated, _rounds_to_x

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(m_old - m_new) stays NaN-free


@triton.jit
def _kv_tile(cache_ptr, scale_ptr, slot, kv_head, stride_cs, stride_ch, stride_ss, d, kv_mask, key_ok,
             DTYPE: tl.constexpr, F32_DOT: tl.constexpr):
    """One KV head's rows at slot [BLOCK_N] (dims d [BLOCK_D]) -> [BLOCK_N, BLOCK_D] in DTYPE: the cache's values,
    an FP8 cache's dequantized by their (slot, head) scales (scale_ptr [S, Hkv], stride_ss per slot)."""
    raw = tl.load(cache_ptr + slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :], mask=kv_mask, other=0.0)
    if cache_ptr.dtype.element_ty.is_fp8():
        tile = dequantize(raw, tl.load(scale_ptr + slot * stride_ss + kv_head, mask=key_ok, other=0.0), DTYPE,
                          F32_DOT)
    else:
        tile = raw.to(DTYPE)
    return tile


@triton.jit
def _attend_block(q, k_cache_ptr, v_cache_ptr, slot, kv_head, stride_kcs, stride_kch, stride_vcs, stride_vch,
                  d, d_ok, key_ok, visible, m_i, l_i, acc, qk_scale, k_scale_ptr, v_scale_ptr, stride_ss,
                  MASKED: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a block of BLOCK_N keys.

    q [M, BLOCK_D]; slot [BLOCK_N] int64 KV slots; key_ok [BLOCK_N] keys that exist; visible [M, BLOCK_N] the
    causal mask (used when MASKED); m_i, l_i [M] running max / sum (base 2); acc [M, BLOCK_D] float32. An FP8 cache:
    k_scale_ptr / v_scale_ptr [S, Hkv] row scales (stride_ss per slot), the tiles dequantized to q's dtype."""
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = _kv_tile(k_cache_ptr, k_scale_ptr, slot, kv_head, stride_kcs, stride_kch, stride_ss, d, kv_mask, key_ok,
                 q.dtype, F32_DOT)  # [BLOCK_N, BLOCK_D]
    s = dot(q, tl.trans(k), F32_DOT, PRECISION) * qk_scale  # [M, BLOCK_N]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _kv_tile(v_cache_ptr, v_scale_ptr, slot, kv_head, stride_vcs, stride_vch, stride_ss, d, kv_mask, key_ok,
                 q.dtype, F32_DOT)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, F32_DOT, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prep_rows(row_ptrs, ok, i, w_ptr, eps, cs_ptr, pos, stride_cs, head_dim,
               HAS_NORM: tl.constexpr, W_OFFSET: tl.constexpr, X_ROUND: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The q/k prep of whole heads (rotary over all of D = 2 BLOCK_HALF dims) as the prep kernel does it
    (triton_qk_prep._norm_rope_heads): heads at row_ptrs [R, 1] (rows where ok [R]) at positions pos [R] int64 ->
    (dims [0, half), dims [half, D)) [R, BLOCK_HALF], normed (HAS_NORM), rotated and rounded as the prep kernel
    rounds what it writes back (triton_qk_prep._rotated: x's dtype under X_ROUND, else float32)."""
    m_rot = ok[:, None]
    x1 = tl.load(row_ptrs + i[None, :], mask=m_rot, other=0.0).to(tl.float32)  # [R, BLOCK_HALF]
    x2 = tl.load(row_ptrs + BLOCK_HALF + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
    if HAS_NORM:
        i_ok = i < BLOCK_HALF
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [R]
        r = tl.rsqrt(sq / head_dim + eps)[:, None]  # [R, 1]
        x1 = _normed(x1, r, w_ptr, i, i_ok, row_ptrs, W_OFFSET, X_ROUND)
        x2 = _normed(x2, r, w_ptr + BLOCK_HALF, i, i_ok, row_ptrs, W_OFFSET, X_ROUND)
    c = tl.load(cs_ptr + pos[:, None] * stride_cs + i[None, :], mask=m_rot, other=0.0)  # [R, BLOCK_HALF]
    s = tl.load(cs_ptr + pos[:, None] * stride_cs + BLOCK_HALF + i[None, :], mask=m_rot, other=0.0)
    return _rotated(x1, x2, c, s, row_ptrs.dtype.element_ty, X_ROUND)


@triton.jit
def _store_new_kv(k_new_ptr, v_new_ptr, loc_ptr, pos_ptr, cs_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, b, kv_head,
                  seq_len, start, end, head_dim, eps, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
                  stride_pos, stride_kcs, stride_kch, stride_vcs, stride_vch, k_scale_ptr, v_scale_ptr, stride_ss,
                  W: tl.constexpr, HAS_NORM: tl.constexpr, W_OFFSET: tl.constexpr, K_ROUND: tl.constexpr,
                  BLOCK_W: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, RNE: tl.constexpr):
    """The new tokens of request b whose keys fall in [start, end): key head kv_head prepped, stored with its value
    at the token's slot (an FP8 cache: quantized, their scales beside them); then a barrier, so the program's loads
    of its range see them."""
    jn = tl.arange(0, BLOCK_W)
    n_new = seq_len - W + jn  # [BLOCK_W] sequence index of new token jn
    own = (jn < W) & (n_new >= start) & (n_new < end)
    tok = (b * W + jn).to(tl.int64)
    slot = tl.load(loc_ptr + tok, mask=own, other=0).to(tl.int64)  # [BLOCK_W]
    pos = tl.load(pos_ptr + tok * stride_pos, mask=own, other=0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    k1, k2 = _prep_rows(k_new_ptr + tok[:, None] * stride_knt + kv_head * stride_knh, own, i, kw_ptr, eps, cs_ptr,
                        pos, stride_cs, head_dim, HAS_NORM, W_OFFSET, K_ROUND, BLOCK_HALF)
    cache_row = k_cache_ptr + slot[:, None] * stride_kcs + kv_head * stride_kch  # [BLOCK_W, 1]
    d = tl.arange(0, BLOCK_D)
    v = tl.load(v_new_ptr + tok[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :], mask=own[:, None])
    v_dst = v_cache_ptr + slot[:, None] * stride_vcs + kv_head * stride_vch + d[None, :]  # [BLOCK_W, BLOCK_D]
    cdt = k_cache_ptr.dtype.element_ty
    if cdt.is_fp8():  # one scale per key over both rotation halves (rows not owned are 0)
        f1, f2 = k1.to(tl.float32), k2.to(tl.float32)
        sc = fp8_scale(tl.maximum(tile_amax(f1), tile_amax(f2)), cdt)  # [BLOCK_W]
        tl.store(cache_row + i[None, :], fp8_quantize(f1, sc, cdt, RNE), mask=own[:, None])
        tl.store(cache_row + BLOCK_HALF + i[None, :], fp8_quantize(f2, sc, cdt, RNE), mask=own[:, None])
        tl.store(k_scale_ptr + slot * stride_ss + kv_head, sc, mask=own)
        store_rows_fp8(v_dst, v.to(tl.float32), own[:, None] & (d < BLOCK_D)[None, :],
                       v_scale_ptr + slot * stride_ss + kv_head, own, RNE)
    else:
        tl.store(cache_row + i[None, :], k1.to(cdt), mask=own[:, None])
        tl.store(cache_row + BLOCK_HALF + i[None, :], k2.to(cdt), mask=own[:, None])
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=own[:, None])
    tl.debug_barrier()  # every thread's stores before any thread's loads of the range (block scope)


@triton.jit
def _fixed_width_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, rows_ptr, seq_lens_ptr,
                        out_ptr, part_o_ptr, part_lse_ptr, counter_ptr, qk_scale, num_q_heads, head_dim,
                        stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_table,
                        stride_ot, stride_oh,
                        k_new_ptr, v_new_ptr, loc_ptr, cs_ptr, pos_ptr, qw_ptr, kw_ptr, eps, stride_knt, stride_knh,
                        stride_vnt, stride_vnh, stride_cs, stride_pos, k_scale_ptr, v_scale_ptr, stride_ss,
                        W: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
                        PRECISION: tl.constexpr, MERGE: tl.constexpr, GDC: tl.constexpr,
                        PREP: tl.constexpr, HAS_NORM: tl.constexpr, W_OFFSET: tl.constexpr, Q_ROUND: tl.constexpr,
                        K_ROUND: tl.constexpr, BLOCK_W: tl.constexpr):
    """PREP: q_ptr holds the unprepped q; k_new_ptr / v_new_ptr the new tokens' unprepped keys and their values,
    loc_ptr their slots, cs_ptr / pos_ptr the rotary table and positions, qw_ptr / kw_ptr the q/k norm weights
    (HAS_NORM). Unused otherwise."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_enter(GDC)  # launched with PDL (one_wave_pdl): the next kernel may launch; wait for our inputs
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # tile rows: m = j * GROUP + g  ->  new token j of request b, query head kv_head * GROUP + g
    m = tl.arange(0, BLOCK_M)  # [M]
    j = m // GROUP
    m_ok = m < W * GROUP
    tok = (b * W + j).to(tl.int64)  # [M]
    head = kv_head * GROUP + m % GROUP  # [M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh  # [M, 1]
    if PREP:
        pos = tl.load(pos_ptr + tok * stride_pos, mask=m_ok, other=0).to(tl.int64)  # [M]
        q1, q2 = _prep_rows(q_rows, m_ok, tl.arange(0, BLOCK_D // 2), qw_ptr, eps, cs_ptr, pos, stride_cs, head_dim,
                            HAS_NORM, W_OFFSET, Q_ROUND, BLOCK_D // 2)
        dt = q_ptr.dtype.element_ty
        q = tl.reshape(tl.permute(tl.join(q1.to(dt), q2.to(dt)), (0, 2, 1)), (BLOCK_M, BLOCK_D))  # [M, BLOCK_D]
    else:
        q = tl.load(q_rows + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]
    q_idx = seq_len - W + j  # [M] sequence index of each row's query

    # this split's keys: [start, end), a multiple of BLOCK_N long, from the live seq_len
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if PREP:
        _store_new_kv(k_new_ptr, v_new_ptr, loc_ptr, pos_ptr, cs_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, b, kv_head,
                      seq_len, start, end, head_dim, eps, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
                      stride_pos, stride_kcs, stride_kch, stride_vcs, stride_vch, k_scale_ptr, v_scale_ptr, stride_ss,
                      W, HAS_NORM, W_OFFSET, K_ROUND, BLOCK_W, BLOCK_D // 2, BLOCK_D, F32_DOT)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + row * stride_table
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = n < end
        slot = tl.load(table_row + n, mask=key_ok, other=0).to(tl.int64)
        visible = key_ok[None, :] & (n[None, :] <= q_idx[:, None])
        m_i, l_i, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, slot, kv_head, stride_kcs, stride_kch,
                                      stride_vcs, stride_vch, d, d_ok, key_ok, visible, m_i, l_i, acc, qk_scale,
                                      k_scale_ptr, v_scale_ptr, stride_ss, True, F32_DOT, PRECISION)

    has_mass = l_i > 0.0  # False for rows that see no key of this split
    o = acc / tl.where(has_mass, l_i, 1.0)[:, None]  # [M, BLOCK_D]
    store_mask = m_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partials laid out [T, Hq, NUM_SPLITS, (D)], contiguous
        part = (tok * num_q_heads + head) * NUM_SPLITS + split  # [M]
        lse = tl.where(has_mass, m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=m_ok)
        tl.store(part_o_ptr + part[:, None] * head_dim + d[None, :], o, mask=store_mask)
        if MERGE:
            # The split that finishes last merges them (no merge launch). The barrier orders every thread's partial
            # stores before the one-thread atomic, whose release makes them visible at GPU scope to the program
            # that acquires the final count; that program reads them through L2 (.cg), never a stale L1 line.
            tl.debug_barrier()
            counter = counter_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                base = (tok * num_q_heads + head) * NUM_SPLITS  # [M]
                mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for sp in tl.static_range(NUM_SPLITS):
                    mx = tl.maximum(mx, tl.load(part_lse_ptr + base + sp, mask=m_ok, other=float("-inf"),
                                                cache_modifier=".cg"))
                mx = tl.where(mx == float("-inf"), 0.0, mx)
                total = tl.zeros([BLOCK_M], tl.float32)
                res = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for sp in tl.static_range(NUM_SPLITS):
                    wgt = tl.math.exp2(tl.load(part_lse_ptr + base + sp, mask=m_ok, other=float("-inf"),
                                               cache_modifier=".cg") - mx)  # [M]; 0 for empty splits
                    o_sp = tl.load(part_o_ptr + (base + sp)[:, None] * head_dim + d[None, :], mask=store_mask,
                                   other=0.0, cache_modifier=".cg")
                    res += o_sp * wgt[:, None]
                    total += wgt
                res = res / tl.where(total > 0.0, total, 1.0)[:, None]
                tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                         res.to(out_ptr.dtype.element_ty), mask=store_mask)
                tl.store(counter, 0)  # the next launch (or graph replay) counts from 0 again


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_q_heads, head_dim, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    base = (t * num_q_heads + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + sp, mask=s_ok, other=float("-inf"))  # [BLOCK_S] base-2 log-sum-exp
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wgt = tl.math.exp2(lse - mx)  # [BLOCK_S]; 0 for empty splits
    o = tl.load(part_o_ptr + (base + sp)[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(wgt, axis=0)
    res = tl.sum(o * wgt[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _varlen_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, rows_ptr, seq_lens_ptr, q_starts_ptr, ext_lens_ptr,
                   out_ptr, qk_scale, head_dim,
                   stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_table,
                   stride_ot, stride_oh, k_scale_ptr, v_scale_ptr, stride_ss,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    ext = tl.load(ext_lens_ptr + b).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 < ext:  # the grid covers the longest request; shorter ones have idle tail programs
        row = tl.load(rows_ptr + b).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        q_start = tl.load(q_starts_ptr + b).to(tl.int64)
        prefix = seq_len - ext
        kv_head = head // GROUP

        m = m0 + tl.arange(0, BLOCK_M)  # [M] new-token index within the request
        m_ok = m < ext
        tok = q_start + m  # [M]
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]
        q_idx = prefix + m  # [M]

        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row = table_ptr + row * stride_table
        # keys [0, full_end) lie below every query of this block: no mask
        full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            slot = tl.load(table_row + n).to(tl.int64)
            m_i, l_i, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, slot, kv_head, stride_kcs, stride_kch,
                                          stride_vcs, stride_vch, d, d_ok, n >= 0, n >= 0, m_i, l_i, acc,
                                          qk_scale, k_scale_ptr, v_scale_ptr, stride_ss, False, F32_DOT, PRECISION)
        # the diagonal band: keys up to the block's last query, causal mask
        hi = prefix + tl.minimum(m0 + BLOCK_M, ext)
        for n0 in range(full_end, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            key_ok = n < hi
            slot = tl.load(table_row + n, mask=key_ok, other=0).to(tl.int64)
            visible = key_ok[None, :] & (n[None, :] <= q_idx[:, None])
            m_i, l_i, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, slot, kv_head, stride_kcs, stride_kch,
                                          stride_vcs, stride_vch, d, d_ok, key_ok, visible, m_i, l_i, acc,
                                          qk_scale, k_scale_ptr, v_scale_ptr, stride_ss, True, F32_DOT, PRECISION)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _dot_flags(q: torch.Tensor) -> tuple[bool, str]:
    # float32 inputs: full-precision products (the torch oracle does not use TF32 either)
    return (not q.is_cuda), ("ieee" if q.dtype == torch.float32 else "tf32")


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    return out


MERGE_MAX_PROGRAMS = 1 << 16  # requests x KV heads; larger launches merge in a second kernel


@dataclass
class AttnPrep:
    """What fixed_width_attention needs to do the q/k prep itself (triton_qk_prep.qk_norm_rope_store_triton's
    arguments but q and the caches): the new tokens' k, v [T, Hkv, D] (unit stride along D), their slots loc [T]
    int64, the rotary table cos_sin [P, D] float32 and positions [T], and optional per-head q/k RMSNorm weights
    [D] (both or neither) with eps and weight_offset (1.0: zero-centred)."""

    k: torch.Tensor
    v: torch.Tensor
    loc: torch.Tensor
    cos_sin: torch.Tensor
    positions: torch.Tensor
    q_norm_w: torch.Tensor | None = None
    k_norm_w: torch.Tensor | None = None
    eps: float = 1e-6
    weight_offset: float = 0.0

    @staticmethod
    def fits(head_dim: int, cos_sin: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether the kernel takes this prep: rotary over the whole head (no partial rotary), a head dim that is a
        power of two, 1-D positions (no mRoPE); else the prep kernel runs first."""
        return (cos_sin.shape[1] == head_dim and head_dim & (head_dim - 1) == 0 and positions.dim() == 1
                and cos_sin.dtype == torch.float32)


def _merge_counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per (request, KV head) program group of a split launch (kernels/counters.py)."""
    return arrival_counters("attention merge", device, MERGE_MAX_PROGRAMS)


def fixed_width_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                          rows: torch.Tensor, seq_lens: torch.Tensor, width: int, num_splits: int, scaling: float,
                          block_n: int = 64, out: torch.Tensor | None = None,
                          merge_in_kernel: bool = True, num_stages: int = 2,
                          prep: AttnPrep | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [bs * width, Hq, D]; rows, seq_lens [bs] (device); -> out [bs * width, Hq, D] in q's dtype. num_stages:
    the key loop's software pipelining depth (a launch option; the backend keeps the default).

    prep (AttnPrep.fits): q is not yet normed or rotated and the new tokens' k, v not yet stored; the kernel does
    both as qk_norm_rope_store_triton would (q is left as it was; the caches get the new keys and values).

    k_scale, v_scale [S, Hkv] float32: the row scales of an FP8 cache (kernels/triton_kv_fp8.py), read with it
    (and, with prep, written for the new tokens).

    With key splits, the split of each (request, KV head) that finishes last merges them (merge_in_kernel; else a
    second kernel does). Every argument that shapes the launch (bs, width, num_splits) is a host int, so this is
    capturable."""
    num_tokens, num_q_heads, head_dim = q.shape
    bs = rows.shape[0]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = _output(out, q)  # [T, Hq, D]
    if num_tokens == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    k_scale, v_scale, stride_ss = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    block_m = max(16, triton.next_power_of_2(width * group))
    block_d = triton.next_power_of_2(head_dim)
    f32_dot, precision = _dot_flags(q)
    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    merge = merge_in_kernel and num_splits > 1 and bs * num_kv_heads <= MERGE_MAX_PROGRAMS
    counters = _merge_counters(q.device) if merge else seq_lens  # unused without the in-kernel merge
    gdc = one_wave_pdl(q.device, bs * num_kv_heads * num_splits)
    _fixed_width_kernel[(bs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, table, rows, seq_lens, out, part_o, part_lse, counters, scaling * _LOG2E, num_q_heads,
        head_dim, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), table.stride(0), out.stride(0), out.stride(1), *_prep_args(prep, q), k_scale, v_scale,
        stride_ss, W=width, GROUP=group, NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        F32_DOT=f32_dot, PRECISION=precision, MERGE=merge, GDC=gdc, **_prep_flags(prep, q, width), num_warps=4,
        num_stages=num_stages, **pdl_kwargs(gdc),
    )
    if num_splits > 1 and not merge:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_o, part_lse, out, num_q_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )
    return out


def _prep_args(prep: AttnPrep | None, q: torch.Tensor) -> tuple:
    """_fixed_width_kernel's prep arguments (k_new .. stride_pos); placeholders without prep."""
    if prep is None:
        return (q, q, q, q, q, q, q, 0.0, 0, 0, 0, 0, 0, 0)
    num_tokens, _, head_dim = q.shape
    k, v, cs, pos = prep.k, prep.v, prep.cos_sin, prep.positions
    assert AttnPrep.fits(head_dim, cs, pos), "the prep needs full rotary, a power-of-two head dim and 1-D positions"
    assert k.shape[0] == v.shape[0] == prep.loc.shape[0] == pos.shape[0] == num_tokens
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cs.stride(-1) == 1
    assert (prep.q_norm_w is None) == (prep.k_norm_w is None), "both q and k norms, or neither"
    qw = prep.q_norm_w.contiguous() if prep.q_norm_w is not None else q
    kw = prep.k_norm_w.contiguous() if prep.k_norm_w is not None else q
    return (k, v, prep.loc, cs, pos, qw, kw, float(prep.eps), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cs.stride(0), pos.stride(0))


def _prep_flags(prep: AttnPrep | None, q: torch.Tensor, width: int) -> dict:
    if prep is None:
        return dict(PREP=False, HAS_NORM=False, W_OFFSET=0.0, Q_ROUND=False, K_ROUND=False, BLOCK_W=1)
    return dict(PREP=True, HAS_NORM=prep.q_norm_w is not None, W_OFFSET=float(prep.weight_offset),
                Q_ROUND=_rounds_to_x(q, prep.q_norm_w, prep.weight_offset),
                K_ROUND=_rounds_to_x(prep.k, prep.k_norm_w, prep.weight_offset),
                BLOCK_W=triton.next_power_of_2(width))


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, q_starts: torch.Tensor, ext_lens: torch.Tensor,
                     max_ext: int, scaling: float, block_m: int = 64, block_n: int = 64,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (requests' new tokens back to back); rows, seq_lens, q_starts, ext_lens [bs] (device);
    max_ext: host bound on ext_lens (sizes the grid) -> out [T, Hq, D]. k_scale, v_scale [S, Hkv] float32: the row
    scales of an FP8 cache."""
    num_tokens, num_q_heads, head_dim = q.shape
    bs = rows.shape[0]
    group = num_q_heads // k_cache.shape[1]
    out = _output(out, q)  # [T, Hq, D]
    if num_tokens == 0 or max_ext == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    k_scale, v_scale, stride_ss = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    block_d = triton.next_power_of_2(head_dim)
    f32_dot, precision = _dot_flags(q)
    _varlen_kernel[(triton.cdiv(max_ext, block_m), num_q_heads, bs)](
        q, k_cache, v_cache, table, rows, seq_lens, q_starts, ext_lens, out, scaling * _LOG2E, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1), k_scale, v_scale, stride_ss,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, F32_DOT=f32_dot, PRECISION=precision,
        num_warps=4 if block_m * block_d <= 64 * 128 else 8, num_stages=2,
    )
    return out
