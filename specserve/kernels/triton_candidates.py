"""A sampled draft drawn from the draft head's K candidates in one launch (oracle: speculative/draft_state.py
candidate_probs, then layers/sampler.py sample_from_probs with SALT_DRAFT).

Per row (one program, the K candidates' logits in descending order): softmax at the row's temperature; the row's
top-k, top-p and min-p among the candidates by the sampler's rule (layers/sampler.py filter_sorted: equal
probabilities share one fate, judged by the tokens strictly more likely, counted and summed over a [K, K]
comparison instead of a cumulative sum over the sorted order; the first candidate always survives); renormalised
(one-hot at the first candidate for greedy rows); then the exponential race argmax(q / -log u) with the counter-based
noise of kernels/noise.py, bit for bit the reference's uniforms. Replaces ~50 small launches a draft step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.noise import SALT_DRAFT
from specserve.kernels.triton_accept import _key, _uniform


@triton.jit
def _candidates_kernel(vals_ptr, ids_ptr, temp_ptr, greedy_ptr, topk_ptr, topp_ptr, minp_ptr, seeds_ptr, pos_ptr,
                       q_ptr, tok_ptr, idx_ptr, k, stride_v, stride_i, stride_q,
                       BLOCK_K: tl.constexpr, SALT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_K)
    ok = c < k
    greedy = tl.load(greedy_ptr + r) != 0
    temp = tl.where(greedy, 1.0, tl.load(temp_ptr + r))
    z = tl.load(vals_ptr + r * stride_v + c, mask=ok, other=float("-inf")).to(tl.float32) / temp
    e = tl.where(ok, tl.exp(z - tl.max(z, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)  # [BLOCK_K] softmax, descending as the logits
    p_max = tl.max(p, axis=0)
    # the tokens strictly more likely than each: their count (the rank of its tie group) and mass
    gt = (p[None, :] > p[:, None]) & ok[None, :]  # [i, j]: candidate j more likely than candidate i
    first = tl.sum(gt.to(tl.int32), axis=1)
    above = tl.sum(tl.where(gt, p[None, :], 0.0), axis=1)
    top_k = tl.load(topk_ptr + r)
    top_p = tl.load(topp_ptr + r)
    min_p = tl.load(minp_ptr + r)
    by_p = tl.where(top_p < 1.0, (above > top_p).to(tl.int32), 0) != 0  # top_p 1 keeps all
    drop = (first.to(tl.int64) >= top_k) | by_p | (p < min_p * p_max)
    drop = (drop & (c > 0)) | (c >= k)  # the most likely always survives
    kept = tl.where(drop, 0.0, p)
    q = kept / tl.sum(kept, axis=0)
    q = tl.where(greedy, tl.where(c == 0, 1.0, 0.0), q)
    key = _key(tl.load(seeds_ptr + r), tl.load(pos_ptr + r), SALT)
    u = _uniform(key + c.to(tl.uint64) * 0x9E3779B97F4A7C15)
    score = tl.where(ok, q / -tl.log(u), float("-inf"))
    idx = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(q_ptr + r * stride_q + c, q, mask=ok)
    tl.store(idx_ptr + r, idx.to(tl.int64))
    tl.store(tok_ptr + r, tl.load(ids_ptr + r * stride_i + idx))


def sample_candidates_triton(vals: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                             top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                             positions: torch.Tensor, salt: int = SALT_DRAFT
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vals [B, K] the head's candidate logits (descending), ids [B, K] their token ids, per-row sampling parameters,
    seeds and positions [B] -> (tokens [B] int64, q [B, K] float32 the distribution drawn from, index [B] int64 of
    the drawn candidate). Capturable."""
    b, k = vals.shape
    assert ids.shape == (b, k) and k > 0
    dev = vals.device
    q = torch.empty((b, k), dtype=torch.float32, device=dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    index = torch.empty(b, dtype=torch.int64, device=dev)
    if b == 0:
        return tokens, q, index
    vals = vals if vals.stride(-1) == 1 else vals.contiguous()
    ids = ids.to(torch.int64)
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
    _candidates_kernel[(b,)](vals, ids, f32(temperature), greedy.to(torch.int8).contiguous(), i64(top_k), f32(top_p),
                             f32(min_p), i64(seeds), i64(positions), q, tokens, index, k, vals.stride(0),
                             ids.stride(0), q.stride(0), BLOCK_K=max(2, triton.next_power_of_2(k)), SALT=salt,
                             num_warps=1 if k <= 64 else 4)
    return tokens, q, index
