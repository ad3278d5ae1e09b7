"""Adaptive speculation (engine/adaptive_spec.py) and the worker's plain step (speculative/worker.py): a plain step in
a speculating engine samples what plain decoding would and runs no draft; the draft catches up over the positions it
missed before the next speculative step (speculative/draft_lag.py), so any interleaving of plain and speculative
steps gives plain decoding's greedy tokens (also when the lag fills up and forces a catch-up) — on a dense target,
the hybrid family (recurrent state slots) and GLM-5 with truly sparse attention; the width-1 runners' static replay
equals their eager forward with shrinking and growing batches; the policy measures both modes per batch-size bucket,
picks the faster, probes the other, and follows the accept rate; it is off by default on a CPU. The sampled
interleavings are checked against the exact distribution in test_sampling_lossless.py."""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import build_tiny_dsa
from hybrid_helpers import build_tiny_hybrid
from spec_fixtures import ForcedSteps, build_scheduler, run_greedy
from test_deepseek_dsa import _with_mtp
from test_runners import _requests
from test_spec_greedy import _prompts

from specserve.engine.adaptive_spec import AdaptiveSpeculation, bucket
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.graphs.padding import LiveInputs
from specserve.graphs.phase_runners import eager_phase
from specserve.layers.sampler import GREEDY
from specserve.speculative.draft_lag import DraftLag
from specserve.speculative.plain_step import plain_step_device
from specserve.speculative.worker import catch_up_groups

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 20
PATTERNS = [[True, False], [False, False, True, True, True], [True]]
SPEC = dict(speculative_algorithm="MTP", speculative_num_steps=3, speculative_adaptive=True)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    return {"llama": tiny_models["llama_mtp"],
            "qwen3_next": build_tiny_hybrid(str(root / "next"), "qwen3_next", seed=41, mtp=True),
            "glm": _with_mtp(build_tiny_dsa(str(root / "glm"), "glm_moe_dsa", seed=42, index_topk=5), 43)}


@pytest.fixture(scope="module")
def plain_ref(models):
    prompts = _prompts()
    return prompts, {k: [r.output_ids for r in run_greedy(build_scheduler(p, max_total_tokens=4096)[0], prompts,
                                                          NEW)] for k, p in models.items()}


def test_bucket():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_policy_measures_both_picks_the_faster_and_probes():
    a = AdaptiveSpeculation(probe_every=4, probe_len=1, max_period=4)
    assert not a.choose_plain(3)  # nothing measured: speculate first
    a.record(3, False, 0.010, 2.0)  # 2 tokens per request in 10 ms: 200 tokens/s
    assert a.choose_plain(3)  # then one plain step
    a.record(3, True, 0.004, 1.0)  # 250 tokens/s: plain is faster
    assert a.plain_is_faster(3) is True
    assert [a.choose_plain(4) for _ in range(8)] == [True, True, True, False] * 2  # every 4th step probes
    assert not a.choose_plain(20)  # another bucket measures for itself
    for _ in range(30):  # acceptance rises to 4 tokens a step: 400 tokens/s, speculation wins again
        a.record(3, False, 0.010, 4.0)
    assert a.plain_is_faster(3) is False and not a.choose_plain(3)
    s = a.summary()
    assert s["plain_steps"] == 1 and s["spec_steps"] == 31 and s["buckets"][4]["plain_is_faster"] is False
    assert s["buckets"][4]["plain_ms"] == pytest.approx(4.0)


@pytest.mark.parametrize("key", ["llama", "qwen3_next", "glm"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=["alternate", "spec-first", "all-plain"])
def test_plain_steps_keep_greedy_lossless(models, plain_ref, key, pattern):
    prompts, ref = plain_ref
    sched, _ = build_scheduler(models[key], max_total_tokens=4096, chunked_prefill_size=16, **SPEC)
    sched.adaptive = ForcedSteps(pattern)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref[key]
    assert sched.stats.spec_plain_steps > 0
    assert (sched.stats.spec_verify_ct > 0) == (False in pattern)
    one = sched.model_runner.spec.plain_step_graph  # the plain steps ran as one (static) replay each
    assert one in sched.model_runner.spec.graph_runners() and one.replays_by_kind["greedy"] > 0
    sched.check_idle_invariants()


def test_plain_runners_replay_equals_eager(models):
    """The target's width-1 verify runner: padded static replay == eager."""
    mr = build_scheduler(models["llama"], max_total_tokens=4096, **SPEC)[0].model_runner
    runners = [mr.phases.plain_verify]
    assert runners[0].width == 1 and mr.spec.plain_step_graph in mr.spec.graph_runners()
    for runner in runners:
        for i, bs in enumerate([7, 3, 1, 5, 8, 2]):
            handles, rows, s = _requests(mr, bs, 3, seed=i)
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 256, (bs,), generator=g)
            live = LiveInputs(bs, ids, s, rows, s + 1, int(s.max()) + 1)
            eager = {k: v.clone() for k, v in runner.forward_phase(live, runner.eager_backends, False).items()}
            before = runner.replays
            out = runner.run(live)
            assert runner.replays == before + 1
            for k in eager:
                torch.testing.assert_close(out[k], eager[k], rtol=1e-5, atol=1e-5, msg=f"{runner.name} bs={bs}")
            for h in handles:
                mr.kv.release(h)


def test_plain_step_graph_replay_equals_eager(models):
    """The speculating engine's plain step as one graph (PlainStepGraph, static replay on CPU) == its eager
    function over the phase's eager backends, with shrinking and growing batches: the tokens, the last-token rows,
    the token history and the lag's kept features and tokens."""
    mr = build_scheduler(models["llama"], max_total_tokens=4096, speculative_ngram_lookup=True, **SPEC)[0].model_runner
    w = mr.spec
    one, ctx = w.plain_step_graph, w.plain_step_ctx
    for i, bs in enumerate([7, 3, 1, 5, 8, 2]):
        handles, rows, s = _requests(mr, bs, 3, seed=i)
        mr.last_token[rows] = torch.randint(0, 256, (bs,), generator=torch.Generator().manual_seed(i))
        before = mr.last_token.clone()
        eager = plain_step_device(ctx, eager_phase, rows, s, s, int(s.max()), GREEDY)
        kept = [t[rows, s % w.lag.capacity].clone() for t in (w.lag.hidden, w.lag.tokens)]
        hist = w.state.tokens[rows, s + 1].clone()
        mr.last_token.copy_(before)
        w.lag.hidden.zero_()
        w.state.tokens[rows, s + 1] = -1
        replays = one.replays
        out = one.run(rows.tolist(), s.tolist(), s.tolist(), GREEDY)
        assert one.replays == replays + 1
        assert torch.equal(out, eager) and torch.equal(mr.last_token[rows], eager), f"bs={bs}"
        assert torch.equal(w.state.tokens[rows, s + 1], hist) and torch.equal(hist, eager)
        torch.testing.assert_close(w.lag.hidden[rows, s % w.lag.capacity], kept[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(w.lag.tokens[rows, s % w.lag.capacity], kept[1])
        for h in handles:
            mr.kv.release(h)


def test_the_lag_counted_in_the_budget_is_what_it_allocates(models):
    """The engine takes the lag's buffers out of its memory budget by DraftLag.bytes_per_row (model_runner.py):
    that is what they take, for every page-table row; without adaptive speculation there is none."""
    on, off = (build_scheduler(models["llama"], speculative_algorithm="MTP", speculative_num_steps=3,
                               speculative_adaptive=a)[0].model_runner for a in (True, False))
    lag = on.spec.lag
    rows = on.req_to_token.table.shape[0]
    assert off.spec.lag is None and lag.tokens.shape[0] == rows and lag.hidden.shape[2] == on.draft.feature_size
    counted = rows * DraftLag.bytes_per_row(on.draft.feature_size, lag.hidden.dtype)
    assert counted == lag.hidden.numel() * lag.hidden.element_size() + lag.tokens.numel() * lag.tokens.element_size()


def test_off_by_default_on_cpu(models):
    sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, speculative_algorithm="MTP",
                               speculative_num_steps=3)
    assert sched.adaptive is None and not sched.model_runner.adaptive_spec
    assert sched.model_runner.phases.plain_verify is None
    with pytest.raises(RuntimeError, match="adaptive speculation is off"):
        sched.model_runner.spec.plain_step([1], [4], [4], None)


def test_the_policy_in_the_engine(models, plain_ref):
    """The real policy on a CPU: it measures both modes, reports them, and the tokens stay plain decoding's."""
    prompts, ref = plain_ref
    sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, **SPEC)
    assert isinstance(sched.adaptive, AdaptiveSpeculation)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["llama"]
    s = sched.adaptive.summary()
    assert s["plain_steps"] >= 1 and s["spec_steps"] >= 1 and s["plain_steps"] == sched.stats.spec_plain_steps
    assert any(b["spec_ms"] and b["plain_ms"] for b in s["buckets"].values())
    sched.check_idle_invariants()


@pytest.mark.parametrize("capacity", [None, 3])
def test_plain_steps_keep_the_draft_in_step(models, capacity):
    """After k plain steps and the catch-up the draft's next token and hidden state are what a fresh prefill of the
    same tokens gives (its draft extend over the whole sequence): the catch-up filled the draft KV of every
    position the plain steps skipped — also with room for only 3 pending positions (forced catch-ups between)."""
    from specserve.engine.request import Req
    from specserve.engine.sampling_params import SamplingParams

    path, prompt, k = models["llama"], _prompts()[0], 7

    def start(ids, until):
        sched, _ = build_scheduler(path, max_total_tokens=4096, **SPEC)
        w = sched.model_runner.spec
        if capacity is not None:
            w.lag = w.plain_step_ctx.lag = DraftLag.allocate(w.lag.tokens.shape[0], w.draft.feature_size,
                                                    w.lag.hidden.dtype, w.device, capacity=capacity)
        sched.adaptive = ForcedSteps([True])
        r = Req("r", list(ids), SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True), seed=0)
        sched.add_request(r)
        while len(r.output_ids) < until:
            sched.step()
        row = r.kv.row
        plain = until - 1  # one position per plain step; a forced catch-up at capacity starts the count over
        assert w.lag.pending.get(row, 0) == (plain if capacity is None or not plain else (plain - 1) % capacity + 1)
        w.catch_up([row], [r.seq_len], [r.seq_len])
        assert not w.lag.pending.get(row)
        st = w.state
        return r.output_ids, int(st.draft_token[r.kv.row]), st.draft_hidden[r.kv.row].clone()

    out, d1, hidden = start(prompt, k + 1)  # t0 from the prefill, then k plain steps
    assert len(out) == k + 1
    out2, d1_fresh, hidden_fresh = start(prompt + out[:-1], 1)  # prefill the same tokens; t0 = the last one
    assert out2 == out[-1:]
    assert d1 == d1_fresh
    torch.testing.assert_close(hidden, hidden_fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", ["llama", "glm"])
def test_a_full_lag_catches_up_before_the_next_plain_step(models, plain_ref, key):
    """With room for 3 pending positions, runs of 7 plain steps catch up twice inside the run: still plain
    decoding's tokens (test_plain_steps_keep_the_draft_in_step checks the draft state itself at capacity 3)."""
    prompts, ref = plain_ref
    for capacity in (3, None):
        sched, _ = build_scheduler(models[key], max_total_tokens=4096, **SPEC)
        w = sched.model_runner.spec
        if capacity is not None:
            w.lag = w.plain_step_ctx.lag = DraftLag.allocate(w.lag.tokens.shape[0], w.draft.feature_size,
                                                    w.lag.hidden.dtype, w.device, capacity=capacity)
        sched.adaptive = ForcedSteps([True] * 7 + [False])
        assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref[key]
        # forced catch-ups inside the plain runs (capacity 3) or none (capacity 32)
        assert (w.catch_ups["forced"] > 0) == (capacity is not None)
        assert w.catch_ups["positions"] >= 7 * len(prompts)
        sched.check_idle_invariants()


def test_catch_up_groups_fit_the_largest_prefill_graph():
    assert catch_up_groups([7, 7, 7, 7, 7], 16, 8) == [[0, 1], [2, 3], [4]]
    assert catch_up_groups([3, 20, 2, 2], 16, 8) == [[0], [1], [2, 3]]  # a row past the largest graph goes alone
    assert catch_up_groups([1, 1, 1, 1, 1], 64, 2) == [[0, 1], [2, 3], [4]]  # rows per graph batch
    assert catch_up_groups([5, 6], 0, 8) == [[0, 1]]  # no prefill graphs: one eager forward
    assert catch_up_groups([], 16, 8) == []


def test_catch_ups_replay_prefill_graphs(models, plain_ref):
    """Five rows 7 positions behind catch up in forwards of at most 16 positions (the largest draft prefill graph
    here), every one a graph replay (CPU: static replay), and the tokens stay plain decoding's."""
    prompts, ref = plain_ref
    sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, cuda_graph_max_prefill_tokens=16,
                               chunked_prefill_size=16, **SPEC)
    sched.adaptive = ForcedSteps([True] * 7 + [False])
    w = sched.model_runner.spec
    assert w.prefill.max_tokens == 16 and len(prompts) * 7 > 16
    before = w.prefill.eager_runs
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["llama"]
    assert w.catch_ups["positions"] >= 7 * len(prompts)
    assert w.prefill.eager_runs == before and w.prefill.replays > 0
    sched.check_idle_invariants()


@pytest.mark.parametrize("key", ["llama", "qwen3_next"])
def test_lagging_rows_under_retraction(models, plain_ref, key):
    """A KV pool too small for the batch while the draft lags: retracted rows are re-prefilled (possibly into a row
    another request left lagging), and the prefill starts their lag over; the tokens stay plain decoding's."""
    prompts, ref = plain_ref
    sched, _ = build_scheduler(models[key], max_total_tokens=72, page_size=1, chunked_prefill_size=16,
                               context_length=64, **SPEC)
    sched.adaptive = ForcedSteps([True, True, True, False])
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref[key]
    assert sched.stats.num_retractions > 0 and sched.model_runner.spec.catch_ups["before_spec"] > 0
    sched.check_idle_invariants()


def test_a_step_read_behind_a_prefill_launch_is_not_steady(models):
    """Under the overlap schedule a prefill is launched before the decode step in flight is read, so that step's
    time holds the prefill's host work: the scheduler hands it over as not steady."""
    sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, **SPEC)
    sched = Scheduler(sched.model_runner, sched.stop, 0, overlap=True)

    class Counting(ForcedSteps):
        def record(self, *a, **kw):
            super().record(*a, **kw)
            self.prefills.append(sched.stats.num_overlapped_prefills)

    sched.adaptive = forced = Counting([False])
    forced.prefills = []
    prompts = _prompts()
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True), seed=i)
            for i, p in enumerate(prompts)]
    sched.add_request(reqs[0])
    for r in reqs[1:]:  # the others arrive while the first decodes
        for _ in range(3):
            sched.step()
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    behind = [i for i in range(1, len(forced.prefills)) if forced.prefills[i] > forced.prefills[i - 1]]
    assert behind and all(not forced.steady[i] for i in behind)
    assert any(forced.steady)
    sched.check_idle_invariants()


def test_the_catch_up_is_charged_to_the_plain_steps():
    """A catch-up's cost is spread over the plain steps of a probe period taken plain (probe_every - probe_len) and
    added to their estimate, not to the speculative step that ran it: here it turns plain from faster to slower."""
    a = AdaptiveSpeculation()
    a.record(1, False, 0.010, 2.2)  # 220 tokens/s speculating
    a.record(1, True, 0.0044, 1.0)  # 227 tokens/s plain
    assert a.plain_is_faster(1) is True
    a.record(1, False, 0.010, 2.2, catch_up=(0.0124, 1, 31))  # 12.4 ms / 28 plain steps: 0.443 ms a plain step
    assert a.catch_up_s[1] == pytest.approx(0.0124)
    assert a.spec_s[1] == pytest.approx(0.010)  # the speculative step's own time only
    assert a.plain_is_faster(1) is False  # 1 / 4.84 ms = 206 tokens/s
    b = a.summary()["buckets"][1]
    assert b["catch_up_ms"] == pytest.approx(12.4) and b["catch_up_ms_per_plain_step"] == pytest.approx(12.4 / 28)


def test_probes_are_runs_and_only_steady_steps_are_timed():
    """A probe takes probe_len steps of the other mode, and a step that followed a step of the other kind (a switch:
    under the overlap schedule a drain and a synchronous step) is not averaged: an isolated plain step between
    overlapped speculative steps would make plain look slower than it is."""
    a = AdaptiveSpeculation(probe_every=8, probe_len=3, max_period=8)
    a.record(1, False, 0.0100, 2.0, steady=False)  # the first step of all: no time yet
    assert 1 not in a.spec_s and a.tokens_per_spec == 2.0 and not a.choose_plain(1)
    a.record(1, False, 0.0100, 2.0)  # 200 tokens/s speculating
    assert a.choose_plain(1)
    a.record(1, True, 0.0070, 1.0, steady=False)  # the switch: 143 tokens/s, not counted
    assert 1 not in a.plain_s and a.choose_plain(1)  # plain again until a steady plain step is timed
    a.record(1, True, 0.0045, 1.0)  # 222 tokens/s: plain is faster
    assert a.plain_s[1] == pytest.approx(0.0045) and a.plain_is_faster(1) is True
    assert [a.choose_plain(1) for _ in range(16)] == ([True] * 5 + [False] * 3) * 2
    a.record(1, False, 0.0200, 2.0, steady=False)  # a slow switch back to speculation changes nothing
    assert a.spec_s[1] == pytest.approx(0.0100) and a.num_spec == 3


def test_a_settled_choice_probes_less_often():
    """Each period whose probe leaves the choice as it was doubles the next (up to max_period); a changed choice
    starts over at probe_every. The catch-up is spread over the current period's plain steps."""
    a = AdaptiveSpeculation(probe_every=4, probe_len=1, max_period=16)
    a.record(1, False, 0.010, 2.0)
    a.record(1, True, 0.004, 1.0)  # plain is faster
    assert [a.choose_plain(1) for _ in range(4 + 8 + 16 + 16)] == \
        [True] * 3 + [False] + [True] * 7 + [False] + ([True] * 15 + [False]) * 2
    assert a.period[1] == 16 and a.summary()["buckets"][1]["probe_period"] == 16
    a.record(1, True, 0.0, 1.0, catch_up=(0.015, 1, 15))
    assert a.catch_up_per_plain_step(1) == pytest.approx(0.001)  # 15 ms over 15 plain steps
    for _ in range(40):  # acceptance rises: speculation wins, and the next period is back to 4 steps
        a.record(1, False, 0.010, 4.0)
    assert [a.choose_plain(1) for _ in range(4 + 8)] == [False] * 3 + [True] + [False] * 7 + [True]
    assert a.period[1] == 8


def test_the_scheduler_marks_switches_unsteady(models):
    """Which steps the scheduler hands over as steady, synchronous and overlapped: never the first step after a
    switch of kind; under the overlap schedule also not the synchronous step a switch takes nor the first one
    launched after it."""
    prompts = _prompts()
    for overlap in (False, True):
        sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, **SPEC)
        if overlap:
            sched = Scheduler(sched.model_runner, sched.stop, 0, overlap=True)
        sched.adaptive = forced = ForcedSteps([True] * 4 + [False] * 4)
        run_greedy(sched, prompts, NEW)
        kinds = [plain for _, plain, _ in forced.recorded]
        steady = forced.steady
        assert any(s and k for s, k in zip(steady, kinds)) and any(s and not k for s, k in zip(steady, kinds))
        assert not steady[0] and all(not steady[i] for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1])
        if overlap:
            assert sched.stats.num_overlapped_steps > 0
            assert all(not steady[i] for i in range(1, len(kinds)) if kinds[i - 1] != kinds[max(i - 2, 0)])
        else:
            assert all(steady[i] for i in range(1, len(kinds)) if kinds[i] == kinds[i - 1])


def test_the_scheduler_times_catch_ups_apart(models):
    """Each speculative step after a run of plain steps hands the policy its catch-up: the rows that lagged and
    their positions, at most one per plain step of the run."""
    prompts, _ = _prompts(), None
    sched, _ = build_scheduler(models["llama"], max_total_tokens=4096, **SPEC)
    sched.adaptive = forced = ForcedSteps([True, True, True, False])
    run_greedy(sched, prompts, NEW)
    caught = [(plain, c) for (_, plain, _), c in zip(forced.recorded, forced.caught) if c is not None]
    assert caught and all(not plain for plain, _ in caught)  # catch-ups only before speculative steps here
    assert all(secs > 0 and 0 < rows <= positions <= 3 * rows for _, (secs, rows, positions) in caught)
    assert sum(p for _, (_, _, p) in caught) == sched.model_runner.spec.catch_ups["positions"]


def test_accept_average_weighs_requests_not_steps():
    """One batch-1 step with a poor accept length moves the accept average little (a sample of one request), a
    batch-32 step with the same mean much more: single noisy steps do not flip the policy near break-even."""
    one, many = AdaptiveSpeculation(), AdaptiveSpeculation()
    for a in (one, many):
        a.record(1, False, 0.010, 3.0)
    one.record(1, False, 0.010, 1.0)
    many.record(32, False, 0.010, 1.0)
    assert 2.9 < one.tokens_per_spec < 3.0
    assert many.tokens_per_spec < 2.2
