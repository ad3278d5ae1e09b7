"""The overlap schedule (engine/overlap.py): plain decode step k+1 launched before step k's tokens are read.

On a CPU the launch computes as it goes, so these tests check the bookkeeping, which is the same on a GPU: outputs
equal to the synchronous schedule's under stop tokens, stop strings, length and context limits, seeded sampling,
chunked prefill, arrivals while a step is in flight, retractions and aborts; every page, page-table row and state
row back at the end. The GPU run of the same comparison (graphs, pinned readback) is in tests/test_gpu.py."""

import argparse

import pytest
import torch
from test_kv_accounting import _workload

from specserve import Engine
from specserve.engine.overlap import TokenReadback
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.server_args import ServerArgs


def overlapped(eng: Engine) -> Engine:
    """The engine with its scheduler rebuilt under the overlap schedule (a CPU engine steps synchronously)."""
    core = eng.core
    core.scheduler = Scheduler(core.model_runner, core.scheduler.stop, core.args.chunked_prefill_size, overlap=True)
    assert core.scheduler.overlap
    return eng


def _same(expected: list[dict], got: list[dict]) -> None:
    for e, o in zip(expected, got, strict=True):
        assert o["output_ids"] == e["output_ids"]
        assert o["meta_info"]["finish_reason"] == e["meta_info"]["finish_reason"]


def check_mixed_workload(path: str, total: int, min_share: float, **spec) -> None:
    """The mixed workload (stops, stop strings, seeded sampling, chunked prefill; retractions in a pool of 160
    tokens) under the overlap schedule == under the synchronous one; at least min_share of the decode steps
    overlapped; nothing leaks."""
    kw = dict(model_path=path, context_length=128, chunked_prefill_size=32, max_running_requests=8,
              schedule_conservativeness=0.0, max_total_tokens=total, **spec)
    prompts, params = _workload()
    sync = Engine(**kw)
    assert not sync.scheduler.overlap  # a CPU engine's default
    expected = sync.generate(input_ids=prompts, sampling_params=params)
    eng = overlapped(Engine(**kw))
    _same(expected, eng.generate(input_ids=prompts, sampling_params=params))
    st = eng.scheduler.stats
    assert st.num_overlapped_steps > min_share * st.num_decode_steps
    assert st.num_overlapped_prefills > 0  # prompts admitted while a step was in flight
    assert (st.num_retractions > 0) == (total == 160)
    eng.scheduler.check_idle_invariants()


@pytest.mark.parametrize("total", [8192, 160])  # roomy, and tight enough to retract
def test_mixed_workload_matches_synchronous(tiny_models, total, key="llama"):
    """key: the checkpoint (other families call this test with theirs)."""
    check_mixed_workload(tiny_models[key], total, 0.5)


def test_length_and_context_limits_are_not_overrun(tiny_models):
    """A request finishing by max_new_tokens or by the context is left out of the next launch: it gets exactly its
    tokens, its KV never passes the context, and a request alone costs no step beyond its last."""
    ctx = 40
    eng = overlapped(Engine(model_path=tiny_models["llama"], context_length=ctx, max_total_tokens=4096))
    sched = eng.scheduler
    prompts = [list(range(3, 3 + ctx - 6)), list(range(5, 15)), list(range(7, 12))]
    params = [{"max_new_tokens": 100, "ignore_eos": True}, {"max_new_tokens": 9, "ignore_eos": True},
              {"max_new_tokens": 1, "ignore_eos": True}]
    out = eng.generate(input_ids=prompts, sampling_params=params)
    assert [len(o["output_ids"]) for o in out] == [6, 9, 1]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in out)
    sched.check_idle_invariants()
    steps = sched.stats.num_decode_steps
    eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert sched.stats.num_decode_steps - steps == 4  # the prefill gives the first token


def test_tokens_arrive_one_step_late_and_nothing_is_lost(tiny_models):
    eng = overlapped(Engine(model_path=tiny_models["llama"], max_total_tokens=4096))
    sched = eng.scheduler
    r = Req("a", [3, 4, 5, 6], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0), seed=0)
    sched.add_request(r)
    assert not sched.in_flight
    assert sched.step() == [] and sched._inflight.prefill and sched.in_flight  # the prefill launched, t0 not read
    assert r.seq_len == 4 and r.output_ids == [] and r in sched.running
    assert [x.rid for x in sched.step()] == ["a"]  # decode 1 launched (from t0 on the device), then t0 read
    assert r.seq_len == 5 and len(r.output_ids) == 1 and r.first_token_time is not None
    assert not sched._inflight.prefill and sched.in_flight and sched.stats.num_overlapped_prefills == 0
    seen = []
    while sched.has_work:
        seen += [len(x.output_ids) for x in sched.step()]
    assert seen == [2, 3, 4, 5, 6] and not sched.in_flight
    ref = Engine(model_path=tiny_models["llama"], max_total_tokens=4096).generate(
        input_ids=[3, 4, 5, 6], sampling_params={"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.0})
    assert r.output_ids == ref["output_ids"]
    sched.check_idle_invariants()


@pytest.mark.parametrize("spec", [None, dict(speculative_algorithm="MTP", speculative_num_steps=2)])
def test_a_prefill_reads_the_step_in_flight_first(tiny_models, spec):
    """A chunked prompt arriving while a decode step is in flight: the first chunk is launched, then that step's
    tokens read (with the first chunk's step, not after the whole prefill)."""
    eng = overlapped(Engine(model_path=tiny_models["llama_mtp" if spec else "llama"], max_total_tokens=4096,
                            chunked_prefill_size=8, **(spec or {})))
    sched = eng.scheduler
    a = Req("a", [3, 4, 5, 6], SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0), seed=0)
    sched.add_request(a)
    assert sched.step() == []  # a's prefill, in flight
    assert [r.rid for r in sched.step()] == ["a"] and len(a.output_ids) == 1  # a's first decode launched, t0 read
    assert sched._inflight is not None and not sched._inflight.prefill
    sched.add_request(Req("b", list(range(3, 83)), SamplingParams(max_new_tokens=4, ignore_eos=True), seed=1))
    assert [r.rid for r in sched.step()] == ["a"] and len(a.output_ids) > 1  # b's first chunk, a's step read
    assert sched.prefilling is not None and sched._inflight is None  # a chunk with no t0 leaves nothing to read
    assert sched.stats.num_overlapped_prefills == 1
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()


def _reqs(n: int, new: int) -> list[Req]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        p = torch.randint(3, 250, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.8 if i % 2 else 0.0)
        out.append(Req(f"r{i}", p, sp, seed=i))
    return out


def _drive(sched: Scheduler, reqs: list[Req], arrive: dict[int, int], abort: dict[int, int]) -> dict[int, int]:
    """Step until idle; request i is added before step arrive[i] and aborted before step abort[i]. Returns the
    aborted requests' token counts at their abort."""
    k = 0
    held = {}
    while k <= max(arrive.values()) or sched.has_work:
        for i, at in arrive.items():
            if at == k:
                sched.add_request(reqs[i])
        for i, at in abort.items():
            if at == k:
                held[i] = len(reqs[i].output_ids)
                sched.abort(reqs[i].rid)
        sched.step()
        k += 1
    sched.check_idle_invariants()
    return held


def test_arrivals_and_aborts_while_a_step_is_in_flight(tiny_models, key="llama", spec=None):
    """Requests arriving (prefilled while a decode step is in flight) and aborted mid-flight: the others' outputs
    equal the synchronous schedule's, an aborted request keeps only the tokens it had, nothing leaks.
    key: the checkpoint (other families call this test with theirs); spec: speculation's engine arguments."""
    arrive = {0: 0, 1: 0, 2: 3, 3: 4, 4: 9, 5: 9}
    abort = {1: 6, 4: 12}
    outs = {}
    for overlap in (False, True):
        eng = Engine(model_path=tiny_models[key], max_total_tokens=4096, chunked_prefill_size=16, **(spec or {}))
        if overlap:
            overlapped(eng)
        reqs = _reqs(6, 14)
        held = _drive(eng.scheduler, reqs, arrive, abort)
        outs[overlap] = reqs
        if overlap:
            assert eng.scheduler.stats.num_overlapped_steps > 0
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        if i in abort:
            assert b.finished_reason["type"] == "abort"
            assert 0 < len(b.output_ids) == held[i] < 14  # nothing appended after the abort
            assert b.output_ids == a.output_ids[:len(b.output_ids)]
        else:
            assert b.output_ids == a.output_ids and len(b.output_ids) == 14


@pytest.mark.parametrize("spec", [None, dict(speculative_algorithm="MTP", speculative_num_steps=2)])
def test_first_tokens_that_end_a_request_while_its_prefill_is_in_flight(tiny_models, spec, key=None):
    """Prompts prefilled while others decode, whose first token (read only with the next step, which may already
    decode them) ends them: max_new_tokens 1 (left out of that step), a stop token id, a context of one more
    token. Their outputs, and everyone else's, equal the synchronous schedule's; nothing leaks. key: the checkpoint
    (other families call this test with theirs)."""
    path = tiny_models[key or ("llama_mtp" if spec else "llama")]
    kw = dict(model_path=path, max_total_tokens=4096, chunked_prefill_size=16, context_length=64, **(spec or {}))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 20, 63, 6)]
    first = [o["output_ids"][0] for o in Engine(**kw).generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True, "temperature": 0.0})]

    def reqs() -> list[Req]:
        sp = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8),
              SamplingParams(max_new_tokens=1, ignore_eos=True),
              SamplingParams(max_new_tokens=8, stop_token_ids=[first[2]], temperature=0.0),
              SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.7),
              SamplingParams(max_new_tokens=6, stop_token_ids=[first[4]], temperature=0.0),
              SamplingParams(max_new_tokens=9, ignore_eos=True),  # 63 prompt tokens: the context ends at t0
              SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8)]
        return [Req(f"q{i}", p, s, seed=i) for i, (p, s) in enumerate(zip(prompts, sp))]

    arrive = {0: 0, 1: 2, 2: 3, 3: 3, 4: 5, 5: 6, 6: 8}
    outs = {}
    for overlap in (False, True):
        eng = Engine(**kw)
        if overlap:
            overlapped(eng)
        rs = reqs()
        _drive(eng.scheduler, rs, arrive, {})
        outs[overlap] = rs
        if overlap:
            assert eng.scheduler.stats.num_overlapped_prefills >= 4
    for a, b in zip(outs[False], outs[True]):
        assert b.output_ids == a.output_ids and b.finished_reason == a.finished_reason
    assert [len(r.output_ids) for r in outs[True][1:6]] == [1, 1, 1, 1, 1]
    assert all(r.first_token_time is not None for r in outs[True])


def test_default_and_flag():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--disable-overlap-schedule"]))
    assert args.disable_overlap_schedule
    assert not ServerArgs().disable_overlap_schedule
    assert ServerArgs.from_cli_args(parser.parse_args(["--enable-overlap-schedule"])).enable_overlap_schedule
    with pytest.raises(ValueError, match="contradict"):
        ServerArgs(enable_overlap_schedule=True, disable_overlap_schedule=True).validate()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("total", [8192, 160])
def test_spec_mixed_workload_matches_synchronous(tiny_models, n, total, key="llama_mtp"):
    """Speculative steps launched before the previous one's accept lengths are read (their S from the device).
    key: the checkpoint (other families call this test with theirs)."""
    check_mixed_workload(tiny_models[key], total, 1 / 3, speculative_algorithm="MTP", speculative_num_steps=n)


def _oracle_scheduler(tiny_models, n: int, overlap: bool, device: str = "cpu", **kw) -> Scheduler:
    from spec_fixtures import OracleDraft, build_scheduler
    from test_spec_greedy import _hf_greedy, _prompts

    prompts = _prompts()
    ref = _hf_greedy(tiny_models["llama"], prompts)
    oracle = OracleDraft(64, {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, ref))}, wrong_every=5, vocab=256)
    sched, _ = build_scheduler(tiny_models["llama"], draft=oracle, device=device, max_total_tokens=4096,
                               speculative_algorithm="MTP", speculative_num_steps=n, **kw)
    mr = sched.model_runner
    return Scheduler(mr, sched.stop, mr.args.chunked_prefill_size, overlap=overlap), prompts, ref


@pytest.mark.parametrize("n", [2, 4])
def test_spec_overlap_with_long_accepts_equals_transformers(tiny_models, n):
    """An oracle drafter accepts runs of 0..N drafts, so consecutive steps advance S by different amounts on the
    device: greedy outputs == transformers' greedy, every step after the first of a run overlapped."""
    from spec_fixtures import run_greedy

    sched, prompts, ref = _oracle_scheduler(tiny_models, n, True)
    reqs = run_greedy(sched, prompts, len(ref[0]))
    assert [r.output_ids for r in reqs] == ref
    accepts = {a for a in sched.stats.recent_accept}
    assert len(accepts) >= 3 and max(accepts) == n + 1, accepts
    assert sched.stats.num_overlapped_steps >= sched.stats.num_decode_steps - 4


@pytest.mark.parametrize("pattern", [[False, False, False, True, True, False, False, True], [True]])
def test_spec_overlap_with_forced_plain_steps(tiny_models, pattern):
    """Adaptive speculation's plain steps (the draft lagging, then catching up) among speculative steps: runs of
    either kind overlap (a plain step's S is the host's; a speculative one continues on the device), a switch
    reads the step in flight first (a catch-up needs the host's S); outputs == transformers' greedy."""
    from spec_fixtures import ForcedSteps, run_greedy

    sched, prompts, ref = _oracle_scheduler(tiny_models, 3, True, speculative_adaptive=True)
    sched.adaptive = ForcedSteps(pattern)
    reqs = run_greedy(sched, prompts, len(ref[0]))
    assert [r.output_ids for r in reqs] == ref
    st = sched.stats
    assert st.spec_plain_steps > 0 and st.num_overlapped_steps > 0
    if pattern == [True]:  # plain steps only, after each prompt's draft prefill: all but the first overlapped
        assert st.spec_verify_ct == 0 and st.num_overlapped_steps >= st.num_decode_steps - 2
    else:
        assert sched.model_runner.spec.catch_ups["before_spec"] > 0
    assert len(sched.adaptive.recorded) == st.num_decode_steps  # every step's cost reported once


def test_spec_arrivals_and_aborts_while_a_step_is_in_flight(tiny_models):
    test_arrivals_and_aborts_while_a_step_is_in_flight(tiny_models, key="llama_mtp",
                                                       spec=dict(speculative_algorithm="MTP", speculative_num_steps=3))


def test_spec_near_the_context_waits_for_the_read(tiny_models):
    """A request that the step in flight may bring within N + 1 positions of the context is not launched until
    that step is read: it still ends exactly at the context, as synchronously."""
    ctx = 48
    kw = dict(model_path=tiny_models["llama_mtp"], context_length=ctx, max_total_tokens=4096,
              speculative_algorithm="MTP", speculative_num_steps=4)
    prompts = [list(range(3, 3 + ctx - 20)), list(range(5, 20))]
    params = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0.0}
    expected = Engine(**kw).generate(input_ids=prompts, sampling_params=params)
    eng = overlapped(Engine(**kw))
    got = eng.generate(input_ids=prompts, sampling_params=params)
    _same(expected, got)
    assert [len(p) + len(o["output_ids"]) for p, o in zip(prompts, got)] == [ctx, ctx]
    eng.scheduler.check_idle_invariants()


def test_readback_alternates_buffers():
    rb = TokenReadback(4, torch.device("cpu"))
    a = rb.start(torch.tensor([1, 2, 3]))
    b = rb.start(torch.tensor([4, 5]))
    assert a.host.data_ptr() != b.host.data_ptr()
    assert a.wait() == [1, 2, 3] and b.wait() == [4, 5]
    c = rb.start(torch.tensor([7]))
    assert c.host.data_ptr() == a.host.data_ptr() and c.wait() == [7]
    d = rb.start(torch.tensor([[1, 2], [3, 4]]))  # a speculative step's rows
    assert d.wait() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="5 values"):
        rb.start(torch.arange(5))


def test_random_workloads_match_synchronous():
    """A few of scripts/fuzz_overlap.py's random workloads (arrivals, aborts, stops, chunked prefill, tight pools,
    plain and MTP): the overlap schedule's outputs equal the synchronous one's; nothing leaks (a failure prints
    the workload)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "fuzz_overlap.py")
    spec = importlib.util.spec_from_file_location("fuzz_overlap", path)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    assert fuzz.main(1000, 10) == 0
