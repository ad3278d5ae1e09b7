"""Triton accept kernels against speculative/accept.py: identical accept lengths and verified tokens for the same inputs
(same counter-based noise), including argmax ties, filtered (zero-probability) tokens, one-hot greedy rows and
vocabularies that span several blocks. Outputs are poisoned before each run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels.noise import SALT_ACCEPT, SALT_SAMPLE, uniform_noise  # noqa: E402
from specserve.kernels.triton_accept import accept_greedy_triton, accept_sampling_triton  # noqa: E402
from specserve.speculative.accept import accept_greedy, accept_sampling  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _poisoned_out(bs: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((bs,), -7, dtype=torch.int64, device=DEV),
            torch.full((bs, n + 1), -7, dtype=torch.int64, device=DEV))


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1]), (got[1], want[1])


@pytest.mark.parametrize("bs,n,vocab", [(1, 1, 50), (5, 3, 3001), (4, 4, 257)])
def test_accept_greedy_matches_reference(bs, n, vocab):
    g = torch.Generator().manual_seed(bs * 31 + n)
    # coarse logits so that ties happen: the first maximal index must win, as in torch.argmax
    logits = torch.randint(0, 6, (bs, n + 1, vocab), generator=g).float()
    logits[0, 0, vocab - 1] = 9.0  # a maximum in the last (partial) block
    if vocab > 2048:
        logits[-1, 0, 10] = logits[-1, 0, 2100] = 20.0  # tie across blocks: the earlier block keeps it
    pred = logits.argmax(dim=-1)
    drafts = pred[:, :n].clone()
    # break the drafts at different depths: row b keeps its first (b mod (n + 1)) drafts
    for b in range(bs):
        k = b % (n + 1)
        if k < n:
            drafts[b, k] = (drafts[b, k] + 1) % vocab
    logits, drafts = logits.to(DEV), drafts.to(DEV)
    want = accept_greedy(drafts, logits)
    got = accept_greedy_triton(drafts, logits, out=_poisoned_out(bs, n))
    _assert_same(got, want)
    assert sorted(set(want[0].tolist())) == sorted({b % (n + 1) for b in range(bs)})  # the case mix is covered


def _probs(g: torch.Generator, bs: int, n: int, vocab: int, sharp: float) -> torch.Tensor:
    logits = torch.randn(bs, n + 1, vocab, generator=g) * sharp
    probs = torch.softmax(logits, dim=-1)
    # top-k style filtering: most of the vocabulary has exactly zero mass, then renormalise
    keep = logits >= logits.topk(min(40, vocab), dim=-1).values[..., -1:]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("bs,n,vocab,sharp", [(6, 3, 3001, 3.0), (3, 1, 100, 1.0), (4, 4, 700, 6.0)])
def test_accept_sampling_matches_reference(bs, n, vocab, sharp):
    g = torch.Generator().manual_seed(bs * 1000 + vocab)
    probs = _probs(g, bs, n, vocab, sharp)
    # drafts drawn from the target itself, so acceptances happen at all depths
    drafts = torch.multinomial(probs[:, :n].reshape(-1, vocab), 1, generator=g).view(bs, n)
    probs[0] = torch.nn.functional.one_hot(probs[0].argmax(-1), vocab).float()  # a greedy row
    drafts[0] = probs[0, :n].argmax(-1)
    drafts[0, n - 1] = (drafts[0, n - 1] + 1) % vocab  # rejected at the last draft
    seeds = torch.randint(-2 ** 62, 2 ** 62, (bs,), generator=g)
    base = torch.randint(0, 5000, (bs,), generator=g)
    probs, drafts, seeds, base = probs.to(DEV), drafts.to(DEV), seeds.to(DEV), base.to(DEV)
    want = accept_sampling(drafts, probs, seeds, base)
    got = accept_sampling_triton(drafts, probs, seeds, base, out=_poisoned_out(bs, n))
    _assert_same(got, want)
    assert got[0][0].item() == n - 1


def test_accept_sampling_covers_accept_and_bonus_paths():
    """Enough random rows that full acceptance (bonus draw) and early rejection both occur; all must match."""
    g = torch.Generator().manual_seed(99)
    bs, n, vocab = 24, 2, 64
    probs = _probs(g, bs, n, vocab, 4.0)
    drafts = probs[:, :n].argmax(-1)  # likely drafts: high acceptance
    drafts[::3, 0] = torch.randint(0, vocab, (len(range(0, bs, 3)),), generator=g)
    seeds = torch.arange(bs, dtype=torch.int64) * 7919 - 50
    base = torch.randint(0, 100, (bs,), generator=g)
    probs, drafts, seeds, base = probs.to(DEV), drafts.to(DEV), seeds.to(DEV), base.to(DEV)
    want = accept_sampling(drafts, probs, seeds, base)
    got = accept_sampling_triton(drafts, probs, seeds, base, out=_poisoned_out(bs, n))
    _assert_same(got, want)
    lens = set(want[0].tolist())
    assert n in lens and 0 in lens


def test_accept_sampling_noise_is_the_samplers():
    """The accept test compares p(d) with the sampler's SALT_ACCEPT uniform: p(d) just above u accepts, just below
    rejects - so the kernel must reproduce the noise bit for bit."""
    bs, n, vocab = 8, 1, 16
    seeds = torch.arange(bs, dtype=torch.int64) * 104729 + 3
    base = torch.arange(bs, dtype=torch.int64) * 11
    u = uniform_noise(seeds, base + 1, SALT_ACCEPT, None)  # [bs] the accept uniforms at j = 0
    drafts = torch.zeros((bs, n), dtype=torch.int64)
    probs = torch.full((bs, n + 1, vocab), 0.0)
    above = torch.arange(bs) % 2 == 0
    p_d = torch.where(above, torch.nextafter(u, torch.ones_like(u)), u)  # u < p accepts; u == p rejects
    probs[:, 0, 0] = p_d
    probs[:, 0, 1:] = ((1 - p_d) / (vocab - 1))[:, None]
    probs[:, 1] = 1.0 / vocab
    args = [t.to(DEV) for t in (drafts, probs, seeds, base)]
    want = accept_sampling(*args)
    got = accept_sampling_triton(*args, out=_poisoned_out(bs, n))
    _assert_same(got, want)
    assert want[0].tolist() == above.long().tolist()
    assert SALT_SAMPLE != SALT_ACCEPT


def test_noise_is_strictly_inside_the_unit_interval():
    """The largest hash value maps below 1 (a u of exactly 1 made the exponential race divide by -log(1) = 0)."""
    import torch as _t

    from specserve.kernels import noise

    extremes = _t.tensor([-1, 0, (1 << 63) - 1], dtype=_t.int64)  # all bits set, none, all but the top one
    u = noise.to_unit(extremes)
    assert _t.all(u < 1.0) and _t.all(u > 0.0), u
    x = uniform_noise(_t.arange(64), _t.arange(64), SALT_SAMPLE, 4096)
    assert float(x.max()) < 1.0 and float(x.min()) > 0.0


def test_accept_sampling_one_request_over_many_chunks():
    """One request spreads its vocabulary row over many programs (kernels/triton_accept.py pick_residual_chunk: the
    smallest chunk at one row): the chunks' totals and races must combine to the reference's token, whether the
    winner falls in the first, a middle or the last chunk; several seeds."""
    from specserve.kernels.launch import target_programs
    from specserve.kernels.triton_accept import pick_residual_chunk

    bs, n, vocab = 1, 3, 3001
    assert vocab // pick_residual_chunk(bs, vocab, target_programs(DEV, cpu=8)) >= 4 or DEV.type == "cuda"
    g = torch.Generator().manual_seed(5)
    seen = set()
    for trial in range(12):
        probs = _probs(g, bs, n, vocab, 2.0)
        drafts = torch.randint(0, vocab, (bs, n), generator=g)  # mostly rejected at once: the residual's race
        seeds = torch.tensor([trial * 7717 - 3], dtype=torch.int64)
        base = torch.tensor([trial * 13], dtype=torch.int64)
        args = [t.to(DEV) for t in (drafts, probs, seeds, base)]
        want = accept_sampling(*args)
        _assert_same(accept_sampling_triton(*args, out=_poisoned_out(bs, n)), want)
        seen.add(int(want[1][0, int(want[0][0])]) * 4 // vocab)  # the winner's quarter of the vocabulary
    assert len(seen) >= 3
