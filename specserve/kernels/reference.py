"""Torch reference implementations. They run on CPU and GPU, and every Triton kernel is tested against them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.reference_kv_fp8 import quantize_kv, store_kv_fp8


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """x [T, H], w [H] -> [T, H] in x's dtype (statistics in float32). weight_offset 1.0: a zero-centred norm
    (Qwen3-Next, Gemma) scaling by (1 + w), all in float32 as transformers does; otherwise the normed row is
    rounded to x's dtype before the weight multiply (Llama, Qwen)."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    if weight_offset:
        return (xf * torch.rsqrt(var + eps) * (w.float() + weight_offset)).to(x.dtype)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * w


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float = 0.0):
    """(rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, w, eps, weight_offset), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rope_cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor, mrope_section: list[int] | None,
                 mrope_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin_cache [P, D] (cos | sin halves); positions [T] or [3, T] -> cos, sin [T, D/2] float32.

    mRoPE (positions [3, T], sections (s0, s1, s2)) picks, for frequency band j of the half-dim, the position row it
    turns with: contiguous bands (Qwen2-VL style): row 0 for j < s0, row 1 for j < s0 + s1, else row 2 (sum = D/2);
    interleaved (Qwen3.5, mrope_interleaved): mrope_row_of_band.
    """
    half = cos_sin_cache.shape[1] // 2
    if positions.dim() == 1:
        cs = cos_sin_cache[positions]  # [T, D]
        return cs[:, :half], cs[:, half:]
    if mrope_interleaved:
        rows = mrope_row_of_band(mrope_section, half, positions.device)  # [D/2]
        cs = cos_sin_cache[positions]  # [3, T, D]
        j = torch.arange(half, device=positions.device)  # [D/2]
        # advanced indices on dims 0 and 2 -> [D/2, T]; a pure gather, so equal rows give the 1-D values exactly
        return cs[rows, :, j].T.contiguous(), cs[rows, :, half + j].T.contiguous()
    assert mrope_section is not None and sum(mrope_section) == half, "mRoPE sections must cover head_dim / 2"
    rows = [cos_sin_cache[positions[i]] for i in range(3)]  # 3 x [T, D]
    cos_parts, sin_parts, off = [], [], 0
    for i, s in enumerate(mrope_section):
        cos_parts.append(rows[i][:, off:off + s])
        sin_parts.append(rows[i][:, half + off:half + off + s])
        off += s
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


def mrope_row_of_band(mrope_section: list[int] | None, half: int, device=None) -> torch.Tensor:
    """Interleaved mRoPE (transformers' Qwen3.5 text rotary): the position row [D/2] int64 each frequency band j
    turns with: 1 (height) where j % 3 == 1 and j < 3 s1, 2 (width) where j % 3 == 2 and j < 3 s2, else 0 (time).
    s0 is not read and the sections need not sum to D/2 (transformers takes the same rule for any rotary dim)."""
    assert mrope_section is not None and len(mrope_section) == 3, "interleaved mRoPE needs 3 sections"
    j = torch.arange(half, device=device)
    h = (j % 3 == 1) & (j < 3 * mrope_section[1])
    w = (j % 3 == 2) & (j < 3 * mrope_section[2])
    return torch.where(h, 1, torch.where(w, 2, 0))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate-half) rotary. x [T, heads, D]; cos, sin [T, D/2]."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, kv_heads, D] at slots loc [T]. With k_scale, v_scale [S, kv_heads] float32 (an FP8 cache)
    each row is quantized with its own scale (reference_kv_fp8.py)."""
    if k_scale is not None:
        store_kv_fp8(k_cache, k_scale, loc, k)
        store_kv_fp8(v_cache, v_scale, loc, v)
        return
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, loc: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                       mrope_section: list[int] | None, q_norm_w: torch.Tensor | None = None,
                       k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, weight_offset: float = 0.0,
                       mrope_interleaved: bool = False, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What an attention layer does between its qkv projection and the attention, composed of the ops above:
    rms_norm of each head of q [T, Hq, D] and k [T, Hkv, D] with q_norm_w / k_norm_w [D] (when given), rotary on
    the first rot_dim = cos_sin_cache.shape[1] dims of each head (the rest unchanged; positions [3, T]: the mRoPE
    layout of rope_cos_sin), store_kv(k, v) at loc [T] (quantized with k_scale, v_scale for an FP8 cache).

    q and k are written back in place (copy_, outside autograd); returns the normed, rotated (q, k) as the ops
    produce them (new tensors, in the dtype of x * w when the norm weight's dtype differs from x's)."""
    if q_norm_w is not None:
        qn, kn = rms_norm(q, q_norm_w, eps, weight_offset), rms_norm(k, k_norm_w, eps, weight_offset)
    else:
        qn, kn = q, k
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = rope_cos_sin(cos_sin_cache, positions, mrope_section, mrope_interleaved)  # [T, rot_dim / 2]
    if rot_dim == q.shape[-1]:
        qn, kn = apply_rope(qn, cos, sin), apply_rope(kn, cos, sin)
    else:  # partial rotary: the leading dims rotate in place (of q and k themselves when there is no norm)
        qn[..., :rot_dim] = apply_rope(qn[..., :rot_dim], cos, sin)
        kn[..., :rot_dim] = apply_rope(kn[..., :rot_dim], cos, sin)
    store_kv(k_cache, v_cache, loc, kn, v, k_scale, v_scale)
    if qn is not q:
        with torch.no_grad():  # a side effect for other readers; autograd follows the returned tensors
            q.copy_(qn)
            k.copy_(kn)
    return qn, kn


def row_top1(x: torch.Tensor, vocab_map: torch.Tensor | None = None,
             with_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, V] -> (argmax [R] int64, first index on ties, mapped through vocab_map [V] when given; the softmax
    probability at it [R] float32, or None)."""
    if with_prob:
        top, idx = x.max(dim=-1)
        prob = 1.0 / torch.exp(x - top[:, None]).sum(dim=-1)
    else:
        idx, prob = x.argmax(dim=-1), None
    return (vocab_map[idx] if vocab_map is not None else idx), prob



def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed experts: out[t] = sum_k topk_weights[t, k] * w2[e] @ silu_and_mul(w13[e] @ x[t]), e = topk_ids[t, k].

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K]
    int64 -> [T, H] in x's dtype. Each expert's product is rounded to x's dtype before the weighted sum (in float32),
    as a grouped GEMM that writes per-(token, k) rows does."""
    t, k = topk_ids.shape
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)  # [T * K]
    for e in flat.unique().tolist():  # reference only: reads the chosen experts, host loop
        sel = (flat == e).nonzero().squeeze(1)  # [n] (token, k) pairs routed to e
        tok = sel // k
        h = silu_and_mul(x[tok] @ w13[e].T)  # [n, I]
        y = (h @ w2[e].T).float()  # [n, H]
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[sel, None].float())
    return out.to(x.dtype)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax router: softmax over all experts in float32, the top_k (equal weights: the lower expert id
    first, the tie-break the kernel uses), optionally renormalised to sum 1. logits [T, E] -> (weights [T, K]
    float32, ids [T, K] int64) by descending weight.

    shared_gate: the last logit column is a gated shared expert's gate (logits [T, E + 1]); it is routed to as
    expert E with weight sigmoid(gate), after the K routed ones -> [T, K + 1]."""
    if shared_gate:
        e = logits.shape[1] - 1
        weights, ids = softmax_topk(logits[:, :e], top_k, renormalize)
        gate = logits[:, e:].float().sigmoid()  # [T, 1]
        return torch.cat((weights, gate), dim=1), torch.cat((ids, torch.full_like(ids[:, :1], e)), dim=1)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# ---------------------------------------------------------------------------------------------------------------
# Linear attention over slot-indexed recurrent state (gated delta net; layers/gdn.py, docs/architecture.md).
#
# Both ops take a batch of sequences laid out back to back in the token dimension: sequence b owns tokens
# starts[b] .. starts[b] + lens[b] - 1 (lens[b] may be 0) and the state of (state_rows[b], start_slots[b]) in the
# layer's pool view [rows, S, ...]. With per_position=False (prefill chunks, plain decode) the sequence continues
# from its start slot and its final state is written back into that slot. With per_position=True (target verify)
# the state after the sequence's token i is written into slot i, so the accept commit can make any verified
# position current without a rollback.


def causal_conv_states(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_rows: torch.Tensor,
                       start_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                       per_position: bool) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU with a carried window. x [T, C]; weight [C, K]; conv_state [rows, S, K-1, C]
    (the K-1 inputs before the next token, oldest first); state_rows, start_slots, starts, lens [B] int64.
    -> [T, C] in x's dtype (float32 sums); tokens outside every sequence are 0. Writes conv_state."""
    k = weight.shape[1]
    out = torch.zeros_like(x)
    w = weight.float().t()  # [K, C]
    for row, slot, s, n in zip(*(t.tolist() for t in (state_rows, start_slots, starts, lens))):
        window = conv_state[row, slot].float()  # [K-1, C]
        for i in range(n):
            full = torch.cat((window, x[s + i].float()[None]), dim=0)  # [K, C]
            out[s + i] = F.silu((full * w).sum(dim=0)).to(x.dtype)
            window = full[1:]
            if per_position:
                conv_state[row, i] = window.to(conv_state.dtype)
        if not per_position:
            conv_state[row, slot] = window[-(k - 1):].to(conv_state.dtype)
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA convention transformers follows), in float32."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            ssm_state: torch.Tensor, state_rows: torch.Tensor, start_slots: torch.Tensor,
                            starts: torch.Tensor, lens: torch.Tensor, per_position: bool) -> torch.Tensor:
    """The gated delta rule, token by token, over slot-indexed states.

    q, k [T, Hk, Dk] (raw: L2-normalised here, q also scaled by Dk^-0.5); v [T, Hv, Dv]; g [T, Hv] float32 log
    decay (<= 0); beta [T, Hv] float32; ssm_state [rows, S, Hv, Dk, Dv]; value head h reads key head h // (Hv / Hk).
    Per token: S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = q^T S.  -> o [T, Hv, Dv] in v's dtype (float32
    math); tokens outside every sequence are 0. Writes ssm_state."""
    hv, hk = v.shape[1], k.shape[1]
    rep = hv // hk
    qn = (l2_normalize(q) * q.shape[-1] ** -0.5).repeat_interleave(rep, dim=1)  # [T, Hv, Dk]
    kn = l2_normalize(k).repeat_interleave(rep, dim=1)  # [T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.zeros_like(v)
    for row, slot, s, n in zip(*(t.tolist() for t in (state_rows, start_slots, starts, lens))):
        state = ssm_state[row, slot].float()  # [Hv, Dk, Dv]
        for i in range(n):
            t = s + i
            state = state * gf[t].exp()[:, None, None]
            kv_mem = torch.einsum("hk,hkv->hv", kn[t], state)  # [Hv, Dv]
            delta = (vf[t] - kv_mem) * bf[t][:, None]  # [Hv, Dv]
            state = state + kn[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", qn[t], state).to(v.dtype)
            if per_position:
                ssm_state[row, i] = state.to(ssm_state.dtype)
        if not per_position:
            ssm_state[row, slot] = state.to(ssm_state.dtype)
    return out


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta net's per-token gates: g = -exp(A_log) * softplus(a + dt_bias) (log decay), beta = sigmoid(b).
    a, b [T, Hv] (any row stride); a_log, dt_bias [Hv] -> (g, beta) [T, Hv] float32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * w * silu(gate) per row, as transformers' Qwen3NextRMSNormGated rounds it: the normed row scaled
    by w in x's dtype, the gate applied in float32. x, gate [N, D]; w [D] -> [N, D] in x's dtype."""
    y = rms_norm(x, w, eps).float()
    return (y * F.silu(gate.float())).to(x.dtype)


def grouped_sigmoid_topk(logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None, n_group: int,
                         topk_group: int, routed_scaling_factor: float,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5: sigmoid scores; experts are chosen on scores + correction_bias, but weighted by the
    unbiased scores. The E experts form n_group groups of E / n_group; a group is rated by the sum of its two best
    biased scores, the topk_group best groups stay, and the top_k experts among them are taken. Weights are
    normalised to sum 1 when `renormalize` (HF norm_topk_prob), then multiplied by routed_scaling_factor (always,
    as HF does). logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64), ids by descending biased
    score. Needs E / n_group >= 2 (the top-2 group rating)."""
    t, e = logits.shape
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)  # [T, E]
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # HF's epsilon, kept for parity
    return weights * routed_scaling_factor, ids


def quantise_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 rows [..., D], float32 scales [...]): each row's largest magnitude maps to e4m3's largest
    finite value, 448 (the DSA index-key cache's fp8 format; the indexer scores' q_fp8 option rounds q's head rows
    the same way in its kernel)."""
    return quantize_kv(x, torch.float8_e4m3fn, min_amax=1e-12)  # the FP8 KV rule, its amax floor 1e-12
