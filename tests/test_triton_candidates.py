"""Sampled drafts on the Triton kernels against the torch references (kernels/triton_candidates.py vs
speculative/draft_state.py candidate_probs + sample_from_probs; kernels/triton_accept.py accept_sampling_q_triton vs
speculative/accept.py accept_sampling_q): the same distributions, drawn tokens, accept lengths and verified tokens
for the same counter-based noise; greedy rows, top-k / top-p / min-p alone and together, ties among the candidates
(bfloat16-rounded logits), duplicate candidate ids, one-hot (deterministic) drafts, rejections at every depth and
the bonus draw; a vocabulary spanning several column blocks. On CPU under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels.noise import SALT_DRAFT  # noqa: E402
from specserve.kernels.triton_accept import accept_sampling_q_triton, accept_sampling_triton  # noqa: E402
from specserve.kernels.triton_candidates import sample_candidates_triton  # noqa: E402
from specserve.layers.sampler import SamplingBatch, sample_from_probs  # noqa: E402
from specserve.speculative.accept import accept_sampling_q, one_hot_dist  # noqa: E402
from specserve.speculative.draft_state import candidate_probs  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 5000


def _batch(rows: list[tuple[float, int, float, float]]) -> SamplingBatch:
    """rows: (temperature (0: greedy), top_k (VOCAB: off), top_p, min_p)."""
    t = lambda i, dt=torch.float32: torch.tensor([r[i] for r in rows], dtype=dt, device=DEV)  # noqa: E731
    greedy = t(0) == 0
    return SamplingBatch(t(0), t(2), t(1, torch.int64), t(3), torch.arange(len(rows), device=DEV) * 7919 - 3,
                         greedy, all_greedy=False, need_filter=True)


ROWS = [(0.0, VOCAB, 1.0, 0.0), (0.7, VOCAB, 0.95, 0.0), (1.0, 5, 1.0, 0.0), (0.8, VOCAB, 1.0, 0.1),
        (1.3, 12, 0.8, 0.02), (0.6, 1, 1.0, 0.0), (1.0, VOCAB, 1.0, 0.0), (0.9, 3, 0.5, 0.0)]


@pytest.mark.parametrize("k", [32, 7])
def test_candidates_match_reference(k):
    g = torch.Generator().manual_seed(k)
    sb = _batch(ROWS)
    b = len(ROWS)
    vals = (torch.randn((b, k), generator=g) * 3).to(torch.bfloat16).float()  # bf16: ties among the candidates
    vals[2, 3:6] = vals[2, 2]  # a tie group straddling top-k 5
    vals = vals.sort(dim=-1, descending=True).values.to(DEV)
    ids = torch.randint(0, VOCAB, (b, k), generator=g).to(DEV)
    positions = torch.randint(0, 4000, (b,), generator=g).to(DEV)
    want_q = candidate_probs(vals, sb)
    want_idx = sample_from_probs(want_q, sb.seeds, positions, SALT_DRAFT)
    tokens, q, idx = sample_candidates_triton(vals, ids, sb.temperature, sb.greedy, sb.top_k, sb.top_p, sb.min_p,
                                              sb.seeds, positions)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-5)
    assert torch.equal((q > 0), (want_q > 0))  # the same candidates kept
    assert torch.equal(idx, want_idx)
    assert torch.equal(tokens, ids.gather(1, want_idx[:, None]).squeeze(1))
    # greedy, top-k 1: one candidate with all the mass (a GPU's fast division may leave 1 - 1 ulp)
    assert abs(q[0, 0].item() - 1.0) < 1e-6 and abs(q[5, 0].item() - 1.0) < 1e-6 and (q[5, 1:] == 0).all()


def _q_dists(g, bs: int, n: int, k: int, probs: torch.Tensor, drafts: torch.Tensor):
    """Candidate distributions around each draft: its id among k - 1 others (some repeated), random weights; row 0
    one-hot (a deterministic draft)."""
    ids = torch.randint(0, probs.shape[-1], (bs, n, k), generator=g)
    ids[..., 1] = ids[..., 2]  # a duplicate id: its weights add up
    ids[..., 0] = drafts
    w = torch.rand((bs, n, k), generator=g) ** 3
    w = w / w.sum(dim=-1, keepdim=True)
    oh_ids, oh_probs = one_hot_dist(drafts[0], k)
    ids[0], w[0] = oh_ids, oh_probs
    return ids, w


@pytest.mark.parametrize("bs,n,vocab,k", [(8, 3, 3001, 32), (5, 1, 100, 4), (6, 4, 700, 16)])
def test_accept_q_matches_reference(bs, n, vocab, k):
    g = torch.Generator().manual_seed(bs * 100 + vocab + k)
    logits = torch.randn(bs, n + 1, vocab, generator=g) * 3
    probs = torch.softmax(logits, dim=-1)
    keep = logits >= logits.topk(min(40, vocab), dim=-1).values[..., -1:]  # filtered: exact zeros
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    drafts = torch.multinomial(probs[:, :n].reshape(-1, vocab), 1, generator=g).view(bs, n)
    drafts[1, 0] = (probs[1, 0] == 0).nonzero()[0, 0]  # a draft the target gives no mass: rejected at once
    ids, w = _q_dists(g, bs, n, k, probs, drafts)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (bs,), generator=g)
    base = torch.randint(0, 5000, (bs,), generator=g)
    args = [t.to(DEV) for t in (drafts, probs, ids, w, seeds, base)]
    want = accept_sampling_q(*args)
    got = accept_sampling_q_triton(*args)
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    assert want[0][1].item() == 0
    if bs >= 6:
        assert len(set(want[0].tolist())) >= 2  # rejections at more than one depth


def test_accept_q_with_one_hot_drafts_is_the_one_hot_kernel():
    g = torch.Generator().manual_seed(5)
    bs, n, vocab = 10, 3, 600
    probs = torch.softmax(torch.randn(bs, n + 1, vocab, generator=g) * 12, dim=-1)
    drafts = probs[:, :n].argmax(-1)
    drafts[::3, 1] = torch.randint(0, vocab, (len(range(0, bs, 3)),), generator=g)
    ids, w = one_hot_dist(drafts, 8)
    seeds = torch.arange(bs, dtype=torch.int64) * 31 + 1
    base = torch.randint(0, 100, (bs,), generator=g)
    d, p, i, q, s, b0 = (t.to(DEV) for t in (drafts, probs, ids, w, seeds, base))
    got = accept_sampling_q_triton(d, p, i, q, s, b0)
    want = accept_sampling_triton(d, p, s, b0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert n in set(want[0].tolist())  # some rows accept everything: the bonus path
