"""The top-1 of each row of logits, split over the vocabulary: the argmax (first index on ties, as torch) and, on
request, the softmax probability at it and the index mapped through a vocabulary table (a reduced draft
vocabulary). Reference: kernels/reference.py `row_top1`.

One program streaming a whole row is slow at small batch: the verify argmax over a vocabulary-wide row at batch 1
is a long serial walk on one SM (torch's argmax too), and the draft head's (max, exp, sum, reciprocal, gather)
costs about as much again per draft token (scripts/gpu/profile_spec_step.py). Here a row is cut into chunks of
CHUNK columns: one program per (row, chunk) keeps (max, first argmax, sum of exp(x - max)), and one program per row
merges its chunks, so any row count fills the GPU and a draft token costs two short kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 2048


@triton.jit
def _chunk_kernel(x_ptr, pmax_ptr, pidx_ptr, psum_ptr, vocab, stride_row, num_chunks, CHUNK: tl.constexpr,
                  WITH_SUM: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + r * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    o = r * num_chunks + c
    tl.store(pmax_ptr + o, m)
    tl.store(pidx_ptr + o, c * CHUNK + tl.argmax(x, axis=0, tie_break_left=True))
    if WITH_SUM:
        # a chunk of -inf only adds nothing (and no NaN from -inf - -inf)
        tl.store(psum_ptr + o, tl.where(m > float("-inf"), tl.sum(tl.exp(x - m), axis=0), 0.0))


@triton.jit
def _merge_kernel(pmax_ptr, pidx_ptr, psum_ptr, map_ptr, idx_ptr, prob_ptr, num_chunks, BLOCK_C: tl.constexpr,
                  WITH_SUM: tl.constexpr, HAS_MAP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    pm = tl.load(pmax_ptr + r * num_chunks + c, mask=ok, other=float("-inf"))
    pi = tl.load(pidx_ptr + r * num_chunks + c, mask=ok, other=0)
    m = tl.max(pm, axis=0)
    # the first chunk holding the row's max (chunks are in column order, each chunk's index is its first max)
    first = tl.min(tl.where(ok & (pm == m), c, BLOCK_C), axis=0)
    idx = tl.sum(tl.where(c == first, pi, 0), axis=0).to(tl.int64)
    if HAS_MAP:
        idx = tl.load(map_ptr + idx)
    tl.store(idx_ptr + r, idx)
    if WITH_SUM:
        ps = tl.load(psum_ptr + r * num_chunks + c, mask=ok, other=0.0)
        total = tl.sum(tl.where(ok & (pm > float("-inf")), ps * tl.exp(pm - m), 0.0), axis=0)
        tl.store(prob_ptr + r, 1.0 / total)


def row_top1_triton(x: torch.Tensor, vocab_map: torch.Tensor | None = None, with_prob: bool = False,
                    out_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, V] (unit column stride) -> (argmax [R] int64, mapped through vocab_map [V] when given;
    softmax probability at it [R] float32, or None). out_idx: an [R] int64 buffer to write the indices to."""
    rows, vocab = x.shape
    assert x.stride(-1) == 1
    dev = x.device
    idx = out_idx if out_idx is not None else torch.empty(rows, dtype=torch.int64, device=dev)
    prob = torch.empty(rows, dtype=torch.float32, device=dev) if with_prob else None
    if rows == 0:
        return idx, prob
    chunk = min(_CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    pmax = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    pidx = torch.empty((rows, num_chunks), dtype=torch.int32, device=dev)
    psum = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev) if with_prob else pmax
    _chunk_kernel[(rows, num_chunks)](x, pmax, pidx, psum, vocab, x.stride(0), num_chunks, CHUNK=chunk,
                                      WITH_SUM=with_prob, num_warps=4)
    if vocab_map is not None:
        vocab_map = vocab_map.to(torch.int64).contiguous()
    _merge_kernel[(rows,)](pmax, pidx, psum, vocab_map if vocab_map is not None else idx, idx,
                           prob if with_prob else pmax, num_chunks,
                           BLOCK_C=max(2, triton.next_power_of_2(num_chunks)), WITH_SUM=with_prob,
                           HAS_MAP=vocab_map is not None, num_warps=1)
    return idx, prob
