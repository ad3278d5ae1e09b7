"""The fused MoE's expert blocks (kernels/triton_moe.py, kernels/triton_moe_fp8.py): what every grouped expert GEMM
shares, bf16 or FP8.
  * Alignment (`moe_align`, three small kernels): the T*K pairs are counted per expert (a histogram per chunk of
    pairs); one program takes the prefix sums, each expert's run padded up to a multiple of BLOCK_M; a grid places
    the pairs, stably (by expert, then pair index), into `sorted_ids` (padding rows hold the sentinel T*K) and
    writes `block_expert[b]`, the expert of block b. `num_padded` [1] is the padded total, at most
    T*K + min(E, T*K) * (BLOCK_M - 1): the host bound that sizes the grids. Blocks past the live total exit at
    once, and an expert with no pair owns no block, so a decode step reads only the chosen experts' weights.
  * `route`: direct (one token: a pair a block, no alignment) or aligned blocks; `block_pairs` (in a kernel): a
    block's liveness, expert and pairs; `expert_tile`: a program's tile pointers.
  * Sums: `sum_k` (`_sum_k_kernel`): out[t] = sum_k w[t, k] * y[t*K + k] in float32, in k order, then cast; at one
    token (the direct path) the down GEMM's last program per column block does it instead (`sum_pairs`, an arrival
    counter). The sums never use float atomics, so the result is deterministic run to run (it may differ from the
    reference's expert-order float32 sum in the last bit).
Capturable with fixed shapes: nothing is read back to the host and every buffer and grid is sized from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.triton_fp8_tiles import round_to

_CHUNK = 128  # most pairs per alignment program: the stable rank within a chunk is a [CHUNK, CHUNK] comparison
DIRECT_BLOCK_M = 16  # rows of a direct block (one pair in row 0): the tile of the aligned path at one token
SUM_COUNTERS = 4096  # column blocks of the down GEMM that can sum in-kernel at one token (more: _sum_k_kernel)


def sum_counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per column block of the one-token down GEMM (kernels/counters.py)."""
    return arrival_counters("moe sum", device, SUM_COUNTERS)


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, n_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < n_pairs
    ex = tl.arange(0, E_PAD)
    hist = tl.histogram(tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32), E_PAD)
    hist -= tl.where(ex == 0, CHUNK - tl.sum(ok.to(tl.int32), 0), 0)  # lanes past the last pair counted as expert 0
    tl.store(hist_ptr + c * E_PAD + ex, hist)


@triton.jit
def _offsets_kernel(hist_ptr, offs_ptr, pad_end_ptr, sorted_ptr, num_padded_ptr, n_pairs, num_experts, num_chunks,
                    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: the per-expert prefix sums. Everything that scales with the blocks is left to _place_kernel's
    grid: one program has one multiprocessor's bandwidth (reading the histograms is most of its time)."""
    ex = tl.arange(0, E_PAD)
    cb = tl.arange(0, BLOCK_C)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):  # BLOCK_C chunks a step: few dependent loads even for a long prefill
        c = c0 + cb
        counts += tl.sum(tl.load(hist_ptr + c[:, None] * E_PAD + ex[None, :], mask=(c < num_chunks)[:, None],
                                 other=0), axis=0)
    counts = tl.where(ex < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    pad_end = tl.cumsum(padded, 0)  # experts >= E: the total
    pad_start = pad_end - padded
    tl.store(pad_end_ptr + ex, pad_end)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    # offs[c, e]: where chunk c's first pair of expert e goes (chunks in order: a stable placement)
    base = pad_start
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + cb
        c_ok = (c < num_chunks)[:, None]
        h = tl.load(hist_ptr + c[:, None] * E_PAD + ex[None, :], mask=c_ok, other=0)  # [BLOCK_C, E_PAD]
        tl.store(offs_ptr + c[:, None] * E_PAD + ex[None, :], base[None, :] + tl.cumsum(h, 0) - h, mask=c_ok)
        base += tl.sum(h, axis=0)
    # padding rows: each expert's run past its count
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (pad_start + counts)[:, None] + j[None, :], n_pairs,
             mask=j[None, :] < (padded - counts)[:, None])


@triton.jit
def _place_kernel(ids_ptr, offs_ptr, pad_end_ptr, num_padded_ptr, sorted_ptr, block_expert_ptr, n_pairs,
                  num_experts, num_chunks, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    c = tl.program_id(0)
    if c < num_chunks:  # chunk c of pairs: each to its expert's run, after the same expert's earlier pairs
        r = tl.arange(0, CHUNK)
        i = c * CHUNK + r
        ok = i < n_pairs
        e = tl.load(ids_ptr + i, mask=ok, other=num_experts).to(tl.int32)  # [CHUNK]
        before = (e[:, None] == e[None, :]) & (r[None, :] < r[:, None])  # [CHUNK, CHUNK] same expert, earlier
        rank = tl.sum(before.to(tl.int32), axis=1)
        dst = tl.load(offs_ptr + c * E_PAD + e, mask=ok, other=0) + rank
        tl.store(sorted_ptr + dst, i, mask=ok)
    # blocks [c * BLOCK_B, (c + 1) * BLOCK_B): block b belongs to the expert whose padded run holds row b * BLOCK_M,
    # i.e. the number of runs that end at or before it; past the live total that is >= E (runs of e >= E end at
    # the total), and those blocks' rows get the sentinel
    b = c * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < max_blocks
    pad_end = tl.load(pad_end_ptr + tl.arange(0, E_PAD))
    tl.store(block_expert_ptr + b, tl.sum((pad_end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1),
             mask=b_ok)
    tail = b_ok & (b * BLOCK_M >= tl.load(num_padded_ptr))
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + b[:, None] * BLOCK_M + j[None, :], n_pairs, mask=tail[:, None])


@triton.jit
def _align_one_chunk_kernel(ids_ptr, pad_end_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs,
                            num_experts, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_B: tl.constexpr):
    """The three alignment kernels in one program, for batches of at most CHUNK pairs (decode, short verify): the
    histogram, the padded per-expert runs, the stable placement, the padding rows and the block owners, with the
    same results as _count_kernel + _offsets_kernel + _place_kernel (one launch instead of three)."""
    r = tl.arange(0, CHUNK)
    ok = r < n_pairs
    e = tl.load(ids_ptr + r, mask=ok, other=num_experts).to(tl.int32)  # [CHUNK]; lanes past the pairs: no expert
    ex = tl.arange(0, E_PAD)
    counts = tl.histogram(tl.where(ok, e, 0), E_PAD)
    counts -= tl.where(ex == 0, CHUNK - tl.sum(ok.to(tl.int32), 0), 0)  # lanes past the last pair counted as 0
    counts = tl.where(ex < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    pad_end = tl.cumsum(padded, 0)  # experts >= E: the total
    pad_start = pad_end - padded
    total = tl.sum(padded, 0)
    tl.store(pad_end_ptr + ex, pad_end)
    tl.store(num_padded_ptr, total)
    # padding rows: each expert's run past its count
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (pad_start + counts)[:, None] + j[None, :], n_pairs,
             mask=j[None, :] < (padded - counts)[:, None])
    tl.debug_barrier()  # pad_end in memory for every thread of the program
    # each pair after the same expert's earlier pairs, in its expert's run, which starts where run e - 1 ends
    before = (e[:, None] == e[None, :]) & (r[None, :] < r[:, None])  # [CHUNK, CHUNK]
    rank = tl.sum(before.to(tl.int32), axis=1)
    start = tl.load(pad_end_ptr + e - 1, mask=ok & (e > 0), other=0)
    tl.store(sorted_ptr + start + rank, r, mask=ok)
    # block owners (the runs ending at or before the block's first row) and the sentinel past the live total
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < max_blocks
        tl.store(block_expert_ptr + b, tl.sum((pad_end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1),
                 mask=b_ok)
        tail = b_ok & (b * BLOCK_M >= total)
        tl.store(sorted_ptr + b[:, None] * BLOCK_M + j[None, :], n_pairs, mask=tail[:, None])


@triton.jit
def block_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, n_pairs, pid_m, BLOCK_M: tl.constexpr,
                DIRECT: tl.constexpr):
    """(live, expert, pairs [BLOCK_M]; n_pairs marks padding) of block pid_m. Aligned: the block's run of
    sorted_ids and its owner; live while the block is below the live padded total (the grid covers the bound).
    DIRECT (one token, no alignment): block pid_m is pair pid_m alone, its expert read from the router's ids."""
    lane = tl.arange(0, BLOCK_M)
    if DIRECT:
        live = pid_m < n_pairs
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        pair = tl.where(lane == 0, pid_m, n_pairs)
    else:
        live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + lane)
    return live, e, pair


@triton.jit
def expert_tile(a_ptr, a_rows, stride_a, w_ptr, e, stride_we, stride_wn, pid_n, n_dim, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """A GEMM program's tile (every expert GEMM here: weights [E, N, K], K contiguous): its columns n [BLOCK_N] of
    n_dim and n_ok, the K lanes k [BLOCK_K], the input rows' pointers a_ptrs [M, K] (rows a_rows [M] int64 of
    stride_a) and expert e's weight pointers w_ptrs [K, N] (row n of stride_wn)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + k[None, :]  # [M, K]
    w_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [K, N]
    return n, n < n_dim, k, a_ptrs, w_ptrs


@triton.jit
def sum_pairs(y_ptr, wts_ptr, out_ptr, counter_ptr, pid_n, n, n_ok, hidden, n_pairs, TOP_K: tl.constexpr,
              BLOCK_N: tl.constexpr, RNE: tl.constexpr):
    """One token (direct): the last of the TOP_K programs of column block pid_n to finish (counter pid_n) sums their
    outputs y [K, H] at columns n [BLOCK_N] into out [1, H] as _sum_k_kernel does (weights wts [K], in k order,
    float32), and resets the counter to 0: no sum launch.
    The barrier orders every thread's y stores before the one-thread atomic, whose release makes them visible at GPU
    scope to the program that acquires the final count; it reads y through L2 (.cg)."""
    tl.debug_barrier()
    counter = counter_ptr + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel") == n_pairs - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for kk in tl.static_range(TOP_K):  # fixed order: deterministic, _sum_k_kernel's sum
            wk = tl.load(wts_ptr + kk).to(tl.float32)
            total += wk * tl.load(y_ptr + kk * hidden + n, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + n, round_to(total, dt, RNE).to(dt), mask=n_ok)
        tl.store(counter, 0)  # the next launch (or graph replay) counts from 0 again


@triton.jit
def _sum_k_kernel(y_ptr, w_ptr, out_ptr, hidden, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                  RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):  # fixed order: deterministic
        wk = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (t * TOP_K + k) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, round_to(acc, out_ptr.dtype.element_ty, RNE).to(
        out_ptr.dtype.element_ty), mask=ok)


def moe_block_m(n_pairs: int, num_experts: int) -> int:
    """Rows per block from shapes only: about twice the mean pairs per expert, 16..64, so a small batch pads each
    chosen expert to one 16-row block and a mid-size one reads each expert's weights about once; 128 from 128 pairs
    per expert on, where the GEMMs turn compute-bound (measured faster on the H200 at Qwen3-30B-A3B's shapes from
    2048 tokens on, no faster up to 1024; re-tune with scripts/gpu/bench_moe.py)."""
    if n_pairs >= 128 * num_experts:
        return 128
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(2 * n_pairs, num_experts))))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_launch: bool = True):
    """topk_ids [T, K] -> (sorted_ids [P] int32: pair indices t*K + k grouped by expert, each expert's run padded to
    a multiple of block_m with the sentinel T*K; block_expert [P / block_m] int32; num_padded [1] int32, the live
    padded total). P = block_m * ((T*K + min(E, T*K) * (block_m - 1)) // block_m) is the bound from shapes.
    Batches of one chunk (at most 128 pairs: decode, short verify) take one launch (one_launch; False: the three
    kernels every larger batch takes, which give the same results)."""
    ids = topk_ids.reshape(-1)  # [T*K]
    n_pairs, dev = ids.numel(), ids.device
    max_blocks = (n_pairs + min(num_experts, n_pairs) * (block_m - 1)) // block_m
    e_pad = triton.next_power_of_2(num_experts)
    chunk = min(_CHUNK, max(16, triton.next_power_of_2(n_pairs)))  # a decode step's few pairs: one small chunk
    num_chunks = triton.cdiv(n_pairs, chunk)
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)  # [chunks, E_PAD]
    offs = torch.empty_like(hist)  # [chunks, E_PAD]
    pad_end = torch.empty(e_pad, dtype=torch.int32, device=dev)  # [E_PAD] end of each expert's padded run
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)  # [P]
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)  # [P / block_m]
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_b = 16
    if num_chunks == 1 and one_launch:
        _align_one_chunk_kernel[(1,)](ids, pad_end, sorted_ids, block_expert, num_padded, n_pairs, num_experts,
                                      max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCK_B=block_b,
                                      num_warps=4)
        return sorted_ids, block_expert, num_padded
    _count_kernel[(num_chunks,)](ids, hist, n_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    _offsets_kernel[(1,)](hist, offs, pad_end, sorted_ids, num_padded, n_pairs, num_experts, num_chunks,
                          BLOCK_M=block_m, E_PAD=e_pad, BLOCK_C=min(64, triton.next_power_of_2(num_chunks)),
                          num_warps=8)
    _place_kernel[(max(num_chunks, triton.cdiv(max_blocks, block_b)),)](
        ids, offs, pad_end, num_padded, sorted_ids, block_expert, n_pairs, num_experts, num_chunks, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCK_B=block_b, num_warps=4)
    return sorted_ids, block_expert, num_padded


def route(topk_ids: torch.Tensor, num_experts: int, direct: bool, block_m: int) -> tuple:
    """(ids, sorted_ids, block_expert, num_padded, blocks): the GEMMs' blocks, direct (a pair a block, no
    alignment; the alignment's outputs are then unused stand-ins) or aligned (moe_align)."""
    ids = topk_ids.reshape(-1)  # [T*K]
    if direct:
        return ids, ids, ids, ids, ids.numel()
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, block_m)
    return ids, sorted_ids, block_expert, num_padded, block_expert.shape[0]


def sum_k(y: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, top_k: int, rne: bool) -> torch.Tensor:
    """out [T, H] = the pairs' outputs y [T*K, H] summed per token with weights wts [T*K] (float32, in k order);
    rne: round the float32 sum to out's dtype explicitly (the interpreter's cast truncates: triton_fp8_tiles.py)."""
    num_tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_k_kernel[(num_tokens, triton.cdiv(hidden, block))](y, wts, out, hidden, out.stride(0), TOP_K=top_k,
                                                            BLOCK=block, RNE=rne, num_warps=4)
    return out


def sums_in_kernel(direct: bool, num_tokens: int, col_blocks: int) -> bool:
    """Whether the down GEMM sums the k outputs itself (sum_pairs): one token on the direct path, with a counter for
    each of its col_blocks column blocks."""
    return direct and num_tokens == 1 and col_blocks <= SUM_COUNTERS
