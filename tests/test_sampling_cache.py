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
