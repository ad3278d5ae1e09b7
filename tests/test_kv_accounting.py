"""KV accounting under pressure: a mixed workload (stops, stop strings, chunked prefill, retractions) on a pool
too small for it returns every page and page-table row, and retracted requests still produce exactly the output
they would have produced with plenty of memory."""

import os

import pytest
import torch

from specserve import Engine


def _workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(14):
        n = int(torch.randint(4, 70, (1,), generator=g))
        prompts.append(torch.randint(3, 250, (n,), generator=g).tolist())
        sp = {"max_new_tokens": int(torch.randint(1, 56, (1,), generator=g)), "temperature": 0.0}
        if i % 3 != 1:
            sp["ignore_eos"] = True
        if i % 4 == 1:
            sp["stop_token_ids"] = [int(torch.randint(3, 250, (1,), generator=g))]
        if i % 5 == 2:
            sp["stop"] = ["a", "Q"]
        if i % 7 == 3:
            sp.update(temperature=0.8, seed=i)
        params.append(sp)
    return prompts, params


@pytest.mark.parametrize("spec", [None, 2, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_returns_to_start_after_mixed_workload_with_retractions(tiny_models, spec, page_size, key="llama_mtp"):
    """key: the checkpoint (other families call this test with theirs)."""
    path = tiny_models[key]
    # no growth reserve at admission, so that the tight pool retracts (what this test is about)
    kw = dict(context_length=128, chunked_prefill_size=32, page_size=page_size, max_running_requests=8,
              schedule_conservativeness=0.0)
    if spec:
        kw.update(speculative_algorithm="MTP", speculative_num_steps=spec)
    prompts, params = _workload()
    roomy = Engine(model_path=path, max_total_tokens=8192, **kw)
    expected = roomy.generate(input_ids=prompts, sampling_params=params)
    tight = Engine(model_path=path, max_total_tokens=160, **kw)
    sched = tight.scheduler
    start_free = sched.model_runner.kv.available_pages  # free + cached pages nobody uses
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert sched.stats.num_retractions > 0, "the pool was not tight enough to force a retraction"
    assert sched.model_runner.kv.available_pages == start_free
    sched.check_idle_invariants()
    for e, o in zip(expected, got):
        assert o["output_ids"] == e["output_ids"]
        assert o["meta_info"]["finish_reason"] == e["meta_info"]["finish_reason"]
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in got}
    assert "length" in reasons
    # stop strings cut the text before the match
    for o, sp in zip(got, params):
        fr = o["meta_info"]["finish_reason"]
        if fr["type"] == "stop" and isinstance(fr["matched"], str):
            assert fr["matched"] in sp["stop"] and fr["matched"] not in o["text"]


def test_abort_frees_kv(tiny_models, key="llama_mtp"):
    """key: the checkpoint (other families call this test with theirs)."""
    from specserve.engine.request import Req
    from specserve.engine.sampling_params import SamplingParams

    eng = Engine(model_path=tiny_models[key], max_total_tokens=4096, speculative_algorithm="MTP",
                 speculative_num_steps=3)
    sched = eng.scheduler
    start = sched.model_runner.allocator.num_free_pages
    reqs = [Req(f"a{i}", list(range(3, 3 + 10 * (i + 1))), SamplingParams(max_new_tokens=50, ignore_eos=True), 0)
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        sched.step()
    assert sched.model_runner.allocator.num_free_pages < start
    for r in reqs:
        sched.abort(r.rid)
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    sched.step()
    sched.check_idle_invariants()


def test_admission_reserves_room_for_growth(tiny_models):
    """16 prompts of 300 tokens, 150 new tokens each, into a 3000-token pool: prompt-size-only admission took ~9
    and retracted 8 times; growth-aware admission keeps retraction the exception, and outputs are unchanged."""
    from helpers import build_tiny_model

    path = build_tiny_model(os.path.join(tiny_models["llama"], "..", "long_ctx"), "llama", seed=1,
                            max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (300,), generator=g).tolist() for _ in range(16)]
    sp = {"max_new_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=path, max_total_tokens=3000, context_length=1024) as tight:
        got = tight.generate(input_ids=prompts, sampling_params=sp)
        stats = tight.scheduler.stats
        assert stats.num_retractions <= 3, f"{stats.num_retractions} retractions: admission over-committed"
        tight.scheduler.check_idle_invariants()
    with Engine(model_path=path, max_total_tokens=16384, context_length=1024) as roomy:
        want = roomy.generate(input_ids=prompts[:4], sampling_params=sp)
    assert [o["output_ids"] for o in got[:4]] == [o["output_ids"] for o in want]


def test_a_request_alone_is_admitted_whatever_its_growth(tiny_models):
    """max_new_tokens far beyond what the pool could ever hold: the growth estimate must not keep it waiting when
    nothing else runs (it would wait forever); it runs to the context limit."""
    with Engine(model_path=tiny_models["llama"], max_total_tokens=200, context_length=128) as eng:
        out = eng.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]],
                           sampling_params={"max_new_tokens": 10_000, "temperature": 0.0, "ignore_eos": True})
        assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length", "length"]
        assert [len(o["output_ids"]) for o in out] == [124, 125]  # up to the context length
        eng.scheduler.check_idle_invariants()
