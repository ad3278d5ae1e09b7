"""The MLA + MoE family (DeepSeek-V3) on small random checkpoints, against transformers:
- logits of a chunked prefill (several requests, one longer than a chunk), 4-token verifies and a step decode over
  the absorbed latent cache (kv_lora_rank + rope values per token, one pool per layer);
- greedy MTP (the MTP layer at model.layers.{L}, its block MLA + the grouped-sigmoid MoE) == plain == transformers
  greedy, N 1..3, page sizes 1 and 16, chunked prefill; a retraction workload returns every pool to its start;
- the graph runners' static replay == eager with shrinking and growing batches, per-runner metadata isolation (the
  MLA kind included), and the one-graph spec step."""

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek
from spec_fixtures import build_scheduler, run_greedy
from test_kv_accounting import test_pool_returns_to_start_after_mixed_workload_with_retractions as mixed_workload
from test_overlap_schedule import test_mixed_workload_matches_synchronous as overlap_workload
from test_overlap_schedule import test_spec_mixed_workload_matches_synchronous as overlap_spec_workload
from test_prefill_graph import SMALL_BATCHES, SMALL_MAX_TOKENS, check_padded_prefill, prefill_runner
from test_qwen3_next import _hf_greedy, _hf_logits, _prefill, _runner
from test_runners import _inputs, _spec_runner, check_isolation, check_one_graph_step, check_phase_replay
from test_spec_greedy import _prompts

from specserve.batch import CacheKind
from specserve.graphs.padding import LiveInputs
from specserve.kvcache.manager import KVHandle
from specserve.layers.mla import MLAAttention
from specserve.layers.moe import GatedMLP, SparseMoEBlock
from specserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from specserve.models.loader import ModelSource, load_target

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    return {"mtp": build_tiny_deepseek(str(root / "mtp"), seed=51, mtp=True),
            "no_qlora": build_tiny_deepseek(str(root / "noq"), seed=52, q_lora_rank=None, rope_interleave=False)}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_family_layers_and_caches(deepseek):
    t = load_target(ModelSource.resolve(deepseek["mtp"]), torch.float32, CPU, 600)
    assert isinstance(t.model, DeepseekV3ForCausalLM) and t.has_mtp
    layers = t.model.model.layers
    assert [type(lay.mlp) for lay in layers] == [GatedMLP, SparseMoEBlock, SparseMoEBlock]  # first_k_dense_replace
    moe = layers[1].mlp
    # the plain shared expert, as wide as a routed one: expert E of the grouped GEMM, weight 1
    assert moe.router == "grouped_sigmoid" and moe.shared_expert is None and moe.fused_shared
    assert moe.experts.w13.shape[0] == moe.num_experts + 1 and moe.gate.weight.shape[0] == moe.num_experts
    specs = t.model.cache_specs()
    assert [s.kind for s in specs] == [CacheKind.MLA] * 3 and specs[0].width == 32 + 8  # latent + rope per token
    assert all(isinstance(lay.self_attn, MLAAttention) for lay in layers)


@pytest.mark.parametrize("key", ["mtp", "no_qlora"])
def test_prefill_verify_logits_match_hf(deepseek, key):
    """Chunked prefill, then three 4-token verifies continuing the sequence, against transformers."""
    path = deepseek[key]
    hf = _hf(path)
    mr, t = _runner(path, n=3) if key == "mtp" else _runner(path, n=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (k,), generator=g).tolist() for k in (9, 1, 30)]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + 16])
    for p, got in zip(prompts, _prefill(mr, t, prompts, handles, chunk=16)):
        torch.testing.assert_close(got, _hf_logits(hf, p), rtol=1e-4, atol=1e-4)
    seqs = [list(p) for p in prompts]
    rows = torch.tensor([h.row for h in handles])
    for step in range(3):
        if key == "mtp":  # 4-token verifies
            more = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in prompts]
            s = torch.tensor([len(x) for x in seqs])
            live = LiveInputs(3, torch.tensor(sum(more, [])), (s[:, None] + torch.arange(4)).reshape(-1), rows,
                              s + 4, int(s.max()) + 4)
            out = mr.spec.phases.target_verify.run(live)["logits"]
        else:  # decode steps
            more = [[int(x)] for x in torch.randint(3, 250, (3,), generator=g)]
            s = torch.tensor([len(x) for x in seqs])
            out = mr.phases.decode.run(LiveInputs(3, torch.tensor(sum(more, [])), s, rows, s + 1,
                                                      int(s.max()) + 1))["logits"][:, None]
        for b, m in enumerate(more):
            seqs[b] += m
            ref = _hf_logits(hf, seqs[b])[-len(m):]
            torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-4, msg=f"{key} step {step} row {b}")
    for h in handles:
        mr.kv.release(h)


@pytest.fixture(scope="module")
def greedy_ref(deepseek):
    prompts = _prompts()
    return prompts, _hf_greedy(_hf(deepseek["mtp"]), prompts, NEW)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_mtp_matches_plain_and_hf(deepseek, greedy_ref, n, page_size):
    """n = 0: plain decoding. The MTP block is MLA + MoE with its own latent cache; chunks of 16 prompt tokens."""
    prompts, ref = greedy_ref
    kw = {"speculative_algorithm": "MTP", "speculative_num_steps": n} if n else {}
    sched, _ = build_scheduler(deepseek["mtp"], page_size=page_size, max_total_tokens=4096, chunked_prefill_size=16,
                               **kw)
    reqs = run_greedy(sched, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref
    if n:
        assert isinstance(sched.model_runner.draft.decoder.self_attn, MLAAttention)
        assert all(r.spec_verify_ct > 0 for r in reqs)


@pytest.mark.parametrize("spec", [None, 3])
def test_mixed_workload_with_retractions(deepseek, spec):
    mixed_workload(deepseek, spec, 16, key="mtp")


def test_overlap_schedule_matches_synchronous(deepseek):
    overlap_workload(deepseek, 160, key="mtp")
    overlap_spec_workload(deepseek, 3, 160, key="mtp")


def test_phase_replay_equals_eager_and_isolation(deepseek):
    mr = _spec_runner(deepseek["mtp"], n=3)
    check_phase_replay(mr)
    check_isolation(mr)
    check_one_graph_step(mr, [7, 5, 3, 1, 2, 8, 6], 1e-4)


def test_router_params_stay_float32_in_a_bfloat16_model(deepseek):
    """transformers keeps the grouped sigmoid router's gate and correction bias in float32; so does the loader (a
    bias rounded to bfloat16 moves expert choices), with the checkpoint's values exactly."""
    from safetensors import safe_open

    t = load_target(ModelSource.resolve(deepseek["mtp"]), torch.bfloat16, CPU, 600)
    moe = t.model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w13.dtype == torch.bfloat16
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with safe_open(f"{deepseek['mtp']}/model.safetensors", framework="pt") as st:
        want = st.get_tensor(name).float()
    assert torch.equal(moe.e_score_correction_bias, want)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mtp_chain_before_or_after_the_final_norm(deepseek, greedy_ref, page_size):
    """--speculative-mtp-chain prenorm chains the MTP block's residual stream (before shared_head.norm) instead of
    its normed output: still lossless, and a different drafter (its chained drafts differ)."""
    prompts, ref = greedy_ref
    for chain in ("normed", "prenorm"):
        sched, _ = build_scheduler(deepseek["mtp"], page_size=page_size, max_total_tokens=4096,
                                   speculative_algorithm="MTP", speculative_num_steps=3, speculative_mtp_chain=chain)
        assert sched.model_runner.draft.chain_prenorm == (chain == "prenorm")
        reqs = run_greedy(sched, prompts, NEW)
        assert [r.output_ids for r in reqs] == ref
    draft = sched.model_runner.draft
    h = torch.randn(3, 2 * draft.config.hidden_size)
    assert torch.equal(draft.chained(h), h[:, draft.config.hidden_size:])  # the pre-norm half chains
    # the same draft-extend inputs: the same drafts (logits read the normed half), another chained hidden state —
    # the pre-norm stream (with hnorm behind it, the two differ by the final norm's weight and scale)
    mr = _spec_runner(deepseek["mtp"], n=3)
    runner = mr.spec.phases.draft_extend
    handles, live = _inputs(mr, "draft_extend", 8, seed=3)
    out = {}
    for prenorm in (False, True):
        mr.draft.set_chain_prenorm(prenorm)
        out[prenorm] = runner.forward_phase(live, runner.eager_backends, False)
    assert torch.equal(out[False]["tokens"], out[True]["tokens"])
    normed, stream = out[False]["hidden"], out[True]["hidden"]  # [8, H] each
    assert normed.shape == stream.shape and not torch.allclose(normed, stream, atol=1e-2)
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mr.draft.config.rms_norm_eps)
    torch.testing.assert_close(normed, rms(stream) * mr.draft.final_norm.weight, rtol=1e-4, atol=1e-4)
    # chained on from there: draft decode's N - 1 = 2 steps from the same d1, each way -> different drafts
    dd = mr.spec.phases.draft_decode
    last = live.seq_lens - 4 + live.accept_len + 1  # [8] committed tokens after the extend: d1 sits at `last`
    drafts = {}
    for prenorm in (False, True):
        mr.draft.set_chain_prenorm(prenorm)
        step = LiveInputs(8, out[False]["tokens"], last, live.req_pool_indices, last + 1, int(last.max()) + 3,
                          hidden=out[prenorm]["hidden"])
        drafts[prenorm] = dd.forward_phase(step, dd.eager_backends, False)["tokens"]  # [8, 2]
    assert drafts[False].shape == (8, 2) and not torch.equal(drafts[False], drafts[True])


def test_prefill_graph_token_rows_equal_eager(deepseek):
    """The Triton MLA backend captures prefill as token rows: the padded static replay of the target's and the MTP
    layer's extend equals the eager reference prefill (outputs and every cache slot but the padding's). The MLA
    layers under Triton's CPU interpreter: over SMALL_BATCHES, rows of 128 columns."""
    check_padded_prefill(prefill_runner(deepseek["mtp"], None, "triton", max_tokens=SMALL_MAX_TOKENS, context_len=128),
                         1e-4, SMALL_BATCHES, SMALL_MAX_TOKENS)


def test_mla_prefill_graphs_bound_the_attended_pairs(deepseek):
    """MLA prefill graphs walk each token's prefix alone, so the runners graph a batch only up to a bound of (query,
    key) pairs; beyond it the same batch runs eagerly (and dense models have no bound)."""
    from test_prefill_graph import _batch

    from specserve.engine.model_runner import _PREFILL_GRAPH_ATTENDED

    mr = prefill_runner(deepseek["mtp"], None, "triton")
    assert mr.prefill.max_attended == mr.spec.prefill.max_attended == _PREFILL_GRAPH_ATTENDED
    runner = mr.prefill
    handles, x = _batch(mr, [30, 0], [5, 4], seed=1)  # 5 * 30 + 15 + 10 = 175 pairs
    x.hidden = None
    want = runner.forward(runner._eager_batch(x)).clone()
    for bound, graphed in ((175, True), (174, False)):
        runner.max_attended = bound
        replays, eager = runner.replays, runner.eager_runs
        got = runner.run(x)
        assert (runner.replays - replays, runner.eager_runs - eager) == ((1, 0) if graphed else (0, 1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for h in handles:
        mr.kv.release(h)


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_yarn_attention_scale_from_an_old_style_config(key):
    """DeepSeek's yarn mscale multiplies the attention scale, whether the config names the rope type `type` (an old
    config.json's rope_scaling, a GGUF) or `rope_type`: equal to transformers' attention module's scale."""
    from types import SimpleNamespace

    from deepseek_helpers import TINY_DEEPSEEK
    from transformers import DeepseekV3Config as HFConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from specserve.models.deepseek_v3 import DeepseekV3Config

    yarn = {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = HFConfig(**TINY_DEEPSEEK, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn})
    hf.architectures = ["DeepseekV3ForCausalLM"]
    plain = hf.to_dict()
    plain.pop("rope_parameters")
    plain.update(rope_theta=10000.0, rope_scaling={key: "yarn", **yarn})
    ours = DeepseekV3Config.from_hf(SimpleNamespace(**plain), "DeepseekV3ForCausalLM").attn_scaling
    ref = DeepseekV3Attention(hf, 0).scaling
    assert ours == pytest.approx(ref, rel=1e-6)
    assert ours > (TINY_DEEPSEEK["qk_nope_head_dim"] + TINY_DEEPSEEK["qk_rope_head_dim"]) ** -0.5 * 1.4  # scaled
