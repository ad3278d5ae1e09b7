"""Memory-bound Triton GEMVs for decode rows (M <= 16 tokens) on CUDA, with their neighbours fused in (references:
F.linear, and kernels/reference.py add_rms_norm / rms_norm and silu_and_mul).

At batch 1 a dense layer's projections read megabytes of weights for one activation row, and the small kernels
around them (the residual add + RMSNorm before qkv and gate_up, the SiLU-and-mul after gate_up, cuBLAS's split-K
reduce) and the gaps between launches cost as much as the weights' bytes on small models. Here:

`gemv`: y [M, N] = x [M, K] @ w[N, K]^T (+ bias), one launch, no split-K reduce.

`norm_gemv`: the RMSNorm of h = x + residual fused into the GEMV's prologue (and, with silu_mul, SiLU(gate) * up
in its epilogue), one launch; it also returns h (the new residual).

`norm_gemv_rope_store`: norm_gemv on an attention layer's q|k|v weight with the layer's q/k prep
(kernels/triton_qk_prep.py: optional per-head q/k RMSNorms, neox rotary on q and k, K and V stored into the paged
caches) in its epilogue, so the prep launch goes (the epilogue: kernels/triton_gemv_rope.py).

One row (a decode step at batch 1) runs the GEMV below. 2..16 rows (verify's N + 1, a small batch) run, for a
weight shape with a measured row-GEMV config (`tuned_h200.GEMV_TUNED_ROWS`, up to ROWS_GEMV_MAX rows), the same
GEMV with the rows unrolled (each weight tile loaded once, one accumulator tile per row), else a skinny GEMM with the
same fusions and rounding (`_rows_kernel`): each weight tile multiplied with every row on the tensor cores (tl.dot,
rows padded to 16), a [16, BLOCK_N] float32 accumulator, tiles of at least 16.

Grid cdiv(N_out, BLOCK_N): each program owns BLOCK_N output columns (BLOCK_N weight rows, or with silu_mul BLOCK_N
gate rows and the same BLOCK_N up rows) and loops over all of K in BLOCK_K steps (`tl.range`, pipelined by
num_stages), so the result does not depend on the grid (deterministic; no atomics). Per row of x it accumulates a
[BLOCK_N, BLOCK_K] float32 tile of products (the M rows unrolled with tl.static_range, reusing each loaded weight
tile) and reduces over K once, after the loop. Many small programs (a few weight rows each) keep several in flight
on every SM.

The RMSNorm prologue: every program first sums the squares of its rows over all of K itself (the rows come from
L2 after the first programs; one launch, no cross-program sync), then recomputes the normed activation of each K
step as it consumes it. Program 0 writes h.

Rounding follows the unfused torch ops, with float32 accumulation: h = x + residual is rounded to x's dtype and the
statistics are over the rounded h in float32; weight_offset 0 (Llama, Qwen): the normed row is rounded to x's dtype,
then its product with the norm weight is rounded too, `(hf * rsqrt(var + eps)).to(x.dtype) * w`; weight_offset != 0
(zero-centred norms): `(hf * rsqrt(var + eps) * (w.float() + offset)).to(x.dtype)`. The GEMV consumes that x.dtype
activation; its float32 sums (+ bias, in float32) are rounded once to x's dtype as F.linear's output is. silu_mul:
gate and up are each rounded, then silu(gate) is rounded and its product with up rounded, as
`silu_and_mul(F.linear(a, w))` in bfloat16. bfloat16 rounding is to nearest even by hand (`_rounded`), as the GPU's
conversion does, because Triton's interpreter (CPU tests) truncates instead. The sums differ from cuBLAS's only in
the order of accumulation.

LATE_RSTD (a launch config key of the row GEMV; on only in SmolLM2's tuned launches, measured slower on the larger K
of Llama-3.1-8B, Qwen3-8B and Qwen3-30B-A3B): W (h * w) / rms(h) computed as rstd * sum_k W_k (h_k w_k) in float32, the
squares summed in the same K loop, so a program's first weight load waits for nothing. The normed activation is
then never rounded to x's dtype (nor h * rstd before the weight multiply): outputs within the output rounding of the
exact-rounding path (closer to the float32 result), not bit-equal to the unfused ops'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import one_wave_pdl, pdl_kwargs, pdl_supported
from specserve.kernels.rope_store import RopeStore
from specserve.kernels.triton_dot import dot
from specserve.kernels.triton_gemv_rope import (
    _norm_rope_head,
    _rope_args,
    _rope_columns,
    _rope_flags,
    _rope_store_epilogue,
)
from specserve.kernels.tuned_h200 import GEMV_PDL_MAX_BYTES, GEMV_PDL_SHAPES, GEMV_TUNED, GEMV_TUNED_ROWS, SMS

MAX_ROWS = 16  # rows a call takes: one (the GEMV) or up to a tl.dot tile of rows (the skinny GEMM)

ROWS_GEMV_MAX = 8  # the unrolled GEMV keeps one [BLOCK_N, BLOCK_K] float32 tile a row: more rows would spill
_PROGRAMS_PER_SM = 4  # the heuristic launches aim for this many programs on each of tuned_h200.SMS


@triton.jit
def _rounded(v, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """float32 v -> float32 holding v rounded to DTYPE (to nearest even; bfloat16 by hand, see the module doc)."""
    if ROUND_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = v.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def _load_h(x_ptr, r_ptr, m, k, k_ok, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Row m of h = x + residual at columns k [BLOCK_K], float32 of the value rounded to x's dtype (0 past K)."""
    h = tl.load(x_ptr + m * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + m * stride_r + k, mask=k_ok, other=0.0).to(tl.float32)
        h = _rounded(h + r, x_ptr.dtype.element_ty, ROUND_BF16)
    return h


@triton.jit
def _w_tiles(gate_rows, up_rows, k, w_mask, SILU: tl.constexpr):
    """One K step of the program's weight rows as float32: gate (all) rows [BLOCK_N, BLOCK_K] and up rows (SILU)."""
    wg = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
    wu = wg
    if SILU:
        wu = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
    return wg, wu


@triton.jit
def _accumulate(acc, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, rstd, stride_x, stride_r, M: tl.constexpr,
                NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_OFFSET: tl.constexpr, SILU: tl.constexpr,
                ROUND_BF16: tl.constexpr):
    """acc (per row [BLOCK_N, BLOCK_K] float32: gate rows, then with SILU up rows) += this K step's products."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
    acts = ()  # per row [BLOCK_K] float32 of the x.dtype activation
    for m in tl.static_range(M):
        if NORM:
            h = _load_h(x_ptr, r_ptr, m, k, k_ok, stride_x, stride_r, HAS_RESIDUAL, ROUND_BF16)
            if W_OFFSET == 0.0:
                a = _rounded(_rounded(h * rstd[m], dtype, ROUND_BF16) * nw, dtype, ROUND_BF16)
            else:
                a = _rounded(h * rstd[m] * (nw + W_OFFSET), dtype, ROUND_BF16)
        else:
            a = tl.load(x_ptr + m * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        acts = acts + (a,)
    new_acc = ()
    for m in tl.static_range(M):
        new_acc = new_acc + (acc[m] + wg * acts[m][None, :],)
    if SILU:
        for m in tl.static_range(M):
            new_acc = new_acc + (acc[M + m] + wu * acts[m][None, :],)
    return new_acc


@triton.jit
def _accumulate_late(acc, sq, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, h_ptr, pid, stride_x, stride_r, stride_h,
                     M: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_OFFSET: tl.constexpr, SILU: tl.constexpr,
                     ROUND_BF16: tl.constexpr):
    """LATE_RSTD's K step: (acc, sq) with acc += the products of the weight tiles with h * w (h = x + residual
    rounded to x's dtype, w the norm weight (+ W_OFFSET), in float32, not rounded: 1/rms is applied after the loop)
    and sq (per row [BLOCK_K]) += h * h; program 0 stores h, the new residual."""
    nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32) + W_OFFSET  # [BLOCK_K]
    new_acc = ()
    new_sq = ()
    acts = ()
    for m in tl.static_range(M):
        h = _load_h(x_ptr, r_ptr, m, k, k_ok, stride_x, stride_r, HAS_RESIDUAL, ROUND_BF16)
        if HAS_RESIDUAL and pid == 0:
            tl.store(h_ptr + m * stride_h + k, h.to(x_ptr.dtype.element_ty), mask=k_ok)
        new_sq = new_sq + (sq[m] + h * h,)
        acts = acts + (h * nw,)
    for m in tl.static_range(M):
        new_acc = new_acc + (acc[m] + wg * acts[m][None, :],)
    if SILU:
        for m in tl.static_range(M):
            new_acc = new_acc + (acc[M + m] + wu * acts[m][None, :],)
    return new_acc, new_sq


@triton.jit
def _k_step(acc, sq, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, h_ptr, pid, rstd, stride_x, stride_r, stride_h,
            M: tl.constexpr, NORM: tl.constexpr, LATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
            W_OFFSET: tl.constexpr, SILU: tl.constexpr, ROUND_BF16: tl.constexpr):
    """One K step of the row GEMV: (acc, sq) by _accumulate_late under LATE (LATE_RSTD), else by _accumulate (sq
    unchanged)."""
    if LATE:
        acc, sq = _accumulate_late(acc, sq, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, h_ptr, pid, stride_x, stride_r,
                                   stride_h, M, HAS_RESIDUAL, W_OFFSET, SILU, ROUND_BF16)
    else:
        acc = _accumulate(acc, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, rstd, stride_x, stride_r, M, NORM,
                          HAS_RESIDUAL, W_OFFSET, SILU, ROUND_BF16)
    return acc, sq


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, n_out, K, eps, up_offset,
                 stride_x, stride_r, stride_h, stride_w, stride_y,
                 pos_ptr, loc_ptr, cs_ptr, kc_ptr, vc_ptr, rot_programs, q_heads, half, stride_cs,
                 stride_kcs, stride_kch, stride_vcs, stride_vch, part_ptr, count_ptr, qn_ptr, kn_ptr, qk_eps,
                 M: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_OFFSET: tl.constexpr,
                 SILU: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
                 GDC: tl.constexpr, NORM_BLOCK: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                 QK_W_OFFSET: tl.constexpr, HALF_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
                 LATE_RSTD: tl.constexpr):
    """Program i: output columns i*BLOCK_N .. + BLOCK_N of all M rows. x [M, K] (row stride stride_x), w [N, K]
    (row stride stride_w; with SILU N = 2 n_out, gate rows then up rows), y [M, n_out]. NORM: the activation is the
    RMSNorm of h = x (+ residual r [M, K]) with weight nw [K]; program 0 stores h [M, K] (with a residual); the
    statistics are summed NORM_BLOCK columns a step (norm_block: a hidden size's K in one step).
    PDL (launched with programmatic dependent launch): 0 off; 1 lets the next kernel launch at once, 2 only after
    the main loop; either way the first K step's weights (never written by another kernel) are loaded before
    gdc_wait, and everything the previous kernel writes (x, r) is read, and every output written, after it. GDC:
    emit the grid-dependency instructions (CUDA; off under the interpreter, which then runs PDL's order of loads
    without them).
    ROPE: y is an attention layer's fused q|k|v projection, and the epilogue does the q/k prep's work (rotary on q
    and k, K and V stored into the caches; see _rope_store_epilogue): the first rot_programs programs own rotation
    pairs, BLOCK_N / 2 dims of a head and their partners half dims on (_rope_columns), the rest V columns. QK_NORM:
    each q and k head is RMS-normed first (weights qn / kn [D], eps qk_eps; _norm_rope_head), by the last of its
    programs.
    LATE_RSTD (only with NORM): no statistics prologue; the K loop also sums the squares, and each row's 1/rms
    scales the float32 sums after it (see the module doc: not the unfused ops' rounding)."""
    pid = tl.program_id(0)
    if ROPE:
        cols = _rope_columns(pid, rot_programs, half, BLOCK_N)  # [BLOCK_N]
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    dtype = x_ptr.dtype.element_ty
    gate_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    up_rows = gate_rows + up_offset  # [BLOCK_N, 1] (read only with SILU)
    k_first = 0
    if PDL:
        if PDL == 1 and GDC:
            tl.extra.cuda.gdc_launch_dependents()
        first_ok = ks < K
        wg0, wu0 = _w_tiles(gate_rows, up_rows, ks, col_ok[:, None] & first_ok[None, :], SILU)
        k_first = BLOCK_K
        if GDC:
            tl.extra.cuda.gdc_wait()  # the previous kernel's outputs (x, the residual) are complete and visible

    # RMSNorm statistics: each row's sum of squares over all of K (h rounded first), in float32.
    rstd = ()
    if NORM and not LATE_RSTD:
        nks = tl.arange(0, NORM_BLOCK)  # [NORM_BLOCK]: a hidden size's K in one step (one round trip, not K/BLOCK_K)
        sq = ()
        for _ in tl.static_range(M):
            sq = sq + (tl.zeros([NORM_BLOCK], dtype=tl.float32),)
        for k0 in tl.range(0, K, NORM_BLOCK):
            k = k0 + nks
            k_ok = k < K
            new_sq = ()
            for m in tl.static_range(M):
                h = _load_h(x_ptr, r_ptr, m, k, k_ok, stride_x, stride_r, HAS_RESIDUAL, ROUND_BF16)
                if HAS_RESIDUAL and pid == 0:  # the new residual, once
                    tl.store(h_ptr + m * stride_h + k, h.to(dtype), mask=k_ok)
                new_sq = new_sq + (sq[m] + h * h,)
            sq = new_sq
        for m in tl.static_range(M):
            rstd = rstd + (tl.rsqrt(tl.sum(sq[m], 0) / K + eps),)

    acc = ()  # per row [BLOCK_N, BLOCK_K] float32 partial products of the gate (all) rows, then of the up rows
    for _ in tl.static_range(M * (2 if SILU else 1)):
        acc = acc + (tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32),)
    sums = ()  # LATE_RSTD: per row [BLOCK_K] float32 sums of squares, summed in the K loop
    if LATE_RSTD:
        for _ in tl.static_range(M):
            sums = sums + (tl.zeros([BLOCK_K], dtype=tl.float32),)
    if PDL:  # the first K step, from the weights loaded before the wait
        acc, sums = _k_step(acc, sums, wg0, wu0, ks, first_ok, x_ptr, r_ptr, nw_ptr, h_ptr, pid, rstd, stride_x,
                            stride_r, stride_h, M, NORM, LATE_RSTD, HAS_RESIDUAL, W_OFFSET, SILU, ROUND_BF16)
    for k0 in tl.range(k_first, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + ks
        k_ok = k < K
        wg, wu = _w_tiles(gate_rows, up_rows, k, col_ok[:, None] & k_ok[None, :], SILU)
        acc, sums = _k_step(acc, sums, wg, wu, k, k_ok, x_ptr, r_ptr, nw_ptr, h_ptr, pid, rstd, stride_x, stride_r,
                            stride_h, M, NORM, LATE_RSTD, HAS_RESIDUAL, W_OFFSET, SILU, ROUND_BF16)
    if LATE_RSTD:
        for m in tl.static_range(M):
            rstd = rstd + (tl.rsqrt(tl.sum(sums[m], 0) / K + eps),)
    if PDL == 2 and GDC:
        tl.extra.cuda.gdc_launch_dependents()  # only now: its waiting programs never hold SMs this grid needs

    if HAS_BIAS:
        bg = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        if SILU:
            bu = tl.load(b_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)
    for m in tl.static_range(M):
        y = tl.sum(acc[m], 1)  # [BLOCK_N]
        if LATE_RSTD:
            y = y * rstd[m]
        if HAS_BIAS:
            y += bg
        y = _rounded(y, dtype, ROUND_BF16)
        if SILU:
            u = tl.sum(acc[M + m], 1)
            if LATE_RSTD:
                u = u * rstd[m]
            if HAS_BIAS:
                u += bu
            u = _rounded(u, dtype, ROUND_BF16)
            y = _rounded(_rounded(y / (1.0 + tl.exp(-y)), dtype, ROUND_BF16) * u, dtype, ROUND_BF16)
        if ROPE:
            _rope_store_epilogue(y, m, pid, cols, y_ptr, stride_y, pos_ptr, loc_ptr, cs_ptr, kc_ptr, vc_ptr,
                                 rot_programs, q_heads, half, stride_cs, stride_kcs, stride_kch, stride_vcs,
                                 stride_vch, part_ptr, BLOCK_N, QK_NORM)
        else:
            tl.store(y_ptr + m * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)
    if QK_NORM and pid < rot_programs:
        _norm_rope_head(pid, y_ptr, stride_y, pos_ptr, loc_ptr, cs_ptr, kc_ptr, part_ptr, count_ptr, qn_ptr, kn_ptr,
                        qk_eps, rot_programs, q_heads, half, stride_cs, stride_kcs, stride_kch, M, BLOCK_N,
                        QK_W_OFFSET, HALF_PAD, PARTS_PAD)


@triton.jit
def _rows_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, n_out, K, eps, up_offset,
                 stride_x, stride_r, stride_h, stride_w, stride_y,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_OFFSET: tl.constexpr, SILU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """_gemv_kernel's contract for 2..BLOCK_M rows (verify's), as a skinny GEMM: each weight tile is loaded once
    and multiplied with all rows at once on the tensor cores (tl.dot, the rows padded to BLOCK_M), the accumulator
    [BLOCK_M, BLOCK_N] float32 instead of a [BLOCK_N, BLOCK_K] tile per row. The activations are rounded to x's
    dtype exactly as in _gemv_kernel before the product."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    dtype = x_ptr.dtype.element_ty
    gate_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    up_rows = gate_rows + up_offset
    m2 = rows[:, None]  # [BLOCK_M, 1]

    if NORM:  # each row's sum of squares over all of K (h rounded first), in float32
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            k = k0 + ks
            ok = row_ok[:, None] & (k < K)[None, :]
            h = _load_h(x_ptr, r_ptr, m2, k[None, :], ok, stride_x, stride_r, HAS_RESIDUAL, ROUND_BF16)
            if HAS_RESIDUAL and pid == 0:  # the new residual, once
                tl.store(h_ptr + m2 * stride_h + k[None, :], h.to(dtype), mask=ok)
            sq += h * h
        rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)[:, None]  # [BLOCK_M, 1]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + ks
        k_ok = k < K
        ok = row_ok[:, None] & k_ok[None, :]  # [BLOCK_M, BLOCK_K]
        w_mask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K] in x's dtype
        if NORM:
            h = _load_h(x_ptr, r_ptr, m2, k[None, :], ok, stride_x, stride_r, HAS_RESIDUAL, ROUND_BF16)
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
            if W_OFFSET == 0.0:
                a = _rounded(_rounded(h * rstd, dtype, ROUND_BF16) * nw, dtype, ROUND_BF16)
            else:
                a = _rounded(h * rstd * (nw + W_OFFSET), dtype, ROUND_BF16)
            a = a.to(dtype)
        else:
            a = tl.load(x_ptr + m2 * stride_x + k[None, :], mask=ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += dot(a, tl.trans(wg), F32_DOT, PRECISION)
        if SILU:
            wu = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
            acc_u += dot(a, tl.trans(wu), F32_DOT, PRECISION)

    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _rounded(acc, dtype, ROUND_BF16)
    if SILU:
        if HAS_BIAS:
            acc_u += tl.load(b_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        u = _rounded(acc_u, dtype, ROUND_BF16)
        y = _rounded(_rounded(y / (1.0 + tl.exp(-y)), dtype, ROUND_BF16) * u, dtype, ROUND_BF16)
    tl.store(y_ptr + m2 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype, silu_mul: bool = False) -> dict[str, int]:
    """Launch parameters (BLOCK_N, BLOCK_K, num_warps, num_stages) for x [m, k] and a weight [n, k] (silu_mul: n =
    2I rows, BLOCK_N counts output columns, each program reads 2 BLOCK_N rows). One row (the GEMV): GEMV_TUNED (n, k)
    first, else a heuristic: K steps of 1 kB of each weight row (16-byte loads, 512 bf16) unless that pads K by more
    than an eighth, and the most output columns a program (16 weight rows at most) that still gives
    _PROGRAMS_PER_SM programs per SM, down to 2. 2..ROWS_GEMV_MAX rows: GEMV_TUNED_ROWS (n, k) (the row-unrolled GEMV,
    marked GEMV=1) where listed; otherwise, and for more rows, the skinny GEMM (_rows_config)."""
    if m > 1:
        if m <= ROWS_GEMV_MAX and (n, k) in GEMV_TUNED_ROWS:
            return dict(GEMV_TUNED_ROWS[(n, k)], GEMV=1)
        return _rows_config(n // 2 if silu_mul else n, k, dtype)
    if (n, k) in GEMV_TUNED:
        return dict(GEMV_TUNED[(n, k)])
    return _default_config(n // 2 if silu_mul else n, k, dtype, silu_mul)


def norm_block(k: int, block_k: int, num_warps: int) -> int:
    """Columns a step of the GEMV's RMSNorm statistics: all of K (to the next power of two) up to 32 a thread, at
    least BLOCK_K. Summing a row's squares in one wide step costs one round trip for x and the residual instead of
    K / BLOCK_K dependent ones before the first weight is read (measured faster on the H200)."""
    return max(block_k, min(triton.next_power_of_2(k), 32 * 32 * num_warps))


def _rows_config(cols: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """The skinny GEMM's tiles: 512 bytes of each weight row a K step, 32 output columns a program where that still
    gives two programs per SM, else 16 (tl.dot's smallest)."""
    block_k = min(512 // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    block_n = 32 if triton.cdiv(cols, 32) >= 2 * SMS else 16
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                num_stages=3 if triton.cdiv(k, block_k) >= 4 else 2)


def _default_config(cols: int, k: int, dtype: torch.dtype, silu_mul: bool) -> dict[str, int]:
    block_k = 1024 // dtype.itemsize
    while block_k > 64 and triton.cdiv(k, block_k) * block_k - k > k // 8:
        block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    w_rows = 2 if silu_mul else 1  # weight rows per output column
    block_n = 16 // w_rows
    while block_n > 2 and triton.cdiv(cols, block_n) < SMS * _PROGRAMS_PER_SM:
        block_n //= 2
    tile = w_rows * block_n * block_k  # weight elements a K step
    num_warps = max(1, min(4, tile // (32 * 16)))  # 16 or more elements a thread, up to 4 warps
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                num_stages=3 if triton.cdiv(k, block_k) >= 4 else 2)


def pdl_mode(device: torch.device, programs: int, w: torch.Tensor) -> int:
    """How the GEMV with weight w launches (its kernel's PDL). Where PDL is supported (launch.pdl_supported) and the
    weight is at most GEMV_PDL_MAX_BYTES (SmolLM2's projections) or its shape is in GEMV_PDL_SHAPES (both in
    kernels/tuned_h200.py): with programmatic dependent launch, letting the next kernel launch at once (1) when the
    grid fits in one wave of the GPU (launch.one_wave_pdl: its waiting programs then take no SM the grid still
    needs), else only after the main loop (2); otherwise (Llama-3.1-8B's other projections, where a layer measured
    no gain), off (0). A config's PDL key overrides it."""
    small = w.numel() * w.element_size() <= GEMV_PDL_MAX_BYTES
    if not pdl_supported(device) or not (small or tuple(w.shape) in GEMV_PDL_SHAPES):
        return 0
    return 1 if one_wave_pdl(device, programs) else 2


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> None:
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype:
        raise ValueError(f"gemv: weight {tuple(w.shape)} {w.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv: {x.shape[0]} rows; the kernel is for decode rows (at most {MAX_ROWS})")
    if w.stride(1) != 1:
        raise ValueError("gemv: the weight must be row-major (unit stride along K)")
    if silu_mul and w.shape[0] % 2:
        raise ValueError(f"gemv: silu_mul needs gate and up rows, got {w.shape[0]} rows")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} {bias.dtype} does not fit weight {tuple(w.shape)}")


def _launch(x, residual, norm_w, w, bias, y, h, eps, weight_offset, silu_mul, config,
            rope: RopeStore | None = None) -> None:
    m, k = x.shape
    n_out = y.shape[1]
    if m == 0 or n_out == 0:
        return
    cfg = config or gemv_config(m, w.shape[0], k, x.dtype, silu_mul)
    if rope is not None and not rope.fits(x, w, cfg):
        raise ValueError(f"gemv: the rotary/KV-store epilogue does not fit this launch ({cfg})")
    args = (x, residual if residual is not None else x, norm_w if norm_w is not None else x, w,
            bias if bias is not None else w, y, h if h is not None else y)
    strides = (x.stride(0), residual.stride(0) if residual is not None else 0, h.stride(0) if h is not None else 0,
               w.stride(0), y.stride(0))
    flags = dict(NORM=norm_w is not None, HAS_RESIDUAL=residual is not None, W_OFFSET=float(weight_offset),
                 SILU=silu_mul, HAS_BIAS=bias is not None, ROUND_BF16=x.dtype == torch.bfloat16)
    if m == 1 or cfg.get("GEMV"):  # the GEMV, its rows unrolled (a config marked GEMV=1 at more than one row)
        programs = triton.cdiv(n_out, cfg["BLOCK_N"])
        pdl = cfg.get("PDL", pdl_mode(x.device, programs, w))
        gdc = bool(pdl) and pdl_supported(x.device)  # (a PDL config elsewhere: PDL's order of loads, no gdc ops)
        _gemv_kernel[(programs,)](
            *args, n_out, k, eps, n_out * w.stride(0), *strides, *_rope_args(rope, y, m, cfg["BLOCK_N"]), M=m,
            **flags, **_rope_flags(rope, cfg["BLOCK_N"]),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["num_stages"], PDL=pdl, GDC=gdc,
            NORM_BLOCK=cfg.get("NORM_BLOCK", norm_block(k, cfg["BLOCK_K"], cfg["num_warps"])), ROPE=rope is not None,
            LATE_RSTD=norm_w is not None and bool(cfg.get("LATE_RSTD", 0)),  # (module doc; tuned SmolLM2 launches)
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(gdc))
        return
    block_n, block_k = max(16, cfg["BLOCK_N"]), max(16, cfg["BLOCK_K"])  # tl.dot's smallest tiles
    _rows_kernel[(triton.cdiv(n_out, block_n),)](
        *args, m, n_out, k, eps, n_out * w.stride(0), *strides, **flags, F32_DOT=not x.is_cuda,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict[str, int] | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for decode rows on CUDA: x [M, K] (M <= MAX_ROWS; bf16, fp16 or fp32), w [N, K] row-major in
    x's dtype, bias [N] or None -> y [M, N] in x's dtype: float32 sums (+ bias) rounded once, as F.linear's, up to
    the order of accumulation (fixed: no split-K). One launch, capturable in a CUDA graph. config: gemv_config's
    result, to override (benchmarks, tests)."""
    _check(x, w, bias, False)
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    _launch(_unit_stride(x), None, None, w, bias.contiguous() if bias is not None else None, y, None, 0.0, 0.0,
            False, config)
    return y


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
              weight_offset: float, w: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
              config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """F.linear(rms_norm(h, norm_w, eps, weight_offset), w, bias) with h = x + residual (or x when residual is None)
    in one launch for decode rows on CUDA, rounded as the unfused ops (reference.add_rms_norm / rms_norm, then
    F.linear; see the module doc). x, residual [M, K] (M <= MAX_ROWS), norm_w [K] (x's dtype unless
    weight_offset), w [N, K] row-major, bias [N] or None, all in x's dtype. Returns (y, h): y [M, N], or with
    silu_mul (w = gate rows [0, I) then up rows [I, 2I)) y [M, I] = silu_and_mul(F.linear(a, w, bias)); h [M, K]
    the new residual (x itself when residual is None). config: gemv_config's result, to override."""
    return _norm_gemv(x, residual, norm_w, eps, weight_offset, w, bias, silu_mul, config, None)


def norm_gemv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                         weight_offset: float, w: torch.Tensor, bias: torch.Tensor | None, rope: RopeStore,
                         config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_gemv on an attention layer's q|k|v weight w [(Hq + 2 Hkv) D, K], with the q/k prep in its epilogue:
    returns (qkv [M, (Hq + 2 Hkv) D], h) where qkv's q and k heads are normed (with rope's q/k norm weights) and
    rotated at rope.positions as kernels/triton_qk_prep.py leaves them, and k, v are stored at rope.loc in
    rope.k_cache / rope.v_cache: one launch for norm + projection + (q/k norms +) rotary + KV store.
    rope.fits(x, w, config) (with config None: gemv_config's; rope_store_config gives it when it fits) must hold,
    else ValueError."""
    return _norm_gemv(x, residual, norm_w, eps, weight_offset, w, bias, False, config, rope)


def _norm_gemv(x, residual, norm_w, eps, weight_offset, w, bias, silu_mul, config, rope):
    _check(x, w, bias, silu_mul)
    m, k = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_gemv: residual {tuple(residual.shape)} {residual.dtype} does not fit x")
    if norm_w.shape != (k,) or (not weight_offset and norm_w.dtype != x.dtype):
        raise ValueError(f"norm_gemv: norm weight {tuple(norm_w.shape)} {norm_w.dtype} does not fit x")
    x = _unit_stride(x)
    h = x
    if residual is not None:
        residual = _unit_stride(residual)
        h = torch.empty_like(x, memory_format=torch.contiguous_format)  # [M, K]
    n_out = w.shape[0] // 2 if silu_mul else w.shape[0]
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)  # [M, N] or [M, I]
    _launch(x, residual, norm_w.contiguous(), w, bias.contiguous() if bias is not None else None, y,
            h if residual is not None else None, float(eps), weight_offset, silu_mul, config, rope)
    return y, h


def rope_store_config(x: torch.Tensor, w: torch.Tensor, rope: RopeStore) -> dict[str, int] | None:
    """gemv_config's launch for x [M, K] @ w^T when it can take norm_gemv_rope_store's epilogue, else None."""
    cfg = gemv_config(x.shape[0], w.shape[0], x.shape[1], x.dtype)
    return cfg if rope.fits(x, w, cfg) else None
