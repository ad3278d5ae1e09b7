"""Lossless speculative sampling: with speculation, sampled tokens follow the target's distribution exactly.

On a tiny-vocabulary random model (V = 12) we compute the exact distribution of the first three generated tokens
with transformers (temperature / top-k / top-p / min-p applied by an independent implementation here) and run a
chi-square goodness-of-fit test on the samples of plain decoding and of speculative decoding (N = 2 and 3, MTP
layer in the checkpoint), also for batches mixing greedy rows and rows of different sampling parameters.
Threshold: p-value > 1e-3 for every test, with fixed seeds (so the test is deterministic; a wrong verifier — e.g.
accepting drafts without the p(d) test, or sampling the residual without removing d — fails with p < 1e-10 here).
The drafter proposes the greedy continuation of the (shared) prompt and the target is low-entropy, so drafts are
accepted often and every accept/reject/bonus path is sampled.
"""

import itertools

import numpy as np
import pytest
import torch
from helpers import build_tiny_model
from scipy.stats import chisquare
from spec_fixtures import ForcedSteps, OracleDraft, build_scheduler

from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.layers.sampler import GREEDY

pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny steps: intra-op threads only spin

V = 12
PROMPT = [3, 7, 1, 9, 4]
NUM = 3000


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    cum = 0.0
    for rank, i in enumerate(order):
        if rank >= top_k:
            break
        if cum >= top_p and rank > 0:
            break
        if p[i] < min_p * p[order[0]]:  # min-p: relative to the most likely token (after temperature)
            break
        keep[i] = True
        cum += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _exact_joint(path, params) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] from transformers' logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    def dist(seq):
        with torch.no_grad():
            lg = hf(torch.tensor([seq])).logits[0, -1].numpy()
        return _filtered(lg, *params)

    joint = np.zeros((V, V, V))
    p1 = dist(PROMPT)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = dist(PROMPT + [a])
        for b in range(V):
            if p2[b] == 0:
                continue
            joint[a, b] = p1[a] * p2[b] * dist(PROMPT + [a, b])
    return joint


def _greedy(path, device: str = "cpu") -> list[int]:
    sched, _ = build_scheduler(path, max_total_tokens=4096, device=device)
    r = Req("g", list(PROMPT), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), seed=0)
    sched.add_request(r)
    while sched.has_work:
        sched.step()
    return r.output_ids


def _sampling(params) -> SamplingParams:
    """(temperature, top_k, top_p[, min_p]) -> a request's parameters (temperature 0: greedy)."""
    temperature, top_k, top_p, min_p = (*params, 0.0)[:4]
    return SamplingParams(max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          ignore_eos=True)


def _samples(path, params, graphed_steps: list | None = None, device: str = "cpu", force_plain: list | None = None,
             drafts_drawn: list | None = None, num: int = NUM, wrong_every: int | None = None,
             batch_mix: list | None = None, **spec) -> np.ndarray:
    """params: (temperature, top_k, top_p[, min_p]) for every request, or a list of them, request i taking entry
    i % len(params) (mixed batches); graphed_steps: if a list, receives the one-graph spec step's (greedy,
    sampled, filtered) replay counts and then the number of decode steps; force_plain: a repeating pattern of
    plain (True) and speculative steps (adaptive speculation); drafts_drawn: if a list, receives how often the
    drafter's distribution was sampled (draft_candidates calls); wrong_every: the oracle drafter's mistakes
    (OracleDraft); batch_mix: if a list, receives (greedy rows, sampled rows) of each one-graph spec step run."""
    groups = params if isinstance(params, list) else [params]
    draft = None
    if spec:
        seq = PROMPT + _greedy(path, device)
        draft = OracleDraft(32, {row: seq for row in range(1, 65)}, wrong_every=wrong_every, vocab=V)
    sched, _ = build_scheduler(path, draft=draft, max_total_tokens=1 << 15, max_running_requests=64, device=device,
                               **spec)
    if force_plain is not None:
        sched.adaptive = ForcedSteps(force_plain)
    if batch_mix is not None:
        _record_batch_mix(sched.model_runner.spec.spec_step_graph, batch_mix)
    reqs = [Req(f"r{i}", list(PROMPT), _sampling(groups[i % len(groups)]), seed=1000 + i) for i in range(num)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    if spec:
        acc = sched.stats.spec_accept_length
        assert acc > 1.3, f"drafts are rarely accepted ({acc}); the test would not exercise acceptance"
    if drafts_drawn is not None:
        drafts_drawn.append(draft.logit_calls)
    worker = sched.model_runner.spec
    if graphed_steps is not None and worker is not None and worker.spec_step_graph is not None:
        one = worker.spec_step_graph
        graphed_steps += list(one.replays_by_kind.values()) + [sched.stats.num_decode_steps]
    return np.array([r.output_ids for r in reqs])


def _record_batch_mix(one, batch_mix: list) -> None:
    """Wrap the one-graph spec step's run (called only for the batches it covers) to record each batch's greedy
    and sampled rows."""
    run = one.run

    def recording(rows, seq_lens, pos0, sb=GREEDY):
        greedy = len(rows) if sb.all_greedy else int(sb.greedy.sum())
        batch_mix.append((greedy, len(rows) - greedy))
        return run(rows, seq_lens, pos0, sb)

    one.run = recording


def _gof(observed_tokens: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 are pooled."""
    counts = np.bincount(observed_tokens, minlength=expected_probs.size).astype(float)
    exp = expected_probs.ravel() * len(observed_tokens)
    small = exp < 5
    obs_b = np.append(counts[~small], counts[small].sum())
    exp_b = np.append(exp[~small], exp[small].sum())
    if exp_b[-1] == 0:
        obs_b, exp_b = obs_b[:-1], exp_b[:-1]
        assert counts[small].sum() == 0, "samples fell where the exact probability is zero"
    return chisquare(obs_b, exp_b * obs_b.sum() / exp_b.sum()).pvalue


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v12") / "m")
    # Low-entropy logits (large lm_head scale) so greedy-ish drafts get accepted often at temperature 1.
    return build_tiny_model(path, "llama", seed=5, vocab_size=V, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, logit_scale=2.5)


@pytest.mark.parametrize("params", [(1.0, V, 1.0), (0.7, 6, 0.9)], ids=["t1", "t0.7-k6-p0.9"])
def test_spec_sampling_matches_exact_distribution(small_vocab_model, params):
    joint = _exact_joint(small_vocab_model, params)
    cases = {"plain": {}, "spec2": {"speculative_algorithm": "MTP", "speculative_num_steps": 2},
             "spec3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3},
             # context lookup: other (still deterministic) drafts, the same exact distribution
             "spec3_lookup": {"speculative_algorithm": "MTP", "speculative_num_steps": 3,
                              "speculative_ngram_lookup": True},
             # every step of 64 requests or fewer as the one-graph spec step (static replay on a CPU)
             "spec3_one_graph": {"speculative_algorithm": "MTP", "speculative_num_steps": 3,
                                 "cuda_graph_bs": [1, 2, 4, 8, 16, 32, 64]}}
    for name, spec in cases.items():
        graphed: list[int] = []
        s = _samples(small_vocab_model, params, graphed_steps=graphed, **spec)
        if name == "spec3_one_graph":
            _assert_graph_set(graphed, params)
        _assert_fits(joint, s, name)
    # drafts drawn from the drafter's own (soft) distribution, verified with min(1, p/q) and max(0, p - q): in the
    # one-graph step; with context lookup (one-hot q where a continuation wins); and with batches too large for
    # the one-graph step (phase graphs: one-hot drafts), whose d1 distributions the next steps read
    one_graph = [1, 2, 4, 8, 16, 32, 64]
    sampled_drafts = {"q": {"cuda_graph_bs": one_graph}, "q_lookup": {"cuda_graph_bs": one_graph,
                                                                     "speculative_ngram_lookup": True},
                      "q_mixed_paths": {"cuda_graph_bs": [1, 2, 4, 8, 16, 32]}}
    for name, extra in sampled_drafts.items():
        graphed, drawn = [], []
        s = _samples(small_vocab_model, params, graphed_steps=graphed, drafts_drawn=drawn,
                     speculative_algorithm="MTP", speculative_num_steps=3, speculative_draft_sampling="sample",
                     **extra)
        assert drawn[0] > 0 and sum(graphed[1:3]) > 0, (name, drawn, graphed)
        _assert_fits(joint, s, name)
    # adaptive speculation: plain and speculative steps interleaved (the first decode step plain)
    for pattern in ([True, False], [True, True, False]):
        s = _samples(small_vocab_model, params, force_plain=pattern, speculative_algorithm="MTP",
                     speculative_num_steps=3, speculative_adaptive=True)
        _assert_fits(joint, s, f"adaptive {pattern}")


def _assert_graph_set(graphed: list[int], params) -> None:
    """The sampled steps ran as the one-graph spec step, with the filter iff the params ask for one."""
    kind = 2 if _filters(params) else 1
    assert graphed[kind] > 0 and graphed[3 - kind] == 0 and graphed[0] == 0, graphed


def _filters(params) -> bool:
    """Whether (temperature, top_k, top_p[, min_p]) asks for the top-k / top-p / min-p filter."""
    temperature, top_k, top_p, min_p = (*params, 0.0)[:4]
    return top_k < V or top_p < 1.0 or min_p > 0


def _assert_fits(joint: np.ndarray, s: np.ndarray, name: str) -> None:
    for pos in range(3):
        marg = joint.sum(axis=tuple(i for i in range(3) if i != pos))
        p = _gof(s[:, pos], marg)
        assert p > 1e-3, (name, pos, p)
    for a, b in itertools.combinations(range(3), 2):
        pair = joint.sum(axis=3 - a - b)
        p = _gof(s[:, a] * V + s[:, b], pair)
        assert p > 1e-3, (name, (a, b), p)


ONE_GRAPH = {"speculative_algorithm": "MTP", "speculative_num_steps": 3, "cuda_graph_bs": [1, 2, 4, 8, 16, 32, 64]}


@pytest.mark.parametrize("params", [(1.0, V, 1.0, 0.1), (0.7, 8, 0.95, 0.1)],
                         ids=["t1-minp0.1", "t0.7-k8-p0.95-minp0.1"])
def test_spec_sampling_min_p_matches_exact_distribution(small_vocab_model, params):
    """min-p, alone and with top-k / top-p, as a per-row input of the one-graph spec step (one-hot drafts and drafts
    drawn from the drafter's distribution) samples the exact joint of the filtered target, as plain decoding does."""
    joint = _exact_joint(small_vocab_model, params)
    # min-p drops mass that the other filters keep here, so a step that ignored it would not fit
    assert np.abs(joint - _exact_joint(small_vocab_model, params[:3])).sum() > 0.1
    cases = {"plain": {}, "spec3_one_graph": ONE_GRAPH,
             "q_one_graph": {**ONE_GRAPH, "speculative_draft_sampling": "sample"}}
    for name, spec in cases.items():
        graphed, drawn = [], []
        s = _samples(small_vocab_model, params, graphed_steps=graphed,
                     drafts_drawn=drawn if name.startswith("q") else None, **spec)
        if spec:
            _assert_graph_set(graphed, params)
            assert graphed[2] == graphed[3], (name, graphed)  # every decode step ran as the one graph
        if drawn:
            assert drawn[0] > 0, (name, drawn)
        _assert_fits(joint, s, name)


def test_mixed_greedy_sampled_batches_one_graph(small_vocab_model):
    """Batches mixing greedy rows and sampled rows of different parameters (temperature, top-k, top-p, min-p; a
    seed per row) run as the one-graph spec step: each sampled group samples its own exact joint and the greedy
    rows emit plain greedy decoding's tokens, with one-hot and with sampled drafts (the oracle drafter errs, so
    greedy rows also reject)."""
    groups = [(0.0, V, 1.0), (1.0, V, 1.0), (0.7, 6, 0.9), (0.7, 8, 0.95, 0.1)]  # request i takes groups[i % 4]
    joints = {g: _exact_joint(small_vocab_model, g) for g in groups[1:]}
    want = _greedy(small_vocab_model)[:3]
    cases = {"plain": {}, "spec3_one_graph": ONE_GRAPH,
             "q_one_graph": {**ONE_GRAPH, "speculative_draft_sampling": "sample"}}
    for name, spec in cases.items():
        graphed, mix = [], []
        s = _samples(small_vocab_model, groups, graphed_steps=graphed, num=len(groups) * NUM, wrong_every=3,
                     batch_mix=mix if spec else None, **spec)
        if spec:
            # every decode step ran as the one graph (the filtered kind wherever a row filters), nearly all of
            # them over greedy and sampled rows together
            assert sum(graphed[:3]) == graphed[3] and graphed[2] > 0, (name, graphed)
            both = sum(1 for g, smp in mix if g and smp)
            assert len(mix) == graphed[3] and both >= 0.9 * len(mix), (name, both, len(mix))
        greedy_rows = s[0::len(groups)]
        assert (greedy_rows == want).all(), (name, np.unique(greedy_rows, axis=0))
        for i, g in enumerate(groups[1:], start=1):
            _assert_fits(joints[g], s[i::len(groups)], f"{name} {g}")


@pytest.mark.gpu
@pytest.mark.parametrize("draft_sampling", ["argmax", "sample"])
@pytest.mark.parametrize("params", [(1.0, V, 1.0), (0.7, 6, 0.9), (0.7, 8, 0.95, 0.1)],
                         ids=["t1", "t0.7-k6-p0.9", "t0.7-k8-p0.95-minp0.1"])
def test_spec_sampling_one_graph_exact_on_gpu(small_vocab_model, params, draft_sampling):
    """The sampled one-graph spec step captured and replayed as CUDA graphs (float32) samples the exact joint, with
    one-hot drafts and with drafts drawn from the drafter's distribution (min-p through the Triton sampler's own
    path on CUDA)."""
    joint = _exact_joint(small_vocab_model, params)
    graphed: list[int] = []
    s = _samples(small_vocab_model, params, graphed_steps=graphed, device="cuda", speculative_algorithm="MTP",
                 speculative_num_steps=3, cuda_graph_bs=[1, 2, 4, 8, 16, 32, 64],
                 speculative_draft_sampling=draft_sampling)
    _assert_graph_set(graphed, params)
    _assert_fits(joint, s, f"cuda_one_graph_{draft_sampling}")


def test_q_rule_with_one_hot_drafts_is_the_one_hot_rule():
    """accept_sampling_q with one-hot draft distributions gives exactly accept_sampling's tokens (same noise), over
    many rows of random target distributions with zeros (filtered tokens) and drafts both likely and impossible."""
    from specserve.speculative.accept import accept_sampling, accept_sampling_q, one_hot_dist

    g = torch.Generator().manual_seed(3)
    bs, n, v = 512, 3, 7
    probs = torch.rand(bs, n + 1, v, generator=g) ** 3
    probs[torch.rand(bs, n + 1, v, generator=g) < 0.3] = 0.0
    probs[..., 0] += 1e-3  # every row keeps some mass
    probs /= probs.sum(-1, keepdim=True)
    drafts = torch.randint(0, v, (bs, n), generator=g)
    seeds, base = torch.arange(bs) * 7 + 1, torch.randint(0, 100, (bs,), generator=g)
    a1, v1 = accept_sampling(drafts, probs, seeds, base)
    a2, v2 = accept_sampling_q(drafts, probs, *one_hot_dist(drafts, 5), seeds, base)
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert (a1 == 0).sum() > 0 and (a1 == n).sum() > 0  # rejections and full acceptance both occurred


def test_sampled_drafting_keeps_greedy_rows_greedy(small_vocab_model):
    """With sampled drafting on, the greedy requests of mixed greedy / sampled batches still emit plain greedy
    decoding's tokens (their drafts are the argmax; their accept test ignores q)."""
    want = _greedy(small_vocab_model)
    seq = PROMPT + want
    draft = OracleDraft(32, {row: seq for row in range(1, 65)}, wrong_every=3, vocab=V)
    sched, _ = build_scheduler(small_vocab_model, draft=draft, max_total_tokens=4096, max_running_requests=16,
                               speculative_algorithm="MTP", speculative_num_steps=3,
                               speculative_draft_sampling="sample", cuda_graph_bs=[1, 2, 4, 8, 16])
    reqs = [Req(f"m{i}", list(PROMPT), SamplingParams(max_new_tokens=8, temperature=0.0 if i % 2 else 1.0,
                                                      ignore_eos=True), seed=i) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    assert draft.logit_calls > 0
    assert all(r.output_ids == want for r in reqs[1::2])
    assert any(r.output_ids != want for r in reqs[0::2])  # the sampled ones sampled


def test_candidate_probs_is_the_sampler_filter_over_the_candidates():
    """With every token a candidate, a sampled draft's distribution (speculative/draft_state.candidate_probs) is
    the sampler's own (layers/sampler.probs_from_logits) under temperature, top-k, top-p, min-p and greedy rows."""
    from specserve.layers.sampler import SamplingBatch, probs_from_logits
    from specserve.speculative.draft_state import candidate_probs

    g = torch.Generator().manual_seed(7)
    rows, v = 6, 20
    logits = torch.randn(rows, v, generator=g) * 2
    f = lambda x, dt=torch.float32: torch.tensor(x, dtype=dt)  # noqa: E731
    sb = SamplingBatch(f([0.7, 1.0, 1.3, 0.0, 0.9, 0.5]), f([0.9, 1.0, 0.5, 1.0, 1.0, 0.8]),
                       f([v, 5, v, v, 3, v], torch.int64), f([0.0, 0.0, 0.0, 0.0, 0.0, 0.1]),
                       f([1, 2, 3, 4, 5, 6], torch.int64), f([False, False, False, True, False, False], torch.bool),
                       all_greedy=False, need_filter=True)
    vals, ids = logits.topk(v, dim=-1)
    dense = torch.zeros(rows, v).scatter_(1, ids, candidate_probs(vals, sb))
    torch.testing.assert_close(dense, probs_from_logits(logits, sb), atol=1e-6, rtol=1e-5)
    assert (dense > 0).sum(1).tolist()[3] == 1 and (dense > 0).sum(1).tolist()[4] <= 3  # greedy; top-k 3


# ---------------------------------------------------------------------- tiny temperatures
def _mixed_batch(temperature: float):
    """Row 0 at `temperature`, row 1 an ordinary sampled row (so the batch is not all-greedy and row 0 goes through
    the per-row sampling tensors), 40 tokens."""
    from specserve.layers.sampler import SamplingBatch

    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=0.8)]
    return params, SamplingBatch.build(params, [11, 12], 40, torch.device("cpu"))


@pytest.mark.parametrize("temperature", [1e-40, 1.4e-45, 1e-30, 1e-8, 9.99e-6])
def test_tiny_temperatures_are_greedy_on_every_path(temperature):
    """A positive temperature whose division would overflow float32 is greedy: the sampled token is the argmax (not
    token 0 of a NaN row), the distribution one-hot, a sampled draft's distribution one-hot at its best candidate,
    and logprobs are taken at temperature 1 as for greedy rows."""
    from specserve.engine.logit_rules import _temperature
    from specserve.layers.sampler import probs_from_logits, sample
    from specserve.speculative.draft_state import candidate_probs

    params, sb = _mixed_batch(temperature)
    assert params[0].is_greedy and _temperature(params[0]) == 1.0
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 40, generator=g) * 5
    logits[0, 0] = -50.0  # token 0 (what NaN probabilities sample) is never the argmax
    want = int(logits[0].argmax())
    probs = probs_from_logits(logits, sb)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == torch.nn.functional.one_hot(torch.tensor(want), 40).float().tolist()
    for pos in range(5):
        assert int(sample(logits, sb, torch.tensor([pos, pos]))[0]) == want
    vals, _ = logits.topk(8, dim=-1)
    q = candidate_probs(vals, sb)
    assert torch.isfinite(q).all() and q[0].tolist() == [1.0] + [0.0] * 7


@pytest.mark.parametrize("temperature", ["threshold", "just above", 1e-4])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e28])
def test_smallest_sampled_temperatures_never_give_nan(temperature, scale):
    """The smallest temperatures still sampled, against large logits: the probabilities are finite and sum to 1, and
    with a clear winner all mass is on the argmax (sampler and sampled drafts alike)."""
    from specserve.engine.sampling_params import MIN_TEMPERATURE
    from specserve.layers.sampler import probs_from_logits, sample
    from specserve.speculative.draft_state import candidate_probs

    t = {"threshold": MIN_TEMPERATURE, "just above": MIN_TEMPERATURE * (1 + 1e-6)}.get(temperature, temperature)
    params, sb = _mixed_batch(t)
    assert not params[0].is_greedy
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 40, generator=g) * scale
    logits[0, 7] = logits[0].abs().max() * 2 + scale  # a clear winner
    probs = probs_from_logits(logits, sb)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert float(probs[0, 7]) == pytest.approx(1.0)
    assert int(sample(logits, sb, torch.tensor([0, 0]))[0]) == 7
    vals, _ = logits.topk(8, dim=-1)
    q = candidate_probs(vals, sb)
    assert torch.isfinite(q).all() and float(q[0, 0]) == pytest.approx(1.0)
