"""Context lookup drafting (`--speculative-ngram-lookup`): the n-gram search against a plain-Python reference, and
the engine with it on: greedy speculative output still equals plain output (N 1..5, page sizes 1/16, static replay
and eager, under retraction), drafts are identical with and without graphs, and on text that repeats itself it
accepts more than the head alone."""

import random

import pytest
import torch
from spec_fixtures import build_scheduler, run_greedy

from specserve.speculative.ngram import choose_drafts, history_tail, lookup_drafts, ngram_continuation


def _ref_continuation(hist, last, p2, p1, p0):
    for n, pat in ((3, [p2, p1, p0]), (2, [p1, p0])):
        if any(t < 0 for t in pat):
            continue
        for j in range(last - n, -1, -1):  # the continuation index j + n must be <= last
            if hist[j:j + n] == pat:
                return hist[j + n]
    return -1


def test_ngram_continuation_matches_reference():
    rng = random.Random(0)
    for vocab in (2, 3, 5):
        rows, width = 64, 40
        hist = [[rng.randrange(vocab) for _ in range(width)] for _ in range(rows)]
        last = [rng.randrange(-1, width) for _ in range(rows)]
        pats = [[rng.choice([-1] + list(range(vocab))) if rng.random() < 0.1 else rng.randrange(vocab)
                 for _ in range(3)] for _ in range(rows)]
        got = ngram_continuation(torch.tensor(hist), torch.tensor(last), *(torch.tensor(c) for c in zip(*pats)))
        want = [_ref_continuation(h, lst, *p) for h, lst, p in zip(hist, last, pats)]
        assert got.tolist() == want
        assert sum(w >= 0 for w in want) > rows // 4  # the case matters: many rows do find a continuation
        tail = history_tail(torch.tensor(hist), torch.tensor(last))
        for b in range(rows):
            assert [int(t[b]) for t in tail] == [hist[b][i] if i >= 0 else -1 for i in
                                                 (last[b] - 2, last[b] - 1, last[b])]
    # the newest occurrence wins; a trigram beats a newer bigram
    h = torch.tensor([[7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 0]])
    assert ngram_continuation(h, torch.tensor([11]), *(torch.tensor([x]) for x in (7, 1, 2))).item() == 3
    assert ngram_continuation(h, torch.tensor([11]), *(torch.tensor([x]) for x in (5, 1, 2))).item() == 0
    assert ngram_continuation(h, torch.tensor([9]), *(torch.tensor([x]) for x in (5, 1, 2))).item() == 4
    heads, conf, cont = torch.tensor([5, 5, 5]), torch.tensor([0.2, 0.9, 0.2]), torch.tensor([6, 6, -1])
    assert choose_drafts(heads, conf, cont, 0.5).tolist() == [6, 5, 5]


def test_lookup_drafts_on_cpu_is_the_reference():
    """lookup_drafts (the engine's entry; Triton on CUDA) is choose_drafts(ngram_continuation(...)) on CPU."""
    g = torch.Generator().manual_seed(3)
    hist = torch.randint(0, 4, (6, 30), generator=g)
    last = torch.tensor([-1, 0, 2, 10, 28, 29])
    p2, p1, p0 = history_tail(hist, last)
    head, conf = torch.arange(100, 106), torch.tensor([0.1, 0.9, 0.1, 0.5, 0.2, 0.4])
    want = choose_drafts(head, conf, ngram_continuation(hist, last, p2, p1, p0), 0.5)
    assert torch.equal(lookup_drafts(hist, last, p2, p1, p0, head, conf, 0.5), want)
    assert (want < 100).any()  # some rows take the continuation


def _loop_prompts(n, seed):
    """Prompts that repeat a short random phrase: the target's greedy text keeps copying from them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 250, (4 + i % 3,), generator=g).tolist()
        out.append((phrase * 6)[:20 + 3 * i])
    return out


def _run(sched, prompts, new=40):
    return run_greedy(sched, prompts, new)


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    prompts = _loop_prompts(5, 0)
    sched, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=4096)
    return prompts, [r.output_ids for r in _run(sched, prompts)]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_lookup_is_lossless_and_graph_equals_eager(tiny_models, plain_outputs, n, page_size):
    prompts, ref = plain_outputs
    accepted = {}
    for graphs in (True, False):
        sched, _ = build_scheduler(tiny_models["llama_mtp"], page_size=page_size, max_total_tokens=4096,
                                   speculative_algorithm="MTP", speculative_num_steps=n,
                                   speculative_ngram_lookup=True, disable_cuda_graph=not graphs)
        reqs = _run(sched, prompts)
        assert [r.output_ids for r in reqs] == ref, (n, page_size, graphs)
        accepted[graphs] = [r.spec_accepted_drafts for r in reqs]
    assert accepted[True] == accepted[False]  # the same drafts through static replay and eager


def test_lookup_accepts_more_on_repeating_text(tiny_models, plain_outputs):
    prompts, ref = plain_outputs
    res = {}
    for lookup in (False, True):
        sched, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
                                   speculative_num_steps=3, speculative_ngram_lookup=lookup)
        reqs = _run(sched, prompts)
        assert [r.output_ids for r in reqs] == ref
        res[lookup] = sched.stats.spec_accept_length
    # the random head accepts ~nothing; copying the prompt's phrase (and the target's own loops) accepts a lot
    assert res[False] < 1.1 and res[True] > res[False] + 0.3, res  # measured: 1.00 -> 1.47


@pytest.mark.parametrize("lookup", [False, True])
def test_lookup_under_retraction(tiny_models, lookup):
    """A KV pool too small for the batch: requests are retracted and re-prefilled (which rewrites their token
    history); the output still equals plain decoding. (Prompt seed 3: the looping prompts of some seeds drive this
    random target into exact fp32 logit ties, where any two kernels may pick different tokens.)"""
    prompts = _loop_prompts(8, 3)
    kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8)
    plain, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=4096, **kw)
    ref = [r.output_ids for r in _run(plain, prompts, new=48)]
    sched, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=160, page_size=1,
                               speculative_algorithm="MTP", speculative_num_steps=3, speculative_ngram_lookup=lookup,
                               **kw)
    reqs = _run(sched, prompts, new=48)
    assert sched.stats.num_retractions > 0
    assert [r.output_ids for r in reqs] == ref
