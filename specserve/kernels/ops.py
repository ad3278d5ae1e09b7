"""Op dispatch: the Triton kernel for CUDA tensors when Triton is importable, the torch reference otherwise.

Dispatch is by the tensors themselves, so there is no global switch: CPU runs and CPU tests always take the
reference, and GPU runs take the kernels — except where autograd must record through the op (training an MTP head,
specserve.train): the kernels have no backward, so those calls take the differentiable reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import reference as ref
from specserve.kernels import reference_fp8 as ref_fp8
from specserve.kernels import reference_moe_fp8 as ref_moe_fp8
from specserve.kernels.availability import triton_kernels
from specserve.kernels.rope_store import RopeStore


def _kernels(*tensors: torch.Tensor):
    """The Triton module for CUDA tensors that autograd does not need to differentiate through, else None."""
    if not tensors[0].is_cuda:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return triton_kernels()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """reference.rms_norm; weight_offset 1.0 for zero-centred weights (1 + w)."""
    if (tk := _kernels(x, w)) is not None:
        return tk.rms_norm(x, w, eps, weight_offset=weight_offset)
    return ref.rms_norm(x, w, eps, weight_offset)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float = 0.0):
    if (tk := _kernels(x, residual, w)) is not None:
        return tk.add_rms_norm(x, residual, w, eps, weight_offset=weight_offset)
    return ref.add_rms_norm(x, residual, w, eps, weight_offset)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if (tk := _kernels(x)) is not None:
        return tk.silu_and_mul(x)
    return ref.silu_and_mul(x)


def rope(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
         mrope_section: list[int] | None, mrope_interleaved: bool = False):
    """Rotary on q [T, Hq, D] and k [T, Hkv, D] at positions [T] or [3, T] (mRoPE layout: reference.rope_cos_sin);
    returns (q, k)."""
    if (tk := _kernels(q, k)) is not None:
        return tk.rope(q, k, cos_sin_cache, positions, mrope_section, mrope_interleaved)
    cos, sin = ref.rope_cos_sin(cos_sin_cache, positions, mrope_section, mrope_interleaved)
    return ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, Hkv, D] into the caches at loc [T]; k_scale, v_scale [S, Hkv]: an FP8 cache's row scales."""
    if k.is_cuda and (tk := triton_kernels()) is not None:
        return tk.store_kv(k_cache, v_cache, loc, k, v, k_scale, v_scale)
    return ref.store_kv(k_cache, v_cache, loc, k, v, k_scale, v_scale)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, loc: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                       mrope_section: list[int] | None, q_norm_w: torch.Tensor | None = None,
                       k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, weight_offset: float = 0.0,
                       mrope_interleaved: bool = False, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm (weights given), rotary on the first cos_sin_cache.shape[1] dims, K/V store at loc
    (reference.qk_norm_rope_store; k_scale, v_scale: an FP8 cache's row scales): q and k written in place; returns
    the (q, k) to attend with. One capturable kernel on CUDA (triton_qk_prep.py)."""
    weights = [w for w in (q_norm_w, k_norm_w) if w is not None]
    if (tk := _kernels(q, k, v, *weights)) is not None:
        return tk.qk_norm_rope_store_triton(q, k, v, k_cache, v_cache, loc, cos_sin_cache, positions, mrope_section,
                                            q_norm_w, k_norm_w, eps, weight_offset, mrope_interleaved, k_scale,
                                            v_scale)
    return ref.qk_norm_rope_store(q, k, v, k_cache, v_cache, loc, cos_sin_cache, positions, mrope_section,
                                  q_norm_w, k_norm_w, eps, weight_offset, mrope_interleaved, k_scale, v_scale)


def row_top1(x: torch.Tensor, vocab_map: torch.Tensor | None = None,
             with_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, V] logits -> (argmax [R], mapped through vocab_map when given; softmax probability at it [R] or
    None)."""
    if x.is_cuda and x.stride(-1) == 1 and (tk := triton_kernels()) is not None:
        return tk.row_top1_triton(x, vocab_map, with_prob)
    return ref.row_top1(x, vocab_map, with_prob)



TOPK_CHUNK = 1024  # values of a row per first-stage chunk of row_topk


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] -> (values [R, k] descending, indices [R, k]): torch.topk's result (equal values may come in another
    order). On CUDA a row of many values goes in two stages (topk_two_stage): torch's one-stage top-k walks a row
    with one thread block, slow for a long row (the drawn drafts' step over a large vocabulary)."""
    if x.is_cuda and x.shape[-1] >= 4 * TOPK_CHUNK and 4 * k <= TOPK_CHUNK:
        return topk_two_stage(x, k)
    return x.topk(k, dim=-1)


def topk_two_stage(x: torch.Tensor, k: int, chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """row_topk in two stages: the k largest of every chunk of `chunk` values (R x chunks short rows, which fill
    the device), then the k largest of those R x chunks x k survivors. Exact: a row's k largest are each among the
    k largest of their chunk. x [R, V] (padded with -inf to whole chunks) -> (values, indices) [R, k]."""
    r, v = x.shape
    n = -(-v // chunk)
    xp = x if n * chunk == v else F.pad(x, (0, n * chunk - v), value=float("-inf"))
    vals, idx = xp.reshape(r * n, chunk).topk(k, dim=-1)  # [R * n, k]
    idx = idx.view(r, n, k) + torch.arange(0, n * chunk, chunk, device=x.device)[:, None]
    top, pos = vals.view(r, n * k).topk(k, dim=-1)  # [R, k]
    return top, idx.view(r, n * k).gather(1, pos)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """Routed experts (kernels/reference.py fused_moe): x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K]
    float32, topk_ids [T, K] int64 -> [T, H]. The Triton grouped GEMM on CUDA reads only the chosen experts' weights
    and never syncs with the host (capturable).
    FP8 weights when the scales are given (kernels/reference_moe_fp8.py): w13, w2 float8_e4m3fn, w13_scale
    [E, 2I/bn, ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)] float32, block (bn, bk); or per-channel, block
    None: w13_scale [E, 2I], w2_scale [E, H] (activations then quantized per token / per pair)."""
    if w13_scale is not None or w2_scale is not None:
        if (tk := _kernels(x, w13, w2)) is not None:
            return tk.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                                block=block)
        return ref_moe_fp8.fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, block, topk_weights, topk_ids)
    if (tk := _kernels(x, w13, w2)) is not None:
        return tk.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return ref.fused_moe(x, w13, w2, topk_weights, topk_ids)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax MoE router: logits [T, E] -> (weights [T, K] float32, ids [T, K] int64), one kernel on CUDA;
    with shared_gate the last column gates a shared expert routed as expert E (reference.softmax_topk)."""
    if (tk := _kernels(logits)) is not None:
        return tk.softmax_topk_triton(logits, top_k, renormalize, shared_gate)
    return ref.softmax_topk(logits, top_k, renormalize, shared_gate)


# Token counts up to this route through the one-launch router GEMV + top-k (decode, verify of a few rows); larger
# batches are GEMM-shaped and take cuBLAS + the router kernel (scripts/gpu/bench_router.py).
ROUTER_FUSED_MAX_TOKENS = 16


def router_softmax_topk(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                        shared_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk(F.linear(x, gate_weight), ...): x [T, H], gate_weight [E (+ 1), H] in x's dtype. On CUDA with
    T <= ROUTER_FUSED_MAX_TOKENS (a shape-only choice: capturable) one kernel computes the logits and routes
    (triton_router.router_topk_triton); otherwise F.linear and softmax_topk."""
    if (x.dim() == 2 and x.shape[0] <= ROUTER_FUSED_MAX_TOKENS and x.dtype == gate_weight.dtype
            and (tk := _kernels(x, gate_weight)) is not None):
        return tk.router_topk_triton(x, gate_weight, top_k, renormalize, shared_gate)
    return softmax_topk(F.linear(x, gate_weight), top_k, renormalize, shared_gate)


def router_grouped_sigmoid_topk(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                                top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float,
                                renormalize: bool, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.grouped_sigmoid_topk(F.linear(x.float(), gate_weight.float()), ...) (DeepSeek-V3 / GLM): on CUDA
    with T <= ROUTER_FUSED_MAX_TOKENS, a float32 gate and shapes it serves, one kernel computes the logits and
    routes (triton_router.grouped_router_topk_triton); otherwise the torch ops. shared: one more column, a plain
    shared expert fused as expert E (id E, weight 1)."""
    if (x.dim() == 2 and x.shape[0] <= ROUTER_FUSED_MAX_TOKENS and gate_weight.dtype == torch.float32
            and (correction_bias is None or correction_bias.dtype == torch.float32)
            and (tk := _kernels(x, gate_weight)) is not None and tk.grouped_router_fits(gate_weight.shape[0], n_group)):
        return tk.grouped_router_topk_triton(x, gate_weight, correction_bias, top_k, n_group, topk_group,
                                             routed_scaling_factor, renormalize, shared)
    w, ids = ref.grouped_sigmoid_topk(F.linear(x.float(), gate_weight.float()), top_k, correction_bias, n_group,
                                      topk_group, routed_scaling_factor, renormalize)
    if shared:
        w = torch.cat([w, torch.ones_like(w[:, :1])], 1)  # [T, K + 1]
        ids = torch.cat([ids, torch.full_like(ids[:, :1], gate_weight.shape[0])], 1)
    return w, ids


def norm_router_softmax_topk(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                             weight_offset: float, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                             shared_gate: bool = False):
    """The RMSNorm of h = x + residual (x when residual is None) and router_softmax_topk over it -> (weights, ids,
    the normed x [T, H], h [T, H]): one launch on CUDA for T <= ROUTER_FUSED_MAX_TOKENS
    (triton_router.norm_router_topk_triton), the unfused ops otherwise."""
    if (x.dim() == 2 and x.shape[0] <= ROUTER_FUSED_MAX_TOKENS and x.dtype == gate_weight.dtype
            and (tk := _kernels(x, gate_weight)) is not None):
        return tk.norm_router_topk_triton(x, residual, norm_w, eps, weight_offset, gate_weight, top_k, renormalize,
                                          shared_gate)
    xn, h = _add_norm(x, residual, norm_w, eps, weight_offset)
    return (*router_softmax_topk(xn, gate_weight, top_k, renormalize, shared_gate), xn, h)


def _add_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
              weight_offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = x + residual, or x itself without a residual: the unfused ops the fused
    norm-and-projection kernels stand for."""
    if residual is None:
        return rms_norm(x, w, eps, weight_offset), x
    return add_rms_norm(x, residual, w, eps, weight_offset)


def causal_conv_states(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_rows: torch.Tensor,
                       start_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                       per_position: bool) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over slot-indexed windows (kernels/reference.py causal_conv_states): x [T, C],
    weight [C, K], conv_state [rows, S, K-1, C] (written) -> [T, C]. One capturable kernel on CUDA."""
    if (tk := _kernels(x, weight)) is not None:
        return tk.causal_conv_states_triton(x, weight, conv_state, state_rows, start_slots, starts, lens,
                                            per_position)
    return ref.causal_conv_states(x, weight, conv_state, state_rows, start_slots, starts, lens, per_position)


def gated_delta_rule_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            ssm_state: torch.Tensor, state_rows: torch.Tensor, start_slots: torch.Tensor,
                            starts: torch.Tensor, lens: torch.Tensor, per_position: bool) -> torch.Tensor:
    """The gated delta rule over slot-indexed states (kernels/reference.py gated_delta_rule_states): q, k [T, Hk, Dk],
    v [T, Hv, Dv], g, beta [T, Hv], ssm_state [rows, S, Hv, Dk, Dv] (written) -> [T, Hv, Dv]. One capturable kernel
    on CUDA."""
    if (tk := _kernels(q, k, v)) is not None:
        return tk.gated_delta_rule_states_triton(q, k, v, g, beta, ssm_state, state_rows, start_slots, starts, lens,
                                                 per_position)
    return ref.gated_delta_rule_states(q, k, v, g, beta, ssm_state, state_rows, start_slots, starts, lens,
                                       per_position)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN gates (reference.gdn_gating): a, b [T, Hv] -> (g, beta) [T, Hv] float32, one kernel on CUDA."""
    if (tk := _kernels(a, b)) is not None:
        return tk.gdn_gating_triton(a, b, a_log, dt_bias)
    return ref.gdn_gating(a, b, a_log, dt_bias)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * w * silu(gate) (reference.gated_rms_norm): x, gate [N, D] -> [N, D], one kernel on CUDA."""
    if (tk := _kernels(x, gate, w)) is not None:
        return tk.gated_rms_norm_triton(x, gate, w, eps)
    return ref.gated_rms_norm(x, gate, w, eps)


def causal_conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_rows: torch.Tensor,
                        start_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                        max_tokens_per_seq: int) -> torch.Tensor:
    """causal_conv_states with per_position=False for prefill: on CUDA token-parallel (kernels/triton_gdn_chunked.py),
    max_tokens_per_seq a host bound on lens (the batch's token count will do); capturable."""
    if (tk := _kernels(x, weight)) is not None:
        return tk.causal_conv_prefill_triton(x, weight, conv_state, state_rows, start_slots, starts, lens,
                                             max_tokens_per_seq)
    return ref.causal_conv_states(x, weight, conv_state, state_rows, start_slots, starts, lens, False)


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             ssm_state: torch.Tensor, state_rows: torch.Tensor, start_slots: torch.Tensor,
                             starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """gated_delta_rule_states with per_position=False for prefill: on CUDA chunk-parallel
    (kernels/triton_gdn_chunked.py), T / 64 dependent chunk steps instead of T token steps; capturable."""
    if (tk := _kernels(q, k, v)) is not None:
        return tk.gated_delta_rule_prefill_triton(q, k, v, g, beta, ssm_state, state_rows, start_slots, starts, lens)
    return ref.gated_delta_rule_states(q, k, v, g, beta, ssm_state, state_rows, start_slots, starts, lens, False)


GEMV_MAX_ROWS = 16  # rows the fused GEMV / skinny-GEMM kernels take (kernels/triton_gemv.py MAX_ROWS)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for decode rows (x [M <= 4, K]): the Triton GEMV (one launch, no split-K reduce) on CUDA."""
    if (tk := _kernels(x, w)) is not None:
        return tk.gemv(x, w, bias)
    return F.linear(x, w, bias)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over an FP8 (e4m3) weight: x [..., K], wq [N, K] float8_e4m3fn with float32 scales sw (block
    (bn, bk): [ceil(N/bn), ceil(K/bk)], x quantised per token per bk columns; None: per-channel [N], x per token)
    -> [..., N] in x's dtype (reference_fp8.fp8_linear_ref has the rule). On CUDA the Triton kernels
    (triton_fp8.fp8_linear: one GEMV launch up to 16 rows, else quantise + fp8 GEMM; capturable); elsewhere the
    reference, which dequantises to float32."""
    if (tk := _kernels(x, wq)) is not None:
        return tk.fp8_linear(x, wq, sw, block, bias)
    return ref_fp8.fp8_linear_ref(x, wq, sw, block, bias)


def norm_gemv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                         weight_offset: float, w: torch.Tensor, bias: torch.Tensor | None,
                         rope: RopeStore) -> tuple[torch.Tensor, torch.Tensor] | None:
    """norm_gemv on an attention layer's q|k|v weight, then its q/k prep (rope: q/k norms when it has them, rotary
    on q and k in place, K/V stored) -> (qkv, h). On CUDA one Triton launch (triton_gemv.norm_gemv_rope_store), or
    None where its launch cannot take the epilogue (RopeStore.fits: the caller runs the unfused ops); elsewhere the
    reference ops (norm_gemv, then qk_norm_rope_store)."""
    if (tk := _kernels(x, w)) is not None:
        if (cfg := tk.rope_store_config(x, w, rope)) is None:
            return None
        return tk.norm_gemv_rope_store(x, residual, norm_w, eps, weight_offset, w, bias, rope, config=cfg)
    y, h = norm_gemv(x, residual, norm_w, eps, weight_offset, w, bias)
    t, d, hq, hkv = x.shape[0], rope.head_dim, rope.num_q_heads, rope.num_kv_heads
    q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref.qk_norm_rope_store(q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), rope.k_cache, rope.v_cache,
                           rope.loc, rope.cos_sin_cache, rope.positions, None, rope.q_norm_w, rope.k_norm_w, rope.eps,
                           rope.weight_offset, k_scale=rope.k_scale, v_scale=rope.v_scale)
    return y, h


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, weight_offset: float,
              w: torch.Tensor, bias: torch.Tensor | None = None,
              silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(h), w, bias) [then silu_and_mul], h) with h = x + residual (x when residual is None): one
    Triton launch for decode rows on CUDA; the unfused reference ops otherwise."""
    if (tk := _kernels(x, w)) is not None:
        return tk.norm_gemv(x, residual, norm_w, eps, weight_offset, w, bias, silu_mul)
    a, h = _add_norm(x, residual, norm_w, eps, weight_offset)
    y = F.linear(a, w, bias)
    return (ref.silu_and_mul(y) if silu_mul else y), h
