"""GPU tests of the Qwen3-MoE family (skipped on CPU; run on the H200 and recorded in BENCHMARKS.md):

- every phase runner (target decode, target verify, draft decode, draft extend) of a small random Qwen3-MoE target
  with its MTP draft (the MTP block uses the target's MoE MLP: the fused-MoE Triton kernel under a graph) is
  captured, and its CUDA graph replay equals the eager run with shrinking then growing batch sizes; so does the
  greedy step captured as one graph; so do the prefill graphs (target and MTP layer);
- greedy MTP == plain == transformers on the GPU in float32 with every phase graphed, for the MTP layer inside the
  checkpoint and a separate draft folder.
"""

import pytest
from helpers import build_draft_folder, build_tiny_model
from spec_fixtures import build_scheduler, run_greedy
from test_gpu import CAPTURE, _cuda_spec_runner, check_phase_replay_gpu
from test_prefill_graph import check_padded_prefill, prefill_runner
from test_runners import check_one_graph_step
from test_spec_greedy import _hf_greedy, _prompts

from specserve.graphs.capture import LadderRunner
from specserve.layers.moe import SparseMoEBlock

pytestmark = pytest.mark.gpu
NEW = 24


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The target with an MTP layer in the checkpoint (DeepSeek layout), and a separate draft folder for it."""
    root = tmp_path_factory.mktemp("gmoe")
    target = build_tiny_model(str(root / "mtp"), "qwen3_moe", seed=51, mtp_layout="deepseek")
    return {"mtp": (target, None), "draft": (target, build_draft_folder(str(root / "draft"), target, seed=52))}


def _ladder_runners(*owners) -> list[LadderRunner]:
    """Every graph runner an owner (model runner, speculative worker) holds: phases, prefill, one-graph steps."""
    found: list[LadderRunner] = []
    for owner in owners:
        for value in vars(owner).values():
            for r in value.values() if isinstance(value, dict) else [value]:
                if isinstance(r, LadderRunner) and all(r is not f for f in found):
                    found.append(r)
    return found


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("key", ["mtp", "draft"])
def test_graph_replay_equals_eager_every_phase(moe, key, page_size):
    target, draft = moe[key]
    mr = _cuda_spec_runner(target, 3, page_size, draft_path=draft)
    assert isinstance(mr.draft.decoder.mlp, SparseMoEBlock)  # the MTP block uses the target's MoE MLP
    check_phase_replay_gpu(mr, seed=page_size)
    check_one_graph_step(mr, [13, 9, 5, 3, 1, 2, 7, 16], 2e-4)


def test_prefill_graphs_equal_eager_gpu(moe):
    mr = prefill_runner(*moe["mtp"], "triton", device="cuda")
    assert all(sorted(r.graphs) == r.ladder.sizes == [16, 32, 64] for r in (mr.prefill, mr.spec.prefill))
    check_padded_prefill(mr, 2e-4)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("key", ["mtp", "draft"])
def test_spec_greedy_equals_plain_and_hf_fp32_all_phases_graphed(moe, key, n):
    target, draft = moe[key]
    prompts = _prompts()
    ref = _hf_greedy(target, prompts, NEW)
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32,
              cuda_graph_max_prefill_tokens=64)
    plain, _ = build_scheduler(target, **kw)
    assert [r.output_ids for r in run_greedy(plain, prompts, NEW)] == ref
    spec, _ = build_scheduler(target, draft_path=draft, speculative_algorithm="MTP", speculative_num_steps=n, **kw)
    reqs = run_greedy(spec, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref
    assert all(r.spec_verify_ct > 0 for r in reqs)
    mr = spec.model_runner
    assert isinstance(mr.draft.decoder.mlp, SparseMoEBlock)
    assert mr.spec.spec_step_graph.replays > 0  # greedy steps ran as one graph
    runners = _ladder_runners(plain.model_runner) + _ladder_runners(mr, mr.spec)
    assert len(runners) >= 8
    for r in runners:  # every runner captured; nothing ran eagerly (32-token prefill chunks fit the graphs)
        assert r.graphs and r.eager_runs == 0, (type(r).__name__, r.replays, r.eager_runs)
    assert all(r.replays > 0 for r in (plain.model_runner.prefill, mr.prefill, mr.spec.prefill))
    spec.check_idle_invariants()
