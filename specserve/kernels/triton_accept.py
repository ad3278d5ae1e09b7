"""Triton verification kernels: same inputs, outputs and noise as speculative/accept.py (the reference), no host sync.

* `accept_greedy_triton`: the argmax of the target logits at every position (first index on ties, like torch;
  kernels/triton_top1.py), then one program per request counts the leading draft == argmax matches.
* `accept_sampling_triton`: the accept tests in order, then two passes over the vocabulary row of the first
  rejected (or bonus) position: the residual's total, then the exponential race argmax((residual / total) /
  -log u). Each pass spreads a row over chunks of the vocabulary (one program per (request, chunk), the chunk from
  the launch size: at one request a serial walk of one program over 49k-152k entries was the latency); each program
  redoes the request's accept tests (N loads). Three launches: the chunks' sums, the chunks' races (the total = the
  sum of the chunks' sums in chunk order), the winner over the chunks (the earliest on ties) and the outputs.
* `accept_sampling_q_triton`: the same for drafts drawn from distributions q of K candidates each
  (--speculative-draft-sampling sample): accept while u * q(d) < p(d), the residual max(0, p - q) with the
  rejected position's candidates compared against each block of columns.

The counter-based noise of kernels/noise.py (splitmix64 of seed, position, salt, column) is reproduced bit for bit
in uint64 arithmetic, so the accept tests and the race see exactly the reference's uniforms; the floating-point ops
are done in the reference's order (the total's summation order and log's last bit may differ, which only matters
for exact ties of the race).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import chunk_for_grid, target_programs
from specserve.kernels.noise import SALT_ACCEPT, SALT_SAMPLE
from specserve.kernels.triton_top1 import row_top1_triton

_BLOCK_V = 2048
# vocabulary elements per program of the residual's passes, largest first: the largest whose grid (requests x
# chunks) still fills the device (at one request: the smallest, so one row's vocabulary spreads over many programs)
RESIDUAL_CHUNKS = (8192, 4096, 2048, 1024, 512, 256)
pick_residual_chunk = functools.partial(chunk_for_grid, RESIDUAL_CHUNKS)  # (rows, vocab, target) -> chunk


@triton.jit
def _mix64(x):
    """splitmix64 finaliser on uint64 (wrapping multiply, logical shifts) == kernels/noise._mix64."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _key(seed, position, SALT: tl.constexpr):
    """The per-(seed, position, salt) key of sampler.uniform_noise (already mixed once). seed, position int64."""
    s = seed.to(tl.uint64, bitcast=True)
    p = position.to(tl.uint64, bitcast=True)
    return _mix64(s * 0x9E3779B97F4A7C15 + p * 0x632BE5AB + SALT * 0x2545F491)


@triton.jit
def _uniform(key):
    """Top 23 bits of mix64(key) -> (bits + 0.5) / 2^23 in (0, 1), exactly as the reference (kernels/noise.py)."""
    bits = _mix64(key) >> 41
    return (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _greedy_accept_kernel(drafts_ptr, pred_ptr, accept_ptr, n, stride_d, stride_p, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    ok = j < n
    d = tl.load(drafts_ptr + b * stride_d + j, mask=ok, other=0)
    p = tl.load(pred_ptr + b * stride_p + j, mask=ok, other=0)
    first_miss = tl.min(tl.where(ok & (d != p), j, n), axis=0)
    tl.store(accept_ptr + b, first_miss.to(tl.int64))


@triton.jit
def _residual(x, cols, rejected, d_rej, qk_ids, qk_probs, HAS_Q: tl.constexpr):
    """The distribution drawn from at the first rejected (or bonus) position, unnormalised, for columns cols:
    max(0, p - q) after a rejection (q: the rejected draft's candidates; one-hot at d_rej without HAS_Q), else p."""
    if HAS_Q:
        qv = tl.sum(tl.where(qk_ids[None, :] == cols[:, None], qk_probs[None, :], 0.0), axis=1)  # [BLOCK_V]
        return tl.where(rejected, tl.maximum(x - qv, 0.0), x)
    return tl.where(rejected & (cols == d_rej), 0.0, x)


@triton.jit
def _accept_prefix(drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, b, n, k, stride_d, stride_pb,
                   stride_pn, stride_qb, stride_qn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_Q: tl.constexpr, SALT_ACC: tl.constexpr):
    """Request b's accept tests in order -> (accept_len, rejected, the rejected draft d_rej, the rejected position's
    q candidates (ids, probs; zero weights where nothing was rejected or without HAS_Q)). HAS_Q: the drafts were
    drawn from distributions q given as K candidates per position (ids, probs); else they are one-hot."""
    seed = tl.load(seeds_ptr + b)
    base = tl.load(base_ptr + b)
    j = tl.arange(0, BLOCK_N)  # [BLOCK_N] draft positions
    ok = j < n
    c = tl.arange(0, BLOCK_K)  # [BLOCK_K] candidates
    c_ok = c < k
    d = tl.load(drafts_ptr + b * stride_d + j, mask=ok, other=0)
    row = probs_ptr + b * stride_pb
    p_draft = tl.load(row + j * stride_pn + d, mask=ok, other=0.0)  # p(d_j) at position j
    u = _uniform(_key(seed, base + j + 1, SALT_ACC))  # [BLOCK_N]
    if HAS_Q:
        q_tile = b * stride_qb + j[:, None] * stride_qn + c[None, :]  # [BLOCK_N, BLOCK_K]
        tile_ok = ok[:, None] & c_ok[None, :]
        q_ids = tl.load(qid_ptr + q_tile, mask=tile_ok, other=-1)
        q_probs = tl.load(qp_ptr + q_tile, mask=tile_ok, other=0.0)
        q_draft = tl.sum(tl.where(q_ids == d[:, None], q_probs, 0.0), axis=1)  # [BLOCK_N] q(d_j)
        reject = ~(u * q_draft < p_draft)  # accept with probability min(1, p / q)
    else:
        reject = u >= p_draft
    accept_len = tl.min(tl.where(ok & reject, j, n), axis=0)  # leading accepts
    rejected = accept_len < n
    jk = tl.minimum(accept_len, n - 1)
    d_rej = tl.sum(tl.where(j == jk, d, 0), axis=0)
    if HAS_Q:  # the rejected position's q, as candidates (a zero weight where the row was accepted to the end)
        qk_ids = tl.load(qid_ptr + b * stride_qb + jk * stride_qn + c, mask=c_ok, other=-1)  # [BLOCK_K]
        qk_probs = tl.where(rejected, tl.load(qp_ptr + b * stride_qb + jk * stride_qn + c, mask=c_ok, other=0.0),
                            0.0)
    else:
        qk_ids = tl.zeros([BLOCK_K], tl.int64)
        qk_probs = tl.zeros([BLOCK_K], tl.float32)
    return accept_len, rejected, d_rej, qk_ids, qk_probs


@triton.jit
def _residual_total_kernel(drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, ws_tot_ptr,
                           n, vocab, k, chunk, stride_d, stride_pb, stride_pn, stride_qb, stride_qn,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_Q: tl.constexpr,
                           SALT_ACC: tl.constexpr):
    """Program (b, c): the residual's sum over vocabulary chunk c of request b's first rejected (or bonus) position
    -> ws_tot [bs, chunks]."""
    b = tl.program_id(0).to(tl.int64)
    ci = tl.program_id(1)
    accept_len, rejected, d_rej, qk_ids, qk_probs = _accept_prefix(
        drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, b, n, k, stride_d, stride_pb, stride_pn,
        stride_qb, stride_qn, BLOCK_N, BLOCK_K, HAS_Q, SALT_ACC)
    pk = probs_ptr + b * stride_pb + accept_len * stride_pn  # the distribution at that position
    lo = ci * chunk
    hi = tl.minimum(lo + chunk, vocab)
    total = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(pk + cols, mask=cols < hi, other=0.0).to(tl.float32)
        total += _residual(x, cols, rejected, d_rej, qk_ids, qk_probs, HAS_Q)
    tl.store(ws_tot_ptr + b * tl.num_programs(1) + ci, tl.sum(total, axis=0))


@triton.jit
def _residual_race_kernel(drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, ws_tot_ptr, ws_val_ptr,
                          ws_idx_ptr, n, vocab, k, chunk, num_chunks, stride_d, stride_pb, stride_pn, stride_qb,
                          stride_qn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_C: tl.constexpr, HAS_Q: tl.constexpr, SALT_ACC: tl.constexpr,
                          SALT_SMP: tl.constexpr):
    """Program (b, c): the exponential race argmax((residual / total) / -log u) over chunk c (the first index on
    ties) -> ws_val, ws_idx [bs, chunks]; the total is the sum of the chunks' sums in chunk order."""
    b = tl.program_id(0).to(tl.int64)
    ci = tl.program_id(1)
    accept_len, rejected, d_rej, qk_ids, qk_probs = _accept_prefix(
        drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, b, n, k, stride_d, stride_pb, stride_pn,
        stride_qb, stride_qn, BLOCK_N, BLOCK_K, HAS_Q, SALT_ACC)
    cs = tl.arange(0, BLOCK_C)
    tot = tl.sum(tl.load(ws_tot_ptr + b * num_chunks + cs, mask=cs < num_chunks, other=0.0), axis=0)
    denom = tl.maximum(tot, 1e-30)
    seed = tl.load(seeds_ptr + b)
    key = _key(seed, tl.load(base_ptr + b) + accept_len + 1, SALT_SMP)
    pk = probs_ptr + b * stride_pb + accept_len * stride_pn
    lo = ci * chunk
    hi = tl.minimum(lo + chunk, vocab)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        v_ok = cols < hi
        x = tl.load(pk + cols, mask=v_ok, other=0.0).to(tl.float32)
        resid = _residual(x, cols, rejected, d_rej, qk_ids, qk_probs, HAS_Q)
        resid = tl.where(tot > 0.0, resid / denom, x)
        u_col = _uniform(key + cols.to(tl.uint64) * 0x9E3779B97F4A7C15)
        score = tl.where(v_ok, resid / -tl.log(u_col), float("-inf"))
        blk_max = tl.max(score, axis=0)
        blk_idx = v0 + tl.argmax(score, axis=0, tie_break_left=True)
        take = blk_max > best_val
        best_idx = tl.where(take, blk_idx, best_idx)
        best_val = tl.where(take, blk_max, best_val)
    tl.store(ws_val_ptr + b * num_chunks + ci, best_val)
    tl.store(ws_idx_ptr + b * num_chunks + ci, best_idx)


@triton.jit
def _race_pick_kernel(drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, ws_val_ptr, ws_idx_ptr,
                      accept_ptr, verified_ptr, n, k, num_chunks, stride_d, stride_pb, stride_pn, stride_qb,
                      stride_qn, stride_v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                      HAS_Q: tl.constexpr, SALT_ACC: tl.constexpr):
    """Program b: the race's winner over the chunks (the earliest chunk on ties), then accept_len [bs] and
    verified [bs, N+1] (the drafts, the new token at accept_len)."""
    b = tl.program_id(0).to(tl.int64)
    accept_len, _, _, _, _ = _accept_prefix(
        drafts_ptr, probs_ptr, qid_ptr, qp_ptr, seeds_ptr, base_ptr, b, n, k, stride_d, stride_pb, stride_pn,
        stride_qb, stride_qn, BLOCK_N, BLOCK_K, HAS_Q, SALT_ACC)
    cs = tl.arange(0, BLOCK_C)
    vals = tl.load(ws_val_ptr + b * num_chunks + cs, mask=cs < num_chunks, other=float("-inf"))
    best = tl.argmax(vals, axis=0, tie_break_left=True)
    best_idx = tl.load(ws_idx_ptr + b * num_chunks + best)
    tl.store(accept_ptr + b, accept_len.to(tl.int64))
    jv = tl.arange(0, BLOCK_N * 2)  # verified [n + 1]: the drafts, a 0 bonus slot, then the new token
    dv = tl.load(drafts_ptr + b * stride_d + jv, mask=jv < n, other=0)
    out = tl.where(jv == accept_len, best_idx.to(tl.int64), dv)
    tl.store(verified_ptr + b * stride_v + jv, out, mask=jv <= n)


def _rows_last_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _outputs(out: tuple[torch.Tensor, torch.Tensor] | None, bs: int, n: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len [bs], verified [bs, N+1]) int64: the caller's buffers when given (e.g. a runner's static ones)."""
    if out is None:
        return (torch.empty(bs, dtype=torch.int64, device=device),
                torch.empty((bs, n + 1), dtype=torch.int64, device=device))
    accept_len, verified = out
    assert accept_len.shape == (bs,) and verified.shape == (bs, n + 1) and verified.stride(-1) == 1
    assert accept_len.dtype == verified.dtype == torch.int64
    return accept_len, verified


def accept_greedy_triton(drafts: torch.Tensor, target_logits: torch.Tensor,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [bs, N]; target_logits [bs, N+1, V] -> (accept_len [bs], verified [bs, N+1]) as speculative/accept.py."""
    bs, n = drafts.shape
    vocab = target_logits.shape[-1]
    logits = _rows_last_unit(target_logits).reshape(bs * (n + 1), vocab)  # [bs * (N+1), V]
    accept_len, pred = _outputs(out, bs, n, drafts.device)  # pred [bs, N+1]: the argmax at every position
    if bs == 0:
        return accept_len, pred
    row_top1_triton(logits, out_idx=pred.view(-1))
    drafts = _rows_last_unit(drafts)
    _greedy_accept_kernel[(bs,)](drafts, pred, accept_len, n, drafts.stride(0), pred.stride(0),
                                 BLOCK_N=max(2, triton.next_power_of_2(n)), num_warps=1)
    return accept_len, pred


def accept_sampling_triton(drafts: torch.Tensor, probs: torch.Tensor, seeds: torch.Tensor, base_index: torch.Tensor,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [bs, N]; probs [bs, N+1, V] float32; seeds, base_index [bs] int64 -> (accept_len [bs],
    verified [bs, N+1]) as speculative/accept.py accept_sampling."""
    return _accept_sampling(drafts, probs, None, seeds, base_index, out)


def accept_sampling_q_triton(drafts: torch.Tensor, probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                             seeds: torch.Tensor, base_index: torch.Tensor,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [bs, N]; probs [bs, N+1, V] float32; q_ids [bs, N, K] int64, q_probs [bs, N, K] float32 (each draft's
    distribution as K candidates); seeds, base_index [bs] int64 -> (accept_len [bs], verified [bs, N+1]) as
    speculative/accept.py accept_sampling_q (the same three launches as accept_sampling_triton)."""
    return _accept_sampling(drafts, probs, (q_ids, q_probs), seeds, base_index, out)


def _accept_sampling(drafts, probs, q: tuple[torch.Tensor, torch.Tensor] | None, seeds, base_index, out):
    bs, n = drafts.shape
    vocab = probs.shape[-1]
    accept_len, verified = _outputs(out, bs, n, drafts.device)  # [bs], [bs, N+1]
    if bs == 0:
        return accept_len, verified
    drafts, probs = _rows_last_unit(drafts), _rows_last_unit(probs)
    seeds, base_index = seeds.to(torch.int64).contiguous(), base_index.to(torch.int64).contiguous()
    if q is None:
        q_ids = q_probs = drafts  # unused pointers
        k, q_strides, block_k, block_v = 1, (0, 0), 2, _BLOCK_V
    else:
        q_ids, q_probs = q[0].to(torch.int64).contiguous(), q[1].to(torch.float32).contiguous()
        k = q_ids.shape[-1]
        assert q_ids.shape == q_probs.shape == (bs, n, k) and n > 0
        q_strides = (q_ids.stride(0), q_ids.stride(1))
        block_k = max(2, triton.next_power_of_2(k))
        block_v = max(256, min(_BLOCK_V, 32768 // block_k))  # the [BLOCK_V, K] compare tile of the residual
    chunk = pick_residual_chunk(bs, vocab, target_programs(drafts.device, cpu=8))
    block_v = min(block_v, chunk, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    ws_tot, ws_val = torch.empty((2, bs, num_chunks), dtype=torch.float32, device=drafts.device)  # [bs, chunks] each
    ws_idx = torch.empty((bs, num_chunks), dtype=torch.int32, device=drafts.device)
    common = (drafts, probs, q_ids, q_probs, seeds, base_index)
    strides = (drafts.stride(0), probs.stride(0), probs.stride(1), *q_strides)
    blocks = dict(BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_K=block_k)
    flags = dict(HAS_Q=q is not None, SALT_ACC=SALT_ACCEPT)
    block_c = max(2, triton.next_power_of_2(num_chunks))
    _residual_total_kernel[(bs, num_chunks)](*common, ws_tot, n, vocab, k, chunk, *strides, **blocks,
                                             BLOCK_V=block_v, **flags, num_warps=4)
    _residual_race_kernel[(bs, num_chunks)](*common, ws_tot, ws_val, ws_idx, n, vocab, k, chunk, num_chunks,
                                            *strides, **blocks, BLOCK_V=block_v, BLOCK_C=block_c, **flags,
                                            SALT_SMP=SALT_SAMPLE, num_warps=4)
    _race_pick_kernel[(bs,)](*common, ws_val, ws_idx, accept_len, verified, n, k, num_chunks, *strides,
                             verified.stride(0), **blocks, BLOCK_C=block_c, **flags, num_warps=1)
    return accept_len, verified
