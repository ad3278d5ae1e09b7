"""The running batch's SamplingBatch made once per composition (engine/sampling_cache.py), and a step graph's
staging that skips a batch it staged last (graphs/step_graph.py SamplingBuffers) but never serves a stale one."""

from __future__ import annotations

import torch

from specserve.engine.request import Req
from specserve.engine.sampling_cache import SamplingCache
from specserve.engine.sampling_params import SamplingParams
from specserve.graphs.step_graph import SamplingBuffers


def _req(i: int, temperature: float) -> Req:  # temperatures exact in float32
    return Req(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=temperature, top_p=0.9), seed=i)


def test_cache_reuses_one_batch_per_composition():
    cache = SamplingCache(100, torch.device("cpu"))
    a, b, c = _req(1, 0.75), _req(2, 1.0), _req(3, 0.5)
    sb = cache.get([a, b])
    assert cache.get([a, b]) is sb and cache.builds == 1
    assert cache.get([b, a]) is not sb  # order matters: rows are positions
    assert cache.get([b, a]).temperature.tolist() == [1.0, 0.75] and cache.builds == 2
    assert cache.get([a, b, c]).temperature.shape == (3,)
    twin = _req(1, 0.125)  # the same rid and seed, another object with other parameters
    assert cache.get([twin, b]).temperature.tolist() == [0.125, 1.0]
    assert cache.builds == 4


def test_staging_skips_only_the_batch_staged_last():
    cache = SamplingCache(100, torch.device("cpu"))
    buf = SamplingBuffers(4, 100, torch.device("cpu"))
    sb1 = cache.get([_req(1, 0.75), _req(2, 0.875)])
    sb2 = SamplingCache(100, torch.device("cpu")).get([_req(3, 0.25)])
    buf.stage(sb1, 4)
    assert buf.temperature.tolist() == [0.75, 0.875, 1.0, 1.0]
    buf.temperature[0] = 5.0  # a skipped staging leaves the buffer as it is
    buf.stage(sb1, 4)
    assert buf.temperature[0] == 5.0
    buf.stage(sb2, 4)
    assert buf.temperature.tolist() == [0.25, 1.0, 1.0, 1.0] and buf.seeds.tolist() == [3, 0, 0, 0]
    buf.stage(sb1, 4)  # staged again after another batch: copied
    assert buf.temperature.tolist()[:2] == [0.75, 0.875] and buf.seeds.tolist()[:2] == [1, 2]
    buf.stage(sb1, 2)  # another padded size: staged
    buf.stage(None, 4)  # capture's all-padding staging
    assert buf.temperature.tolist() == [1.0] * 4 and buf.greedy.tolist() == [True] * 4
    buf.stage(sb1, 4)
    assert buf.temperature.tolist() == [0.75, 0.875, 1.0, 1.0]


def test_scheduler_builds_one_sampling_batch_per_composition(tiny_models):
    """Through the scheduler: sampled decode steps reuse the running batch's SamplingBatch while no request joins or
    leaves (a handful of builds for dozens of steps), and each request's sampled tokens equal those it gets running
    alone (counter-based noise: a cached batch that served a row another request's parameters would show)."""
    from spec_fixtures import build_scheduler

    from specserve.engine.sampling_params import SamplingParams

    def reqs(ids):
        return [Req(f"s{i}", [5 + i, 17, 99, 3], SamplingParams(max_new_tokens=12 + 6 * i, temperature=0.6 + 0.2 * i,
                                                                  top_p=0.9, top_k=20 + i), seed=40 + i) for i in ids]

    def run(sched, batch):
        for r in batch:
            sched.add_request(r)
        steps = 0
        while sched.has_work:
            sched.step()
            steps += 1
        return [r.output_ids for r in batch], steps

    # two running at a time: when the first finishes the third joins, a composition of the same size
    kw = dict(max_total_tokens=2048, max_running_requests=2, cuda_graph_bs=[1, 2], context_length=256)
    sched, _ = build_scheduler(tiny_models["llama"], **kw)
    together, steps = run(sched, reqs(range(4)))
    builds = sched.model_runner.decode_sampling.builds
    assert steps >= 30 and 3 <= builds <= 8
    alone_sched, _ = build_scheduler(tiny_models["llama"], **kw)
    alone = [run(alone_sched, reqs([i]))[0][0] for i in range(4)]
    assert together == alone
