"""KV accounting under pressure: a mixed workload (stops, stop strings, chunked prefill, retractions) on a pool
too small for it returns every page and page-table row, and retracted requests still produce exactly the output
they would have produced with plenty of memory."""

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
    kw = dict(context_length=128, chunked_prefill_size=32, page_size=page_size, max_running_requests=8)
    if spec:
        kw.update(speculative_algorithm="MTP", speculative_num_steps=spec)
    prompts, params = _workload()
    roomy = Engine(model_path=path, max_total_tokens=8192, **kw)
    expected = roomy.generate(input_ids=prompts, sampling_params=params)
    tight = Engine(model_path=path, max_total_tokens=160, **kw)
    sched = tight.scheduler
    start_free = sched.mr.allocator.num_free_pages
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert sched.stats.num_retractions > 0, "the pool was not tight enough to force a retraction"
    assert sched.mr.allocator.num_free_pages == start_free
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


def test_abort_frees_kv(tiny_models):
    from specserve.engine.request import Req
    from specserve.engine.sampling_params import SamplingParams

    eng = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
                 speculative_num_steps=3)
    sched = eng.scheduler
    start = sched.mr.allocator.num_free_pages
    reqs = [Req(f"a{i}", list(range(3, 3 + 10 * (i + 1))), SamplingParams(max_new_tokens=50, ignore_eos=True), 0)
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        sched.step()
    assert sched.mr.allocator.num_free_pages < start
    for r in reqs:
        sched.abort(r.rid)
    assert all(r.finished_reason["type"] == "abort" for r in reqs)
    sched.step()
    sched.check_idle_invariants()
