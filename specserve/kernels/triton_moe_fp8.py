"""The fused MoE's FP8 expert GEMMs (W8A8; reference: kernels/reference_moe_fp8.py), called by
kernels/triton_moe.py fused_moe when the weights come with scales. Blocks, alignment, the direct path and the sums are
the bf16 path's (kernels/triton_moe_blocks.py).
Block-scaled weights (bn x bk blocks) are fed quantized activations so no program re-quantizes what another already
did: x is quantized once (triton_fp8's dense-linear quantizer, one small launch: xq [T, H] e4m3, sx [T, H/bk]);
`_gate_up_fp8_kernel` dots e4m3 tiles a scale group at a time (a K step is one or more groups of bk columns, each
product scaled by its rows' and columns' scales) and quantizes its act tile in the epilogue (its BLOCK_N covers whole
bk groups: aq [T*K, I] e4m3, sa [T*K, I/bk]); `_down_fp8_kernel` reads those. Their tiles: tuned_h200.MOE_FP8_TILES
(untuned).
Per-channel FP8 weights (block None: a scale per weight row, w13_scale [E, 2I], w2_scale [E, H]; compressed-tensors'
channel / tensor checkpoints) take two more GEMMs: x is quantized once per token (triton_fp8's per-token quantizer:
xq [T, H], sx [T]); `_gate_up_fp8_channel_kernel` runs plain e4m3 dots along K (no scale changes along it) and
multiplies sx[row] * s[expert, col] once after; the act's scale is per pair, over a whole row of I that no program
holds, so its epilogue writes the act in x's dtype and each row's amax over its columns; `_down_fp8_channel_kernel`
takes the max of a row's partials (a few floats), quantizes the act tiles by the rule as it loads them, and scales
once after its K loop. The same tile table (keyed by rows per block).
`F32_DOT` does the products in float32 on CPU tensors, where the Triton interpreter's bfloat16 tl.dot is wrong;
`RNE` rounds explicitly there (the interpreter's bfloat16 cast truncates: triton_fp8_tiles.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton_fp8 import quantize_act_groups_triton, quantize_act_tokens_triton
from specserve.kernels.triton_fp8_tiles import dot_e4m3, quantize_groups, quantize_rows, round_to, scale_of
from specserve.kernels.triton_moe_blocks import block_pairs, expert_tile, sum_counters, sum_pairs, sums_in_kernel
from specserve.kernels.tuned_h200 import MOE_FP8_TILES


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
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        tok = rows // TOP_K
        # columns past I (not n_ok): zero weights, so a zero act that changes no group's amax
        n, n_ok, k, x_ptrs, g_ptrs = expert_tile(xq_ptr, tok, hidden, w_ptr, e, stride_we, stride_wn, pid_n, inter,
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
    to y's dtype (x's), as the reference does before its weighted sum. SUM: sum_pairs (one token)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = expert_tile(aq_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
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
            sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, RNE)


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
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        tok = rows // TOP_K
        # columns past I (not n_ok): zero weights and scales, so a zero act that changes no amax
        n, n_ok, k, x_ptrs, g_ptrs = expert_tile(xq_ptr, tok, hidden, w_ptr, e, stride_we, stride_wn, pid_n, inter,
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
    (x's), as the reference does before its weighted sum. SUM: sum_pairs (one token)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = expert_tile(act_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
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
            sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, RNE)


def fp8_configs(block_m: int, bk: int, inter: int, hidden: int, tiles) -> tuple[dict, dict]:
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


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fp8_act(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, bn: int, bk: int, route: tuple, cfg: dict
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
        ACT_DTYPE=TL_DTYPES[x.dtype], F32_DOT=not x.is_cuda, RNE=not x.is_cuda, DIRECT=direct,
        **_fp8_launch(cfg, bk))
    return aq, sa


def fp8_channel_configs(block_m: int, inter: int, hidden: int, tiles) -> tuple[dict, dict]:
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


def fp8_channel_act(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, route: tuple, cfg: dict
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 gate/up: x [T, H] quantized once per token by the dense FP8 linear's quantizer
    (quantize_act_tokens_triton: reference_moe_fp8._quantize_groups with the row as one group, bit for bit) ->
    xq [T, H] e4m3, sx [T]; then the GEMM -> (act [T*K, I] in x's dtype, amax [T*K, cdiv(I, BLOCK_N)] float32: the
    rows' partial amaxes, whose max is the act's per-pair scale's). route as fp8_act's. Exposed for the tests."""
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
        w13.stride(0), w13.stride(1), s13.stride(0), TOP_K=top_k, BLOCK_M=block_m, ACT_DTYPE=TL_DTYPES[x.dtype],
        F32_DOT=not x.is_cuda, RNE=not x.is_cuda, DIRECT=direct, **cfg)
    return act, amax


def fp8_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                block: tuple[int, int] | None, route: tuple, tiles: tuple[dict, dict] | None, y: torch.Tensor,
                wts: torch.Tensor, out: torch.Tensor) -> bool:
    """Both FP8 GEMMs of fused_moe: block-scaled (block (bn, bk)) or per-channel (None) weights, x [T, H] -> each
    pair's output in y [T*K, H], or at one token on the direct path the weighted sum straight into out [1, H]
    (returns True then). route: (ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct)."""
    ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct = route
    num_tokens, hidden = x.shape
    inter, n_pairs, f32_dot = w2.shape[2], num_tokens * top_k, not x.is_cuda
    if block is None:
        cfg_gu, cfg_down = fp8_channel_configs(block_m, inter, hidden, tiles)
        act, amax = fp8_channel_act(x, w13, s13, route, cfg_gu)
        grid_down = (blocks, triton.cdiv(hidden, cfg_down["BLOCK_N"]))
        fused_sum = sums_in_kernel(direct, num_tokens, grid_down[1])
        _down_fp8_channel_kernel[grid_down](
            act, amax, w2, s2, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, amax.shape[1],
            w2.stride(0), w2.stride(1), s2.stride(0), wts, out, sum_counters(x.device) if fused_sum else ids,
            TOP_K=top_k, BLOCK_M=block_m, AMAX_TILES=triton.next_power_of_2(amax.shape[1]), F32_DOT=f32_dot,
            RNE=f32_dot, DIRECT=direct, SUM=fused_sum, **cfg_down)
        return fused_sum
    bn, bk = block
    cfg_gu, cfg_down = fp8_configs(block_m, bk, inter, hidden, tiles)
    aq, sa = fp8_act(x, w13, s13, bn, bk, route, cfg_gu)
    grid_down = (blocks, triton.cdiv(hidden, cfg_down["BLOCK_N"]))
    fused_sum = sums_in_kernel(direct, num_tokens, grid_down[1])
    _down_fp8_kernel[grid_down](
        aq, sa, w2, s2, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, sa.shape[1],
        w2.stride(0), w2.stride(1), *s2.stride(), wts, out, sum_counters(x.device) if fused_sum else ids,
        TOP_K=top_k, BLOCK_M=block_m, BN_W=bn, F32_DOT=f32_dot, RNE=f32_dot, DIRECT=direct, SUM=fused_sum,
        **_fp8_launch(cfg_down, bk))
    return fused_sum
