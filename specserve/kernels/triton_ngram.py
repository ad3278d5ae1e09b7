"""Triton context-lookup drafting: speculative/ngram.py's choose_drafts(ngram_continuation(...)) as one kernel launch.

One program per row b, with L = last[b] (the last committed index). The candidate pattern starts are j <= L - 2
(the bigram's continuation j + 2 must be committed; the trigram's j + 3 too). The program walks them newest block
first, BLOCK starts at a time, loading hist[j], hist[j+1], hist[j+2] for the block and taking the largest j with

    trigram: hist[j..j+2] == (p2, p1, p0) and j + 3 <= L        bigram: hist[j..j+1] == (p1, p0)

It stops at the first block holding a trigram (older blocks cannot beat it; a bigram found in a newer block is
also already the newest), or at the first bigram when p2 < 0 rules trigrams out, so only the row's committed
prefix is read, and usually only its tail. Pattern tokens < 0 never match. The draft is then
hist[jt + 3] (else hist[jb + 2]) where one was found and head_conf < confidence, else the head's token.
`confidence` is compared after rounding to head_conf's dtype, as torch's `head_conf < confidence` does.

Fixed grid (B,), no host sync: capturable in the draft phases' CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _lookup_drafts_kernel(hist_ptr, last_ptr, p2_ptr, p1_ptr, p0_ptr, head_ptr, conf_ptr, out_ptr, width,
                          stride_h, confidence, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = hist_ptr + b * stride_h
    L = tl.minimum(tl.load(last_ptr + b).to(tl.int64), width - 1)  # indices past the row are never committed
    p2 = tl.load(p2_ptr + b).to(tl.int64)
    p1 = tl.load(p1_ptr + b).to(tl.int64)
    p0 = tl.load(p0_ptr + b).to(tl.int64)
    tri_ok = p2 >= 0
    jt = tl.full([], -1, tl.int64)  # newest trigram start
    jb = tl.full([], -1, tl.int64)  # newest bigram start
    end = tl.where((p1 >= 0) & (p0 >= 0), L - 1, 0)  # starts j < end; a negative p1/p0 matches nothing
    while (end > 0) & (jt < 0) & (tri_ok | (jb < 0)):
        j = end - BLOCK + tl.arange(0, BLOCK)  # [BLOCK] starts, all <= L - 2 (so j + 2 <= L is in the row)
        ok = j >= 0
        h0 = tl.load(row + j, mask=ok, other=-1)
        h1 = tl.load(row + j + 1, mask=ok, other=-1)
        h2 = tl.load(row + j + 2, mask=ok, other=-1)
        big = ok & (h0 == p1) & (h1 == p0)
        tri = ok & tri_ok & (j + 3 <= L) & (h0 == p2) & (h1 == p1) & (h2 == p0)
        jb = tl.maximum(jb, tl.max(tl.where(big, j, -1), axis=0))
        jt = tl.maximum(jt, tl.max(tl.where(tri, j, -1), axis=0))
        end -= BLOCK
    found = (jt >= 0) | (jb >= 0)
    cont = tl.load(row + tl.where(jt >= 0, jt + 3, jb + 2), mask=found, other=-1).to(tl.int64)
    head = tl.load(head_ptr + b).to(tl.int64)
    conf = tl.load(conf_ptr + b).to(tl.float32)
    tl.store(out_ptr + b, tl.where((cont >= 0) & (conf < confidence), cont, head))


def lookup_drafts_triton(hist: torch.Tensor, last: torch.Tensor, p2: torch.Tensor, p1: torch.Tensor,
                         p0: torch.Tensor, head_tokens: torch.Tensor, head_conf: torch.Tensor,
                         confidence: float) -> torch.Tensor:
    """hist [B, W] int token history; last, p2, p1, p0, head_tokens [B] int; head_conf [B] float32/16/bf16
    -> [B] int64 drafts, as speculative/ngram.py choose_drafts(head_tokens, head_conf, ngram_continuation(hist, last,
    p2, p1, p0), confidence)."""
    bs, width = hist.shape
    out = torch.empty(bs, dtype=torch.int64, device=hist.device)  # [B]
    if bs == 0:
        return out
    assert head_conf.dtype in (torch.float32, torch.float16, torch.bfloat16), head_conf.dtype
    if hist.stride(-1) != 1:
        hist = hist.contiguous()
    last, p2, p1, p0, head_tokens, head_conf = (t.contiguous() for t in (last, p2, p1, p0, head_tokens, head_conf))
    threshold = float(torch.tensor(confidence, dtype=head_conf.dtype))  # CPU rounding, no device sync
    _lookup_drafts_kernel[(bs,)](hist, last, p2, p1, p0, head_tokens, head_conf, out, width, hist.stride(0),
                                 threshold, BLOCK=_BLOCK, num_warps=4)
    return out
