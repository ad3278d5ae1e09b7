"""Sampling from logits without a sort (oracle: layers/sampler.py, probs_from_logits and sample).

Per row: temperature, then top-k, top-p and min-p, then the exponential race over what is kept (greedy rows: the
argmax), with the counter-based noise of kernels/noise.py. The filter keeps every token at or above one threshold,
found by an exact radix select over the 32-bit keys of e = exp(z - max z) (z = logits / temperature; e >= 0, so its
float bits order like the values):

* the threshold is the smallest e_i whose strictly larger tokens number fewer than top_k and hold at most top_p of
  the mass (the sorted reference's rule, ties kept together: sampler.filter_sorted); both sides are monotone in
  e_i, so the descent picks, 5 bits a level over 6 levels, the lowest non-empty bucket whose higher buckets (and
  the levels above) still satisfy both, and after the last level the prefix is the threshold's key itself (e <= 1,
  so a key's two top bits are 0: 30 bits to resolve);
* min-p (e_i >= min_p, since e = p / p_max) is a second threshold on the same keys; kept = key >= max of the two.

Every pass is a grid (rows, chunks of CHUNK tokens). A pass whose result is a per-row reduction (the max and the
normaliser, a level's 32-bucket counts and masses, the race's winner) has each program write its chunk's partial
result to a workspace; the program that arrives last at the row's counter (an acq_rel atomic) reduces the partials
in chunk order (deterministic), writes the row's state, and resets the counter. Launches: 1 for an unfiltered
sample (the race in log space, argmax z_i - log(-log u_i), needs no normaliser); 10 for a filtered sample or a
filtered distribution (statistics, 6 levels, the race or the write); 2 for an unfiltered distribution. Grids and
workspaces depend on shapes only: the launches are CUDA-graph capturable.

At a few rows every pass is latency-bound: a program's serial walk over its chunk is what a pass costs, so the
chunk shrinks until the grid has about two programs per SM (`pick_chunk`: 4096 tokens at many rows, down to 1024
at one row; re-tune with scripts/gpu/bench_sample.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.launch import chunk_for_grid, target_programs
from specserve.kernels.noise import SALT_SAMPLE
from specserve.kernels.triton_accept import _key, _uniform

CHUNK = 4096  # tokens per program, at most
CHUNKS = (4096, 2048, 1024)  # pick_chunk's choices, largest first
BLOCK = 1024  # tokens per step of a program
BITS = 5  # key bits a level resolves (6: one launch fewer, but each slower: measured slower in all)
BINS = 1 << BITS  # buckets per level
KEY_BITS = 30  # e = exp(z - max z) <= 1: the float's sign and top exponent bit are 0
LEVELS = KEY_BITS // BITS
LEVEL_BLOCK = 16384 // BINS  # tokens per step of a level: its [tokens, BINS] one-hot tile at most 16k elements
# Row state: float32 [R, 8] and int32 [R, 8] (one int32 workspace, the float part viewed as float32).
# float: max z, sum e, mass above the prefix, mass with e >= min_p, kept mass
_M, _Z, _MA, _ZMIN, _ZT = (tl.constexpr(i) for i in range(5))
_P, _CA, _ARG = (tl.constexpr(i) for i in range(3))  # int: key prefix, count above it, argmax of z


@triton.jit
def _load_z(x_ptr, row, cols, vocab, temp):
    ok = cols < vocab
    x = tl.load(x_ptr + row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    return x / temp, ok


@triton.jit
def _row_params(temp_ptr, greedy_ptr, k_ptr, p_ptr, r, vocab):
    g = tl.load(greedy_ptr + r)
    greedy = g != 0
    temp = tl.where(greedy, 1.0, tl.load(temp_ptr + r))
    k = tl.load(k_ptr + r)
    top_p = tl.load(p_ptr + r)
    # sampled rows with a top-k or top-p to select
    select = (g == 0) & ((k < vocab) | (top_p < 1.0))
    return greedy, temp, k, top_p, select


@triton.jit
def _arrive(counter_ptr, r):
    """True in the program that arrives last at row r's counter (which it then resets)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + r, 1, sem="acq_rel")
    return arrived == tl.num_programs(1) - 1


@triton.jit
def _stats_kernel(x_ptr, temp_ptr, greedy_ptr, k_ptr, p_ptr, wsf_ptr, wsi_ptr, stf_ptr, sti_ptr, active_ptr,
                  counter_ptr, vocab, stride_x, n_chunks,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr, BINS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    greedy, temp, k, top_p, select = _row_params(temp_ptr, greedy_ptr, k_ptr, p_ptr, r, vocab)
    row = r * stride_x
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        z, ok = _load_z(x_ptr, row, cols, vocab, temp)
        bm = tl.max(z, axis=0)
        bi = off + tl.argmax(z, axis=0, tie_break_left=True)
        take = bm > best_v  # strictly: the first index wins ties, as torch's argmax
        best_i = tl.where(take, bi, best_i)
        best_v = tl.where(take, bm, best_v)
    s = tl.zeros([BLOCK], tl.float32)
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        z, ok = _load_z(x_ptr, row, cols, vocab, temp)
        s += tl.where(ok & (z > float("-inf")), tl.exp(z - best_v), 0.0)  # a chunk of -inf logits sums to 0
    part = (r * n_chunks + c) * BINS
    tl.store(wsf_ptr + part, best_v)
    tl.store(wsf_ptr + part + 1, tl.sum(s, axis=0))
    tl.store(wsi_ptr + part, best_i)
    tl.store(active_ptr + r * n_chunks + c, 1)  # every chunk takes part in the first level
    if _arrive(counter_ptr, r):
        ci = tl.arange(0, NC_PAD)
        cok = ci < n_chunks
        parts = (r * n_chunks + ci) * BINS
        cm = tl.load(wsf_ptr + parts, mask=cok, other=float("-inf"), cache_modifier=".cg")
        cs = tl.load(wsf_ptr + parts + 1, mask=cok, other=0.0, cache_modifier=".cg")
        ca = tl.load(wsi_ptr + parts, mask=cok, other=0, cache_modifier=".cg")
        m = tl.max(cm, axis=0)
        z_sum = tl.sum(tl.where(cok, cs * tl.exp(cm - m), 0.0), axis=0)
        first = tl.min(tl.where(cok & (cm == m), ci, n_chunks), axis=0)
        arg = tl.sum(tl.where(ci == first, ca, 0), axis=0)
        tl.store(stf_ptr + r * 8 + _M, m)
        tl.store(stf_ptr + r * 8 + _Z, z_sum)
        tl.store(stf_ptr + r * 8 + _MA, 0.0)
        tl.store(stf_ptr + r * 8 + _ZMIN, z_sum)
        tl.store(stf_ptr + r * 8 + _ZT, z_sum)
        tl.store(sti_ptr + r * 8 + _P, 0)
        tl.store(sti_ptr + r * 8 + _CA, 0)
        tl.store(sti_ptr + r * 8 + _ARG, arg)
        tl.store(counter_ptr + r, 0)


@triton.jit
def _level_kernel(x_ptr, temp_ptr, greedy_ptr, k_ptr, p_ptr, minp_ptr, wsf_ptr, wsi_ptr, stf_ptr, sti_ptr,
                  active_ptr, counter_ptr, vocab, stride_x, n_chunks, level,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr, BINS: tl.constexpr,
                  BITS: tl.constexpr, LEVELS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    greedy, temp, k, top_p, select = _row_params(temp_ptr, greedy_ptr, k_ptr, p_ptr, r, vocab)
    min_p = tl.load(minp_ptr + r)
    m = tl.load(stf_ptr + r * 8 + _M)
    prefix = tl.load(sti_ptr + r * 8 + _P)
    shift = (LEVELS - 1 - level) * BITS  # this level's bits: shift .. shift + BITS - 1
    hi = shift + BITS  # the prefix's bits are those above (level 0: none, every key is in it)
    active = tl.load(active_ptr + r * n_chunks + c) != 0
    do_hist = select & active
    do_min = (tl.load(greedy_ptr + r) == 0) & (level == 0)
    bins = tl.arange(0, BINS)
    cnt = tl.zeros([BINS], tl.int32)
    mass = tl.zeros([BINS], tl.float32)
    zmin = tl.zeros([BLOCK], tl.float32)
    if do_hist | do_min:
        row = r * stride_x
        for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            z, ok = _load_z(x_ptr, row, cols, vocab, temp)
            e = tl.where(ok, tl.exp(z - m), 0.0)
            key = e.to(tl.int32, bitcast=True)
            inp = ok & ((level == 0) | ((key >> hi) == (prefix >> hi))) & do_hist
            onehot = (((key >> shift) & (BINS - 1))[:, None] == bins[None, :]) & inp[:, None]  # [BLOCK, BINS]
            cnt += tl.sum(onehot.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(onehot, e[:, None], 0.0), axis=0)
            zmin += tl.where(ok & (e >= min_p), e, 0.0)
    part = (r * n_chunks + c) * BINS
    tl.store(wsi_ptr + part + bins, cnt)
    tl.store(wsf_ptr + part + bins, mass)
    # the chunk's mass of e >= min_p: in the second half of the float workspace
    tl.store(wsf_ptr + (n_chunks * tl.num_programs(0) + r * n_chunks + c) * BINS, tl.sum(zmin, axis=0))
    if _arrive(counter_ptr, r):
        ci = tl.arange(0, NC_PAD)
        cok = ci < n_chunks
        parts = (r * n_chunks + ci) * BINS
        tile = parts[:, None] + bins[None, :]  # [NC_PAD, BINS]
        cnts = tl.load(wsi_ptr + tile, mask=cok[:, None], other=0, cache_modifier=".cg")
        all_cnt = tl.sum(cnts, axis=0)  # [BINS]
        all_mass = tl.sum(tl.load(wsf_ptr + tile, mask=cok[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        if do_min:
            zm = tl.load(wsf_ptr + (n_chunks * tl.num_programs(0) + r * n_chunks + ci) * BINS, mask=cok, other=0.0,
                         cache_modifier=".cg")
            tl.store(stf_ptr + r * 8 + _ZMIN, tl.sum(zm, axis=0))
        if select:
            z_sum = tl.load(stf_ptr + r * 8 + _Z)
            m_above = tl.load(stf_ptr + r * 8 + _MA)
            c_above = tl.load(sti_ptr + r * 8 + _CA)
            # tokens and mass in higher buckets (the scan's own total, so the top bucket has exactly 0 above it)
            cum_c = tl.cumsum(all_cnt, axis=0)
            cum_m = tl.cumsum(all_mass, axis=0)
            above_c = tl.max(cum_c, axis=0) - cum_c
            above_m = tl.max(cum_m, axis=0) - cum_m
            p_fits = tl.where(top_p >= 1.0, 1, (m_above + above_m <= top_p * z_sum).to(tl.int32)) != 0
            fits = (c_above + above_c < k) & p_fits
            d = tl.min(tl.where(fits & (all_cnt > 0), bins, BINS), axis=0)
            # rounding can in principle leave no bucket fitting; the highest non-empty one then (it held before)
            d = tl.where(d < BINS, d, tl.max(tl.where(all_cnt > 0, bins, 0), axis=0))
            prefix = prefix | (d << shift)
            c_above += tl.sum(tl.where(bins == d, above_c, 0), axis=0)
            m_above += tl.sum(tl.where(bins == d, above_m, 0.0), axis=0)
            tl.store(sti_ptr + r * 8 + _P, prefix)
            tl.store(sti_ptr + r * 8 + _CA, c_above)
            tl.store(stf_ptr + r * 8 + _MA, m_above)
            if level == LEVELS - 1:  # the prefix is the threshold's key: the kept mass adds its ties
                tl.store(stf_ptr + r * 8 + _ZT, m_above + tl.sum(tl.where(bins == d, all_mass, 0.0), axis=0))
            # next level: only chunks holding a token of the chosen bucket
            in_d = tl.sum(tl.where(bins[None, :] == d, cnts, 0), axis=1)  # [NC_PAD]
            tl.store(active_ptr + r * n_chunks + ci, (in_d > 0).to(tl.int32), mask=cok)
        tl.store(counter_ptr + r, 0)


@triton.jit
def _threshold(stf_ptr, sti_ptr, minp_ptr, r, select):
    """(the smallest kept key, the kept mass) of row r after the descent."""
    min_p = tl.load(minp_ptr + r)
    kmin = tl.maximum(min_p, 0.0).to(tl.int32, bitcast=True)
    kp = tl.where(select, tl.load(sti_ptr + r * 8 + _P), 0)
    z_kp = tl.where(select, tl.load(stf_ptr + r * 8 + _ZT), tl.load(stf_ptr + r * 8 + _Z))
    z_keep = tl.where(kmin > kp, tl.load(stf_ptr + r * 8 + _ZMIN), z_kp)
    return tl.maximum(kp, kmin), z_keep


@triton.jit
def _race_kernel(x_ptr, temp_ptr, greedy_ptr, k_ptr, p_ptr, minp_ptr, seed_ptr, pos_ptr, stf_ptr, sti_ptr,
                 wsf_ptr, wsi_ptr, counter_ptr, out_ptr, vocab, stride_x, n_chunks,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr, BINS: tl.constexpr,
                 FILTER: tl.constexpr, SALT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    greedy, temp, k, top_p, select = _row_params(temp_ptr, greedy_ptr, k_ptr, p_ptr, r, vocab)
    key0 = _key(tl.load(seed_ptr + r), tl.load(pos_ptr + r), SALT)
    if FILTER:
        m = tl.load(stf_ptr + r * 8 + _M)
        thr, _ = _threshold(stf_ptr, sti_ptr, minp_ptr, r, select)
    row = r * stride_x
    best_v = tl.full([], float("-inf"), tl.float32)  # the race
    best_i = tl.full([], 0, tl.int32)
    arg_v = tl.full([], float("-inf"), tl.float32)  # the argmax (greedy rows)
    arg_i = tl.full([], 0, tl.int32)
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        z, ok = _load_z(x_ptr, row, cols, vocab, temp)
        keep = ok
        if FILTER:
            keep = ok & (tl.exp(z - m).to(tl.int32, bitcast=True) >= thr)
        u = _uniform(key0 + cols.to(tl.uint64) * 0x9E3779B97F4A7C15)
        score = tl.where(keep, z - tl.log(-tl.log(u)), float("-inf"))  # log of e / -log(u), up to a constant
        bm = tl.max(score, axis=0)
        bi = off + tl.argmax(score, axis=0, tie_break_left=True)
        take = bm > best_v
        best_i = tl.where(take, bi, best_i)
        best_v = tl.where(take, bm, best_v)
        am = tl.max(z, axis=0)
        ai = off + tl.argmax(z, axis=0, tie_break_left=True)
        take = am > arg_v
        arg_i = tl.where(take, ai, arg_i)
        arg_v = tl.where(take, am, arg_v)
    part = (r * n_chunks + c) * BINS
    tl.store(wsf_ptr + part, best_v)
    tl.store(wsf_ptr + part + 1, arg_v)
    tl.store(wsi_ptr + part, best_i)
    tl.store(wsi_ptr + part + 1, arg_i)
    if _arrive(counter_ptr, r):
        ci = tl.arange(0, NC_PAD)
        cok = ci < n_chunks
        parts = (r * n_chunks + ci) * BINS
        col = tl.where(greedy, 1, 0)
        v = tl.load(wsf_ptr + parts + col, mask=cok, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(wsi_ptr + parts + col, mask=cok, other=0, cache_modifier=".cg")
        vm = tl.max(v, axis=0)
        first = tl.min(tl.where(cok & (v == vm), ci, n_chunks), axis=0)
        tl.store(out_ptr + r, tl.sum(tl.where(ci == first, i, 0), axis=0).to(tl.int64))
        tl.store(counter_ptr + r, 0)


@triton.jit
def _write_kernel(x_ptr, temp_ptr, greedy_ptr, k_ptr, p_ptr, minp_ptr, stf_ptr, sti_ptr, out_ptr, vocab, stride_x,
                  stride_o, CHUNK: tl.constexpr, BLOCK: tl.constexpr, FILTER: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    greedy, temp, k, top_p, select = _row_params(temp_ptr, greedy_ptr, k_ptr, p_ptr, r, vocab)
    m = tl.load(stf_ptr + r * 8 + _M)
    arg = tl.load(sti_ptr + r * 8 + _ARG)
    if FILTER:
        thr, z_keep = _threshold(stf_ptr, sti_ptr, minp_ptr, r, select)
    else:
        thr = 0
        z_keep = tl.load(stf_ptr + r * 8 + _Z)
    row = r * stride_x
    for off in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        z, ok = _load_z(x_ptr, row, cols, vocab, temp)
        e = tl.exp(z - m)
        p = tl.where(e.to(tl.int32, bitcast=True) >= thr, e / z_keep, 0.0)
        p = tl.where(greedy, tl.where(cols == arg, 1.0, 0.0), p)
        tl.store(out_ptr + r * stride_o + cols, p, mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


COUNTER_ROWS = 1 << 16  # rows with shared arrival counters (kernels/counters.py); more rows get their own


def _counters(device: torch.device, rows: int) -> torch.Tensor:
    """One arrival counter per row, zero between passes (each pass leaves them at 0 again): no memset a sample."""
    if rows > COUNTER_ROWS:
        return torch.zeros(rows, dtype=torch.int32, device=device)
    return arrival_counters("sample", device, COUNTER_ROWS)


class _Work:
    """The launches' shared buffers for R rows of V tokens: row state, per-(row, chunk) partials, active flags (set
    by the statistics pass) and the device's arrival counters."""

    def __init__(self, rows: int, vocab: int, device: torch.device, chunk: int):
        self.n_chunks = triton.cdiv(vocab, chunk)
        part = rows * self.n_chunks * BINS
        self.wsi = torch.empty(part, dtype=torch.int32, device=device)
        self.wsf = torch.empty(2 * part, dtype=torch.float32, device=device)  # partials, then the min-p masses
        state = torch.empty((2, rows, 8), dtype=torch.int32, device=device)
        self.sti, self.stf = state[0], state[1].view(torch.float32)
        self.active = torch.empty((rows, self.n_chunks), dtype=torch.int32, device=device)
        self.counter = _counters(device, rows)


pick_chunk = functools.partial(chunk_for_grid, CHUNKS)  # (rows, vocab, target) -> chunk


def _chunk(x: torch.Tensor, chunk: int | None, block: int) -> tuple[int, int]:
    """(chunk, block) for logits x: chunk as given or by pick_chunk (under the interpreter the largest: fewer
    programs), the block no larger than it."""
    if chunk is None:
        chunk = pick_chunk(x.shape[0], x.shape[1], target_programs(x.device, cpu=1))
    return chunk, min(block, chunk)


def _params(temperature, top_k, top_p, min_p, greedy):
    as_bytes = greedy.dtype == torch.bool and greedy.is_contiguous()  # the same bytes: no copy launch
    greedy8 = greedy.view(torch.int8) if as_bytes else greedy.to(torch.int8)
    return (temperature.to(torch.float32).contiguous(), greedy8.contiguous(),
            top_k.to(torch.int64).contiguous(), top_p.to(torch.float32).contiguous(),
            min_p.to(torch.float32).contiguous())


def _descend(x, prm, w: _Work, chunk: int, block: int) -> None:
    """Statistics and the LEVELS levels of the threshold descent: w's row state holds max, normaliser, threshold."""
    rows, vocab = x.shape
    temp, greedy, k, top_p, min_p = prm
    grid = (rows, w.n_chunks)
    nc_pad = max(2, triton.next_power_of_2(w.n_chunks))
    _stats_kernel[grid](x, temp, greedy, k, top_p, w.wsf, w.wsi, w.stf, w.sti, w.active, w.counter, vocab, x.stride(0),
                        w.n_chunks, CHUNK=chunk, BLOCK=block, NC_PAD=nc_pad, BINS=BINS, num_warps=4)
    if min_p is None:
        return
    for level in range(LEVELS):
        _level_kernel[grid](x, temp, greedy, k, top_p, min_p, w.wsf, w.wsi, w.stf, w.sti, w.active, w.counter,
                            vocab, x.stride(0), w.n_chunks, level, CHUNK=chunk, BLOCK=min(block, LEVEL_BLOCK),
                            NC_PAD=nc_pad, BINS=BINS, BITS=BITS, LEVELS=LEVELS, num_warps=8)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  need_filter: bool, salt: int = SALT_SAMPLE, chunk: int | None = None,
                  block: int = BLOCK) -> torch.Tensor:
    """logits [R, V]; per-row temperature, top_k (V where off), top_p, min_p, greedy, seeds, positions [R] ->
    tokens [R] int64, as layers/sampler.py sample (the race's scores in log space: the same winner unless two
    scores tie to float rounding). chunk: tokens per program (None: pick_chunk); block: tokens per step."""
    x = _rows(logits)
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunk, block = _chunk(x, chunk, block)
    prm = _params(temperature, top_k, top_p, min_p, greedy)
    w = _Work(rows, vocab, x.device, chunk)
    if need_filter:
        _descend(x, prm, w, chunk, block)
    temp, greedy8, k, top_p32, min_p32 = prm
    _race_kernel[(rows, w.n_chunks)](
        x, temp, greedy8, k, top_p32, min_p32, seeds.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(), w.stf, w.sti, w.wsf, w.wsi, w.counter, out, vocab, x.stride(0),
        w.n_chunks, CHUNK=chunk, BLOCK=block, NC_PAD=max(2, triton.next_power_of_2(w.n_chunks)), BINS=BINS,
        FILTER=need_filter, SALT=salt, num_warps=4)
    return out


def probs_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, greedy: torch.Tensor, need_filter: bool, chunk: int | None = None,
                 block: int = BLOCK) -> torch.Tensor:
    """logits [R, V] and per-row sampling parameters [R] -> the distribution each row samples from [R, V] float32
    (renormalised after the filter; greedy rows one-hot at the argmax), as layers/sampler.py probs_from_logits."""
    x = _rows(logits)
    rows, vocab = x.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    chunk, block = _chunk(x, chunk, block)
    prm = _params(temperature, top_k, top_p, min_p, greedy)
    w = _Work(rows, vocab, x.device, chunk)
    temp, greedy8, k, top_p32, min_p32 = prm
    _descend(x, prm if need_filter else (temp, greedy8, k, top_p32, None), w, chunk, block)
    _write_kernel[(rows, w.n_chunks)](x, temp, greedy8, k, top_p32, min_p32, w.stf, w.sti, out, vocab, x.stride(0),
                                      out.stride(0), CHUNK=chunk, BLOCK=block, FILTER=need_filter, num_warps=4)
    return out
