"""Triton fused MoE: a grouped GEMM over the routed (token, k) pairs (reference: kernels/reference.py fused_moe).

Capturable with fixed shapes: nothing is read back to the host and every buffer and grid is sized from shapes.
The blocks of pairs each GEMM program takes (alignment by expert, or a pair a block at one token) and the k-sums are
kernels/triton_moe_blocks.py's; FP8 weights take kernels/triton_moe_fp8.py's GEMMs. The bf16 / float32 GEMMs here:
  * Gate/up (`_gate_up_kernel`): one program per (block, BLOCK_N columns of I) multiplies the block's x rows by
    both the gate and the up rows of w13[e] (two accumulators), so silu(gate) * up is fused into the epilogue and
    the [rows, 2I] product is never written. Rounding follows the reference: gate and up rounded to x's dtype,
    silu rounded, then the product rounded.
  * Down (`_down_kernel`): act @ w2[e]^T per block, rounded to x's dtype and written per pair to y [T*K, H], then
    summed per token (at one token by the down GEMM's last program of each column block).
`F32_DOT` does the products in float32 on CPU tensors, where the Triton interpreter's bfloat16 tl.dot is wrong.
(One token as two plain GEMVs, gate/up per expert slot and down summing the slots in registers, was measured no
faster than the direct path and removed.)
The bf16 GEMMs' tiles are tuned per rows a block: kernels/tuned_h200.py MOE_TILES.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.reference_moe_fp8 import check_fp8_moe
from specserve.kernels.triton_dot import dot
from specserve.kernels.triton_moe_blocks import (
    DIRECT_BLOCK_M,
    block_pairs,
    expert_tile,
    moe_block_m,
    route,
    sum_counters,
    sum_k,
    sum_pairs,
    sums_in_kernel,
)
from specserve.kernels.triton_moe_fp8 import TL_DTYPES, fp8_experts
from specserve.kernels.tuned_h200 import MOE_TILES


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, hidden,
                    inter, stride_xt, stride_we, stride_wn, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
                    DIRECT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        tok = (pair // TOP_K).to(tl.int64)
        n, n_ok, k, x_ptrs, g_ptrs = expert_tile(x_ptr, tok, stride_xt, w_ptr, e, stride_we, stride_wn, pid_n, inter,
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
def _down_kernel(act_ptr, w_ptr, y_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, hidden,
                 inter, stride_we, stride_wn, wts_ptr, out_ptr, counter_ptr, TOP_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                 PRECISION: tl.constexpr, DIRECT: tl.constexpr, SUM: tl.constexpr):
    """SUM (one token, direct): the k outputs summed in-kernel (sum_pairs)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    live, e, pair = block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M, DIRECT)
    if live:
        row_ok = pair < n_pairs
        rows = pair.to(tl.int64)
        n, n_ok, k, a_ptrs, w_ptrs = expert_tile(act_ptr, rows, inter, w_ptr, e, stride_we, stride_wn, pid_n, hidden,
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
            sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K, BLOCK_N, False)


def _gemm_configs(block_m: int) -> tuple[dict, dict]:
    """(gate/up, down) tile sizes, warps and stages for blocks of block_m rows: tuned_h200.MOE_TILES's first entry
    of at least block_m rows (its last beyond), as fresh dicts."""
    most = next((rows for rows in MOE_TILES if block_m <= rows), max(MOE_TILES))
    gate_up, down = MOE_TILES[most]
    return dict(gate_up), dict(down)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, direct: bool | None = None, tiles: tuple[dict, dict] | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K]
    int64 -> [T, H] in x's dtype. Launch shapes depend on (T, K, E, H, I) only, so this is capturable.

    FP8 (W8A8; reference: kernels/reference_moe_fp8.py) when the scales are given: w13, w2 float8_e4m3fn with
    float32 scales w13_scale [E, 2I/bn, ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)] per block = (bn, bk) of
    weights (I % bn == 0); x is quantized once per token and bk columns of H (one small launch), the act per pair and
    bk columns of I in the gate/up GEMM's epilogue (fp8_act). block None: per-channel scales w13_scale [E, 2I],
    w2_scale [E, H]; x quantized per token, the act per pair (fp8_channel_act and the down GEMM). ValueError on
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
        if x.dtype not in TL_DTYPES:
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
    block_m = DIRECT_BLOCK_M if direct else moe_block_m(n_pairs, num_experts)
    ids, sorted_ids, block_expert, num_padded, blocks = route(topk_ids, num_experts, direct, block_m)
    y = torch.empty((n_pairs, hidden), dtype=x.dtype, device=x.device)  # [T*K, H] each expert's output per pair
    f32_dot = not x.is_cuda
    wts = topk_weights.reshape(-1)  # [T*K]
    if fp8:
        blocks_of_pairs = (ids, sorted_ids, block_expert, num_padded, blocks, block_m, top_k, direct)
        fused_sum = fp8_experts(x, w13, w13_scale, w2, w2_scale, fp8_block, blocks_of_pairs, tiles, y, wts, out)
        rne = f32_dot  # the interpreter's bfloat16 cast truncates (triton_fp8_tiles.py)
    else:
        act = torch.empty((n_pairs, inter), dtype=x.dtype, device=x.device)  # [T*K, I] silu(gate) * up per pair
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
        fused_sum = sums_in_kernel(direct, num_tokens, grid_down[1])
        _down_kernel[grid_down](
            act, w2, y, ids, sorted_ids, block_expert, num_padded, n_pairs, hidden, inter, w2.stride(0),
            w2.stride(1), wts, out, sum_counters(x.device) if fused_sum else ids, TOP_K=top_k, BLOCK_M=block_m,
            F32_DOT=f32_dot, PRECISION=precision, DIRECT=direct, SUM=fused_sum, **cfg_down)
        rne = False
    return out if fused_sum else sum_k(y, wts, out, top_k, rne)
