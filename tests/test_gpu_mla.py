"""GPU tests of the MLA (+ DSA) family (skipped on CPU; to run on the H200 and record in BENCHMARKS.md):

- every speculative phase runner of DeepSeek-V3.2 / GLM-5 tiny checkpoints (truly sparse top-k) is captured and its
  CUDA graph replay equals the eager run with shrinking then growing batch sizes; so does the one-graph spec step;
- greedy MTP == plain on the GPU in float32 (DeepSeek-V3, == transformers; GLM-5 with sparse top-k);
- a retraction workload leaves no page or page-table row behind;
- prefill as CUDA graphs (token rows through the Triton MLA / indexer / top-k kernels) equals the eager prefill,
  target and MTP layer, DeepSeek-V3 and GLM-5;
- --attention-backend triton (the Triton absorbed-MLA and indexer-score kernels, sparse rows per query) captures
  every phase and gives the torch reference's greedy tokens, plain and MTP;
- FP8 MLA latents: the kernel over fp8 rows == over the dequantised rows bit for bit; the Triton backends against
  the torch reference on the same fp8 cache, greedy MTP == plain; the Triton latent store == the reference store.
"""

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek, build_tiny_dsa
from spec_fixtures import ForcedSteps, build_scheduler, run_greedy
from test_deepseek_dsa import _with_mtp
from test_gpu import CAPTURE, _cuda_spec_runner, check_phase_replay_gpu
from test_prefill_graph import check_padded_prefill, prefill_runner
from test_qwen3_next import _hf_greedy
from test_runners import check_one_graph_step
from test_spec_greedy import _prompts

from specserve.batch import CacheKind

pytestmark = pytest.mark.gpu
NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gmla")
    return {"v3": build_tiny_deepseek(str(root / "v3"), seed=71, mtp=True),
            "glm": _with_mtp(build_tiny_dsa(str(root / "glm"), "glm_moe_dsa", seed=72, index_topk=5), 73)}


@pytest.mark.parametrize("key", ["v3", "glm"])
def test_graph_replay_equals_eager_every_phase(models, key):
    mr = _cuda_spec_runner(models[key], 3, 1)
    check_phase_replay_gpu(mr)
    check_one_graph_step(mr, [13, 9, 5, 3, 1, 2, 7, 16], 2e-4)


@pytest.mark.parametrize("key", ["v3", "glm"])
def test_prefill_graphs_equal_eager_gpu(models, key):
    mr = prefill_runner(models[key], None, "triton", device="cuda")
    assert all(sorted(r.graphs) == r.ladder.sizes == [16, 32, 64] for r in (mr.prefill, mr.spec.prefill))
    check_padded_prefill(mr, 2e-4)


@pytest.mark.parametrize("key", ["v3", "glm"])
def test_spec_greedy_equals_plain_fp32(models, key):
    prompts = _prompts()
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32)
    plain = [r.output_ids for r in run_greedy(build_scheduler(models[key], **kw)[0], prompts, NEW)]
    if key == "v3":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(models[key], dtype=torch.float32).eval()
        assert plain == _hf_greedy(hf, prompts, NEW)
    spec, _ = build_scheduler(models[key], speculative_algorithm="MTP", speculative_num_steps=3, **kw)
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == plain
    assert spec.model_runner.spec.spec_step_graph.replays > 0
    spec.check_idle_invariants()


def test_no_leak_mixed_workload_gpu(models):
    from test_kv_accounting import _workload

    from specserve import Engine

    prompts, params = _workload()
    kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8, speculative_algorithm="MTP",
              speculative_num_steps=3, cuda_graph_bs=[1, 2, 4, 8], schedule_conservativeness=0.0, dtype="float32")
    exp = Engine(model_path=models["glm"], max_total_tokens=8192, **kw).generate(input_ids=prompts,
                                                                                  sampling_params=params)
    tight = Engine(model_path=models["glm"], max_total_tokens=160, **kw)
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert tight.scheduler.stats.num_retractions > 0
    tight.scheduler.check_idle_invariants()
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(got, exp))
    assert same >= len(prompts) - 2, f"only {same}/{len(prompts)} requests equal between tight and roomy engines"


@pytest.mark.parametrize("key", ["v3", "glm"])
def test_triton_mla_backend_equals_reference_gpu(models, key):
    from specserve.attention.torch_mla_backend import TritonMLABackend

    prompts = _prompts()
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32)
    ref = [r.output_ids for r in run_greedy(build_scheduler(models[key], attention_backend="torch", **kw)[0],
                                            prompts, NEW)]
    plain, _ = build_scheduler(models[key], attention_backend="triton", **kw)
    assert [r.output_ids for r in run_greedy(plain, prompts, NEW)] == ref
    spec, _ = build_scheduler(models[key], attention_backend="triton", speculative_algorithm="MTP",
                              speculative_num_steps=3, **kw)
    assert any(isinstance(b, TritonMLABackend) for b in spec.model_runner.spec.phases.target_verify.backends.values())
    assert all(r.graphs for r in spec.model_runner.spec.phases.all())
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == ref
    assert spec.model_runner.spec.spec_step_graph.replays > 0
    spec.check_idle_invariants()


def test_adaptive_plain_steps_gpu(models):
    """Plain steps (forced, interleaved) through the Triton MLA / DSA backends at width 1 == plain decoding."""
    prompts = _prompts()
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32)
    ref = [r.output_ids for r in run_greedy(build_scheduler(models["glm"], **kw)[0], prompts, NEW)]
    spec, _ = build_scheduler(models["glm"], speculative_algorithm="MTP", speculative_num_steps=3, **kw)
    assert spec.model_runner.phases.plain_verify.graphs
    spec.adaptive = ForcedSteps([True, False, False])
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == ref
    assert spec.stats.spec_plain_steps > 0 and spec.model_runner.spec.catch_ups["before_spec"] > 0
    spec.check_idle_invariants()



def _triton_near_reference_glm(models, **flags):
    """GLM-5 (sparse top-k) with `flags` on the GPU: the Triton backends' greedy tokens against the torch
    reference's over the same caches (all but at most 2 prompts: the kernels' dot order may break a near-tie) ->
    (an MTP scheduler through the Triton backends, the prompts, the Triton backends' plain tokens)."""
    prompts = _prompts()
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32, **flags)
    ref = [r.output_ids for r in run_greedy(build_scheduler(models["glm"], attention_backend="torch", **kw)[0],
                                            prompts, NEW)]
    plain = [r.output_ids for r in run_greedy(build_scheduler(models["glm"], attention_backend="triton", **kw)[0],
                                              prompts, NEW)]
    same = sum(p == r for p, r in zip(plain, ref))
    assert same >= len(prompts) - 2, f"only {same} of {len(prompts)} prompts equal to the reference"
    spec, _ = build_scheduler(models["glm"], attention_backend="triton", speculative_algorithm="MTP",
                              speculative_num_steps=3, **kw)
    return spec, prompts, plain


def test_fp8_indexer_triton_gpu(models):
    """--indexer-cache-dtype fp8_e4m3 on the GPU: the Triton scores kernel's fp8 x fp8 tile (q rounded in the kernel,
    its sums kept in the tensor core: fast_acc) against the torch reference rounding q the same way in float32 sums:
    the same greedy tokens for most prompts (a near-tie of the top-k may go the other way); and greedy MTP through
    the Triton backends == their own plain decoding exactly (every phase scores alike)."""
    spec, prompts, plain = _triton_near_reference_glm(models, indexer_cache_dtype="fp8_e4m3")
    assert spec.model_runner.spec.phases.target_verify.backends[CacheKind.INDEX_KEYS].kv_pool.scales is not None
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == plain
    assert spec.model_runner.spec.spec_step_graph.replays > 0
    spec.check_idle_invariants()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,sparse", [(1, False), (4, False), (4, True)])
def test_fp8_latent_kernel_gpu(dtype, width, sparse):
    """The absorbed-MLA kernel over an fp8 latent cache (group scales, kernels/reference_latent_fp8.py) on the GPU:
    the same kernel over the rows dequantised to q's dtype, bit for bit in float32 (the GPU's casts round to
    nearest, as torch's), within the bf16 bound for bf16 q; at 64 heads, 512 + 64 rows (5 scales), with key
    splits; the CPU counterpart runs under the interpreter in tests/test_fp8_mla_cache.py."""
    from specserve.kernels.reference_latent_fp8 import dequantize_latent, quantize_latent
    from specserve.kernels.triton_mla import mla_decode_triton

    g = torch.Generator().manual_seed(90 + width)
    c, r, heads, bs, max_kv, slots = 512, 64, 64, 3, 300, 1000
    x = torch.randn(slots, c + r, generator=g)
    x[:, c:] *= 0.01
    stored, scales = (t.cuda() for t in quantize_latent(x, r, torch.float8_e4m3fn))
    q = torch.randn(bs * width, heads, c + r, generator=g).to(dtype).cuda()
    lens = torch.tensor([40, 300, width]).cuda()
    table = torch.randint(1, slots, (bs, max_kv), generator=g).cuda()
    sel = (torch.rand(bs, 1, width, max_kv, generator=g) < 0.3).cuda() if sparse else None
    got = mla_decode_triton(q, stored, table, lens, width, 0.1, c, sel, scales=scales)
    want = mla_decode_triton(q, dequantize_latent(stored, scales, r, dtype), table, lens, width, 0.1, c, sel)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # bf16 dots: the dequantised key tile comes from registers, the 16-bit one from shared memory, and the
        # compiler may pick another MMA (and so another order of the K sums) for each; measured on an H200 (stop
        # 57): not bit-equal. The CPU test's bound on bf16 (test_fp8_mla_cache.py)
        tol = 4e-2 * want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_fp8_latents_triton_gpu(models):
    """--kv-cache-dtype fp8_e4m3 (fp8 MLA latents) on the GPU, GLM-5 with a sparse top-k: the Triton backends'
    greedy tokens against the torch reference over the same fp8 cache (most prompts: the kernel's dot order may
    break a near-tie), and greedy MTP through them == their own plain decoding exactly."""
    spec, prompts, plain = _triton_near_reference_glm(models, kv_cache_dtype="fp8_e4m3")
    assert spec.model_runner.spec.phases.target_verify.backends[CacheKind.MLA].kv_pool.scales is not None
    assert all(r.graphs for r in spec.model_runner.spec.phases.all())
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == plain
    spec.check_idle_invariants()


@pytest.mark.parametrize("rows_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_fp8_latent_store_gpu(rows_dtype):
    """The compiled Triton latent store (hardware casts) writes the reference store's rows and scales bit for bit,
    DeepSeek's 512 + 64 rows."""
    from specserve.kernels.reference_latent_fp8 import store_latent
    from specserve.kernels.triton_latent_store import store_latent_triton

    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(7, 576, generator=g, device="cuda") * 3).bfloat16()
    loc = torch.tensor([3, 11, 0, 5, 8, 1, 14], device="cuda")
    fp8 = rows_dtype != torch.bfloat16
    got, want = (torch.zeros(16, 576, dtype=rows_dtype, device="cuda") for _ in range(2))
    got_s, want_s = ((torch.ones(16, 5, device="cuda") if fp8 else None) for _ in range(2))
    store_latent_triton(got, got_s, loc, x, 64)
    store_latent(want, want_s, loc, x, 64)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if fp8 else torch.equal(got, want)
    if fp8:
        assert torch.equal(got_s, want_s)
