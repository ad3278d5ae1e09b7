"""Graph-safe DSA top-k in Triton: each query's `k` best index scores as a list of cache slots (oracle:
attention/torch_mla_backend.py, topk_slots / ranked_topk).

Input: the indexer's scores of a fixed-width batch, [bs, W, max_kv] float32 (kernels/triton_indexer.py), where
query i of request b sees key positions < seq_lens[b] - W + i + 1 (its causal length, read on the device). Output:
slots [bs * W, K] (K = min(k, max_kv)) holding the kv_slots of the chosen positions in increasing position order, then
-1; counts [bs * W] = min(k, causal length). The choice is the reference's: the k largest scores, equal scores keep
the earlier position, -0.0 equal to +0.0. Where a query sees no more than k keys it takes them all (no selection
runs: the common case early in a request, which torch.topk over the padded graph width cannot skip).

Selection is an exact radix select over a 32-bit order-preserving key of each score (the float's bits with the
negative ones flipped), 8 bits a pass, most significant first:

1. four histogram passes (`_hist_kernel`, grid (rows, chunks of CHUNK positions); the first one can be done by the
   indexer's scores kernel as it writes the scores, `first_pass_counts` into `topk_workspace`, as the DSA backend
   has it): pass p counts, over the keys whose top 8p bits equal the prefix found so far, their next 8 bits into
   256 bins, and adds the chunk's counts to the row's histogram with integer atomics (integer sums: the same
   totals in any order, so deterministic).
   Each program first re-derives the prefix and the number still to take from the earlier passes' histograms
   (`_prefix`: the largest digit whose count of keys at or above it reaches what is still needed). After four
   passes the prefix is the k-th largest key T itself and `need` is how many keys equal to T to take;
2. `_count_kernel` counts per chunk the keys above T and the keys equal to T. Decode-sized batches (`local`) skip
   it: their last histogram pass also stores, per chunk, its counts of the keys above the 24-bit prefix and of the
   matching keys at or above each last digit, from which the write kernel reads both counts at T's digit;
3. `_write_kernel`: each chunk takes its keys above T and the ties of lowest position up to `need` (the ties before
   it, from the earlier chunks' counts, come first), and writes their slots at its offset: the sum of what the
   earlier chunks take. Chunk 0 also writes counts and the -1 tail.

Grids and workspaces depend on shapes only (the causal lengths are read on the device), so the launches are CUDA-
graph capturable; a chunk wholly past its query's length returns at once. At a few queries every launch is one
program's walk over its chunk (one query over a long context gives few programs), so the chunk
shrinks until the grid has about two programs per SM (`pick_chunk`, as the sampler's).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import chunk_for_grid, grid_pdl, pdl_kwargs, pdl_wait, target_programs

CHUNKS = (2048, 1024, 512, 256)  # positions per program: pick_chunk's choices, largest first
BLOCK = 1024  # positions per step of a program, at most
LOCAL_MAX_BYTES = 16 << 20  # per-chunk counts of the last pass up to this workspace; beyond, the count kernel
_BINS = tl.constexpr(512)  # a workspace row's entries a pass: 256 digit counts (+ the last pass's per-chunk count
# of keys above the prefix at 256, `LOCAL`); the histograms themselves have 256 bins


@triton.jit
def _causal_len(seq_lens_ptr, row, stride_sl, max_kv, W: tl.constexpr):
    b = row // W
    i = row % W
    seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    return tl.minimum(seq_len - W + i + 1, max_kv)


@triton.jit
def _keys(scores_ptr, n, ok):
    """Scores at positions n -> int64 keys in [0, 2^32), ordered as the floats (-0.0 as +0.0)."""
    return score_keys(tl.load(scores_ptr + n, mask=ok, other=0.0))


@triton.jit
def score_keys(s):
    """float32 scores -> int64 keys in [0, 2^32), ordered as the floats (-0.0 as +0.0)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ordered.to(tl.int64) + 2147483648


@triton.jit
def first_pass_counts(s, ok):
    """The first histogram pass's counts [256] int32 over some of a query's scores s [N] float32 (ok: positions it
    sees): what _hist_kernel's pass 0 counts, from another kernel's registers (kernels/triton_indexer.py, as it
    writes the scores); sum them over blocks, then add_first_pass_counts. 256 bins, as _hist_kernel's: positions
    not seen count as digit 0 and are taken off again (512 bins, with a bin for them, measured slower)."""
    digit = tl.where(ok, score_keys(s) >> 24, 0).to(tl.int32)
    unseen = tl.sum(tl.where(ok, 0, 1), 0)
    return tl.histogram(digit, 256) - tl.where(tl.arange(0, 256) == 0, unseen, 0)


@triton.jit
def first_pass_zeros():
    """An empty first_pass_counts, to sum blocks into."""
    return tl.zeros([256], tl.int32)


@triton.jit
def add_first_pass_counts(hist_row_ptr, acc):
    """Adds first_pass_counts to a query's histogram row (hist [rows, 4, _BINS], first pass), integer atomics."""
    d_idx = tl.arange(0, 256)
    tl.atomic_add(hist_row_ptr + d_idx, acc, mask=acc > 0)


def topk_workspace(rows: int, device: torch.device) -> torch.Tensor:
    """The zeroed histograms of index_topk_triton for `rows` queries [rows, 4, _BINS] int32: pass it to
    kernels/triton_indexer.py index_scores_triton (which then does the first pass) and to index_topk_triton."""
    return torch.zeros((rows, 4, _BINS), dtype=torch.int32, device=device)


@triton.jit
def radix_digit(h, rem):
    """One step of a radix select, 8 bits a pass: h [256] the pass's digit counts, rem the keys still to take ->
    (the largest digit whose keys at or above it reach rem (-1 if none), rem less the keys above that digit)."""
    d_idx = tl.arange(0, 256)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with this digit or a larger one
    d = tl.max(tl.where(ge >= rem, d_idx, -1), axis=0)
    return d, rem - tl.sum(tl.where(d_idx > d, h, 0), axis=0)


@triton.jit
def _prefix(hist_row_ptr, k, PASS: tl.constexpr):
    """(prefix of the top 8 * PASS key bits, keys still to take at or below it) from passes < PASS."""
    d_idx = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    rem = tl.zeros([], tl.int32) + k
    for p in tl.static_range(PASS):
        h = tl.load(hist_row_ptr + p * _BINS + d_idx)  # [256] int32
        d, rem = radix_digit(h, rem)
        prefix = (prefix << 8) | d.to(tl.int64)
    return prefix, rem


@triton.jit
def _hist_kernel(scores_ptr, seq_lens_ptr, hist_ptr, local_ptr, k, max_kv, num_chunks, stride_sr, stride_sl,
                 W: tl.constexpr, PASS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 LOCAL: tl.constexpr, PDL: tl.constexpr):
    """Pass PASS of the radix select (module docstring). LOCAL (last pass only): each program also stores its
    chunk's counts for the write kernel, in local [rows, chunks, _BINS]: at d < 256 the keys matching the 24-bit
    prefix whose last digit is >= d, at 256 the keys whose top 24 bits are above the prefix (no count kernel)."""
    row = tl.program_id(0)
    lo = tl.program_id(1) * CHUNK
    pdl_wait(PDL)  # launched with PDL (launch.grid_pdl): the scores and the earlier passes' histograms
    kv_len = _causal_len(seq_lens_ptr, row, stride_sl, max_kv, W)
    hi = tl.minimum(lo + CHUNK, kv_len)
    if (kv_len > k) & (lo < hi):
        hist_row = hist_ptr + row.to(tl.int64) * 4 * _BINS
        prefix, rem = _prefix(hist_row, k, PASS)
        scores_row = scores_ptr + row.to(tl.int64) * stride_sr
        d_idx = tl.arange(0, 256)
        acc = tl.zeros([256], tl.int32)
        above = tl.zeros([], tl.int32)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < hi
            u = _keys(scores_row, n, ok)
            match = ok & ((u >> (32 - 8 * PASS)) == prefix)
            # 256 bins (a histogram's cost grows with its bins): keys that do not match count at digit 0, taken off
            digit = tl.where(match, (u >> (24 - 8 * PASS)) & 255, 0).to(tl.int32)
            misses = BLOCK - tl.sum(match.to(tl.int32), axis=0)
            acc += tl.histogram(digit, 256) - tl.where(d_idx == 0, misses, 0)
            if LOCAL:
                above += tl.sum((ok & ((u >> (32 - 8 * PASS)) > prefix)).to(tl.int32), axis=0)
        tl.atomic_add(hist_row + PASS * _BINS + d_idx, acc, mask=acc > 0)
        if LOCAL:
            ge = tl.sum(acc, axis=0) - tl.cumsum(acc, axis=0) + acc  # [256] matching keys with digit >= d
            local = local_ptr + (row.to(tl.int64) * num_chunks + tl.program_id(1)) * _BINS
            tl.store(local + d_idx, ge)
            tl.store(local + 256, above)


@triton.jit
def _threshold(hist_ptr, row, k, kv_len):
    """(T, need): take keys > T and the first `need` keys == T. A query seeing <= k keys takes all (T = -1)."""
    prefix, rem = _prefix(hist_ptr + row.to(tl.int64) * 4 * _BINS, k, 4)
    big = kv_len > k
    return tl.where(big, prefix, -1), tl.where(big, rem, 0)


@triton.jit
def _program(seq_lens_ptr, hist_ptr, k, max_kv, stride_sl, W: tl.constexpr, CHUNK: tl.constexpr):
    """This program's (row, chunk, chunk start, chunk end, causal length, T, need) after the histogram passes."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lo = chunk * CHUNK
    kv_len = _causal_len(seq_lens_ptr, row, stride_sl, max_kv, W)
    t, need = _threshold(hist_ptr, row, k, kv_len)
    return row, chunk, lo, tl.minimum(lo + CHUNK, kv_len), kv_len, t, need


@triton.jit
def _count_kernel(scores_ptr, seq_lens_ptr, hist_ptr, counts_ptr, k, max_kv, num_chunks, stride_sr, stride_sl,
                  W: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row, chunk, lo, hi, kv_len, t, need = _program(seq_lens_ptr, hist_ptr, k, max_kv, stride_sl, W, CHUNK)
    scores_row = scores_ptr + row.to(tl.int64) * stride_sr
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        ok = n < hi
        u = _keys(scores_row, n, ok)
        gt += tl.sum((ok & (u > t)).to(tl.int32), axis=0)
        eq += tl.sum((ok & (u == t)).to(tl.int32), axis=0)
    base = counts_ptr + (row.to(tl.int64) * num_chunks + chunk) * 2
    tl.store(base, gt)
    tl.store(base + 1, eq)


@triton.jit
def _write_kernel(scores_ptr, seq_lens_ptr, hist_ptr, counts_ptr, kv_slots_ptr, kv_rows_ptr, out_ptr, out_counts_ptr,
                  k, max_kv, num_chunks, out_k, stride_sr, stride_sl, stride_kvb, stride_kvn, stride_or,
                  W: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                  HAS_ROWS: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr):
    """LOCAL: the earlier chunks' counts come from the last histogram pass's per-chunk counts (counts_ptr then
    points at them, [rows, chunks, _BINS]) instead of _count_kernel's [rows, chunks, 2]."""
    pdl_wait(PDL)
    row, chunk, lo, hi, kv_len, t, need = _program(seq_lens_ptr, hist_ptr, k, max_kv, stride_sl, W, CHUNK)
    # what the earlier chunks take: their keys above T and their share of the first `need` ties
    c = tl.arange(0, MAX_CHUNKS)
    before = c < chunk
    if LOCAL:
        if kv_len > k:  # selecting: T = (24-bit prefix, last digit d); past kv_len a chunk stored nothing
            live = before & (c * CHUNK < kv_len)
            d = (t & 255).to(tl.int32)
            base = counts_ptr + (row.to(tl.int64) * num_chunks + c) * _BINS  # [MAX_CHUNKS]
            ge_d = tl.load(base + d, mask=live, other=0)
            ge_next = tl.load(base + tl.minimum(d + 1, 255), mask=live, other=0)
            ge_next = tl.where(d < 255, ge_next, 0)  # no digit above 255
            gt_c = tl.load(base + 256, mask=live, other=0) + ge_next
            eq_c = ge_d - ge_next
        else:  # a query seeing <= k keys takes them all: each earlier chunk is full
            gt_c = tl.where(before, tl.minimum(tl.maximum(kv_len - c * CHUNK, 0), CHUNK), 0)
            eq_c = tl.zeros([MAX_CHUNKS], tl.int32)
    else:
        base = counts_ptr + row.to(tl.int64) * num_chunks * 2
        gt_c = tl.load(base + 2 * c, mask=before, other=0)
        eq_c = tl.load(base + 2 * c + 1, mask=before, other=0)
    eq_prior = tl.cumsum(eq_c, axis=0) - eq_c  # ties in the chunks before each one
    taken_c = gt_c + tl.minimum(tl.maximum(need - eq_prior, 0), eq_c)
    offset = tl.sum(taken_c, axis=0)
    eq_seen = tl.sum(eq_c, axis=0)
    scores_row = scores_ptr + row.to(tl.int64) * stride_sr
    if HAS_ROWS:  # token rows: request row // W's keys are row kv_rows[row // W] of kv_slots (the page table)
        kv_row = tl.load(kv_rows_ptr + row // W).to(tl.int64)
    else:
        kv_row = (row // W).to(tl.int64)
    slots_row = kv_slots_ptr + kv_row * stride_kvb
    out_row = out_ptr + row.to(tl.int64) * stride_or
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        ok = n < hi
        u = _keys(scores_row, n, ok)
        tie = ok & (u == t)
        tie_rank = eq_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (ok & (u > t)) | (tie & (tie_rank < need))
        idx = offset + tl.cumsum(take.to(tl.int32), axis=0) - 1
        slot = tl.load(slots_row + n * stride_kvn, mask=take, other=0)
        tl.store(out_row + idx, slot, mask=take)
        offset += tl.sum(take.to(tl.int32), axis=0)
        eq_seen += tl.sum(tie.to(tl.int32), axis=0)
    if chunk == 0:
        total = tl.minimum(kv_len, k)
        tl.store(out_counts_ptr + row, total.to(tl.int64))
        for f0 in range(total, out_k, BLOCK):
            f = f0 + tl.arange(0, BLOCK)
            tl.store(out_row + f, tl.full([BLOCK], -1, tl.int64), mask=f < out_k)


pick_chunk = functools.partial(chunk_for_grid, CHUNKS)  # (rows, max_kv, target) -> chunk


def index_topk_triton(scores: torch.Tensor, seq_lens: torch.Tensor, kv_slots: torch.Tensor, width: int, k: int, *,
                      chunk: int | None = None, block: int = BLOCK,
                      kv_rows: torch.Tensor | None = None, local: bool | None = None,
                      hist: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [bs, width, max_kv] float32 (the indexer's; positions past a query's causal length are ignored);
    seq_lens [bs] int64 (device); kv_slots [bs, max_kv] int64 -> (slots [bs * width, K] int64: the chosen
    positions' slots in position order, then -1; counts [bs * width] int64), K = min(k, max_kv). Capturable.
    chunk: positions per program (None: pick_chunk; under the interpreter the largest); block: positions per step
    (powers of two, at most chunk). kv_rows [bs] int64:
    request b's slots are kv_slots[kv_rows[b]] (token rows of a prefill; kv_slots then any [rows, max_kv] table).
    local: the last histogram pass keeps per-chunk counts for the write kernel, one launch fewer (default: while
    that workspace is at most LOCAL_MAX_BYTES: decode, verify and draft batches; False: the count kernel).
    hist: topk_workspace(bs * width) with its first pass done by index_scores_triton (same k): one launch fewer."""
    bs, w, max_kv = scores.shape
    assert w == width and seq_lens.shape == (bs,) and k > 0 and kv_slots.shape[1] == max_kv
    assert kv_slots.shape[0] == bs if kv_rows is None else (kv_rows.shape == (bs,) and kv_rows.dtype == torch.int64)
    assert scores.dtype == torch.float32 and scores.stride(-1) == 1 and scores.stride(0) == w * scores.stride(1)
    rows, out_k = bs * w, min(k, max_kv)
    dev = scores.device
    if chunk is None:
        chunk = pick_chunk(rows, max_kv, target_programs(dev, cpu=1))
    block = min(block, chunk)
    out = torch.empty((rows, out_k), dtype=torch.int64, device=dev)
    out_counts = torch.empty((rows,), dtype=torch.int64, device=dev)
    if rows == 0:
        return out, out_counts
    num_chunks = triton.cdiv(max_kv, chunk)
    first = 0 if hist is None else 1  # the first pass already done as the scores were written
    if hist is None:
        hist = topk_workspace(rows, dev)
    assert hist.shape == (rows, 4, _BINS) and hist.dtype == torch.int32
    if local is None:
        local = rows * num_chunks * _BINS * 4 <= LOCAL_MAX_BYTES
    # LOCAL: the last pass keeps per-chunk counts ([rows, chunks, _BINS]), else _count_kernel's [rows, chunks, 2]
    counts = torch.empty((rows, num_chunks, _BINS if local else 2), dtype=torch.int32, device=dev)
    grid = (rows, num_chunks)
    pdl = grid_pdl(dev, rows * num_chunks, rows)
    common = dict(W=width, CHUNK=chunk, BLOCK=block, PDL=pdl, num_warps=4, **pdl_kwargs(bool(pdl)))
    stride_sr = scores.stride(1)
    for p in range(first, 4):
        _hist_kernel[grid](scores, seq_lens, hist, counts, k, max_kv, num_chunks, stride_sr, seq_lens.stride(0),
                           PASS=p, LOCAL=local and p == 3, **common)
    if not local:
        _count_kernel[grid](scores, seq_lens, hist, counts, k, max_kv, num_chunks, stride_sr, seq_lens.stride(0),
                            **common)
    _write_kernel[grid](scores, seq_lens, hist, counts, kv_slots, kv_slots if kv_rows is None else kv_rows, out,
                        out_counts, k, max_kv, num_chunks, out_k, stride_sr, seq_lens.stride(0), kv_slots.stride(0),
                        kv_slots.stride(1), out.stride(0), MAX_CHUNKS=max(2, triton.next_power_of_2(num_chunks)),
                        HAS_ROWS=kv_rows is not None, LOCAL=local, **common)
    return out, out_counts
