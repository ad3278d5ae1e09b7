"""Triton kernels of the gated delta net over slot-indexed recurrent state (references: kernels/reference.py
causal_conv_states, gated_delta_rule_states; the comment above them gives the starts / lens / slot semantics).

Both run the recurrence token by token, one program per independent piece of state, so a step (decode, verify,
a prefill chunk) is one launch whatever the sequences' lengths:
  * `causal_conv_states`: one program per (sequence, BLOCK_C channels). The K-1 previous inputs of its channels
    stay in registers as a [KM1_PAD, BLOCK_C] float32 window (oldest row first); each token adds its input, emits
    silu(window . taps) and shifts the window by a row.
  * `gated_delta_rule_states`: one program per (sequence, value head, BLOCK_V value columns). Its [Dk, BLOCK_V]
    float32 block of the head's state stays in registers for the whole sequence: per token it is decayed,
    corrected by the delta rule and read out by q, with q and k L2-normalised in the kernel. Value columns are
    independent in the recurrence (only the Dk axis is reduced), which is what lets a head split over programs.

CUDA-graph capturable: the grid depends only on shapes (B = state_rows.shape[0], heads, channel and value
blocks); each program loads its sequence's row, start slot, first token and length from device memory and loops
over the tokens with that run-time bound, so no value is read back to the host. A program reads its state block
completely before it writes any slot: with per_position a sequence may write slot i == its start slot. Tokens
outside every sequence are never touched, so they keep the zeros the output is allocated with. Math is float32;
states are loaded and stored in the pool's dtype, outputs in x's / v's dtype. Every stride is passed (q, k, v are
usually views of one projection output); state offsets are int64 since rows * slots * head state passes 2^31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv_kernel(x_ptr, w_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, starts_ptr, lens_ptr, n_ch,
                        stride_xt, stride_xc, stride_wc, stride_wk, stride_sr, stride_ss, stride_sk, stride_sc,
                        stride_ot, stride_oc,
                        K: tl.constexpr, KM1_PAD: tl.constexpr, BLOCK_C: tl.constexpr, PER_POSITION: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    c_ok = c < n_ch
    j = tl.arange(0, KM1_PAD)[:, None]  # [KM1_PAD, 1] window row (oldest first); rows >= K-1 are padding
    win_ok = (j < K - 1) & c_ok[None, :]
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int64)

    taps = tl.load(w_ptr + c[None, :] * stride_wc + j * stride_wk, mask=win_ok, other=0.0).to(tl.float32)
    tap_new = tl.load(w_ptr + c * stride_wc + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
    win_offs = j * stride_sk + c[None, :] * stride_sc  # [KM1_PAD, BC] within one (row, slot)
    row_ptr = state_ptr + row * stride_sr
    win = tl.load(row_ptr + slot * stride_ss + win_offs, mask=win_ok, other=0.0).to(tl.float32)
    for i in range(0, n):
        t = start + i
        xt = tl.load(x_ptr + t * stride_xt + c * stride_xc, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc = tl.sum(win * taps, axis=0) + xt * tap_new  # [BC]
        tl.store(out_ptr + t * stride_ot + c * stride_oc, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
                 mask=c_ok)
        # shift by a row: row r takes row r + 1 (pulled out by a masked sum over the few rows), row K-2 the input
        shifted = tl.zeros([KM1_PAD, BLOCK_C], tl.float32)
        for r in tl.static_range(K - 2):
            shifted = tl.where(j == r, tl.sum(tl.where(j == r + 1, win, 0.0), axis=0)[None, :], shifted)
        win = tl.where(j == K - 2, xt[None, :], shifted)
        if PER_POSITION:  # the window after token i -> slot i
            tl.store(row_ptr + i * stride_ss + win_offs, win.to(state_ptr.dtype.element_ty), mask=win_ok)
    if not PER_POSITION:
        tl.store(row_ptr + slot * stride_ss + win_offs, win.to(state_ptr.dtype.element_ty), mask=win_ok)


def causal_conv_states_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                              state_rows: torch.Tensor, start_slots: torch.Tensor, starts: torch.Tensor,
                              lens: torch.Tensor, per_position: bool) -> torch.Tensor:
    """x [T, C]; weight [C, K]; conv_state [rows, S, K-1, C] (written); state_rows, start_slots, starts, lens [B]
    int64 -> silu(causal conv) [T, C] in x's dtype, 0 outside every sequence."""
    n_ch, k = weight.shape
    assert k >= 2 and x.shape[1] == n_ch and conv_state.shape[2:] == (k - 1, n_ch)
    out = torch.zeros_like(x)  # [T, C]
    n_seq = state_rows.shape[0]
    if n_seq == 0:
        return out
    # 256 channels x 2 warps: 4 adjacent channels per thread (vector loads of x), a small window per thread
    block_c = min(256, triton.next_power_of_2(n_ch))
    grid = (n_seq, triton.cdiv(n_ch, block_c))
    _causal_conv_kernel[grid](
        x, weight, conv_state, out, state_rows, start_slots, starts, lens, n_ch,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(), out.stride(0),
        out.stride(1),
        K=k, KM1_PAD=triton.next_power_of_2(k - 1), BLOCK_C=block_c, PER_POSITION=bool(per_position), num_warps=2,
    )
    return out


@triton.jit
def _l2_normalized(ptr, mask):
    """The vector at ptr (masked lanes 0) times rsqrt(sum of squares + 1e-6), in float32."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, starts_ptr,
                        lens_ptr, dk, dv, scale,
                        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                        stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
                        stride_sr, stride_ss, stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_od,
                        REP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                        PER_POSITION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)  # value head; it reads key head h // REP
    hk = h // REP
    d_k = tl.arange(0, BLOCK_K)  # [BK]
    d_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    k_ok, v_ok = d_k < dk, d_v < dv
    s_ok = k_ok[:, None] & v_ok[None, :]
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int64)

    s_offs = h * stride_sh + d_k[:, None] * stride_sk + d_v[None, :] * stride_sv  # [BK, BV] within one slot
    row_ptr = state_ptr + row * stride_sr
    state = tl.load(row_ptr + slot * stride_ss + s_offs, mask=s_ok, other=0.0).to(tl.float32)  # [BK, BV]
    for i in range(0, n):
        t = start + i
        q = _l2_normalized(q_ptr + t * stride_qt + hk * stride_qh + d_k * stride_qd, k_ok) * scale  # [BK]
        kk = _l2_normalized(k_ptr + t * stride_kt + hk * stride_kh + d_k * stride_kd, k_ok)  # [BK]
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d_v * stride_vd, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
        state = state * tl.exp(g)
        kv_mem = tl.sum(kk[:, None] * state, axis=0)  # [BV] what the state recalls for k
        delta = (v - kv_mem) * beta  # [BV]
        state = state + kk[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, axis=0)  # [BV]
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d_v * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=v_ok)
        if PER_POSITION:  # the state after token i -> slot i
            tl.store(row_ptr + i * stride_ss + s_offs, state.to(state_ptr.dtype.element_ty), mask=s_ok)
    if not PER_POSITION:
        tl.store(row_ptr + slot * stride_ss + s_offs, state.to(state_ptr.dtype.element_ty), mask=s_ok)


def gated_delta_rule_states_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, ssm_state: torch.Tensor, state_rows: torch.Tensor,
                                   start_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                                   per_position: bool) -> torch.Tensor:
    """q, k [T, Hk, Dk] (raw); v [T, Hv, Dv]; g, beta [T, Hv]; ssm_state [rows, S, Hv, Dk, Dv] (written);
    state_rows, start_slots, starts, lens [B] int64 -> o [T, Hv, Dv] in v's dtype, 0 outside every sequence."""
    _, hk, dk = k.shape
    _, hv, dv = v.shape
    assert q.shape == k.shape and hv % hk == 0 and ssm_state.shape[2:] == (hv, dk, dv)
    out = torch.zeros_like(v)  # [T, Hv, Dv]
    n_seq = state_rows.shape[0]
    if n_seq == 0:
        return out
    # BLOCK_V 32 of a Dk = 128 head: a 128 x 32 float32 block is 32 registers a thread over 4 warps, and a head
    # splits into Dv / 32 programs, so a small decode batch still spreads over the multiprocessors
    block_k = triton.next_power_of_2(dk)
    block_v = min(32, triton.next_power_of_2(dv))
    num_warps = 4 if block_k * block_v >= 4096 else (2 if block_k * block_v >= 1024 else 1)
    grid = (n_seq, hv, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, ssm_state, out, state_rows, start_slots, starts, lens, dk, dv, dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *ssm_state.stride(), *out.stride(),
        REP=hv // hk, BLOCK_K=block_k, BLOCK_V=block_v, PER_POSITION=bool(per_position), num_warps=num_warps,
    )
    return out
