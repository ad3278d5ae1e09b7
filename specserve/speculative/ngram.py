"""Context lookup for drafting (`--speculative-ngram-lookup`): an n-gram continuation found in the request's own
tokens can replace the head's draft token.

A one-layer MTP head sees the target's last hidden state, which carries little of the current token, so it copies
poorly from the context: on text that repeats its context (summaries, code edits) the continuation of the last
earlier occurrence of the current n-gram matches the target far more often than the head's own first draft. So
each draft token is chosen as:

    the continuation of the newest earlier occurrence of the last three tokens (else of the last two), when one
    exists in the committed context and the head's own top probability is below --speculative-ngram-confidence;
    otherwise the head's greedy token.

Drafts stay deterministic, so verification (greedy or rejection sampling with a one-hot draft) stays exact: the
output is unchanged, only the accept length moves. Everything is fixed-shape tensor work over a per-row token
history, so it runs inside the draft phases' CUDA graphs; on CUDA, lookup_drafts does the search and the choice
in one Triton kernel (kernels/triton_ngram.py), the functions below being its reference.
"""

from __future__ import annotations

import torch

from specserve.kernels.availability import triton_kernels


def ngram_continuation(hist: torch.Tensor, last: torch.Tensor, p2: torch.Tensor, p1: torch.Tensor,
                       p0: torch.Tensor) -> torch.Tensor:
    """The token after the newest occurrence of (p2, p1, p0) in hist[b, :last+1], else after the newest occurrence
    of (p1, p0), else -1. The continuation must itself be committed (index <= last), which also keeps a pattern
    that ends at `last` from matching itself.

    hist [B, L] int64 token history; last [B] index of the last committed token; p2, p1, p0 [B] the pattern, p0
    the newest (tokens < 0 never match) -> [B] int64."""
    b, n = hist.shape
    idx = torch.arange(n, device=hist.device)
    eq0, eq1, eq2 = (hist == p[:, None] for p in (p0, p1, p2))  # [B, L] each
    lim = last[:, None]
    # bigram at j: hist[j] = p1, hist[j+1] = p0, continuation hist[j+2]
    big = eq1[:, :-2] & eq0[:, 1:-1] & ((idx[:-2] + 2) <= lim)  # [B, L-2]
    jb = torch.where(big, idx[:-2], -1).amax(dim=1)  # [B]
    # trigram at j: hist[j] = p2, hist[j+1] = p1, hist[j+2] = p0, continuation hist[j+3]
    tri = eq2[:, :-3] & eq1[:, 1:-2] & eq0[:, 2:-1] & ((idx[:-3] + 3) <= lim)  # [B, L-3]
    jt = torch.where(tri, idx[:-3], -1).amax(dim=1)
    cont_b = hist.gather(1, (jb + 2).clamp(min=0, max=n - 1)[:, None]).squeeze(1)
    cont_t = hist.gather(1, (jt + 3).clamp(min=0, max=n - 1)[:, None]).squeeze(1)
    return torch.where(jt >= 0, cont_t, torch.where(jb >= 0, cont_b, -1))


def history_tail(hist: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hist[last-2], hist[last-1], hist[last]) per row, -1 where the index is negative. hist [B, L], last [B]."""
    out = []
    for k in (2, 1, 0):
        i = last - k
        tok = hist.gather(1, i.clamp(min=0)[:, None]).squeeze(1)
        out.append(torch.where(i >= 0, tok, -1))
    return out[0], out[1], out[2]


def choose_drafts(head_tokens: torch.Tensor, head_conf: torch.Tensor, cont: torch.Tensor,
                  confidence: float) -> torch.Tensor:
    """The continuation where one exists and the head is less sure than `confidence`, else the head's token."""
    return torch.where((cont >= 0) & (head_conf < confidence), cont, head_tokens)


def lookup_drafts(hist: torch.Tensor, last: torch.Tensor, p2: torch.Tensor, p1: torch.Tensor, p0: torch.Tensor,
                  head_tokens: torch.Tensor, head_conf: torch.Tensor, confidence: float) -> torch.Tensor:
    """choose_drafts(head_tokens, head_conf, ngram_continuation(hist, last, p2, p1, p0), confidence): one Triton
    kernel for CUDA tensors (kernels/triton_ngram.py), these references otherwise. Shapes as there -> [B] int64."""
    if hist.is_cuda and (tk := triton_kernels()) is not None:
        return tk.lookup_drafts_triton(hist, last, p2, p1, p0, head_tokens, head_conf, confidence)
    return choose_drafts(head_tokens, head_conf, ngram_continuation(hist, last, p2, p1, p0), confidence)
