"""Triton softmax router (reference: kernels/reference.py softmax_topk).

`softmax_topk_triton`: one program per token does the softmax over its E expert logits, the top-k by k rounds of
argmax (equal weights: the lower expert id first), and the renormalisation, where torch needs a softmax, a top-k, a
sum and a division (four launches per MoE layer). With a gated shared expert fused into the routed ones
(layers/moe.py) it also writes the shared expert's slot: id E, weight sigmoid(the gate logit in column E).

`router_topk_triton`: the router GEMV (logits = x @ gate_weight^T, rounded to x's dtype as F.linear's output is) and
the same routing in one launch, for decode and verify batches of a few tokens, where the GEMV reads well under 2 MB
of weights and the separate launches (cuBLAS's GEMV, its split-K reduce, the router kernel) are mostly launch
latency. Each program computes a block of logit columns for a block of tokens into a float32 scratch; the program
that finishes a token block last (a device counter per block, kernels/counters.py) routes those tokens from the scratch.
Both kernels share the routing step, `_route_rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.launch import one_wave_pdl, pdl_enter, pdl_kwargs
from specserve.kernels.triton_gemv import _rounded
from specserve.kernels.triton_topk import score_keys
from specserve.kernels.tuned_h200 import ROUTER


@triton.jit
def _route_rows(x, gate, rows, row_ok, num_experts, w_ptr, ids_ptr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                E_PAD: tl.constexpr, K_PAD: tl.constexpr, SHARED: tl.constexpr):
    """Route R tokens at once: x [R, E_PAD] float32 logits (lanes >= num_experts are ignored), gate [R] float32 the
    shared expert's gate logits (read only with SHARED); writes output rows `rows` [R] (where row_ok) of w_ptr
    (float32) and ids_ptr (int64), each TOP_K + SHARED wide."""
    R: tl.constexpr = x.shape[0]
    e = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    ok = e < num_experts
    x = tl.where(ok, x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]  # [R, E_PAD] softmax; padding lanes 0
    # One int64 key a lane, (the weight's bits, E_PAD - 1 - expert): a weight is >= 0, so its bits order as it does,
    # and one max per round gives the best weight and, among equal weights, the lowest expert id (a max and a
    # min per round before: each a reduction across the warps, the router's critical path)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - e)
    key = tl.where(ok, key, -1)  # never chosen
    kk = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]: TOP_K need not be a power of two (Qwen3-Next: 10)
    wts = tl.zeros([R, K_PAD], dtype=tl.float32)
    ids = tl.zeros([R, K_PAD], dtype=tl.int32)
    total = tl.zeros([R], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.max(key, 1)  # [R]
        best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)  # [R]
        idx = (E_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)  # [R]
        wts = tl.where(kk == j, best[:, None], wts)
        ids = tl.where(kk == j, idx[:, None], ids)
        total += best
        key = tl.where(e == idx[:, None], -1, key)
    if RENORM:
        wts = wts / total[:, None]
    _store_routes(w_ptr, ids_ptr, rows, row_ok, wts, ids, kk, 1.0 / (1.0 + tl.exp(-gate)), num_experts, TOP_K,
                  SHARED)


@triton.jit
def _store_routes(w_ptr, ids_ptr, rows, row_ok, wts, ids, kk, shared_w, num_experts, TOP_K: tl.constexpr,
                  SHARED: tl.constexpr):
    """Writes R tokens' routes: wts / ids [R, K_PAD] (lanes kk >= TOP_K unused) at output rows `rows` of w_ptr /
    ids_ptr, TOP_K + SHARED wide; with SHARED the last column is the fused shared expert (id E = num_experts,
    weight shared_w [R])."""
    OUT_K: tl.constexpr = TOP_K + SHARED
    out = rows.to(tl.int64)[:, None] * OUT_K + kk
    mask = row_ok[:, None] & (kk < TOP_K)
    tl.store(w_ptr + out, wts, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)
    if SHARED:
        slot = rows.to(tl.int64) * OUT_K + TOP_K
        tl.store(ids_ptr + slot, tl.zeros_like(rows).to(tl.int64) + num_experts, mask=row_ok)
        tl.store(w_ptr + slot, shared_w, mask=row_ok)


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                         RENORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, SHARED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # [1]: this program's token
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + e[None, :], mask=(e < num_experts)[None, :],
                other=float("-inf")).to(tl.float32)  # [1, E_PAD]
    gate = tl.zeros([1], dtype=tl.float32)
    if SHARED:
        gate = tl.load(logits_ptr + rows * stride_t + num_experts).to(tl.float32)
    _route_rows(x, gate, rows, rows >= 0, num_experts, w_ptr, ids_ptr, TOP_K, RENORM, E_PAD, K_PAD, SHARED)


def softmax_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool,
                        shared_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, ids [T, K] int64); top_k a power of two is not required. With
    shared_gate, logits [T, E + 1] -> [T, K + 1] (reference.softmax_topk)."""
    t, cols = logits.shape
    num_experts = cols - 1 if shared_gate else cols
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out_k = top_k + int(shared_gate)
    w = torch.empty((t, out_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, out_k), dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](logits, w, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                   RENORM=renormalize, E_PAD=triton.next_power_of_2(num_experts),
                                   K_PAD=triton.next_power_of_2(top_k), SHARED=shared_gate, num_warps=4)
    return w, ids


@triton.jit
def _route_grouped(x, bias, rows, row_ok, num_experts, scaling, w_ptr, ids_ptr, TOP_K: tl.constexpr,
                   RENORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, SHARED: tl.constexpr):
    """DeepSeek-V3 / GLM routing of R tokens (reference.grouped_sigmoid_topk): x [R, E_PAD] float32 logits, bias
    [1, E_PAD] the choice-only correction bias (0 past E). Experts are chosen on sigmoid(x) + bias, within the
    TOPK_GROUP groups of E / N_GROUP experts whose two best choice scores sum highest, and weighted by sigmoid(x)
    (renormalised when RENORM, times `scaling`); ids by descending choice score. Equal scores: the lower group / the
    lower expert id first. With N_GROUP > 1, E == E_PAD (groups are runs of E_PAD / N_GROUP lanes). SHARED: output
    rows TOP_K + 1 wide, the last a plain shared expert fused as expert E (weight 1)."""
    R: tl.constexpr = x.shape[0]
    e = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    ok = e < num_experts
    scores = 1.0 / (1.0 + tl.exp(-x))  # [R, E_PAD]
    choice = scores + bias
    if N_GROUP > 1:
        GS: tl.constexpr = E_PAD // N_GROUP
        c3 = tl.reshape(choice, [R, N_GROUP, GS])
        lane = tl.arange(0, GS)[None, None, :]
        m1 = tl.max(c3, 2)  # [R, G] each group's best choice score
        i1 = tl.min(tl.where(c3 == m1[:, :, None], lane, GS), 2)
        m2 = tl.max(tl.where(lane == i1[:, :, None], float("-inf"), c3), 2)  # its second best (m1 again if tied)
        rating = m1 + m2  # [R, G]
        g = tl.arange(0, N_GROUP)
        a = rating[:, :, None]  # group g
        b = rating[:, None, :]  # group h
        ahead = (b > a) | ((b == a) & (g[None, None, :] < g[None, :, None]))  # [R, G, G] h ranks before g
        keep = tl.sum(ahead.to(tl.int32), 2) < TOPK_GROUP  # [R, G]
        keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], [R, N_GROUP, GS]), [R, E_PAD])
        ok = ok & keep_e
    # one int64 key a lane: (the choice score's order-preserving bits, E_PAD - 1 - expert): one max a round
    key = (score_keys(choice) << 16) | (E_PAD - 1 - e)
    key = tl.where(ok, key, -1)  # never chosen
    kk = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    ids = tl.zeros([R, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        top = tl.max(key, 1)  # [R]
        idx = (E_PAD - 1 - (top & 0xFFFF)).to(tl.int32)  # [R]
        ids = tl.where(kk == j, idx[:, None], ids)
        key = tl.where(e == idx[:, None], -1, key)
    pick = (tl.arange(0, E_PAD)[None, None, :] == ids[:, :, None]) & (kk < TOP_K)[:, :, None]  # [R, K_PAD, E_PAD]
    wts = tl.sum(tl.where(pick, scores[:, None, :], 0.0), 2)  # [R, K_PAD] the unbiased scores of the chosen
    if RENORM:
        wts = wts / (tl.sum(wts, 1)[:, None] + 1e-20)  # HF's epsilon
    _store_routes(w_ptr, ids_ptr, rows, row_ok, wts * scaling, ids, kk, tl.zeros_like(rows).to(tl.float32) + 1.0,
                  num_experts, TOP_K, SHARED)


# ---------------------------------------------------------------------------------------------------------------
# The router GEMV and the routing in one launch.


@triton.jit
def _norm_input(x_rows, r_ptr, tok, k, ok, H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, dtype,
                ROUND_BF16: tl.constexpr):
    """h = x (+ residual) at columns k of the tokens, float32 of the value rounded to x's dtype (0 where not ok)."""
    hk = tl.load(x_rows + k, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + tok.to(tl.int64)[:, None, None] * H + k, mask=ok, other=0.0).to(tl.float32)
        hk = _rounded(hk + r, dtype, ROUND_BF16)
    return hk


@triton.jit
def _router_gemv_topk_kernel(x_ptr, wt_ptr, scratch_ptr, counter_ptr, w_ptr, ids_ptr, r_ptr, nw_ptr, xn_ptr, h_ptr,
                             bias_ptr, num_tokens, num_cols, num_experts, stride_xt, stride_we, eps, scaling,
                             H: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, T_BLOCK: tl.constexpr,
                             R_BLOCK: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, E_PAD: tl.constexpr,
                             K_PAD: tl.constexpr, SHARED: tl.constexpr, ROUND_BF16: tl.constexpr,
                             NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_OFFSET: tl.constexpr,
                             GROUPED: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                             HAS_BIAS: tl.constexpr, GDC: tl.constexpr):
    """Grid (cdiv(num_cols, BLOCK_E), cdiv(num_tokens, T_BLOCK)): program (i, b) computes the logit columns
    i*BLOCK_E .. + BLOCK_E (rows of the weight wt [num_cols, H]) of tokens b*T_BLOCK .. + T_BLOCK into scratch
    [num_tokens, num_cols] float32. The last program of token block b to finish (counter b) routes its tokens from
    the scratch and resets counter b to 0: token blocks are routed in parallel.

    NORM: x is the un-normed input; each program computes its tokens' RMSNorm of h = x (+ residual r) with weight
    nw itself (rounded as reference.add_rms_norm), routes the normed row, and the programs of column block 0 store
    it (xn [T, H], the experts' input) and h (the new residual), both contiguous.

    GROUPED: DeepSeek-V3 / GLM routing (`_route_grouped`: sigmoid scores, correction bias bias_ptr [E], groups,
    `scaling`) of float32 logits, not rounded (the gate runs in float32 there: F.linear(x.float(), w.float())).

    GDC: launched with PDL (a launch config's PDL key): waits for the previous kernel's output before reading."""
    pdl_enter(GDC)
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    col_ok = cols < num_cols
    block = tl.program_id(1)
    tok = block * T_BLOCK + tl.arange(0, T_BLOCK)  # [T_BLOCK]
    tok_ok = tok < num_tokens
    w_rows = wt_ptr + cols.to(tl.int64)[None, :, None] * stride_we  # [1, BLOCK_E, 1]
    x_rows = x_ptr + tok.to(tl.int64)[:, None, None] * stride_xt  # [T_BLOCK, 1, 1]
    dtype = x_ptr.dtype.element_ty
    writer = tl.program_id(0) == 0
    if NORM:  # each token's mean square over H, of h rounded to x's dtype, in float32
        sq = tl.zeros([T_BLOCK, 1, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BLOCK_K]
            hk = _norm_input(x_rows, r_ptr, tok, k, tok_ok[:, None, None] & (k < H), H, HAS_RESIDUAL, dtype,
                             ROUND_BF16)
            sq += hk * hk
        rstd = tl.rsqrt(tl.sum(sq, 2) / H + eps)[:, :, None]  # [T_BLOCK, 1, 1]
    acc = tl.zeros([T_BLOCK, BLOCK_E], dtype=tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):  # unrolled: every chunk's loads can be in flight at once
        k = k0 + tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BLOCK_K]
        k_ok = k < H
        wk = tl.load(w_rows + k, mask=col_ok[None, :, None] & k_ok, other=0.0).to(tl.float32)
        if NORM:
            x_ok = tok_ok[:, None, None] & k_ok
            hk = _norm_input(x_rows, r_ptr, tok, k, x_ok, H, HAS_RESIDUAL, dtype, ROUND_BF16)
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [1, 1, BLOCK_K]
            if W_OFFSET == 0.0:  # (hf * rstd).to(dtype) * w, the product rounded too
                xk = _rounded(_rounded(hk * rstd, dtype, ROUND_BF16) * nw, dtype, ROUND_BF16)
            else:  # (hf * rstd * (w + offset)).to(dtype)
                xk = _rounded(hk * rstd * (nw + W_OFFSET), dtype, ROUND_BF16)
            if writer:
                flat = tok.to(tl.int64)[:, None, None] * H + k
                tl.store(xn_ptr + flat, xk.to(dtype), mask=x_ok)
                if HAS_RESIDUAL:
                    tl.store(h_ptr + flat, hk.to(dtype), mask=x_ok)
        else:
            xk = tl.load(x_rows + k, mask=tok_ok[:, None, None] & k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(xk * wk, 2)  # [T_BLOCK, BLOCK_E]
    # Rounded to x's dtype, as F.linear's output is. bfloat16: to nearest even by hand, as the GPU's conversion does
    # (Triton's interpreter truncates instead).
    if GROUPED:
        logits = acc
    elif ROUND_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        logits = bits.to(tl.float32, bitcast=True)
    else:
        logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(scratch_ptr + tok.to(tl.int64)[:, None] * num_cols + cols[None, :], logits,
             mask=tok_ok[:, None] & col_ok[None, :])
    # Last program finishes. The barrier orders every thread's scratch stores before the (one-thread) atomic, whose
    # release makes them visible at GPU scope to the program that acquires the final count; that program reads the
    # scratch through L2 (.cg), never a stale L1 line.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        e = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
        for r0 in tl.static_range(0, T_BLOCK, R_BLOCK):
            rows = block * T_BLOCK + r0 + tl.arange(0, R_BLOCK)  # [R_BLOCK]
            rows_ok = rows < num_tokens
            row = scratch_ptr + rows.to(tl.int64) * num_cols  # [R_BLOCK]
            x = tl.load(row[:, None] + e, mask=rows_ok[:, None] & (e < num_experts), other=0.0, cache_modifier=".cg")
            if GROUPED:
                bias = tl.load(bias_ptr + e, mask=(e < num_experts) & HAS_BIAS, other=0.0)  # [1, E_PAD]
                _route_grouped(x, bias, rows, rows_ok, num_experts, scaling, w_ptr, ids_ptr, TOP_K, RENORM, E_PAD,
                               K_PAD, N_GROUP, TOPK_GROUP, SHARED)
            else:
                gate = tl.zeros([R_BLOCK], dtype=tl.float32)
                if SHARED:
                    gate = tl.load(row + num_experts, mask=rows_ok, other=0.0, cache_modifier=".cg")
                _route_rows(x, gate, rows, rows_ok, num_experts, w_ptr, ids_ptr, TOP_K, RENORM, E_PAD, K_PAD,
                            SHARED)
        tl.store(counter_ptr + block, 0)  # the next launch (or graph replay) counts from 0 again


ROUTER_MAX_TOKEN_BLOCKS = 1024  # counters per device; batches needing more blocks take F.linear + softmax_topk

ROUTER_TOKEN_BLOCK = 16  # at most this many tokens per program
_GEMV_TILE = 4096  # elements of one [T_BLOCK, BLOCK_E, BLOCK_K] product tile
_ROUTE_TILE = 8192  # elements of one [R_BLOCK, E_PAD] routing tile


def _counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per token block (kernels/counters.py)."""
    return arrival_counters("router", device, ROUTER_MAX_TOKEN_BLOCKS)


def router_config(tokens: int, cols: int, hidden: int, num_experts: int, block_e: int | None = None,
                  t_block: int | None = None, num_warps: int = 4) -> dict[str, int]:
    """Launch parameters from the shapes alone (unless given), by the rules tuned_h200.ROUTER tunes. Many small
    programs win: one weight row each up to ROUTER.row_programs columns (row_programs_few at up to few_tokens
    tokens), more rows a program beyond. T_BLOCK: one token a program where routing a token is costly (more padded
    experts than one_token_experts_over: each token's top-k in its own program, in parallel) or up to
    one_token_up_to tokens; token_block tokens a program above that, which saves GEMV programs. The K chunk fills a
    _GEMV_TILE-element tile."""
    if block_e is None:
        per = ROUTER.row_programs_few if tokens <= ROUTER.few_tokens else ROUTER.row_programs
        block_e = 1 << max(0, (cols // per).bit_length() - 1)  # a power of two
    e_pad = triton.next_power_of_2(num_experts)
    if t_block is None:
        one = tokens <= ROUTER.one_token_up_to or e_pad > ROUTER.one_token_experts_over
        t_block = 1 if one else ROUTER.token_block
        # Very long batches (not what ops dispatches here): within ROUTER_TOKEN_BLOCK and the counters.
        t_block = min(max(t_block, triton.next_power_of_2(triton.cdiv(tokens, ROUTER_MAX_TOKEN_BLOCKS))),
                      ROUTER_TOKEN_BLOCK)
    block_k = min(triton.next_power_of_2(hidden), max(32, _GEMV_TILE // (t_block * block_e)))
    return dict(BLOCK_E=block_e, BLOCK_K=block_k, T_BLOCK=t_block, R_BLOCK=min(t_block, max(1, _ROUTE_TILE // e_pad)),
                num_warps=num_warps)


def router_topk_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                       shared_gate: bool = False, config: dict[str, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk_triton(F.linear(x, weight), top_k, renormalize, shared_gate) in one launch: x [T, H], weight
    [E (+ 1), H] in x's dtype -> (weights [T, K (+ 1)] float32, ids [T, K (+ 1)] int64). The logits are accumulated
    in float32 and rounded to x's dtype, as F.linear's (up to the order of accumulation). Launch shapes depend on
    (T, H, E) alone and nothing is read back to the host: capturable in a CUDA graph. One stream at a time (the
    device's arrival counters are shared, kernels/counters.py). config: router_config's result, to override
    (benchmarks)."""
    return _router(x, weight, top_k, renormalize, shared_gate, config, None)[:2]


def grouped_router_topk_triton(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None,
                               top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float,
                               renormalize: bool, shared: bool = False, config: dict[str, int] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.grouped_sigmoid_topk(F.linear(x.float(), weight.float()), ...) in one launch, for decode-sized
    batches: x [T, H] (any float dtype), weight [E, H] float32, correction_bias [E] float32 or None -> (weights
    [T, K] float32, ids [T, K] int64). The logits are float32 sums (up to the order of accumulation); equal scores
    choose the lower group / expert id. n_group > 1 needs E a power of two (`grouped_router_fits`). shared: one
    more column [T, K + 1], a plain shared expert fused as expert E (id E, weight 1). Capturable, one stream at a
    time, as router_topk_triton."""
    if not grouped_router_fits(weight.shape[0], n_group):
        raise ValueError(f"grouped router kernel: {weight.shape[0]} experts in {n_group} groups (a power of two "
                         "of experts, in groups of >= 2, is needed)")
    if weight.dtype != torch.float32 or (correction_bias is not None and correction_bias.dtype != torch.float32):
        raise ValueError("grouped router kernel: a float32 gate weight and correction bias are needed")
    return _router(x, weight, top_k, renormalize, shared, config, None,
                   (correction_bias, n_group, topk_group, routed_scaling_factor))[:2]


def grouped_router_fits(num_experts: int, n_group: int) -> bool:
    """Whether grouped_router_topk_triton serves these shapes: one group, or E a power of two in groups of >= 2."""
    return n_group == 1 or (num_experts & (num_experts - 1) == 0 and n_group & (n_group - 1) == 0
                            and num_experts // n_group >= 2)


def norm_router_topk_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                            weight_offset: float, weight: torch.Tensor, top_k: int, renormalize: bool,
                            shared_gate: bool = False, config: dict[str, int] | None = None):
    """The RMSNorm of h = x + residual (x when residual is None) and router_topk_triton over it, in one launch, for
    decode-sized batches (at most ROUTER_TOKEN_BLOCK x ROUTER_MAX_TOKEN_BLOCKS tokens): -> (weights, ids, normed x
    [T, H] (the experts' input), h [T, H] (the new residual; x itself without one)), rounded as
    reference.add_rms_norm then router_topk_triton."""
    if norm_w.shape != (x.shape[1],) or (not weight_offset and norm_w.dtype != x.dtype):
        raise ValueError(f"norm weight {tuple(norm_w.shape)} {norm_w.dtype} does not fit x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit x {tuple(x.shape)}")
    return _router(x, weight, top_k, renormalize, shared_gate, config, (residual, norm_w, eps, weight_offset))


def _router(x, weight, top_k, renormalize, shared_gate, config, norm, grouped=None):
    """router_topk_triton, with norm = (residual, norm weight, eps, weight offset) norm_router_topk_triton, with
    grouped = (correction bias, n_group, topk_group, routed scaling) grouped_router_topk_triton."""
    t, h = x.shape
    cols = weight.shape[0]
    if weight.shape[1] != h or (weight.dtype != x.dtype and grouped is None):
        raise ValueError(f"router weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} "
                         f"{x.dtype}")
    num_experts = cols - 1 if shared_gate and grouped is None else cols  # a gated shared expert: gate row E
    cfg = dict(config or router_config(t, cols, h, num_experts))
    # A config's PDL key launches it with programmatic dependent launch where its grid fits one wave; off by
    # default: PDL on the router and every MoE kernel slowed Qwen3-30B-A3B's decode step, and the router alone,
    # with and without PDL on the o GEMV before it, was no faster.
    pdl = cfg.pop("PDL", False)
    if triton.cdiv(t, cfg["T_BLOCK"]) > ROUTER_MAX_TOKEN_BLOCKS:  # prefill-sized: the GEMM path
        if grouped is not None:
            raise ValueError(f"grouped_router_topk_triton: {t} tokens are beyond the decode sizes it serves")
        if norm is None:
            return (*softmax_topk_triton(F.linear(x, weight), top_k, renormalize, shared_gate), None, None)
        raise ValueError(f"norm_router_topk_triton: {t} tokens are beyond the decode sizes it serves")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_k = top_k + int(shared_gate)
    w = torch.empty((t, out_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, out_k), dtype=torch.int64, device=x.device)
    xn = hh = None
    residual = norm_w = None
    eps, offset = 0.0, 0.0
    if norm is not None:
        residual, norm_w, eps, offset = norm
        residual = None if residual is None else residual.contiguous()
        xn = torch.empty((t, h), dtype=x.dtype, device=x.device)  # [T, H] the experts' input
        hh = x if residual is None else torch.empty((t, h), dtype=x.dtype, device=x.device)  # [T, H]
    if t == 0:
        return w, ids, xn, hh
    # Per call, not cached: inside a CUDA graph capture it is a fixed address of the graph's pool.
    scratch = torch.empty((t, cols), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(cols, cfg["BLOCK_E"]), triton.cdiv(t, cfg["T_BLOCK"]))
    gdc = bool(pdl) and one_wave_pdl(x.device, grid[0] * grid[1])
    bias, n_group, topk_group, scaling = grouped or (None, 1, 1, 1.0)
    _router_gemv_topk_kernel[grid](x, weight, scratch, _counters(x.device), w, ids,
                                   x if residual is None else residual, x if norm_w is None else norm_w.contiguous(),
                                   x if xn is None else xn, x if hh is None else hh,
                                   x if bias is None else bias.contiguous(), t, cols, num_experts,
                                   x.stride(0), weight.stride(0), float(eps), float(scaling), H=h, TOP_K=top_k,
                                   RENORM=renormalize, E_PAD=triton.next_power_of_2(num_experts),
                                   K_PAD=triton.next_power_of_2(top_k), SHARED=shared_gate,
                                   ROUND_BF16=x.dtype == torch.bfloat16, NORM=norm is not None,
                                   HAS_RESIDUAL=residual is not None, W_OFFSET=float(offset),
                                   GROUPED=grouped is not None, N_GROUP=n_group, TOPK_GROUP=topk_group,
                                   HAS_BIAS=bias is not None, GDC=gdc, **cfg, **pdl_kwargs(gdc))
    return w, ids, xn, hh
