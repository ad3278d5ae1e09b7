"""Triton scores of the DeepSeek-sparse-attention indexer for fixed-width batches (oracle: attention/
torch_mla_backend.py, TorchIndexBackend.select, fixed-width path).

The indexer (layers/dsa_indexer.py) scores every cached index key for every query token before the top-k picks the
keys its MLA attention may see:

    score[b, i, t] = sum_h w[b * W + i, h] * relu(q[b * W + i, h, :] . key_t)

with one key row of D dims per token shared by all Hi index heads (key = rows[slot], or rows[slot].float() *
scales[slot] when the cache is fp8 with a float32 scale per slot). So, as in the absorbed-MLA kernel
(kernels/triton_mla.py), the heads fill the tile's M dimension: a program reads a block of key rows once and scores
it against all heads of its query, [BLOCK_H, D] x [D, BLOCK_N] on tl.dot, then applies relu and reduces over the
heads with their weights, all in float32. An fp8 key's scale is constant over its D dims and positive, so it
passes through relu and multiplies the key's head-weighted sum once; the fp8 values themselves convert exactly
to q's dtype (bf16 / fp16 hold every finite e4m3 value), so the dot runs on q's dtype with float32 accumulation.

Layout (the fixed-width metadata of attention/torch_backend.py, `_fixed_meta`): request b has `width` = W new
tokens, query i (0 <= i < W) at token b * W + i; kv_slots [bs, max_kv] maps key position -> cache slot, and query i
of b sees the key positions < seq_lens[b] - W + i + 1 (padded requests: seq_lens == W, slots 0). The result is
[bs, W, max_kv] float32 with -inf at every position a query may not see, ready for the top-k.

Grid (bs * W, cdiv(max_kv, BLOCK_N * STEPS)): one program per (query token, run of STEPS blocks of BLOCK_N key
positions; STEPS = 1 unless the grid has programs to spare, `key_steps`). Unlike
attention there is no reduction over keys (every key gets its own score), so nothing forces a program to walk all
of a query's keys; splitting the keys over the grid gives decode batches (bs * W of a few dozen tokens, contexts of
many thousand keys) enough programs to fill the GPU, where one program per token looping over its key blocks would
leave most SMs idle. Tokens are the fast grid axis, so the W queries of a request, which read the same key block,
run close together and share it through L2. A program reads its query's causal length from seq_lens in device
memory; one whose block lies wholly past that length loads nothing and writes -inf. The grid depends on shapes only,
so a launch is CUDA-graph capturable and replays with new q / weights / seq_lens / kv_slots copied into the same
tensors.

Block sizes: BLOCK_N = 64 keys; BLOCK_D = D padded to a power of two (>= 16, tl.dot's smallest K; >= 32 for q_fp8's fp8
dot); BLOCK_H = Hi padded to a power of two, at least 16 (tl.dot's smallest M; padded heads have q = 0 and weight 0) and
at most 64: more heads are looped over in blocks of 64, reusing the loaded key tile. num_warps 4, 8 for the larger q
tiles (BLOCK_H * BLOCK_D > 4096, e.g. DeepSeek-V3.2's Hi = 64, D = 128). `F32_DOT` computes the products in float32: set
for CPU tensors only, where the Triton interpreter's bfloat16 tl.dot is wrong (triton 3.9); bf16 / fp16 / fp8 values are
exact in float32, so it changes nothing but the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import grid_pdl, pdl_kwargs, pdl_wait, target_programs
from specserve.kernels.triton_dot import dot
from specserve.kernels.triton_topk import add_first_pass_counts, first_pass_counts, first_pass_zeros


@triton.jit
def _to_e4m3(y, EXACT_FIRST: tl.constexpr):
    """float32 y (|y| <= 448) -> e4m3, rounded to nearest even. EXACT_FIRST (under the interpreter, whose
    float32 -> fp8 conversion rounds up across a power of two wrongly: 125.6 -> 64, triton 3.9) rounds in float32
    arithmetic first: the step of y's binade, 2^(max(e, -6) - 3) for y = m 2^e, and 2^23 added and taken off to round
    y / step, so that the conversion only meets values it holds exactly."""
    if EXACT_FIRST:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # y's binade (y = 0: -127)
        step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, -6) - 3)
        t = tl.abs(y) / step  # < 16: exact (a power-of-two divisor)
        r = (t + 8388608.0) - 8388608.0  # rounded to nearest even by float32 addition
        y = tl.where(y < 0, -r, r) * step
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _q_fp8(q_row, w_row, h, h_ok, d, d_ok, stride_qh, stride_wh, EXACT_FIRST: tl.constexpr):
    """Heads h of a query for q_fp8: each head's q row in e4m3 with its own scale (amax / 448), and the heads'
    weights times those scales (a scale > 0 passes through relu: w * relu(scale * x) = (w * scale) * relu(x)) ->
    (q8 [BLOCK_H, BLOCK_D] e4m3, weights [BLOCK_H] float32)."""
    qf = tl.load(q_row + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                 other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    q_scale = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-12) / 448.0  # [BLOCK_H]
    q8 = _to_e4m3(tl.clamp(qf / q_scale[:, None], -448.0, 448.0), EXACT_FIRST)
    wh = tl.load(w_row + h * stride_wh, mask=h_ok, other=0.0)  # [BLOCK_H] float32
    return q8, wh * q_scale


@triton.jit
def _head_sum(qh, wh, k, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, KEYS_M: tl.constexpr,
              IMPRECISE: tl.constexpr):
    """sum_h wh[h] * relu(qh[h] . k[n]) for a key tile k [BLOCK_N, BLOCK_D] and heads qh [BLOCK_H, BLOCK_D] ->
    [BLOCK_N] float32. KEYS_M: the dot as [keys, heads] (keys on tl.dot's M, the head sum along N, within a warp's
    lanes); else [heads, keys] (the head sum along M, across warps). With keys on M an fp8 x fp8 tile is a Hopper
    warpgroup MMA, which Triton runs with imprecise fp8 accumulation by default on sm_90 (measured: a share of
    the scores visibly off the float32 sums); IMPRECISE = 0 (max_num_imprecise_acc) keeps every K step's sum
    in float32, IMPRECISE = BLOCK_D (fast_acc) sums the whole head dimension in the tensor core, promoting to float32
    once a tile, as DeepGEMM's fp8 kernels do every 128 elements."""
    if KEYS_M:
        if F32_DOT:
            s = dot(k, tl.trans(qh), F32_DOT, PRECISION)  # [BLOCK_N, BLOCK_H] float32
        else:
            s = tl.dot(k, tl.trans(qh), input_precision=PRECISION, max_num_imprecise_acc=IMPRECISE)
        return tl.sum(tl.maximum(s, 0.0) * wh[None, :], axis=1)
    s = dot(qh, tl.trans(k), F32_DOT, PRECISION)  # [BLOCK_H, BLOCK_N] float32
    return tl.sum(tl.maximum(s, 0.0) * wh[:, None], axis=0)


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, rows_ptr, scales_ptr, kv_slots_ptr, kv_rows_ptr, seq_lens_ptr, out_ptr,
                         hist_ptr, num_heads, head_dim, max_kv, k_sel,
                         stride_qt, stride_qh, stride_wt, stride_wh, stride_rs, stride_sc, stride_kvb, stride_kvn,
                         stride_sl, stride_ob, stride_ow, stride_hist,
                         W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         STEPS: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_ROWS: tl.constexpr,
                         F32_DOT: tl.constexpr, PRECISION: tl.constexpr, HIST: tl.constexpr, PDL: tl.constexpr,
                         NUM_STAGES: tl.constexpr, Q_FP8: tl.constexpr, ONE_H_BLOCK: tl.constexpr,
                         KEYS_M: tl.constexpr, IMPRECISE: tl.constexpr):
    t = tl.program_id(0)  # query token b * W + i
    nb = tl.program_id(1)  # run of STEPS key blocks
    pdl_wait(PDL)  # launched with PDL (launch.grid_pdl): wait for the queries, weights and keys
    b = t // W
    i = t % W
    seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    kv_len = tl.minimum(seq_len - W + i + 1, max_kv)  # this query's causal length
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < head_dim
    if HAS_ROWS:  # token rows: request b's keys are row kv_rows[b] of kv_slots (the page table itself)
        kv_row = tl.load(kv_rows_ptr + b).to(tl.int64)
    else:
        kv_row = b.to(tl.int64)
    q_row = q_ptr + t.to(tl.int64) * stride_qt
    w_row = w_ptr + t.to(tl.int64) * stride_wt
    if Q_FP8 and ONE_H_BLOCK:  # the query's rows in e4m3 once for all its key blocks (see _q_fp8)
        h = tl.arange(0, BLOCK_H)
        q8_all, wq_all = _q_fp8(q_row, w_row, h, h < num_heads, d, d_ok, stride_qh, stride_wh, F32_DOT)
    hist = first_pass_zeros()  # the top-k's first pass over this program's keys (HIST)
    for j in tl.range(0, STEPS, num_stages=NUM_STAGES):
        n = (nb * STEPS + j) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_ok = n < kv_len
        score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if (nb * STEPS + j) * BLOCK_N < kv_len:  # otherwise the block is hidden from this query: -inf, nothing read
            slot = tl.load(kv_slots_ptr + kv_row * stride_kvb + n * stride_kvn, mask=key_ok,
                           other=0).to(tl.int64)  # [BLOCK_N]
            k = tl.load(rows_ptr + slot[:, None] * stride_rs + d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_D]
            if not Q_FP8:
                k = k.to(q_ptr.dtype.element_ty)  # fp8 -> q's dtype is exact
            if HAS_SCALES:
                k_scale = tl.load(scales_ptr + slot * stride_sc, mask=key_ok, other=0.0)  # [BLOCK_N] float32
            acc = tl.zeros([BLOCK_N], tl.float32)
            if Q_FP8 and ONE_H_BLOCK:
                acc += _head_sum(q8_all, wq_all, k, F32_DOT, PRECISION, KEYS_M, IMPRECISE)
            else:
                for h0 in range(0, num_heads, BLOCK_H):
                    h = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
                    h_ok = h < num_heads
                    if Q_FP8:  # an fp8 x fp8 dot (_q_fp8)
                        qh, wh = _q_fp8(q_row, w_row, h, h_ok, d, d_ok, stride_qh, stride_wh, F32_DOT)
                    else:
                        qh = tl.load(q_row + h[:, None] * stride_qh + d[None, :],
                                     mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
                        wh = tl.load(w_row + h * stride_wh, mask=h_ok, other=0.0)  # [BLOCK_H] float32
                    acc += _head_sum(qh, wh, k, F32_DOT, PRECISION, KEYS_M, IMPRECISE)
            if HAS_SCALES:  # a key's scale (> 0) passes through relu: applied once to its column's sum
                acc = acc * k_scale
            score = tl.where(key_ok, acc, float("-inf"))
            if HIST:
                hist += first_pass_counts(score, key_ok)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + i * stride_ow + n, score, mask=n < max_kv)
    if HIST:  # noqa: SIM102 (a constexpr, then a runtime test) the top-k first pass, for queries that select
        if kv_len > k_sel:
            add_first_pass_counts(hist_ptr + t.to(tl.int64) * stride_hist, hist)


WALKS = (8, 4, 2)  # key blocks a program may walk (the kernel's STEPS), most first


def key_steps(num_tokens: int, blocks: int, target: int) -> int:
    """Key blocks a program walks: the most (of WALKS) that still leave about 4 * target programs (target: about
    two per SM), else 1. A batch of many queries over long contexts then runs fewer, longer programs that pipeline
    their key loads and flush one histogram each (one key block a program measured slow for many queries over
    long contexts); a decode at batch 1 keeps one block a program, for parallelism."""
    for s in WALKS:
        if num_tokens * triton.cdiv(blocks, s) >= 4 * target:
            return s
    return 1


def fuse_first_pass(num_tokens: int, max_kv: int, device: torch.device, block_n: int = 64) -> bool:
    """Whether the scores kernel should also do the top-k's first histogram pass (pass it a `hist`): only where its
    programs walk one key block each (`key_steps` 1: a decode at batch 1 over long contexts), where it saves the
    pass's launch. Bigger grids flush a histogram per program and gain from the top-k's own pass (measured on a
    GLM-5 layer over long contexts: fused faster at batch 1, slower at batch 32)."""
    return key_steps(num_tokens, triton.cdiv(max_kv, block_n), target_programs(device, cpu=1)) == 1


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None,
                        kv_slots: torch.Tensor, seq_lens: torch.Tensor, width: int, *, block_n: int | None = None,
                        block_h: int | None = None, out: torch.Tensor | None = None,
                        kv_rows: torch.Tensor | None = None, hist: torch.Tensor | None = None,
                        k: int = 0, steps: int | None = None, num_warps: int | None = None,
                        q_fp8: bool = False, keys_m: bool = False, fast_acc: bool = False) -> torch.Tensor:
    """DSA indexer scores of a fixed-width batch.

    q [bs * width, Hi, D] (bf16 / fp16 / fp32) rotated index queries; weights [bs * width, Hi] float32 per-head
    weights (scales folded in); rows [slots, D] the index-key cache, q's dtype, or float8_e4m3fn with scales
    [slots] float32 (key = rows.float() * scales); kv_slots [bs, max_kv] int64; seq_lens [bs] int64 (device)
    -> out [bs, width, max_kv] float32, -inf where a query may not see the key (position >= its causal length).
    Launch shape from host ints and tensor shapes only: capturable. block_n: keys per program (power of two >= 16;
    default 64 with `hist`, else 128);
    block_h: heads per tl.dot (power of two >= 16; default Hi padded, at most 64). kv_rows [bs] int64: request b's
    keys are kv_slots[kv_rows[b]] (token rows of a prefill, as kernels/triton_mla.py mla_decode_triton).
    hist: kernels/triton_topk.py topk_workspace(bs * width): the top-k's first histogram pass (for its k) is done
    here, as the scores are written; then pass it to index_topk_triton with the same k. steps: key blocks a program
    walks (default `key_steps`: more once the grid has programs to spare); num_warps: default 4, 8 for large q tiles.
    q_fp8 (fp8 caches only): each head's q row rounded to e4m3 with its own scale (amax / 448) in the kernel and the
    dot run in fp8, the key tile never converted (reference: `quantise_rows_fp8` on q, then these scores): what the
    DSA backend runs over fp8 index keys (measured faster than the converted keys at batches 8 to 64). keys_m: each
    tile's dot as [keys, heads] rather than [heads, keys] (`_head_sum`): the DSA backend's choice over fp8 keys.
    fast_acc (with q_fp8 and keys_m): the fp8 tile's sums over the head dimension kept in the tensor core's own
    accumulator and promoted to float32 once (DeepGEMM's fp8 precision; off: every K step promoted), the
    scores a little off the float32 sums but not dependent on the launch shape, so the phases choose alike
    (tests/test_triton_indexer.py)."""
    num_tokens, num_heads, dim = q.shape
    max_kv = kv_slots.shape[1]
    bs = kv_slots.shape[0] if kv_rows is None else kv_rows.shape[0]
    assert num_tokens == bs * width and seq_lens.shape == (bs,) and rows.shape[1] == dim
    assert hist is None or (hist.shape[0] == num_tokens and hist.dtype == torch.int32 and k > 0)
    assert kv_rows is None or kv_rows.dtype == torch.int64
    assert weights.shape == (num_tokens, num_heads) and weights.dtype == torch.float32
    if scales is None:
        assert rows.dtype == q.dtype
    else:
        assert rows.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert scales.shape == (rows.shape[0],)
    assert q.stride(-1) == 1 and rows.stride(-1) == 1
    assert not q_fp8 or scales is not None, "q_fp8 needs an fp8 cache"
    assert not fast_acc or (q_fp8 and keys_m), "fast_acc is an option of the fp8 keys_m tile"
    if out is None:
        out = torch.empty((bs, width, max_kv), dtype=torch.float32, device=q.device)
    assert out.shape == (bs, width, max_kv) and out.dtype == torch.float32 and out.stride(-1) == 1
    if num_tokens == 0 or max_kv == 0:
        return out
    if block_n is None:  # without the first pass, 128-key tiles (measured faster for many queries, long contexts)
        block_n = 64 if hist is not None else 128
    block_d = max(32 if q_fp8 else 16, triton.next_power_of_2(dim))  # an fp8 tl.dot needs K >= 32 on the GPU
    if block_h is None:
        block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    sc, sc_stride = (rows, 0) if scales is None else (scales, scales.stride(0))  # rows: an unused pointer
    f32_dot = not q.is_cuda
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # float32: no TF32, like the torch oracle
    blocks = triton.cdiv(max_kv, block_n)
    if steps is None:
        steps = key_steps(num_tokens, blocks, target_programs(q.device, cpu=1))
    grid = (num_tokens, triton.cdiv(blocks, steps))
    pdl = grid_pdl(q.device, grid[0] * grid[1], num_tokens)
    _index_scores_kernel[grid](
        q, weights, rows, sc, kv_slots, kv_slots if kv_rows is None else kv_rows, seq_lens, out,
        seq_lens if hist is None else hist, num_heads, dim, max_kv, k,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), rows.stride(0), sc_stride,
        kv_slots.stride(0), kv_slots.stride(1), seq_lens.stride(0), out.stride(0), out.stride(1),
        0 if hist is None else hist.stride(0),
        W=width, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, STEPS=steps, HAS_SCALES=scales is not None,
        HAS_ROWS=kv_rows is not None, F32_DOT=f32_dot, PRECISION=precision, HIST=hist is not None, PDL=pdl,
        num_warps=num_warps or (4 if block_h * block_d <= 4096 else 8), NUM_STAGES=2 if steps > 1 else 1, Q_FP8=q_fp8,
        ONE_H_BLOCK=num_heads <= block_h, KEYS_M=keys_m, IMPRECISE=block_d if fast_acc else 0,
        **pdl_kwargs(bool(pdl)),
    )
    return out
