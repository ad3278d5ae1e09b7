"""`specserve bench-phases` pieces on CPU with a tiny target and a random draft: each batch gets every row (the
phases, the step as one graph, phase by phase, and eager), and timing the slower paths leaves every runner, the
one-graph step included, switched back on."""

import pytest
import torch

from specserve.bench.phase_setup import make_runners, random_draft
from specserve.bench.phases import bench_batch, print_table
from specserve.models.loader import ModelSource, load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_batch_rows_and_runner_state(tiny_models, capsys):
    cpu = torch.device("cpu")
    t = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, cpu, 200)
    draft = random_draft(t.config, t.model, torch.float32, cpu, 200)
    pair = make_runners(t.model, draft, t.config, torch.float32, cpu, 2, 4, 128, disable_graphs=False, adaptive=True)
    batches = [bench_batch(pair, bs, 16, 2) for bs in (1, 3)]
    for b in batches:
        for k in ("spec_iter_ms", "spec_iter_phases_ms", "spec_iter_eager_ms", "plain_step_ms", "spec_plain_step_ms"):
            assert b[k] > 0, k
        assert b["spec_plain_over_plain_step"] == b["spec_plain_step_ms"] / b["plain_step_ms"]
        for name in ("decode", "target_verify", "draft_decode", "draft_extend"):
            assert b[name]["eager_ms"] > 0, name
    assert not pair.spec.spec.lag.pending  # the timed plain steps left no lag behind
    spec = pair.spec.spec
    assert spec.spec_step_graph.use_graphs and all(r.use_graphs for r in spec.phases.all())
    replays = spec.spec_step_graph.replays
    bench_batch(pair, 2, 16, 2)
    assert spec.spec_step_graph.replays > replays  # the step as run is the one-graph step again
    print_table({"model": "tiny", "device": "cpu", "N": 2, "prefix_len": 16, "batches": batches})
    text = capsys.readouterr().out
    assert "spec phases" in text and "spec iter / plain step" in text and "plain (spec)" in text


def test_fp8_index_keys_in_the_bench(tmp_path):
    """make_runners(indexer_cache_dtype="fp8_e4m3") (bench-phases --indexer-cache-dtype): both runners keep fp8
    index keys, the bench's random caches give them spread scales, and every phase of a batch runs over them."""
    from deepseek_helpers import build_tiny_dsa

    from specserve.batch import CacheKind
    from specserve.bench.phase_setup import fake_requests, release

    cpu = torch.device("cpu")
    path = build_tiny_dsa(str(tmp_path / "glm"), "glm_moe_dsa", seed=5, index_topk=5)
    t = load_target(ModelSource.resolve(path), torch.float32, cpu, 200)
    draft = random_draft(t.config, t.model, torch.float32, cpu, 200)
    pair = make_runners(t.model, draft, t.config, torch.float32, cpu, 2, 2, 64, disable_graphs=False,
                        indexer_cache_dtype="fp8_e4m3")
    for mr in (pair.plain, pair.spec):
        pool = mr.caches.pools[CacheKind.INDEX_KEYS]
        assert pool.rows[0].dtype == torch.float8_e4m3fn and pool.scales is not None
    release(pair.plain, fake_requests(pair.plain, 2, 16))
    scales = pair.plain.caches.pools[CacheKind.INDEX_KEYS].scales[0]
    assert scales.min() >= 0.5 and scales.max() <= 1.5 and scales.std() > 0
    b = bench_batch(pair, 2, 16, 1)
    for name in ("decode", "target_verify", "draft_decode", "draft_extend"):
        assert b[name]["eager_ms"] > 0, name
