"""Prefill kernels of the gated delta net over slot-indexed recurrent state, per_position=False only (references:
kernels/reference.py causal_conv_states and gated_delta_rule_states; the comment above them gives the starts / lens /
slot semantics). kernels/triton_gdn.py walks the tokens one by one, which is right for decode and verify (1-4 tokens
a sequence) but makes a 2048-token prompt 2048 dependent steps. Here:

  * `gated_delta_rule_prefill_triton`: chunk-parallel (the WY / UT form of the delta rule). Within a chunk of C
    tokens entering with state S [Dk, Dv], gamma = cumsum(g) (log decay since the chunk start) and
        A[i, j] = beta_i (k_i . k_j) exp(gamma_i - gamma_j)   for j < i, else 0            [C, C]
        T       = (I + A)^-1                                   (unit lower triangular)      [C, C]
        U       = T (beta V),   W = T (beta exp(gamma) K)                                   [C, Dv], [C, Dk]
        V'      = U - W S       (what the tokens write: the values less what S already recalls for their keys)
        O       = (exp(gamma) Q) S + ((Q K^T) * exp(gamma_i - gamma_j), j <= i) V'
        S      <- exp(gamma_last) S + (exp(gamma_last - gamma) K)^T V'
    (unrolling S_i = exp(g_i) S_{i-1} + k_i u_i^T with u_i = beta_i (v_i - exp(g_i) k_i^T S_{i-1}) over the chunk
    gives the triangular system (I + A) u = beta V - beta exp(gamma) K S, whence the above). So T dependent token
    steps become T / C dependent chunk steps, each a dozen small matrix products on the tensor cores. The kernel
    evaluates V' as T (beta (V - exp(gamma) (K S))): the same value with one [C, C] product instead of two and no
    [C, Dk] W tile to hold. Decays only ever enter as exp of a difference gamma_i - gamma_j <= 0 (j <= i), never
    as exp(-gamma), so nothing overflows however strong the decay. One program per (sequence, value head, BLOCK_V
    value columns) keeps its [Dk, BLOCK_V] float32 block of the state in registers across the sequence's chunks
    (value columns are independent; only Dk is reduced). Tokens past the sequence end in its last chunk are masked
    to g = beta = 0, q = k = v = 0, which makes them change nothing.

    T is formed blockwise: the 16 x 16 diagonal blocks of I + A are inverted together by forward substitution (15
    steps on a [C/16, 16, 16] tile, row r of every block per step), then the block rows are combined with dots:
    with D the block diagonal part and L the rest, (I + A)^-1 = (I + N)^-1 D^-1, N = D^-1 L strictly block lower,
    evaluated in Horner form T <- D^-1 - N T (C/16 - 1 steps; step m finalises block row m, so this is block
    forward substitution in matrix products). Plain forward substitution on the [C, C] tile would take C - 1
    dependent steps with two cross-warp reductions each; inverting by repeated squaring, (I - A)(I + A^2)(I + A^4)..
    is cheaper still but unstable: with correlated keys powers of A grow like binomial coefficients while T stays
    small, so float32 cancellation would swamp the result.

    Precision (accuracy first: the products feed a triangular inverse and a recurrence over the whole prompt).
    q and k stay raw, in the input dtype, as product operands; their L2 normalisation is a per-row factor applied
    to the products' rows and columns. With 16-bit inputs, Q K^T and K K^T are then exact products summed in
    float32. A raw bfloat16 tile times a float32 operand (K S, Q S, K^T V') takes the float32 side as the sum of
    three bfloat16 parts, three exact-product MMAs that keep all 24 mantissa bits (`split`). The products of two
    float32 operands (the inverse's, T (..), attention times V') and every product of float32 inputs use
    input_precision "tf32x3" (each operand a tf32 head plus tail, three MMAs, close to float32; `precision`).

  * `causal_conv_prefill_triton`: token-parallel, one program per (sequence, BLOCK_T tokens, BLOCK_C channels):
    output t sums its K taps directly from x (and from the start slot's window for the first K-1 tokens).

CUDA-graph capturable: grids depend only on shapes and host ints (B, heads, value / channel blocks, the conv's
max_tokens_per_seq bound); each program loads its row, slot, first token and length from device memory. Tokens
outside every sequence are never written, so they keep the zeros the outputs are allocated with; an empty sequence
leaves its slot untouched. Math is float32; states are loaded and stored in the pool's dtype, outputs in x's / v's
dtype. Every stride is passed; token and state offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------------------
# Causal conv, token-parallel


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, starts_ptr, lens_ptr, n_ch,
                         stride_xt, stride_xc, stride_wc, stride_wk, stride_sr, stride_ss, stride_sk, stride_sc,
                         stride_ot, stride_oc,
                         K: tl.constexpr, KM1_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    n = tl.load(lens_ptr + b).to(tl.int64)
    first = tile * BLOCK_T
    if first < n:  # programs past the sequence end do nothing
        row = tl.load(rows_ptr + b).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        start = tl.load(starts_ptr + b).to(tl.int64)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
        c_ok = c < n_ch
        win_ptr = state_ptr + row * stride_sr + slot * stride_ss  # the start slot's [K-1, C] window, oldest first

        i = first + tl.arange(0, BLOCK_T)  # [BT] position in the sequence
        t_ok = (i < n)[:, None] & c_ok[None, :]  # [BT, BC]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            p = (i - (K - 1) + j)[:, None]  # [BT, 1] input position of tap j; p < 0 is window row K-1+p
            # only tile 0 has p < 0 (BLOCK_T >= K-1): the other tiles' window loads are fully masked
            xin = tl.load(x_ptr + (start + p) * stride_xt + c[None, :] * stride_xc, mask=t_ok & (p >= 0), other=0.0)
            win = tl.load(win_ptr + (K - 1 + p) * stride_sk + c[None, :] * stride_sc, mask=t_ok & (p < 0),
                          other=0.0)
            tap = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
            acc += (xin.to(tl.float32) + win.to(tl.float32)) * tap[None, :]
        tl.store(out_ptr + (start + i[:, None]) * stride_ot + c[None, :] * stride_oc,
                 (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=t_ok)

        if tile == 0:
            # Tile 0 is the only program that reads the old window, so it is also the one that writes the new one
            # (the last K-1 inputs, gathered from x and, for a sequence shorter than K-1, the old window): a later
            # tile writing it would race with tile 0's reads. Within tile 0 a thread may write a row that another
            # thread still has to read, hence the barrier between all of the tile's window reads and the write.
            r = tl.arange(0, KM1_PAD)[:, None]  # [KM1_PAD, 1] row of the new window
            pr = n - (K - 1) + r  # its input position
            r_ok = (r < K - 1) & c_ok[None, :]
            from_x = tl.load(x_ptr + (start + pr) * stride_xt + c[None, :] * stride_xc, mask=r_ok & (pr >= 0),
                             other=0.0)
            from_old = tl.load(win_ptr + (K - 1 + pr) * stride_sk + c[None, :] * stride_sc, mask=r_ok & (pr < 0),
                               other=0.0)
            new = from_x.to(tl.float32) + from_old.to(tl.float32)  # [KM1_PAD, BC]
            tl.debug_barrier()
            tl.store(win_ptr + r * stride_sk + c[None, :] * stride_sc, new.to(state_ptr.dtype.element_ty), mask=r_ok)


def causal_conv_prefill_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                               state_rows: torch.Tensor, start_slots: torch.Tensor, starts: torch.Tensor,
                               lens: torch.Tensor, max_tokens_per_seq: int, *, block_t: int = 32) -> torch.Tensor:
    """reference.causal_conv_states(..., per_position=False), token-parallel. x [T, C]; weight [C, K]; conv_state
    [rows, S, K-1, C] (the start slots written); state_rows, start_slots, starts, lens [B] int64; max_tokens_per_seq
    a host bound on lens (the batch's token count will do) -> silu(causal conv) [T, C] in x's dtype, 0 outside
    every sequence."""
    n_ch, k = weight.shape
    assert k >= 2 and x.shape[1] == n_ch and conv_state.shape[2:] == (k - 1, n_ch)
    assert block_t >= k - 1, "the old window must be read by tile 0 alone"
    out = torch.zeros_like(x)  # [T, C]
    n_seq = state_rows.shape[0]
    if n_seq == 0 or max_tokens_per_seq <= 0:
        return out
    # 32 tokens x 128 channels over 4 warps: 32 outputs a thread along adjacent channels (vector loads of x); the K
    # shifted loads of x overlap and hit in L1. Offline for sm_90: ~130-150 registers, no spills.
    block_c = min(128, triton.next_power_of_2(n_ch))
    grid = (n_seq, triton.cdiv(max_tokens_per_seq, block_t), triton.cdiv(n_ch, block_c))
    _conv_prefill_kernel[grid](
        x, weight, conv_state, out, state_rows, start_slots, starts, lens, n_ch,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_state.stride(), out.stride(0),
        out.stride(1),
        K=k, KM1_PAD=triton.next_power_of_2(k - 1), BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Gated delta rule, chunk-parallel


@triton.jit
def _unit_lower_inverse(a, CHUNK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower triangular float32 [CHUNK, CHUNK] (module docstring: blockwise)."""
    NB: tl.constexpr = CHUNK // SUB
    blk = tl.arange(0, NB)
    same_blk = blk[:, None, None, None] == blk[None, None, :, None]  # [NB, 1, NB, 1]
    rr = tl.arange(0, SUB)[None, :, None]  # [1, SUB, 1] axis 1 of a [NB, SUB, SUB] tile
    cc = tl.arange(0, SUB)[None, None, :]  # [1, 1, SUB] axis 2

    # diagonal blocks, transposed: dt[b, j, i] = a[b SUB + i, b SUB + j]
    dt = tl.sum(tl.where(same_blk, tl.reshape(tl.trans(a), (NB, SUB, NB, SUB)), 0.0), axis=2)  # [NB, SUB, SUB]
    # x = D^-1 by forward substitution, every block at once: x[b, i] = e_i - sum_{j<i} a[b, i, j] x[b, j]
    x = tl.where((rr == cc) & (blk[:, None, None] >= 0), 1.0, 0.0)  # [NB, SUB, SUB] identity
    for i in tl.static_range(1, SUB):
        a_i = tl.sum(tl.where(cc == i, dt, 0.0), axis=2)  # [NB, SUB] a[b, i, j] along j
        x = tl.where(rr == i, x - tl.sum(a_i[:, :, None] * x, axis=1)[:, None, :], x)
    dinv = tl.reshape(tl.where(same_blk, x[:, :, None, :], 0.0), (CHUNK, CHUNK))  # [C, C] block diagonal

    t = dinv
    if NB > 1:
        ci = tl.arange(0, CHUNK)
        below = (ci[:, None] // SUB) > (ci[None, :] // SUB)  # strictly below the diagonal blocks
        nmat = tl.dot(dinv, tl.where(below, a, 0.0), input_precision=PRECISION)  # [C, C] N = D^-1 L
        for _ in tl.static_range(NB - 1):
            t = dinv - tl.dot(nmat, t, input_precision=PRECISION)
    return t


@triton.jit
def _rnorm(x):
    """rsqrt(sum of squares + 1e-6) of each row of a [C, D] tile, in float32 [C] (the L2 normalisation's factor)."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit
def _dot16(x, y, acc, F32_DOT: tl.constexpr):
    """acc + x @ y of two 16-bit tiles: exact products summed in float32 (F32_DOT: the same in float32 operands,
    for the Triton interpreter, whose 16-bit tl.dot is wrong in triton 3.9)."""
    if F32_DOT:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def _dot_raw(x, y, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """x @ y of two raw input tiles (q, k) -> float32."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision=PRECISION)
    return _dot16(x, y, tl.zeros([x.shape[0], y.shape[1]], tl.float32), F32_DOT)


@triton.jit
def _dot_raw_f32(x, s, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """x @ s for a raw input tile x (exact in its dtype) and a float32 s. bfloat16 x: s as a sum of SPLIT bfloat16
    parts (each the rounding of what the previous ones left), one exact-product MMA each with float32 sums; three
    parts carry all of float32's 24 mantissa bits. Other dtypes: float32 operands at PRECISION."""
    if x.dtype == tl.bfloat16:
        part = s.to(tl.bfloat16)
        acc = _dot16(x, part, tl.zeros([x.shape[0], s.shape[1]], tl.float32), F32_DOT)
        rest = s
        for _ in tl.static_range(SPLIT - 1):
            rest = rest - part.to(tl.float32)
            part = rest.to(tl.bfloat16)
            acc = _dot16(x, part, acc, F32_DOT)
        return acc
    return tl.dot(x.to(tl.float32), s, input_precision=PRECISION)


@triton.jit
def _gdn_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, rows_ptr, slots_ptr, starts_ptr,
                        lens_ptr, dk, dv, scale,
                        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                        stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
                        stride_sr, stride_ss, stride_sh, stride_sk, stride_sv, stride_ot, stride_oh, stride_od,
                        REP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                        SUB: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
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

    s_ptrs = state_ptr + row * stride_sr + slot * stride_ss + h * stride_sh + d_k[:, None] * stride_sk \
        + d_v[None, :] * stride_sv  # [BK, BV]
    state = tl.load(s_ptrs, mask=s_ok, other=0.0).to(tl.float32)  # [BK, BV]
    ci = tl.arange(0, CHUNK)  # [C] position in the chunk
    causal = ci[:, None] >= ci[None, :]  # [C, C] j <= i
    strict = ci[:, None] > ci[None, :]  # [C, C] j < i
    for c in range(0, tl.cdiv(n, CHUNK)):
        pos = c * CHUNK + ci  # [C] position in the sequence
        t_ok = pos < n
        t = start + pos  # [C] token
        qk_ok = t_ok[:, None] & k_ok[None, :]
        tv_ok = t_ok[:, None] & v_ok[None, :]
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh, mask=t_ok, other=0.0).to(tl.float32)  # [C]
        beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh, mask=t_ok, other=0.0).to(tl.float32)  # [C]
        gamma = tl.cumsum(g, axis=0)  # [C] log decay from the chunk start through token i
        gamma_last = tl.sum(tl.where(ci == CHUNK - 1, gamma, 0.0), axis=0)  # padding has g = 0: the last token's
        # exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))  # [C, C]

        # q and k stay raw (in the input dtype) as product operands, their L2 normalisation a per-row factor on
        # the products' rows / columns (module docstring: precision)
        k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + d_k[None, :] * stride_kd, mask=qk_ok,
                    other=0.0)  # [C, BK]
        rk = _rnorm(k)  # [C]
        a = _dot_raw(k, tl.trans(k), F32_DOT, PRECISION) * (beta * rk)[:, None] * rk[None, :]  # [C, C] beta_i k_i . k_j
        t_inv = _unit_lower_inverse(tl.where(strict, a * decay, 0.0), CHUNK, SUB, PRECISION)  # [C, C]
        # V' = U - W S = T (beta (V - exp(gamma) K S)): one [C, C] product, and no [C, Dk] W tile to hold
        recall = _dot_raw_f32(k, state, SPLIT, F32_DOT, PRECISION) * rk[:, None]  # [C, BV] k_i^T S
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + d_v[None, :] * stride_vd, mask=tv_ok,
                    other=0.0).to(tl.float32)  # [C, BV]
        v_new = tl.dot(t_inv, (v - tl.exp(gamma)[:, None] * recall) * beta[:, None], input_precision=PRECISION)

        q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + d_k[None, :] * stride_qd, mask=qk_ok,
                    other=0.0)  # [C, BK]
        rq = _rnorm(q) * scale  # [C]
        attn = _dot_raw(q, tl.trans(k), F32_DOT, PRECISION) * rq[:, None] * rk[None, :] * decay  # [C, C] causal
        o = _dot_raw_f32(q, state, SPLIT, F32_DOT, PRECISION) * (rq * tl.exp(gamma))[:, None]  # [C, BV] from S
        o = tl.dot(attn, v_new, o, input_precision=PRECISION)  # + this chunk's writes
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d_v[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=tv_ok)

        # each write decayed to the chunk end (the factor goes on V' rather than on k, which stays raw)
        write = v_new * (rk * tl.exp(gamma_last - gamma))[:, None]  # [C, BV]
        state = state * tl.exp(gamma_last) + _dot_raw_f32(tl.trans(k), write, SPLIT, F32_DOT, PRECISION)  # [BK, BV]
    if n > 0:  # an empty sequence leaves its slot as it was
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_ok)


def gated_delta_rule_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, ssm_state: torch.Tensor, state_rows: torch.Tensor,
                                    start_slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                                    max_len: int | None = None, *, chunk: int = 32, block_v: int = 32,
                                    split: int = 3, precision: str = "tf32x3") -> torch.Tensor:
    """reference.gated_delta_rule_states(..., per_position=False), chunk-parallel. q, k [T, Hk, Dk] (raw); v [T, Hv,
    Dv]; g, beta [T, Hv]; ssm_state [rows, S, Hv, Dk, Dv] (the start slots written); state_rows, start_slots,
    starts, lens [B] int64 -> o [T, Hv, Dv] in v's dtype, 0 outside every sequence. max_len (a host bound on lens)
    is accepted for callers that have one and not needed: each program loops over its own length's chunks.
    chunk: tokens a chunk (16, 32 or 64; 32 by default: on the H200 with triton 3.6, chunk 64 at block_v 32 made
    an illegal memory access at Dk = Dv = 128 — a miscompile, every load being masked — while 16, 32 and 64 at
    block_v 64 matched the reference); block_v: value columns a program;
    split: bfloat16 parts of a float32 operand against raw bfloat16 q / k; precision: tl.dot input precision of
    float32 products (GPU only: "tf32x3", or "bf16x3" / "tf32" for speed; the interpreter computes in float32). See
    the module docstring."""
    del max_len
    _, hk, dk = k.shape
    _, hv, dv = v.shape
    assert q.shape == k.shape and hv % hk == 0 and ssm_state.shape[2:] == (hv, dk, dv)
    assert chunk in (16, 32, 64) and 1 <= split <= 3
    out = torch.zeros_like(v)  # [T, Hv, Dv]
    n_seq = state_rows.shape[0]
    if n_seq == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))  # tl.dot wants every dimension >= 16
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    grid = (n_seq, hv, triton.cdiv(dv, block_v))
    # 32 value columns: a Dv = 128 head is 4 programs, so B = 1, Hv = 32 is 128 programs on a 132-SM H200; 64
    # would halve the work each program repeats (A, T, Q K^T are per head) but halve the programs and, offline for
    # sm_90, spill more. 4 warps (one warpgroup: a C = 64 tile is one wgmma M) and no software pipelining of the
    # chunk loop: 8 warps or more stages only add spills / shared memory (~112 KB at 1 stage: two programs an SM).
    _gdn_prefill_kernel[grid](
        q, k, v, g, beta, ssm_state, out, state_rows, start_slots, starts, lens, dk, dv, dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *ssm_state.stride(), *out.stride(),
        REP=hv // hk, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=chunk, SUB=16, SPLIT=split, F32_DOT=not v.is_cuda,
        PRECISION=precision if v.is_cuda else "ieee", num_warps=4, num_stages=1,
    )
    return out
