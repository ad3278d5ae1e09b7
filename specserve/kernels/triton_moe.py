"""Triton fused MoE: a grouped GEMM over the routed (token, k) pairs (reference: kernels/reference.py fused_moe).

Capturable with fixed shapes: nothing is read back to the host and every buffer and grid is sized from shapes.
  * Alignment (`moe_align`, three small kernels): the T*K pairs are counted per expert (a histogram per chunk of
    pairs); one program takes the prefix sums, each expert's run padded up to a multiple of BLOCK_M; a grid places
    the pairs, stably (by expert, then pair index), into `sorted_ids` (padding rows hold the sentinel T*K) and
    writes `block_expert[b]`, the expert of block b. `num_padded` [1] is the padded total, at most
    T*K + min(E, T*K) * (BLOCK_M - 1): the host bound that sizes the grids. Blocks past the live total exit at
    once, and an expert with no pair owns no block, so a decode step reads only the chosen experts' weights.
  * Gate/up (`_gate_up_kernel`): one program per (block, BLOCK_N columns of I) multiplies the block's x rows by
    both the gate and the up rows of w13[e] (two accumulators), so silu(gate) * up is fused into the epilogue and
    the [rows, 2I] product is never written. Rounding follows the reference: gate and up rounded to x's dtype,
    silu rounded, then the product rounded.
  * Down (`_down_kernel`): act @ w2[e]^T per block, rounded to x's dtype and written per pair to y [T*K, H].
  * `_sum_k_kernel`: out[t] = sum_k w[t, k] * y[t*K + k] in float32, in k order, then cast; at one token (the
    direct path) the down GEMM's last program per column block does it instead (an arrival counter). The sums
    never use float atomics, so the result is deterministic run to run (it may differ from the reference's
    expert-order float32 sum in the last bit).
FP8 weights (W8A8, block-scaled; reference: kernels/reference_moe_fp8.py) take their own two GEMMs, fed quantized
activations so no program re-quantizes what another already did: x is quantized once (triton_fp8's dense-linear
quantizer, one small launch: xq [T, H] e4m3, sx [T, H/bk]); `_gate_up_fp8_kernel` dots e4m3 tiles a scale group at a
time (a K step is one or more groups of bk columns, each product scaled by its rows' and columns' scales) and
quantizes its act tile in the epilogue (its BLOCK_N covers whole bk groups: aq [T*K, I] e4m3, sa [T*K, I/bk]);
`_down_fp8_kernel` reads those. Their tiles: tuned_h200.MOE_FP8_TILES (untuned). Alignment, direct path and sums are
the bf16 path's.
Per-channel FP8 weights (block None: a scale per weight row, w13_scale [E, 2I], w2_scale [E, H]; compressed-tensors'
channel / tensor checkpoints) take two more GEMMs: x is quantized once per token (triton_fp8's per-token quantizer:
xq [T, H], sx [T]); `_gate_up_fp8_channel_kernel` runs plain e4m3 dots along K (no scale changes along it) and
multiplies sx[row] * s[expert, col] once after; the act's scale is per pair, over a whole row of I that no program
holds, so its epilogue writes the act in x's dtype and each row's amax over its columns; `_down_fp8_channel_kernel`
takes the max of a row's partials (a few floats), quantizes the act tiles by the rule as it loads them, and scales
once after its K loop. The same tile table (keyed by rows per block), alignment, direct path and sums.
`F32_DOT` does the products in float32 on CPU tensors, where the Triton interpreter's bfloat16 tl.dot is wrong.
(One token as two plain GEMVs, gate/up per expert slot and down summing the slots in registers, was measured no
faster than the direct path and removed.)
The bf16 GEMMs' tiles are tuned per rows a block: kernels/tuned_h200.py MOE_TILES.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.reference_moe_fp8 import check_fp8_moe
from specserve.kernels.triton_dot import dot
from specserve.kernels.triton_fp8 import quantize_act_groups_triton, quantize_act_tokens_triton
from specserve.kernels.triton_fp8_tiles import dot_e4m3, quantize_groups, quantize_rows, round_to, scale_of
from specserve.kernels.tuned_h200 import MOE_FP8_TILES, MOE_TILES

_CHUNK = 128  # most pairs per alignment program: the stable rank within a chunk is a [CHUNK, CHUNK] comparison
DIRECT_BLOCK_M = 16  # rows of a direct block (one pair in row 0): the tile of the aligned path at one token
SUM_COUNTERS = 4096  # column blocks of the down GEMM that can sum in-kernel at one token (more: _sum_k_kernel)


def _counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per column block of the one-token down GEMM (kernels/counters.py)."""
    return arrival_counters("moe sum", device, SUM_COUNTERS)


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, n_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < n_pairs
    ex = tl.arange(0, E_PAD)
    hist = tl.histogram(tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32), E_PAD)
    hist -= tl.where(ex == 0, CHUNK - tl.sum(ok.to(tl.int32), 0), 0)  # lanes past the last pair counted as expert 0
    tl.store(hist_ptr + c * E_PAD + ex, hist)


@triton.jit
def _offsets_kernel(hist_ptr, offs_ptr, pad_end_ptr, sorted_ptr, num_padded_ptr, n_pairs, num_experts, num_chunks,
                    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: the per-expert prefix sums. Everything that scales with the blocks is left to _place_kernel's
    grid: one program has one multiprocessor's bandwidth (reading the histograms is most of its time)."""
    ex = tl.arange(0, E_PAD)
    cb = tl.arange(0, BLOCK_C)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):  # BLOCK_C chunks a step: few dependent loads even for a long prefill
        c = c0 + cb
        counts += tl.sum(tl.load(hist_ptr + c[:, None] * E_PAD + ex[None, :], mask=(c < num_chunks)[:, None],
                                 other=0), axis=0)
    counts = tl.where(ex < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    pad_end = tl.cumsum(padded, 0)  # experts >= E: the total
    pad_start = pad_end - padded
    tl.store(pad_end_ptr + ex, pad_end)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    # offs[c, e]: where chunk c's first pair of expert e goes (chunks in order: a stable placement)
    base = pad_start
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + cb
        c_ok = (c < num_chunks)[:, None]
        h = tl.load(hist_ptr + c[:, None] * E_PAD + ex[None, :], mask=c_ok, other=0)  # [BLOCK_C, E_PAD]
        tl.store(offs_ptr + c[:, None] * E_PAD + ex[None, :], base[None, :] + tl.cumsum(h, 0) - h, mask=c_ok)
        base += tl.sum(h, axis=0)
    # padding rows: each expert's run past its count
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (pad_start + counts)[:, None] + j[None, :], n_pairs,
             mask=j[None, :] < (padded - counts)[:, None])


@triton.jit
def _place_kernel(ids_ptr, offs_ptr, pad_end_ptr, num_padded_ptr, sorted_ptr, block_expert_ptr, n_pairs,
                  num_experts, num_chunks, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    c = tl.program_id(0)
    if c < num_chunks:  # chunk c of pairs: each to its expert's run, after the same expert's earlier pairs
        r = tl.arange(0, CHUNK)
        i = c * CHUNK + r
        ok = i < n_pairs
        e = tl.load(ids_ptr + i, mask=ok, other=num_experts).to(tl.int32)  # [CHUNK]
        before = (e[:, None] == e[None, :]) & (r[None, :] < r[:, None])  # [CHUNK, CHUNK] same expert, earlier
        rank = tl.sum(before.to(tl.int32), axis=1)
        dst = tl.load(offs_ptr + c * E_PAD + e, mask=ok, other=0) + rank
        tl.store(sorted_ptr + dst, i, mask=ok)
    # blocks [c * BLOCK_B, (c + 1) * BLOCK_B): block b belongs to the expert whose padded run holds row b * BLOCK_M,
    # i.e. the number of runs that end at or before it; past the live total that is >= E (runs of e >= E end at
    # the total), and those blocks' rows get the sentinel
    b = c * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < max_blocks
    pad_end = tl.load(pad_end_ptr + tl.arange(0, E_PAD))
    tl.store(block_expert_ptr + b, tl.sum((pad_end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1),
             mask=b_ok)
    tail = b_ok & (b * BLOCK_M >= tl.load(num_padded_ptr))
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + b[:, None] * BLOCK_M + j[None, :], n_pairs, mask=tail[:, None])


@triton.jit
def _align_one_chunk_kernel(ids_ptr, pad_end_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs,
                            num_experts, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_B: tl.constexpr):
    """The three alignment kernels in one program, for batches of at most CHUNK pairs (decode, short verify): the
    histogram, the padded per-expert runs, the stable placement, the padding rows and the block owners, with the
    same results as _count_kernel + _offsets_kernel + _place_kernel (one launch instead of three)."""
    r = tl.arange(0, CHUNK)
    ok = r < n_pairs
    e = tl.load(ids_ptr + r, mask=ok, other=num_experts).to(tl.int32)  # [CHUNK]; lanes past the pairs: no expert
    ex = tl.arange(0, E_PAD)
    counts = tl.histogram(tl.where(ok, e, 0), E_PAD)
    counts -= tl.where(ex == 0, CHUNK - tl.sum(ok.to(tl.int32), 0), 0)  # lanes past the last pair counted as 0
    counts = tl.where(ex < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    pad_end = tl.cumsum(padded, 0)  # experts >= E: the total
    pad_start = pad_end - padded
    total = tl.sum(padded, 0)
    tl.store(pad_end_ptr + ex, pad_end)
    tl.store(num_padded_ptr, total)
    # padding rows: each expert's run past its count
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (pad_start + counts)[:, None] + j[None, :], n_pairs,
             mask=j[None, :] < (padded - counts)[:, None])
    tl.debug_barrier()  # pad_end in memory for every thread of the program
    # each pair after the same expert's earlier pairs, in its expert's run, which starts where run e - 1 ends
    before = (e[:, None] == e[None, :]) & (r[None, :] < r[:, None])  # [CHUNK, CHUNK]
    rank = tl.sum(before.to(tl.int32), axis=1)
    start = tl.load(pad_end_ptr + e - 1, mask=ok & (e > 0), other=0)
    tl.store(sorted_ptr + start + rank, r, mask=ok)
    # block owners (the runs ending at or before the block's first row) and the sentinel past the live total
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < max_blocks
        tl.store(block_expert_ptr + b, tl.sum((pad_end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1),
                 mask=b_ok)
        tail = b_ok & (b * BLOCK_M >= total)
        tl.store(sorted_ptr + b[:, None] * BLOCK_M + j[None, :], n_pairs, mask=tail[:, None])


@triton.jit
def _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M: tl.constexpr,
           DIRECT: tl.constexpr):
    """(live, expert, pairs [BLOCK_M]; n_pairs marks padding) of block pid_m. Aligned: the block's run of
    sorted_ids and its owner; live while the block is below the live padded total (the grid covers the bound).
    DIRECT (one token, no alignment): block pid_m is pair pid_m alone, its expert read from the router's ids."""
    lane = tl.arange(0, BLOCK_M)
    if DIRECT:
        live = pid_m < n_pairs
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        pair = tl.where(lane == 0, pid_m, n_pairs)
    else:
        live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + lane)
    return live, e, pair


@triton.jit
def _tile(a_ptr, a_rows, stride_a, w_ptr, e, stride_we, stride_wn, pid_n, n_dim, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """A GEMM program's tile (every expert GEMM here: weights [E, N, K], K contiguous): its columns n [BLOCK_N] of
    n_dim and n_ok, the K lanes k [BLOCK_K], the input rows' pointers a_ptrs [M, K] (rows a_rows [M] int64 of
    stride_a) and expert e's weight pointers w_ptrs [K, N] (row n of stride_wn)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + k[None, :]  # [M, K]
    w_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [K, N]
    return n, n < n_dim, k, a_ptrs, w_ptrs


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, hidden,
                    inter, stride_xt, stride_we, stride_wn, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
                    DIRECT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        tok = (pair // TOP_K).to(tl.int64)
        n, n_ok, k, x_ptrs, g_ptrs = _tile(x_ptr, tok, stride_xt, w_ptr, e, stride_we, stride_wn, pid_n, inter,
                                           BLOCK_N, BLOCK_K)  # g_ptrs: the gate rows
        u_ptrs = g_ptrs + inter * stride_wn  # the up rows follow the gate rows
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = k0 + k < hidden
            a = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            acc_g += dot(a, tl.load(g_ptrs + k0, mask=w_mask, other=0.0), F32_DOT, PRECISION)
            acc_u += dot(a, tl.load(u_ptrs + k0, mask=w_mask, other=0.0), F32_DOT, PRECISION)
        dt = act_ptr.dtype.element_ty
        gate = acc_g.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
        tl.store(act_ptr + pair[:, None].to(tl.int64) * inter + n[None, :], act.to(dt),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K: tl.constexpr,
               BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    """One token (direct): the last of the TOP_K programs of column block pid_n to finish (counter pid_n) sums their
    outputs y [K, H] at columns n [BLOCK_N] into out [1, H] as _sum_k_kernel does (weights wts [K], in k order,
    float32), and resets the counter to 0: no sum launch.
    The barrier orders every thread's y stores before the one-thread atomic, whose release makes them visible at GPU
    scope to the program that acquires the final count; it reads y through L2 (.cg)."""
    tl.debug_barrier()
    counter = counter_ptr + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel") == n_pairs - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for kk in tl.static_range(TOP_K):  # fixed order: deterministic, _sum_k_kernel's sum
            wk = tl.load(wts_ptr + kk).to(tl.float32)
            total += wk * tl.load(y_ptr + kk * hidden + n, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + n, round_to(total, dt, RNE).to(dt), mask=n_ok)
        tl.store(counter, 0)  # the next launch (or graph replay) counts from 0 again


@triton.jit
def _down_kernel(act_ptr, w_ptr, y_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, hidden,
                 inter, stride_we, stride_wn, wts_ptr, out_ptr, counter_ptr, TOP_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                 PRECISION: tl.constexpr, DIRECT: tl.constexpr, SUM: tl.constexpr):
    """SUM (one token, direct): the k outputs summed in-kernel (_sum_pairs)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = _tile(act_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
                                           BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = k0 + k < inter
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += dot(a, tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0), F32_DOT, PRECISION)
        # each expert's product rounded to x's dtype, as the reference does before its weighted sum
        tl.store(y_ptr + rows[:, None] * hidden + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])
        if SUM:
            _sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, False)


@triton.jit
def _scaled_step(acc, a_ptrs, sa_ptrs, w_ptrs, sw_ptrs, row_ok, n_ok, kg, k, k_dim, n_groups, stride_sk,
                 GROUP: tl.constexpr, F32_DOT: tl.constexpr):
    """acc [M, N] + the products of one scale group of GROUP columns from kg (a multiple of GROUP): the e4m3 tiles
    a [M, GROUP] (a_ptrs [M, GROUP] at column 0) and w [GROUP, N] (w_ptrs), times the rows' scales sa [M]
    (sa_ptrs [M] at group 0) and the columns' weight block scales sw [N] (sw_ptrs [N] at group 0, groups
    stride_sk apart). A group past k_dim (the last step's tail) loads nothing and adds 0."""
    g = kg // GROUP
    k_ok = kg + k < k_dim  # [GROUP]
    a = tl.load(a_ptrs + kg, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, GROUP] e4m3
    w = tl.load(w_ptrs + kg, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [GROUP, N] e4m3
    # the group's scales; g as a vector: under the interpreter g can be a Python int, which a mask cannot take
    sa = tl.load(sa_ptrs + g, mask=row_ok & (tl.zeros(row_ok.shape, tl.int32) + g < n_groups), other=0.0)  # [M]
    sw = tl.load(sw_ptrs + g * stride_sk, mask=n_ok & (tl.zeros(n_ok.shape, tl.int32) + g < n_groups),
                 other=0.0)  # [N]
    return acc + dot_e4m3(a, w, F32_DOT) * (sa[:, None] * sw[None, :])


@triton.jit
def _gate_up_fp8_kernel(xq_ptr, sx_ptr, w_ptr, s_ptr, aq_ptr, sa_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
                        num_padded_ptr, n_pairs, hidden, inter, x_groups, a_groups, stride_we, stride_wn, stride_se,
                        stride_sn, stride_sk, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr, BN_W: tl.constexpr, ACT_DTYPE: tl.constexpr,
                        F32_DOT: tl.constexpr, RNE: tl.constexpr, DIRECT: tl.constexpr):
    """The gate/up GEMM on FP8 inputs: xq [T, H] e4m3 with scales sx [T, x_groups] (quantized once, before),
    w13 e4m3 with a float32 scale per BN_W x GROUP block (s [E, 2I / BN_W, x_groups]). A K step is GROUPS scale
    groups of GROUP columns, each its own e4m3 dot scaled by the rows' and the columns' scales (_scaled_step).
    Epilogue: the reference's roundings (gate, up, silu and the product in ACT_DTYPE, x's dtype), then the act
    quantized by the rule per (pair, GROUP columns of I): BLOCK_N is a multiple of GROUP, so a program holds whole
    groups -> aq [T*K, I] e4m3 and sa [T*K, a_groups] float32, the down GEMM's input."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        tok = rows // TOP_K
        # columns past I (not n_ok): zero weights, so a zero act that changes no group's amax
        n, n_ok, k, x_ptrs, g_ptrs = _tile(xq_ptr, tok, hidden, w_ptr, e, stride_we, stride_wn, pid_n, inter,
                                           BLOCK_N, GROUP)  # x_ptrs [M, GROUP]; g_ptrs [GROUP, N]: the gate rows
        sx_ptrs = sx_ptr + tok * x_groups  # [M]
        u_ptrs = g_ptrs + inter * stride_wn  # the up rows follow the gate rows
        sg_ptrs = s_ptr + e * stride_se + (n // BN_W) * stride_sn  # [N] the gate columns' block rows
        su_ptrs = s_ptr + e * stride_se + ((n + inter) // BN_W) * stride_sn  # [N] and the up columns'
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, GROUP * GROUPS):
            for j in tl.static_range(GROUPS):
                kg = k0 + j * GROUP
                acc_g = _scaled_step(acc_g, x_ptrs, sx_ptrs, g_ptrs, sg_ptrs, row_ok, n_ok, kg, k, hidden, x_groups,
                                     stride_sk, GROUP, F32_DOT)
                acc_u = _scaled_step(acc_u, x_ptrs, sx_ptrs, u_ptrs, su_ptrs, row_ok, n_ok, kg, k, hidden, x_groups,
                                     stride_sk, GROUP, F32_DOT)
        gate = round_to(acc_g, ACT_DTYPE, RNE)
        act = round_to(round_to(gate / (1.0 + tl.exp(-gate)), ACT_DTYPE, RNE) * round_to(acc_u, ACT_DTYPE, RNE),
                       ACT_DTYPE, RNE)  # [M, N] float32 holding ACT_DTYPE values, the reference's act
        q, s = quantize_groups(act, BLOCK_N // GROUP, GROUP, RNE)  # [M, N] e4m3, [M, N / GROUP]
        tl.store(aq_ptr + rows[:, None] * inter + n[None, :], q, mask=row_ok[:, None] & n_ok[None, :])
        g = pid_n * (BLOCK_N // GROUP) + tl.arange(0, BLOCK_N // GROUP)
        tl.store(sa_ptr + rows[:, None] * a_groups + g[None, :], s, mask=row_ok[:, None] & (g < a_groups)[None, :])


@triton.jit
def _down_fp8_kernel(aq_ptr, sa_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                     n_pairs, hidden, inter, a_groups, stride_we, stride_wn, stride_se, stride_sn, stride_sk, wts_ptr,
                     out_ptr, counter_ptr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP: tl.constexpr, GROUPS: tl.constexpr, BN_W: tl.constexpr, F32_DOT: tl.constexpr,
                     RNE: tl.constexpr, DIRECT: tl.constexpr, SUM: tl.constexpr):
    """The down GEMM on the gate/up GEMM's quantized act: aq [T*K, I] e4m3 with scales sa [T*K, a_groups], w2 e4m3
    with block scales s [E, ceil(H / BN_W), a_groups]; K steps as _gate_up_fp8_kernel's. Each pair's output rounded
    to y's dtype (x's), as the reference does before its weighted sum. SUM: _sum_pairs (one token)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = _tile(aq_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
                                           BLOCK_N, GROUP)  # [M, GROUP], [GROUP, N]
        sw_ptrs = s_ptr + e * stride_se + (n // BN_W) * stride_sn  # [N] the columns' block rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, GROUP * GROUPS):
            for j in tl.static_range(GROUPS):
                acc = _scaled_step(acc, a_ptrs, sa_ptr + rows * a_groups, w_ptrs, sw_ptrs, row_ok, n_ok,
                                   k0 + j * GROUP, k, inter, a_groups, stride_sk, GROUP, F32_DOT)
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + rows[:, None] * hidden + n[None, :], round_to(acc, dt, RNE).to(dt),
                 mask=row_ok[:, None] & n_ok[None, :])
        if SUM:
            _sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, RNE)


@triton.jit
def _gate_up_fp8_channel_kernel(xq_ptr, sx_ptr, w_ptr, s_ptr, act_ptr, amax_ptr, ids_ptr, sorted_ptr,
                                block_expert_ptr, num_padded_ptr, n_pairs, hidden, inter, amax_tiles, stride_we,
                                stride_wn, stride_se, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT_DTYPE: tl.constexpr,
                                F32_DOT: tl.constexpr, RNE: tl.constexpr, DIRECT: tl.constexpr):
    """The gate/up GEMM on per-channel FP8: xq [T, H] e4m3 with one scale per token sx [T] (quantized once,
    before), w13 e4m3 with one scale per row s [E, 2I]. No scale changes along K, so the K loop is plain e4m3 dots
    into float32 and the scales multiply once after it (sx[row] * s[expert, col]). Epilogue: the reference's
    roundings (gate, up, silu and the product in ACT_DTYPE), then the act stored as it is (act [T*K, I] in x's
    dtype: exact) with each row's largest magnitude over this program's columns (amax [T*K, amax_tiles], column
    pid_n): the act's per-pair scale needs the whole row, which no one program holds, so the down GEMM takes the
    max of the row's partials and quantizes its act tiles as it loads them."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        tok = rows // TOP_K
        # columns past I (not n_ok): zero weights and scales, so a zero act that changes no amax
        n, n_ok, k, x_ptrs, g_ptrs = _tile(xq_ptr, tok, hidden, w_ptr, e, stride_we, stride_wn, pid_n, inter,
                                           BLOCK_N, BLOCK_K)  # g_ptrs: the gate rows
        u_ptrs = g_ptrs + inter * stride_wn  # the up rows follow the gate rows
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = k0 + k < hidden
            a = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K] e4m3
            w_mask = k_ok[:, None] & n_ok[None, :]
            acc_g += dot_e4m3(a, tl.load(g_ptrs + k0, mask=w_mask, other=0.0), F32_DOT)
            acc_u += dot_e4m3(a, tl.load(u_ptrs + k0, mask=w_mask, other=0.0), F32_DOT)
        sx = tl.load(sx_ptr + tok, mask=row_ok, other=0.0)  # [M] the tokens' scales
        sg = tl.load(s_ptr + e * stride_se + n, mask=n_ok, other=0.0)  # [N] the gate rows' scales
        su = tl.load(s_ptr + e * stride_se + inter + n, mask=n_ok, other=0.0)  # [N] and the up rows'
        gate = round_to(acc_g * (sx[:, None] * sg[None, :]), ACT_DTYPE, RNE)
        up = round_to(acc_u * (sx[:, None] * su[None, :]), ACT_DTYPE, RNE)
        act = round_to(round_to(gate / (1.0 + tl.exp(-gate)), ACT_DTYPE, RNE) * up, ACT_DTYPE, RNE)  # [M, N]
        dt = act_ptr.dtype.element_ty
        tl.store(act_ptr + rows[:, None] * inter + n[None, :], act.to(dt), mask=row_ok[:, None] & n_ok[None, :])
        tl.store(amax_ptr + rows * amax_tiles + pid_n, tl.max(tl.abs(act), axis=1), mask=row_ok)


@triton.jit
def _down_fp8_channel_kernel(act_ptr, amax_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
                             num_padded_ptr, n_pairs, hidden, inter, amax_tiles, stride_we, stride_wn, stride_se,
                             wts_ptr, out_ptr, counter_ptr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_TILES: tl.constexpr,
                             F32_DOT: tl.constexpr, RNE: tl.constexpr, DIRECT: tl.constexpr, SUM: tl.constexpr):
    """The down GEMM on per-channel FP8: the act [T*K, I] (x's dtype) quantized per pair by the rule as its tiles
    load (the row's scale from the gate/up GEMM's partial amaxes [T*K, amax_tiles]: the same scale whichever program
    computes it, so every column block quantizes the act alike), w2 e4m3 with one scale per row s [E, H]; plain
    e4m3 dots along K, the scales once after (sa[row] * s[expert, col]). Each pair's output rounded to y's dtype
    (x's), as the reference does before its weighted sum. SUM: _sum_pairs (one token)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = _block(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = _tile(act_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
                                           BLOCK_N, BLOCK_K)
        tiles = tl.arange(0, AMAX_TILES)
        amax = tl.max(tl.load(amax_ptr + rows[:, None] * amax_tiles + tiles[None, :],
                              mask=row_ok[:, None] & (tiles < amax_tiles)[None, :], other=0.0), axis=1)  # [M]
        sa = scale_of(amax)  # [M] the pairs' act scales
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = k0 + k < inter
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [K, N] e4m3
            acc += dot_e4m3(quantize_rows(a, sa, RNE), w, F32_DOT)
        sw = tl.load(s_ptr + e * stride_se + n, mask=n_ok, other=0.0)  # [N] the rows' scales
        acc = acc * (sa[:, None] * sw[None, :])
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + rows[:, None] * hidden + n[None, :], round_to(acc, dt, RNE).to(dt),
                 mask=row_ok[:, None] & n_ok[None, :])
        if SUM:
            _sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, RNE)


@triton.jit
def _sum_k_kernel(y_ptr, w_ptr, out_ptr, hidden, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                  RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):  # fixed order: deterministic
        wk = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (t * TOP_K + k) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, round_to(acc, out_ptr.dtype.element_ty, RNE).to(
        out_ptr.dtype.element_ty), mask=ok)


def moe_block_m(n_pairs: int, num_experts: int) -> int:
    """Rows per block from shapes only: about twice the mean pairs per expert, 16..64, so a small batch pads each
    chosen expert to one 16-row block and a mid-size one reads each expert's weights about once; 128 from 128 pairs
    per expert on, where the GEMMs turn compute-bound (measured faster on the H200 at Qwen3-30B-A3B's shapes from
    2048 tokens on, no faster up to 1024; re-tune with scripts/gpu/bench_moe.py)."""
    if n_pairs >= 128 * num_experts:
        return 128
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(2 * n_pairs, num_experts))))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_launch: bool = True):
    """topk_ids [T, K] -> (sorted_ids [P] int32: pair indices t*K + k grouped by expert, each expert's run padded to
    a multiple of block_m with the sentinel T*K; block_expert [P / block_m] int32; num_padded [1] int32, the live
    padded total). P = block_m * ((T*K + min(E, T*K) * (block_m - 1)) // block_m) is the bound from shapes.
    Batches of one chunk (at most 128 pairs: decode, short verify) take one launch (one_launch; False: the three
    kernels every larger batch takes, which give the same results)."""
    ids = topk_ids.reshape(-1)  # [T*K]
    n_pairs, dev = ids.numel(), ids.device
    max_blocks = (n_pairs + min(num_experts, n_pairs) * (block_m - 1)) // block_m
    e_pad = triton.next_power_of_2(num_experts)
    chunk = min(_CHUNK, max(16, triton.next_power_of_2(n_pairs)))  # a decode step's few pairs: one small chunk
    num_chunks = triton.cdiv(n_pairs, chunk)
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)  # [chunks, E_PAD]
    offs = torch.empty_like(hist)  # [chunks, E_PAD]
    pad_end = torch.empty(e_pad, dtype=torch.int32, device=dev)  # [E_PAD] end of each expert's padded run
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)  # [P]
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)  # [P / block_m]
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_b = 16
    if num_chunks == 1 and one_launch:
        _align_one_chunk_kernel[(1,)](ids, pad_end, sorted_ids, block_expert, num_padded, n_pairs, num_experts,
                                      max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCK_B=block_b,
                                      num_warps=4)
        return sorted_ids, block_expert, num_padded
    _count_kernel[(num_chunks,)](ids, hist, n_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    _offsets_kernel[(1,)](hist, offs, pad_end, sorted_ids, num_padded, n_pairs, num_experts, num_chunks,
                          BLOCK_M=block_m, E_PAD=e_pad, BLOCK_C=min(64, triton.next_power_of_2(num_chunks)),
                          num_warps=8)
    _place_kernel[(max(num_chunks, triton.cdiv(max_blocks, block_b)),)](
        ids, offs, pad_end, num_padded, sorted_ids, block_expert, n_pairs, num_experts, num_chunks, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCK_B=block_b, num_warps=4)
    return sorted_ids, block_expert, num_padded


def _gemm_configs(block_m: int) -> tuple[dict, dict]:
    """(gate/up, down) tile sizes, warps and stages for blocks of block_m rows: tuned_h200.MOE_TILES's first entry
    of at least block_m rows (its last beyond), as fresh dicts."""
    most = next((rows for rows in MOE_TILES if block_m <= rows), max(MOE_TILES))
    gate_up, down = MOE_TILES[most]
    return dict(gate_up), dict(down)


def _fp8_configs(block_m: int, bk: int, inter: int, hidden: int, tiles) -> tuple[dict, dict]:
    """(gate/up, down) FP8 launch configs: explicit `tiles`, else tuned_h200.MOE_FP8_TILES's first entry of at least
    block_m rows (its last beyond) with BLOCK_K raised to bk, the gate/up BLOCK_N to bk (whole act groups a
    program), and column tiles no wider than the (power-of-two-padded) output, which only trims test-sized shapes.
    Explicit tiles that break the rule are refused rather than changed (a sweep must time what it names)."""
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"FP8 fused MoE: the weight block's width {bk} must be a power of two >= 16 (one K step "
                         f"of the GEMMs)")
    if tiles is not None:
        gate_up, down = (dict(c) for c in tiles)
        if any(c["BLOCK_K"] % bk for c in tiles) or gate_up["BLOCK_N"] % bk:
            raise ValueError(f"FP8 fused MoE: tiles' BLOCK_K and the gate/up tile's BLOCK_N must be multiples of the "
                             f"weight block's width {bk}, got {[(c['BLOCK_N'], c['BLOCK_K']) for c in tiles]}")
        return gate_up, down
    most = next((rows for rows in MOE_FP8_TILES if block_m <= rows), max(MOE_FP8_TILES))
    gate_up, down = (dict(c) for c in MOE_FP8_TILES[most])
    gate_up["BLOCK_N"] = max(bk, min(gate_up["BLOCK_N"], triton.next_power_of_2(inter)))
    down["BLOCK_N"] = max(16, min(down["BLOCK_N"], triton.next_power_of_2(hidden)))
    for cfg, k_dim in ((gate_up, hidden), (down, inter)):
        cfg["BLOCK_K"] = bk * max(1, min(cfg["BLOCK_K"] // bk, triton.cdiv(k_dim, bk)))
    return gate_up, down


def _fp8_launch(cfg: dict, bk: int) -> dict:
    """A config's BLOCK_K as the FP8 kernels take it: GROUPS scale groups of GROUP = bk columns a K step."""
    launch = {k: v for k, v in cfg.items() if k != "BLOCK_K"}
    return dict(launch, GROUP=bk, GROUPS=cfg["BLOCK_K"] // bk)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _fp8_act(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, bn: int, bk: int, route: tuple, cfg: dict
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 gate/up: x [T, H] quantized once by the dense FP8 linear's quantizer (the rule, per token and bk columns:
    reference_moe_fp8._quantize_groups bit for bit) -> xq [T, H] e4m3, sx [T, ceil(H/bk)]; then the GEMM, whose
    epilogue quantizes the act -> (aq [T*K, I] e4m3, sa [T*K, ceil(I/bk)] float32). route: (ids, sorted_ids,
    block_expert, num_padded, blocks, block_m, top_k, direct). Exposed for the tests (the act against the
    reference's quantized act)."""
    ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct = route
    xq, sx = quantize_act_groups_triton(x, bk)  # [T, H], [T, ceil(H / bk)]
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    n_pairs = num_tokens * top_k
    aq = torch.empty((n_pairs, inter), dtype=torch.float8_e4m3fn, device=x.device)  # [T*K, I]
    sa = torch.empty((n_pairs, triton.cdiv(inter, bk)), dtype=torch.float32, device=x.device)  # [T*K, I / bk]
    _gate_up_fp8_kernel[(blocks, triton.cdiv(inter, cfg["BLOCK_N"]))](
        xq, sx, w13, s13, aq, sa, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, sx.shape[1],
        sa.shape[1], w13.stride(0), w13.stride(1), *s13.stride(), TOP_K=top_k, BLOCK_M=block_m, BN_W=bn,
        ACT_DTYPE=_TL_DTYPES[x.dtype], F32_DOT=not x.is_cuda, RNE=not x.is_cuda, DIRECT=direct,
        **_fp8_launch(cfg, bk))
    return aq, sa


def _fp8_channel_configs(block_m: int, inter: int, hidden: int, tiles) -> tuple[dict, dict]:
    """(gate/up, down) per-channel FP8 launch configs: explicit `tiles` as given, else tuned_h200.MOE_FP8_TILES's
    entry for block_m rows as the block path picks it (the table is keyed by rows per block, not by the weights'
    layout; a per-channel K step has no scale group to cover, so its tiles serve as they are), column and K tiles
    no wider than the (power-of-two-padded) dims, which only trims test-sized shapes, and at least 16 (tl.dot's
    least)."""
    if tiles is not None:
        gate_up, down = (dict(c) for c in tiles)
        return gate_up, down
    most = next((rows for rows in MOE_FP8_TILES if block_m <= rows), max(MOE_FP8_TILES))
    gate_up, down = (dict(c) for c in MOE_FP8_TILES[most])
    for cfg, n_dim, k_dim in ((gate_up, inter, hidden), (down, hidden, inter)):
        cfg["BLOCK_N"] = max(16, min(cfg["BLOCK_N"], triton.next_power_of_2(n_dim)))
        cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], triton.next_power_of_2(k_dim)))
    return gate_up, down


def _fp8_channel_act(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, route: tuple, cfg: dict
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 gate/up: x [T, H] quantized once per token by the dense FP8 linear's quantizer
    (quantize_act_tokens_triton: reference_moe_fp8._quantize_groups with the row as one group, bit for bit) ->
    xq [T, H] e4m3, sx [T]; then the GEMM -> (act [T*K, I] in x's dtype, amax [T*K, cdiv(I, BLOCK_N)] float32: the
    rows' partial amaxes, whose max is the act's per-pair scale's). route as _fp8_act's. Exposed for the tests."""
    ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct = route
    xq, sx = quantize_act_tokens_triton(x)  # [T, H] e4m3, [T]
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    n_pairs = num_tokens * top_k
    tiles_n = triton.cdiv(inter, cfg["BLOCK_N"])
    act = torch.empty((n_pairs, inter), dtype=x.dtype, device=x.device)  # [T*K, I]
    amax = torch.empty((n_pairs, tiles_n), dtype=torch.float32, device=x.device)  # [T*K, I / BLOCK_N]
    _gate_up_fp8_channel_kernel[(blocks, tiles_n)](
        xq, sx, w13, s13, act, amax, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, tiles_n,
        w13.stride(0), w13.stride(1), s13.stride(0), TOP_K=top_k, BLOCK_M=block_m, ACT_DTYPE=_TL_DTYPES[x.dtype],
        F32_DOT=not x.is_cuda, RNE=not x.is_cuda, DIRECT=direct, **cfg)
    return act, amax


def _route(topk_ids: torch.Tensor, num_experts: int, direct: bool, block_m: int) -> tuple:
    """(ids, sorted_ids, block_expert, num_padded, blocks): the GEMMs' blocks, direct (a pair a block, no
    alignment; the alignment's outputs are then unused stand-ins) or aligned (moe_align)."""
    ids = topk_ids.reshape(-1)  # [T*K]
    if direct:
        return ids, ids, ids, ids, ids.numel()
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, block_m)
    return ids, sorted_ids, block_expert, num_padded, block_expert.shape[0]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, direct: bool | None = None, tiles: tuple[dict, dict] | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K]
    int64 -> [T, H] in x's dtype. Launch shapes depend on (T, K, E, H, I) only, so this is capturable.

    FP8 (W8A8; reference: kernels/reference_moe_fp8.py) when the scales are given: w13, w2 float8_e4m3fn with
    float32 scales w13_scale [E, 2I/bn, ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)] per block = (bn, bk) of
    weights (I % bn == 0); x is quantized once per token and bk columns of H (one small launch), the act per pair and
    bk columns of I in the gate/up GEMM's epilogue (_fp8_act). block None: per-channel scales w13_scale [E, 2I],
    w2_scale [E, H]; x quantized per token, the act per pair (_fp8_channel_act and the down GEMM). ValueError on
    shapes that do not fit.

    direct (default: at one token): no alignment; each (token, k) pair is a block of its own whose expert the GEMMs
    read from topk_ids (a router's top-k experts of one token are distinct, so each is read once), and at one token
    the down GEMM's last program of each column block sums the k outputs (two GEMM launches in all instead of four).
    The result is the aligned path's at one token (a pair per 16-row block there too), bit for bit.
    No programmatic dependent launch here: it slowed a Qwen3-30B-A3B decode step at batch 1 (the next kernel's
    early-resident waiting programs slowed the expert GEMMs), though it gained in fused_moe alone.
    tiles: (gate/up, down) launch configs (BLOCK_N, BLOCK_K, num_warps, num_stages) in place of the tables'
    (scripts/gpu/bench_moe.py --sweep tries them; with FP8, BLOCK_K and the gate/up BLOCK_N multiples of bk)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8:
        fp8_block = check_fp8_moe(x, w13, w13_scale, w2, w2_scale, block)  # None: per-channel scales
        if x.dtype not in _TL_DTYPES:
            raise ValueError(f"FP8 fused MoE: x must be float32, bfloat16 or float16, got {x.dtype}")
        assert w13.stride(-1) == 1 and w2.stride(-1) == 1
        if fp8_block is None:  # the kernels index a row's scales as consecutive
            assert w13_scale.stride(-1) == 1 and w2_scale.stride(-1) == 1
    else:
        assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
        assert w13.dtype == x.dtype == w2.dtype and w13.stride(-1) == 1 and w2.stride(-1) == 1
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)  # [T, H]
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_pairs = num_tokens * top_k
    direct = num_tokens == 1 if direct is None else direct
    dev = x.device
    block_m = DIRECT_BLOCK_M if direct else moe_block_m(n_pairs, num_experts)
    ids, sorted_ids, block_expert, num_padded, blocks = _route(topk_ids, num_experts, direct, block_m)
    y = torch.empty((n_pairs, hidden), dtype=x.dtype, device=dev)  # [T*K, H] each expert's output per pair
    f32_dot = not x.is_cuda
    wts = topk_weights.reshape(-1)  # [T*K]
    if fp8 and fp8_block is None:
        cfg_gu, cfg_down = _fp8_channel_configs(block_m, inter, hidden, tiles)
        route = (ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct)
        act, amax = _fp8_channel_act(x, w13, w13_scale, route, cfg_gu)
        grid_down = (blocks, triton.cdiv(hidden, cfg_down["BLOCK_N"]))
        fused_sum = direct and num_tokens == 1 and grid_down[1] <= SUM_COUNTERS
        _down_fp8_channel_kernel[grid_down](
            act, amax, w2, w2_scale, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter,
            amax.shape[1], w2.stride(0), w2.stride(1), w2_scale.stride(0), wts, out,
            _counters(dev) if fused_sum else ids, TOP_K=top_k, BLOCK_M=block_m,
            AMAX_TILES=triton.next_power_of_2(amax.shape[1]), F32_DOT=f32_dot, RNE=f32_dot, DIRECT=direct,
            SUM=fused_sum, **cfg_down)
        rne = f32_dot  # the interpreter's bfloat16 cast truncates (triton_fp8_tiles.py)
    elif fp8:
        bn, bk = fp8_block
        cfg_gu, cfg_down = _fp8_configs(block_m, bk, inter, hidden, tiles)
        route = (ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct)
        aq, sa = _fp8_act(x, w13, w13_scale, bn, bk, route, cfg_gu)
        grid_down = (blocks, triton.cdiv(hidden, cfg_down["BLOCK_N"]))
        fused_sum = direct and num_tokens == 1 and grid_down[1] <= SUM_COUNTERS
        _down_fp8_kernel[grid_down](
            aq, sa, w2, w2_scale, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, sa.shape[1],
            w2.stride(0), w2.stride(1), *w2_scale.stride(), wts, out, _counters(dev) if fused_sum else ids,
            TOP_K=top_k, BLOCK_M=block_m, BN_W=bn, F32_DOT=f32_dot, RNE=f32_dot, DIRECT=direct, SUM=fused_sum,
            **_fp8_launch(cfg_down, bk))
        rne = f32_dot  # the interpreter's bfloat16 cast truncates (triton_fp8_tiles.py)
    else:
        act = torch.empty((n_pairs, inter), dtype=x.dtype, device=dev)  # [T*K, I] silu(gate) * up per pair
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32: no TF32, like the torch reference
        cfg_gu, cfg_down = _gemm_configs(block_m) if tiles is None else tiles
        if x.element_size() > 2:  # float32: halve BLOCK_K to keep the tiles' shared memory that of 16-bit ones,
            # down to tl.dot's least K of 16 (triton 3.6 rejects less on the GPU; the interpreter does not)
            cfg_gu, cfg_down = ({**c, "BLOCK_K": max(16, c["BLOCK_K"] // 2)} for c in (cfg_gu, cfg_down))
        _gate_up_kernel[(blocks, triton.cdiv(inter, cfg_gu["BLOCK_N"]))](
            x, w13, act, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, x.stride(0),
            w13.stride(0), w13.stride(1), TOP_K=top_k, BLOCK_M=block_m, F32_DOT=f32_dot, PRECISION=precision,
            DIRECT=direct, **cfg_gu)
        grid_down = (blocks, triton.cdiv(hidden, cfg_down["BLOCK_N"]))
        fused_sum = direct and num_tokens == 1 and grid_down[1] <= SUM_COUNTERS
        _down_kernel[grid_down](
            act, w2, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, w2.stride(0),
            w2.stride(1), wts, out, _counters(dev) if fused_sum else ids, TOP_K=top_k, BLOCK_M=block_m,
            F32_DOT=f32_dot, PRECISION=precision, DIRECT=direct, SUM=fused_sum, **cfg_down)
        rne = False
    if fused_sum:
        return out
    sum_block = min(1024, triton.next_power_of_2(hidden))
    _sum_k_kernel[(num_tokens, triton.cdiv(hidden, sum_block))](y, wts, out, hidden, out.stride(0), TOP_K=top_k,
                                                                BLOCK=sum_block, RNE=rne, num_warps=4)
    return out
