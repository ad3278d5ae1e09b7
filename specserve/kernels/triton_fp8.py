"""FP8 (W8A8, e4m3) linear layers in Triton: y [M, N] = x [M, K] @ W^T (+ bias), W kept in e4m3 on the GPU with
float32 scales, the products taken in fp8 (references: kernels/reference_fp8.py, which states the quantisation rule
these kernels follow bit for bit: per group, s = max(amax, 1e-10) / 448, q = e4m3(clamp(x / s, -448, 448))).

Two weight layouts:
  block-scaled (block = (bn, bk), DeepSeek-V3 / GLM / Qwen FP8 checkpoints): sw [ceil(N/bn), ceil(K/bk)]; the
    activations quantised per token per bk columns, sx [M, ceil(K/bk)], so each K step of bk columns meets one
    activation scale per row and one weight scale per output block;
  per-channel (block None, online "ptpc" quantisation of a bf16 checkpoint): sw [N]; activations per token, sx [M];
    the scales multiply the float32 sum once at the end.

Kernels:
  `quantize_act_groups_triton` / `quantize_act_tokens_triton`: the activation quantisers (one program per row and
    run of groups; one program per row, two passes over it, for per-token scales).
  `fp8_gemm`: prefill-sized products of quantised activations: tiles [BLOCK_M, BLOCK_N], a K loop over BLOCK_K
    columns, an fp8 x fp8 tl.dot (Hopper's fp8 tensor cores) into float32. Block case: BLOCK_K == bk and BLOCK_N
    divides bn (a tile never straddles two weight blocks), and each K step's partial product is scaled by
    sx[:, kb] * sw[nb, kb] before it is added. Channel case: one scale multiply after the loop.
  `fp8_gemv`: decode rows (M <= 16), `_fp8_gemv_kernel`, one launch over the raw activation, built for memory
    bandwidth (the point of FP8 at decode is reading half the weight bytes). Grid (N / BLOCK_N column tiles,
    SPLIT_K): each program a contiguous run of whole K steps, so even N = 4096 gives several programs a SM
    (gemv_config: about _PROGRAMS_PER_SM). A step reads 512 bytes of each of its BLOCK_N weight rows, as
    512 / group sub-steps of one scale group each (group = bk; 128 per-channel): [BLOCK_N, group] e4m3 tiles,
    16-byte loads. Each program quantises its x columns itself by the same rule (block: per group; per-channel: the
    row's amax over all of K first: x is a few rows, read from L2), so its results equal quantize + fp8_gemm up to
    float32 summation order. Block scales fold into x (a tile lies inside one weight block row: one weight scale a
    sub-step). Per-channel weights up to 4 rows (block-scaled: one row) have their products taken on CUDA cores (per
    row a [BLOCK_N, group] float32 accumulator, reduced over K once after the loop); more rows, up to 16, pad to a
    16-row tensor-core tile, the same product as fp8_gemm's. Split K: float32 partials [SPLIT_K, M, N]; the last
    program of a column tile to arrive (an arrival counter, kernels/counters.py) sums them in split order:
    deterministic, no float atomics, no second launch.
  `fp8_linear`: the front door: x [..., K] -> [..., N] in x's dtype; per-channel bf16 layers without a bias from
    cublas_fp8.MIN_ROWS rows take cuBLAS's row-wise FP8 GEMM (kernels/cublas_fp8.py); otherwise M <= GEMV_MAX_ROWS
    rows take fp8_gemv, more quantize + fp8_gemm.
fp8_gemm is `_fp8_mm_kernel`; grids and configs come from shapes (and the SM count) only, no host sync: every launch
is CUDA-graph capturable.

Rounding (the interpreter's measured on triton 3.9; the GPU's read from the sm_90 PTX, not run here):
  * The interpreter's float32 -> e4m3 conversion (CPU tests) is wrong wherever rounding carries into the next
    binade (125.6 -> 64 instead of 128, 0.0147 -> 0.0137 instead of 0.0156, subnormals -> 0): ~2.5% of Gaussian
    values. So under the interpreter (EXACT_FIRST) `_to_e4m3` first rounds to e4m3's grid in float32 arithmetic and
    the conversion only meets exact values: then it agrees with torch's cast bit for bit (tests/test_fp8_gemm.py
    checks random, wide-range, every e4m3 value, every midpoint and the float32 values either side of it, and
    -0). On the GPU the conversion is the hardware's round-to-nearest-even (PTX cvt.rn.satfinite.e4m3x2.f32),
    torch's rounding, and EXACT_FIRST is off (the same test checks it there).
  * x / s and amax / 448 use div_rn (PTX div.rn.f32, correctly rounded, as torch's `/`): Triton's `/` on float32
    is the GPU's approximate division (div.full.f32), which could move a quotient across an e4m3 midpoint.
  * bfloat16 outputs are rounded to nearest even by hand (`_out`): the interpreter's conversion truncates.
  * On sm_90 an fp8 x fp8 warpgroup MMA accumulates in the tensor core at reduced precision unless told otherwise;
    max_num_imprecise_acc = BLOCK_K promotes the sum to float32 every K step (DeepGEMM's choice, every 128 values),
    so GPU sums within a K step may differ from float32 ones (not measured here; tests/test_fp8_gemm.py bounds it
    on a GPU by 5e-4 of the sum of magnitudes). The GEMV's 16-row tiles (mma.sync) and CUDA-core path sum in
    float32.

fp8 tensors are passed as they are (the interpreter loads float8_e4m3fn pointers, checked: no uint8 views needed).
DOT_DTYPE "f32" (CPU tensors only: the interpreter's low-precision tl.dot is unreliable, as kernels/triton_dot.py's
F32_DOT says) upcasts the dot's operands to float32 (every e4m3 value and every product of two is exact in float32,
so only the summation order changes); on the GPU "fp8", except a bk = 16 block (below an fp8 tl.dot's K of 32):
"bf16", which also holds every e4m3 value exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.kernels import cublas_fp8
from specserve.kernels.counters import arrival_counters
from specserve.kernels.launch import sm_count
from specserve.kernels.reference_fp8 import check_block, check_scales

GEMV_MAX_ROWS = 16  # rows fp8_linear sends to fp8_gemv (decode, verify); more take quantize + fp8_gemm
_CUDA_CORE_ROWS = 4  # per-channel fp8_gemv's rows up to which products run on CUDA cores; more on a 16-row
# tensor-core tile. Block-scaled weights: CUDA cores at one row only: each row's group quantisation (an amax over 128
# columns a sub-step) repeats per row on CUDA cores, so that path's time grows with the rows, where the 16-row tile's
# barely does (the 8B's verify rows: BENCHMARKS.md "FP8").


def _cuda_core_rows(block: tuple[int, int] | None) -> int:
    """Rows up to which fp8_gemv multiplies on CUDA cores (more: a 16-row tensor-core tile)."""
    return 1 if block is not None else _CUDA_CORE_ROWS


@triton.jit
def _to_e4m3(y, EXACT_FIRST: tl.constexpr):
    """float32 y (|y| <= 448) -> e4m3 rounded to nearest even. EXACT_FIRST (the interpreter, see the module doc):
    round to e4m3's grid in float32 first: the step of y's binade is 2^(max(e, -6) - 3), and |y| / step (< 16,
    exact) is rounded to an integer by adding and taking off 2^23; the sign is put back by its bit, so -0 stays
    -0."""
    if EXACT_FIRST:
        bits = y.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127  # y's binade (0: -127)
        step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = ((tl.abs(y) / step + 8388608.0) - 8388608.0) * step  # power-of-two divisor and product: exact
        y = tl.where(bits < 0, -r, r)  # the sign bit's test: -0.0 too
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _scale(amax):
    """The rule's scale of a group of largest magnitude amax (float32): max(amax, 1e-10) / 448, correctly
    rounded."""
    return tl.math.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def _quantize(xf, s, EXACT_FIRST: tl.constexpr):
    """xf [R, C] float32, s [R] float32 scales -> e4m3 [R, C]: clamp(x / s, -448, 448), correctly rounded
    quotient."""
    q = tl.math.div_rn(xf, tl.broadcast_to(s[:, None], xf.shape))
    return _to_e4m3(tl.clamp(q, -448.0, 448.0), EXACT_FIRST)


@triton.jit
def _out(acc, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """float32 acc -> DTYPE; ROUND_BF16 (DTYPE bfloat16): rounded to nearest even by hand (the interpreter's
    conversion truncates)."""
    if ROUND_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    return acc.to(DTYPE)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, K, n_groups, stride_x, stride_q, stride_s,
                         GROUP: tl.constexpr, GROUPS: tl.constexpr, EXACT_FIRST: tl.constexpr):
    """Program (row m, run j): groups j*GROUPS .. + GROUPS of row m of x [M, K] -> q [M, K] e4m3 and s [M, G]."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    ok = (k < K) & (g[:, None] < n_groups)
    xf = tl.load(x_ptr + m * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    s = _scale(tl.max(tl.abs(xf), axis=1))  # [GROUPS]
    tl.store(q_ptr + m * stride_q + k, _quantize(xf, s, EXACT_FIRST), mask=ok)
    tl.store(s_ptr + m * stride_s + g, s, mask=g < n_groups)


@triton.jit
def _quant_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr,
                         EXACT_FIRST: tl.constexpr):
    """Program m: row m of x [M, K] -> q [M, K] e4m3 and s [M]: its amax over K, then the quantised row."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([1], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xf = tl.load(x_ptr + m * stride_x + k0 + cols[None, :], mask=(k0 + cols[None, :]) < K, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xf.to(tl.float32)), axis=1))
    s = _scale(amax)  # [1]
    for k0 in range(0, K, BLOCK_K):
        ok = (k0 + cols[None, :]) < K
        xf = tl.load(x_ptr + m * stride_x + k0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + m * stride_q + k0 + cols[None, :], _quantize(xf, s, EXACT_FIRST), mask=ok)
    tl.store(s_ptr + m + tl.arange(0, 1), s)


@triton.jit
def _product(xq, w, DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, IMPRECISE: tl.constexpr):
    """xq [BLOCK_M, BLOCK_K] e4m3 x w [BLOCK_N, BLOCK_K] e4m3 -> sum over K [BLOCK_M, BLOCK_N] float32. DOT: on
    tensor cores, in DOT_DTYPE ("fp8" itself; "bf16" for K tiles below fp8's 32; "f32" on the interpreter, all
    exact for e4m3 values); else on CUDA cores (a few rows: the broadcast product, reduced over K)."""
    if DOT:
        if DOT_DTYPE == "fp8":
            part = tl.dot(xq, tl.trans(w), max_num_imprecise_acc=IMPRECISE)
        elif DOT_DTYPE == "f32":
            part = tl.dot(xq.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(xq.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        part = tl.sum(xq.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return part


@triton.jit
def _fp8_mm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K,
                   stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
                   BN_W: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, IMPRECISE: tl.constexpr, ROUND_BF16: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    """Tile (BLOCK_M rows, BLOCK_N output columns) of y [M, N] = x [M, K] @ w[N, K]^T with scales: x e4m3 with
    scales sx (BLOCKWISE: [M, ceil(K/BLOCK_K)], else [M]), the products on tensor cores. BLOCKWISE: BLOCK_K == bk,
    BLOCK_N divides BN_W (= bn), sw [ceil(N/bn), ceil(K/bk)]; else sw [N]. Tiles run GROUP_M row tiles at a time
    down a column of tiles, so a column's weight tiles are reused from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    nb = (pid_n * BLOCK_N) // BN_W  # the tile's weight block row (BLOCKWISE)
    for kb in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
        xq = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        part = _product(xq, w, True, DOT_DTYPE, IMPRECISE)  # [BLOCK_M, BLOCK_N] float32
        if BLOCKWISE:
            sx = tl.load(sx_ptr + rm * stride_sxm + kb, mask=m_ok, other=0.0)  # [BLOCK_M] this group's
            acc += part * (sx[:, None] * tl.load(sw_ptr + nb * stride_swn + kb))
        else:
            acc += part
    if BLOCKWISE:
        sx_row = tl.zeros([BLOCK_M], tl.float32)  # (unused: the block scales are in acc already)
    else:
        sx_row = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    _epilogue(acc, sx_row, sw_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_ym, BLOCKWISE, HAS_BIAS, ROUND_BF16)


@triton.jit
def _row_scales(x_rows, m_ok, K, BLOCK_M: tl.constexpr, ROW_K: tl.constexpr):
    """Per-token scales [BLOCK_M] of the rows x_rows ([BLOCK_M, 1] pointers): each row's amax over all of K (x is a
    few rows: every program reads them, from L2 after the first ones)."""
    cols = tl.arange(0, ROW_K)
    amax = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, ROW_K):
        xf = tl.load(x_rows + k0 + cols[None, :], mask=m_ok[:, None] & (k0 + cols[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xf.to(tl.float32)), axis=1))
    return _scale(amax)


@triton.jit
def _epilogue(acc, sx_row, sw_ptr, b_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_ym, BLOCKWISE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [R, BLOCK_N] float32 sums of rows rm (block: already scaled) -> y: the per-channel scales (sx_row [R]),
    the bias, x's dtype."""
    if not BLOCKWISE:
        acc = acc * (sx_row[:, None] * tl.load(sw_ptr + rn, mask=n_ok, other=0.0)[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], _out(acc, y_ptr.dtype.element_ty, ROUND_BF16),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_x(x_rows, m_ok, k, k_ok, sx_row, sw_row, kg, K, GROUP: tl.constexpr, BLOCKWISE: tl.constexpr,
            EXACT_FIRST: tl.constexpr):
    """A sub-step's x: rows x_rows ([R, 1] pointers), columns k [GROUP] from kg -> (xq [R, GROUP] e4m3, s [R]: the
    factor of its products: block, this group's activation scales times the tile's weight block scale; per-channel
    1, the row scales multiply once at the end)."""
    xf = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [R, GROUP]
    if BLOCKWISE:
        sx = _scale(tl.max(tl.abs(xf), axis=1))  # [R]
        return _quantize(xf, sx, EXACT_FIRST), sx * tl.load(sw_row + kg // GROUP, mask=kg < K, other=0.0)
    return _quantize(xf, sx_row, EXACT_FIRST), tl.full(sx_row.shape, 1.0, tl.float32)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, part_ptr, cnt_ptr, y_ptr, M, N, K, K_SPLIT, SPLIT_K,
                     stride_xm, stride_wn, stride_swn, stride_ym,
                     BN_W: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     TILES_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     GROUPS: tl.constexpr, ROW_K: tl.constexpr, DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     EXACT_FIRST: tl.constexpr, ROUND_BF16: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program (column tile pid_n, K split pid_s): y [M, N] columns pid_n * BLOCK_N.. of x [M, K] @ w[N, K]^T over
    columns pid_s * K_SPLIT .. + K_SPLIT (whole steps of GROUPS * GROUP), x the raw activation quantised here by
    the rule. Each step is GROUPS sub-steps of one scale group (GROUP = bk, or 128 per-channel): a [BLOCK_N, GROUP]
    e4m3 weight tile (GROUP contiguous bytes a row) and the x group, quantised (block: its own amax; per-channel:
    the row's, found first over all of K, ROW_K columns a step: 32 values a thread). Block scales fold into x:
    BLOCK_N divides bn, so a sub-step meets one weight scale per row, and sx * sw multiplies the e4m3 x values (or
    the tensor-core partial) before the sum.
    Rows: TILES_M tiles of TILE_M rows, each with its own accumulator (a tuple). CUDA cores (not DOT): TILE_M = 1,
    TILES_M = M, each row a [BLOCK_N, GROUP] float32 tile of products with the shared weight tile, accumulated
    elementwise and reduced over GROUP once after the loop (in the sm_90 TTGIR the products keep the weight tile's
    load layout, 16 bytes a thread; x's group is quantised one or two values a thread and reaches that layout through
    shared memory). DOT: one 16-row tile, a tensor-core product per sub-step.
    SPLIT (SPLIT_K > 1 programs along K; a runtime value, so one compiled kernel serves every split): each program
    stores its sums in part [SPLIT_K, M, N]; the last of a tile's SPLIT_K programs to arrive (counter pid_n) adds
    them in split order (deterministic), finishes y and resets the counter."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rg = tl.arange(0, GROUP)  # [GROUP]
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    sw_row = sw_ptr + ((pid_n * BLOCK_N) // BN_W) * stride_swn  # BLOCKWISE: the tile's weight block row
    rms = ()  # per row tile: its rows [TILE_M]
    sxs = ()  # per row tile, per-channel: its rows' scales [TILE_M] (block: unused ones)
    accs = ()
    for t in tl.static_range(TILES_M):
        rm = t * TILE_M + tl.arange(0, TILE_M)
        rms = rms + (rm,)
        if BLOCKWISE:
            sxs = sxs + (tl.full([TILE_M], 1.0, tl.float32),)
        else:
            sxs = sxs + (_row_scales(x_ptr + rm.to(tl.int64)[:, None] * stride_xm, rm < M, K, TILE_M, ROW_K),)
        if DOT:
            accs = accs + (tl.zeros([TILE_M, BLOCK_N], tl.float32),)
        else:
            accs = accs + (tl.zeros([BLOCK_N, GROUP], tl.float32),)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    for k0 in tl.range(k_lo, k_hi, GROUP * GROUPS, num_stages=NUM_STAGES):
        for g in tl.static_range(GROUPS):
            kg = k0 + g * GROUP  # the sub-step's first column (a multiple of GROUP)
            k = kg + rg
            k_ok = k < K  # splits hold whole steps: only the last one runs past K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, GROUP]
            if not DOT:
                w = w.to(tl.float32)
            new = ()
            for t in tl.static_range(TILES_M):
                rm = rms[t]
                xq, s = _gemv_x(x_ptr + rm.to(tl.int64)[:, None] * stride_xm, rm < M, k, k_ok, sxs[t], sw_row, kg,
                                K, GROUP, BLOCKWISE, EXACT_FIRST)  # [TILE_M, GROUP] e4m3, [TILE_M]
                if DOT:
                    part = _product(xq, w, True, DOT_DTYPE, GROUP)  # [TILE_M, BLOCK_N]
                    new = new + (accs[t] + part * s[:, None],)
                else:
                    new = new + (accs[t] + w * (xq.to(tl.float32) * s[:, None]),)  # [BLOCK_N, GROUP]
            accs = new
    sums = ()  # per row tile [TILE_M, BLOCK_N]
    for t in tl.static_range(TILES_M):
        if DOT:
            sums = sums + (accs[t],)
        else:
            sums = sums + (tl.sum(accs[t], axis=1)[None, :],)
    if not SPLIT:
        for t in tl.static_range(TILES_M):
            _epilogue(sums[t], sxs[t], sw_ptr, b_ptr, y_ptr, rms[t], rn, rms[t] < M, n_ok, stride_ym,
                           BLOCKWISE, HAS_BIAS, ROUND_BF16)
    else:
        for t in tl.static_range(TILES_M):
            mn = rms[t][:, None] * N + rn[None, :]  # [TILE_M, BLOCK_N] offsets in one split's [M, N]
            tl.store(part_ptr + pid_s * M * N + mn, sums[t], mask=(rms[t] < M)[:, None] & n_ok[None, :])
        # The barrier orders every thread's stores before the one-thread atomic, whose release makes them visible
        # at GPU scope to the program that acquires the final count; it reads the partials through L2 (.cg).
        tl.debug_barrier()
        counter = cnt_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            for t in tl.static_range(TILES_M):
                mn = rms[t][:, None] * N + rn[None, :]
                mn_ok = (rms[t] < M)[:, None] & n_ok[None, :]
                total = tl.zeros([TILE_M, BLOCK_N], tl.float32)
                for s_i in range(SPLIT_K):  # fixed order: bit-identical run to run
                    total += tl.load(part_ptr + s_i * M * N + mn, mask=mn_ok, other=0.0, cache_modifier=".cg")
                _epilogue(total, sxs[t], sw_ptr, b_ptr, y_ptr, rms[t], rn, rms[t] < M, n_ok, stride_ym,
                               BLOCKWISE, HAS_BIAS, ROUND_BF16)
            tl.store(counter, 0)  # the next launch (or graph replay) counts from 0 again


def _dot_dtype(device: torch.device, block_k: int) -> str:
    """The tl.dot operand type: float32 under the interpreter (F32_DOT, kernels/triton_dot.py), fp8 on the GPU,
    bfloat16 where the K tile is below an fp8 dot's 32."""
    if device.type != "cuda":
        return "f32"
    return "fp8" if block_k >= 32 else "bf16"


def _col_tile(n: int, block: tuple[int, int] | None, widest: int) -> int:
    """BLOCK_N: `widest`, at most bn (a tile inside one weight block: powers of two, so it divides bn)."""
    return widest if block is None else min(widest, block[0])


def _launch(x, sx, wq, sw, block, bias, y, block_m: int, block_n: int, block_k: int, num_warps: int,
            num_stages: int, group_m: int = 1) -> torch.Tensor:
    m, k = x.shape
    n = wq.shape[0]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    if m == 0:
        return y
    _fp8_mm_kernel[grid](
        x, sx, wq, sw, bias if bias is not None else y, y, m, n, k,
        x.stride(0), sx.stride(0), wq.stride(0), sw.stride(0), y.stride(0),
        BN_W=block[0] if block is not None else 1, BLOCKWISE=block is not None,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_DTYPE=_dot_dtype(x.device, block_k), IMPRECISE=block_k, ROUND_BF16=y.dtype == torch.bfloat16,
        NUM_STAGES=num_stages, num_warps=num_warps)
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-d tensor whose rows are K-contiguous (the kernels' layout); copies only when they are not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def quantize_act_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_fp8.quantize_act_groups: x [M, K] -> (xq [M, K] e4m3, sx [M, ceil(K / group)] float32)."""
    check_block((group, group))
    x = _rows(x)
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    groups = max(1, min(triton.next_power_of_2(n_groups), 1024 // group))  # about 1024 values a program
    _quant_groups_kernel[(m, triton.cdiv(n_groups, groups))](x, xq, sx, k, n_groups, x.stride(0), xq.stride(0),
                                                             sx.stride(0), GROUP=group, GROUPS=groups,
                                                             EXACT_FIRST=not x.is_cuda, num_warps=4)
    return xq, sx


def quantize_act_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_fp8.quantize_act_tokens: x [M, K] -> (xq [M, K] e4m3, sx [M] float32)."""
    x = _rows(x)
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = min(2048, triton.next_power_of_2(k))
    _quant_tokens_kernel[(m,)](x, xq, sx, k, x.stride(0), xq.stride(0), BLOCK_K=block_k, EXACT_FIRST=not x.is_cuda,
                               num_warps=4)
    return xq, sx


def fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3 with sx ([M, ceil(K/bk)] block, [M] channel), wq [N, K] e4m3 with sw ([ceil(N/bn),
    ceil(K/bk)] or [N]), bias [N] or None -> y [M, N] out_dtype: float32 sums of (xq sx)(wq sw) + bias."""
    check_scales(tuple(xq.shape), wq, sw, block, bias)
    m, k = xq.shape
    want = (m,) if block is None else (m, triton.cdiv(k, block[1]))
    if xq.dtype != torch.float8_e4m3fn or tuple(sx.shape) != want or sx.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: expected xq float8_e4m3fn [M, K] with float32 sx {want}, got xq {xq.dtype} "
                         f"{tuple(xq.shape)}, sx {sx.dtype} {tuple(sx.shape)}")
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    block_m = 64 if m <= 64 else 128
    block_k = 128 if block is None else block[1]
    block_n = _col_tile(n, block, 128)
    big = block_m * block_n >= 128 * 128
    return _launch(_rows(xq), _rows(sx), _rows(wq), sw.contiguous(), block, bias, y, block_m, block_n, block_k,
                   8 if big else 4, 3 if big else 4, group_m=8)


@dataclass(frozen=True)
class GemvConfig:
    """A launch of `_fp8_gemv_kernel`. block_n: output columns (weight rows) a program; block_k: columns a K step,
    block_k / group sub-steps of one scale group each (group = bk, or _CHANNEL_GROUP for per-channel weights);
    split_k: programs along K, each a contiguous run of whole steps (fewer run where the steps do not fill them)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


GEMV_COUNTERS = 8192  # arrival counters (one per column tile) of split-K launches; more tiles never split
_CHANNEL_GROUP = 128  # per-channel weights' sub-step: 128 bytes a row, one full cache line
_STEP_BYTES = 512  # weight bytes of each row a K step: 32 threads x 16-byte loads over 4 rows of a tile per warp
_PROGRAMS_PER_SM = 4  # split K until the grid has this many programs a SM (at least one full wave of resident ones)
_MAX_SPLIT = 16  # beyond this the partial sums' traffic (SPLIT_K x M x N float32) stops being small


def _gemv_group(k: int, block: tuple[int, int] | None) -> int:
    """Columns a sub-step: one activation / weight scale group (bk), or _CHANNEL_GROUP (at most K's power of two)."""
    return block[1] if block is not None else min(_CHANNEL_GROUP, max(16, triton.next_power_of_2(k)))


def gemv_config(m: int, n: int, k: int, block: tuple[int, int] | None, sms: int) -> GemvConfig:
    """fp8_gemv's launch from the shape and the SM count (4 warps, 2 stages: the next step's tiles copied to shared
    memory while this one's are multiplied).
    BLOCK_K: _STEP_BYTES of each weight row a step (whole scale groups; fewer where K is shorter).
    BLOCK_N: a sub-step's [BLOCK_N, 128] e4m3 tile is 16 bytes a thread at 16 rows (the least for 16-byte loads).
    One row: 32, a 16 kB step a program; ptxas (sm_90, read from compile_for_gpu's PTX, not timed) gives it 147
    registers, so 3 programs a SM, 48 kB of weights in flight (16 rows: 80 registers, 6 programs, also 48 kB, but
    each thread's 16 x values, quantised once and broadcast through shared memory, then serve half as many weight
    bytes: more instructions a byte; 64 x 256: 168 registers, the same bytes, x shared by 4 rows). 2..4 rows of
    per-channel weights: 16 (a [16, 128] float32 accumulator per row; 168 registers at 4 rows). More rows (a 16-row
    tensor-core tile; block-scaled weights from 2 rows: _cuda_core_rows): 32. At most bn (a tile inside one weight
    block row). scripts/gpu/sweep_fp8_gemv.py times the alternatives.
    SPLIT_K: gemv_split (N = 4096 at 32 columns is 128 tiles: 5 splits on 132 SMs; gate_up's 896 tiles none)."""
    group = _gemv_group(k, block)
    # block-scaled at one row: half the step (two scale groups), and K split in two at least: the H200 sweep's best
    # at Llama-3.1-8B's qkv, o and gate_up (BENCHMARKS.md "FP8")
    one_row_blocks = block is not None and m == 1
    step = _STEP_BYTES // 2 if one_row_blocks else _STEP_BYTES
    block_k = group * max(1, min(step // group, triton.cdiv(k, group)))
    block_n = 32 if m == 1 or m > _cuda_core_rows(block) else 16
    block_n = min(block_n, block[0] if block is not None else block_n)
    return GemvConfig(block_n, block_k, gemv_split(n, k, block_n, block_k, sms, 2 if one_row_blocks else 1), 4, 2)


def gemv_split(n: int, k: int, block_n: int, block_k: int, sms: int, least: int = 1) -> int:
    """SPLIT_K for column tiles of block_n and K steps of block_k: enough programs for _PROGRAMS_PER_SM a SM (and
    `least`), at most one a K step and _MAX_SPLIT; 1 beyond GEMV_COUNTERS tiles."""
    tiles = triton.cdiv(n, block_n)
    if tiles > GEMV_COUNTERS:
        return 1
    wanted = max(least, triton.cdiv(_PROGRAMS_PER_SM * sms, tiles))
    return max(1, min(wanted, triton.cdiv(k, block_k), _MAX_SPLIT))


def _gemv_counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per column tile of a split-K launch (kernels/counters.py)."""
    return arrival_counters("fp8 gemv", device, GEMV_COUNTERS)


def fp8_gemv_with(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
                  bias: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
    """fp8_gemv with the launch `cfg` (the sweep's and the tests' entry; fp8_gemv takes gemv_config's)."""
    check_scales(tuple(x.shape), wq, sw, block, bias)
    x, wq, sw = _rows(x), _rows(wq), sw.contiguous()
    m, k = x.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    group = _gemv_group(k, block)
    dot = m > _cuda_core_rows(block)
    tile_m = 16 if dot else 1  # rows a row tile: a 16-row tensor-core tile, or each row its own accumulator
    block_n = cfg.block_n if block is None else min(cfg.block_n, block[0])
    if dot and block_n < 16:
        raise ValueError(f"fp8_gemv: a tensor-core tile needs BLOCK_N >= 16, got {block_n}")
    if cfg.block_k % group:
        raise ValueError(f"fp8_gemv: BLOCK_K {cfg.block_k} is not a multiple of the scale group {group}")
    tiles = triton.cdiv(n, block_n)
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k  # whole steps a program
    split = triton.cdiv(k, k_split) if tiles <= GEMV_COUNTERS else 1  # no empty programs
    if split == 1:
        k_split = triton.cdiv(k, cfg.block_k) * cfg.block_k
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _gemv_counters(x.device) if split > 1 else y
    _fp8_gemv_kernel[(tiles, split)](
        x, wq, sw, bias if bias is not None else y, part, counters, y, m, n, k, k_split, split,
        x.stride(0), wq.stride(0), sw.stride(0), y.stride(0),
        BN_W=block[0] if block is not None else 1, BLOCKWISE=block is not None, HAS_BIAS=bias is not None,
        SPLIT=split > 1, TILES_M=triton.cdiv(m, tile_m), TILE_M=tile_m, BLOCK_N=block_n, GROUP=group,
        GROUPS=cfg.block_k // group, ROW_K=4096 // tile_m, DOT=dot,
        DOT_DTYPE=_dot_dtype(x.device, group), EXACT_FIRST=not x.is_cuda, ROUND_BF16=y.dtype == torch.bfloat16,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return y


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows: x [M <= 16, K] (raw activation, any float dtype) -> y [M, N] in x's dtype, quantised in the
    kernel by the rule; equal to fp8_gemm(*quantize(x), ...) up to float32 summation order. One launch."""
    check_scales(tuple(x.shape), wq, sw, block, bias)
    m, k = x.shape
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {m} (use fp8_linear)")
    sms = sm_count(x.device) if x.is_cuda else 1
    return fp8_gemv_with(x, wq, sw, block, bias, gemv_config(m, wq.shape[0], k, block, sms))


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (reference_fp8.fp8_linear_ref): per-channel bf16 inputs without a bias
    from cublas_fp8.MIN_ROWS (5) rows the per-token quantiser, then cuBLAS's row-wise FP8 GEMM (cublas_fp8 says
    why); otherwise up to GEMV_MAX_ROWS rows one fp8_gemv launch, more the activation quantiser,
    then fp8_gemm. The choice is by shape and dtype only (capturable)."""
    check_scales(tuple(x.shape), wq, sw, block, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if cublas_fp8.fits(x2, wq, block, bias):  # per-channel bf16 from 5 rows (verify rows included)
        xq, sx = quantize_act_tokens_triton(x2)
        y = cublas_fp8.fp8_linear_rowwise(xq, sx, wq, sw)
    elif x2.shape[0] <= GEMV_MAX_ROWS:
        y = fp8_gemv(x2, wq, sw, block, bias)
    else:
        xq, sx = quantize_act_tokens_triton(x2) if block is None else quantize_act_groups_triton(x2, block[1])
        y = fp8_gemm(xq, sx, wq, sw, block, bias, x.dtype)
    return y.reshape(*lead, wq.shape[0])
