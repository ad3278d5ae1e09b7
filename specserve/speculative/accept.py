"""Verification: which drafts the target accepts, and the token that follows them (torch reference).

Drafts chosen deterministically (the head's argmax, a context-lookup continuation) have a one-hot draft distribution
(docs/architecture.md): accept draft d at a position with probability p(d); on the first rejection draw from p with d
removed and renormalised; if all N are accepted draw a bonus token from the last position's p. The output tokens are
then distributed exactly as plain sampling from p. Greedy rows use one-hot p, which reduces to "accept while draft ==
argmax".

Drafts sampled from the draft's own distribution q (`--speculative-draft-sampling sample`) use the standard rule
(`accept_sampling_q`): accept d with probability min(1, p(d) / q(d)), on the first rejection draw from
max(0, p - q) renormalised. A one-hot q gives exactly the rule above, token for token.
"""

from __future__ import annotations

import torch

from specserve.kernels.availability import triton_kernels
from specserve.kernels.noise import SALT_ACCEPT, uniform_noise
from specserve.layers.sampler import sample_from_probs


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [bs, N]; target_logits [bs, N+1, V] -> (accept_len [bs] in 0..N, verified [bs, N+1]).

    verified[:, j] is the token at sequence index S + j + 1 for j <= accept_len (the accepted drafts, then the
    target's own token)."""
    pred = target_logits.argmax(dim=-1)  # [bs, N+1]
    n = drafts.shape[1]
    match = (drafts == pred[:, :n]).to(torch.int64)
    accept_len = match.cumprod(dim=1).sum(dim=1)
    return accept_len, pred


def accept_sampling(drafts: torch.Tensor, probs: torch.Tensor, seeds: torch.Tensor,
                    base_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. drafts [bs, N]; probs [bs, N+1, V] (already temperature/top-k/top-p/min-p filtered);
    seeds [bs]; base_index [bs] = S, the sequence index of the first verified input token.

    Returns (accept_len [bs], verified [bs, N+1]) as accept_greedy does: accept_sampling_q with one-hot drafts."""
    return accept_sampling_q(drafts, probs, *one_hot_dist(drafts, 1), seeds, base_index)


def accept_sampling_q(drafts: torch.Tensor, probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                      seeds: torch.Tensor, base_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling with the draft distributions. drafts [bs, N]; probs [bs, N+1, V] (the target's, filtered);
    q_ids, q_probs [bs, N, K]: the distribution each draft was drawn from, as K candidate tokens and their
    probabilities (zero elsewhere; one_hot_dist for deterministic drafts); seeds [bs]; base_index [bs] = S.
    Returns (accept_len [bs], verified [bs, N+1]) as accept_sampling does, with the same noise: for one-hot
    distributions the two give the same tokens. Fixed-shape device ops only (graph-safe)."""
    bs, n = drafts.shape
    ar = torch.arange(bs, device=drafts.device)
    j = torch.arange(n, device=drafts.device)
    p_draft = probs[:, :n].gather(-1, drafts[..., None]).squeeze(-1)  # [bs, N]
    q_draft = (q_probs * (q_ids == drafts[..., None])).sum(dim=-1)  # [bs, N]
    u = uniform_noise(seeds[:, None].expand(bs, n), base_index[:, None] + j[None, :] + 1, SALT_ACCEPT, None)
    accepted = (u * q_draft < p_draft).to(torch.int64)  # u < p/q without the division
    accept_len = accepted.cumprod(dim=1).sum(dim=1)  # [bs]
    pk = probs[ar, accept_len]  # [bs, V] distribution at the first rejected (or bonus) position
    jk = accept_len.clamp(max=n - 1)
    qk = torch.zeros_like(pk).scatter_add_(1, q_ids[ar, jk], q_probs[ar, jk])  # [bs, V] the rejected draft's q
    rejected = (accept_len < n)[:, None]
    residual = torch.where(rejected, (pk - qk).clamp_min(0.0), pk)
    total = residual.sum(dim=-1, keepdim=True)
    # A rejection implies p(d) < q(d), so p - q has positive mass somewhere; the guard only absorbs rounding.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), pk)
    new_tok = sample_from_probs(residual, seeds, base_index + accept_len + 1)
    verified = torch.cat((drafts, torch.zeros_like(drafts[:, :1])), dim=1)  # [bs, N+1]
    verified[ar, accept_len] = new_tok
    return accept_len, verified


def one_hot_dist(tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft distribution of deterministic drafts tokens [...] as K candidates: (ids [..., K] = the token,
    probs [..., K] = 1, 0, ..., 0)."""
    ids = tokens[..., None].expand(*tokens.shape, k).contiguous()
    probs = torch.zeros(ids.shape, dtype=torch.float32, device=tokens.device)
    probs[..., 0] = 1.0
    return ids, probs


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_greedy on the device: the Triton kernel for CUDA tensors, the reference above otherwise."""
    if drafts.is_cuda and (tk := triton_kernels()) is not None:
        return tk.accept_greedy_triton(drafts, target_logits)
    return accept_greedy(drafts, target_logits)


def verify_sampling_q(drafts: torch.Tensor, probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                      seeds: torch.Tensor, base_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_sampling_q with the same dispatch as verify_greedy (the Triton kernels on CUDA)."""
    if drafts.is_cuda and (tk := triton_kernels()) is not None:
        return tk.accept_sampling_q_triton(drafts, probs, q_ids, q_probs, seeds, base_index)
    return accept_sampling_q(drafts, probs, q_ids, q_probs, seeds, base_index)


def verify_sampling(drafts: torch.Tensor, probs: torch.Tensor, seeds: torch.Tensor,
                    base_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_sampling with the same dispatch as verify_greedy."""
    if drafts.is_cuda and (tk := triton_kernels()) is not None:
        return tk.accept_sampling_triton(drafts, probs, seeds, base_index)
    return accept_sampling(drafts, probs, seeds, base_index)
