"""Qwen3-MoE (the first MoE family) on small random checkpoints: logits against transformers (prefill, step decode,
a 4-token verify extend, experts that receive no token), greedy MTP == plain == transformers for N 1..4 (MTP layer
inside the checkpoint, and a separate draft folder whose block is the MoE layer), chunked prefill, retraction, the
graph runners' static replay against eager with shrinking and growing batches, and the KV pools back at their start
after a mixed workload."""

import pytest
import torch
from spec_fixtures import build_scheduler, run_greedy
from test_kv_accounting import test_pool_returns_to_start_after_mixed_workload_with_retractions as mixed_workload
from test_runners import CAPTURE, _spec_runner, check_one_graph_step, check_phase_replay
from test_spec_greedy import _hf_greedy, _prompts

from specserve.engine.model_runner import ModelRunner
from specserve.graphs.padding import LiveInputs
from specserve.graphs.prefill import ExtendBatch
from specserve.kvcache.manager import KVHandle
from specserve.layers.moe import SparseMoEBlock
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.models.qwen3_moe import Qwen3MoeForCausalLM
from specserve.server_args import ServerArgs

NEW = 16


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_models):
    prompts = _prompts()
    return prompts, {k: _hf_greedy(tiny_models[k], prompts, NEW) for k in ("qwen3_moe", "qwen3_moe_mtp")}


def test_family_and_layers(tiny_models):
    t = load_target(ModelSource.resolve(tiny_models["qwen3_moe"]), torch.float32, torch.device("cpu"), 600)
    assert isinstance(t.model, Qwen3MoeForCausalLM)
    mlps = [type(layer.mlp).__name__ for layer in t.model.model.layers]
    assert mlps == ["SparseMoEBlock", "DenseMLP", "SparseMoEBlock"]  # mlp_only_layers=[1]
    block = t.model.model.layers[0].mlp
    assert block.experts.w13.shape == (8, 64, 64) and block.experts.w2.shape == (8, 64, 32)
    assert len(t.model.cache_specs()) == 3


def test_verify_extend_logits_match_hf(tiny_models):
    """A 4-token fixed-width extend (target verify) after a prefill, against transformers on the whole sequence."""
    path = tiny_models["qwen3_moe"]
    hf = _hf(path)
    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600)
    args = ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=8, speculative_algorithm="MTP",
                      speculative_num_steps=3, cuda_graph_bs=[1, 2, 4])
    draft = load_mtp_draft(load_target(ModelSource.resolve(tiny_models["qwen3_moe_mtp"]), torch.float32,
                                       torch.device("cpu"), 600), None, torch.float32, torch.device("cpu"), 600)
    mr = ModelRunner(args, t.model, t.config, draft, torch.device("cpu"), torch.float32, 512)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 1, 14)]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + 4])
    table = mr.req_to_token.table
    lens = [len(p) for p in prompts]
    loc = torch.cat([table[h.row, :n] for h, n in zip(handles, lens)])
    pos = torch.tensor([i for n in lens for i in range(n)])
    mr.prefill.run(ExtendBatch(torch.tensor(sum(prompts, [])), pos, loc, [h.row for h in handles], lens, lens))
    more = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in prompts]
    s = torch.tensor(lens)
    rows = torch.tensor([h.row for h in handles])
    live = LiveInputs(3, torch.tensor(sum(more, [])), (s[:, None] + torch.arange(4)).reshape(-1), rows, s + 4,
                      int(s.max()) + 4)
    out = mr.spec.phases.target_verify.run(live)  # static replay at padded batch 4
    for b, (p, m) in enumerate(zip(prompts, more)):
        with torch.no_grad():
            ref = hf(torch.tensor([p + m])).logits[0, -4:]
        torch.testing.assert_close(out["logits"][b], ref, rtol=1e-4, atol=1e-4)
    # one token per request routes 2 of 8 experts: most experts received no token in the decode-sized batch
    assert sum(isinstance(m, SparseMoEBlock) for m in t.model.modules()) == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_plain_greedy_matches_hf(tiny_models, reference, page_size):
    prompts, ref = reference
    sched, _ = build_scheduler(tiny_models["qwen3_moe"], page_size=page_size, max_total_tokens=4096)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["qwen3_moe"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_mtp_layer_in_checkpoint(tiny_models, reference, n, page_size):
    """The MTP layer at model.layers.{L} with per-expert MoE weights: greedy MTP == plain == transformers."""
    prompts, ref = reference
    sched, _ = build_scheduler(tiny_models["qwen3_moe_mtp"], page_size=page_size, max_total_tokens=4096,
                               speculative_algorithm="MTP", speculative_num_steps=n)
    assert isinstance(sched.model_runner.draft.decoder.mlp, SparseMoEBlock)  # the block uses the target's MoE MLP
    reqs = run_greedy(sched, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref["qwen3_moe_mtp"]
    assert all(r.spec_verify_ct > 0 for r in reqs)


@pytest.mark.parametrize("n", [2, 4])
def test_spec_greedy_draft_folder_chunked_prefill(tiny_models, reference, n):
    """A separate draft folder (Qwen3MoeForCausalLMNextN), prompts prefilled in chunks of 8 tokens."""
    prompts, ref = reference
    sched, _ = build_scheduler(tiny_models["qwen3_moe"], draft_path=tiny_models["qwen3_moe_draft"], page_size=4,
                               max_total_tokens=4096, chunked_prefill_size=8, speculative_algorithm="MTP",
                               speculative_num_steps=n)
    assert isinstance(sched.model_runner.draft.decoder.mlp, SparseMoEBlock)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["qwen3_moe"]
    assert sched.stats.num_prefill_steps > len(prompts)  # the longer prompts took several chunks


@pytest.mark.parametrize("spec", [None, 3])
def test_mixed_workload_with_retractions(tiny_models, spec):
    mixed_workload(tiny_models, spec, 16, key="qwen3_moe_mtp")


def test_phase_replay_equals_eager_shrinking_and_growing(tiny_models):
    mr = _spec_runner(tiny_models["qwen3_moe_mtp"], n=3)
    check_phase_replay(mr, tol=1e-5)
    check_one_graph_step(mr, [7, 5, 3, 1, 2, 8, 6], 1e-5)
    assert mr.spec.spec_step_graph.capture_bs == CAPTURE
