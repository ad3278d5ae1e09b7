"""Tensor parallelism on GPUs over NCCL (skipped without two CUDA devices; for a multi-GPU machine, to record in
BENCHMARKS.md): the TP2 engine's greedy tokens equal one GPU's in float32 — a dense target with MTP speculation
(every phase and the one-graph step captured with collectives inside), Qwen3-MoE with its experts split, Qwen3-Next
with MTP (recurrent state split by heads) and GLM-5 with truly sparse attention and MTP; and a dying rank stops the
engine."""

import pytest
import torch
from test_tp_cpu import ENGINE_PROMPTS, GREEDY
from tp_helpers import build_hybrids, build_mla, check_dying_rank_stops_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
KW = dict(max_total_tokens=4096, max_running_requests=8, dtype="float32", device="cuda", cuda_graph_bs=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return build_hybrids(tmp_path_factory.mktemp("gtp_hybrid"))


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    return build_mla(tmp_path_factory.mktemp("gtp_mla"))


def _generate(path, **kw):
    from specserve import Engine

    with Engine(model_path=path, **{**KW, **kw}) as e:
        out = [o["output_ids"] for o in e.generate(input_ids=ENGINE_PROMPTS, sampling_params=GREEDY)]
        e.core.scheduler.check_idle_invariants()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,spec", [("llama_mtp", 3), ("qwen3_moe", None), ("qwen3_next", 3), ("glm", 3)])
def test_engine_tp2_equals_one_gpu(tiny_models, hybrids, mla_models, key, spec):
    path = {**tiny_models, **hybrids, **mla_models}[key]
    kw = dict(speculative_algorithm="MTP", speculative_num_steps=spec) if spec else {}
    assert _generate(path, tp_size=2, **kw) == _generate(path)


@pytest.mark.timeout(300)
def test_dying_rank_stops_the_gpu_engine(tiny_models):
    check_dying_rank_stops_engine(tiny_models["llama"], ENGINE_PROMPTS[:1], GREEDY, **KW)
