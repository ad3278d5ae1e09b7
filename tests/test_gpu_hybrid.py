"""GPU tests of the hybrid linear-attention family (skipped on CPU; run on the H200 and recorded in BENCHMARKS.md):

- every phase runner (target decode: a plain engine's decode and a speculating engine's plain step; target verify,
  draft decode, draft extend, prefill) is captured, and its CUDA graph replay equals the eager run with shrinking
  then growing batch sizes, the GDN state slots included; so does the greedy step captured as one graph;
- greedy MTP == plain == transformers on the GPU in float32 with every phase graphed (the checkpoint's mtp.* layer);
  in bfloat16 the spec-vs-plain match rate is printed;
- a mixed workload with retractions leaves no page, page-table row or state row behind.
"""

import pytest
import torch
from hybrid_helpers import build_tiny_hybrid
from spec_fixtures import build_scheduler, run_greedy
from test_gpu import CAPTURE, _cuda_spec_runner, _to
from test_prefill_graph import check_padded_prefill, prefill_runner
from test_qwen3_next import _hf, _hf_greedy, _hf_logits
from test_runners import _inputs, _requests, check_one_graph_step, token_caches
from test_spec_greedy import _prompts

from specserve.graphs.padding import LiveInputs

pytestmark = pytest.mark.gpu
NEW = 24


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_tiny_hybrid(str(tmp_path_factory.mktemp("ghy") / "m"), "qwen3_next", seed=41, mtp=True)


def _state(mr):
    s = mr.caches.state
    return s.conv.transpose(0, 1)[1:], s.ssm.transpose(0, 1)[1:]  # every row but the dummy


def _phase_inputs(mr, name, bs, seed):
    """test_runners._inputs, plus the width-1 target decode (a plain decode, or a speculating engine's plain
    step): one token per request at position S."""
    if name not in ("decode", "plain_verify"):
        return _inputs(mr, name, bs, seed)
    handles, rows, s = _requests(mr, bs, mr.num_steps, seed)
    ids = torch.randint(0, 256, (bs,), generator=torch.Generator().manual_seed(seed + 1))
    return handles, LiveInputs(bs, ids, s, rows, s + 1, int(s.max()) + 1)


def _check_replay_equals_eager(mr, runners, page_size):
    """Each runner's graph replay against its eager run, bs shrinking then growing: outputs and every state row."""
    assert all(r.graphs for r in runners.values()), "every phase must be captured"
    for name, runner in runners.items():
        for i, bs in enumerate([13, 9, 5, 3, 1, 2, 7, 16]):
            handles, live = _phase_inputs(mr, name, bs, seed=100 * i + page_size)
            live = _to(live, mr.device)
            before = [t.clone() for t in _state(mr)]
            eager = {k: v.clone() for k, v in runner.forward_phase(live, runner.eager_backends, False).items()}
            want = [t.clone() for t in _state(mr)]
            for t, b in zip(_state(mr), before):
                t.copy_(b)
            out = runner.run(live)
            for k in eager:
                torch.testing.assert_close(out[k], eager[k], rtol=2e-4, atol=2e-4, msg=f"{name} bs={bs} {k}")
            for got, w in zip(_state(mr), want):
                torch.testing.assert_close(got, w, rtol=2e-4, atol=2e-4, msg=f"{name} bs={bs} state")
            for h in handles:
                mr.kv.release(h)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_equals_eager_every_phase(hybrid, page_size):
    mr = _cuda_spec_runner(hybrid, 3, page_size)
    # the target's runners (verify, and decode for the plain steps of adaptive speculation, on by default on a GPU)
    # and the draft's; the target verify is in both
    runners = {r.name: r for r in mr.phases.all() + mr.spec.phases.all()}
    assert sorted(runners) == ["draft_decode", "draft_extend", "plain_verify", "target_verify"]
    _check_replay_equals_eager(mr, runners, page_size)
    check_one_graph_step(mr, [13, 9, 5, 3, 1, 2, 7, 16], 2e-4)
    # a plain engine's target decode
    plain = build_scheduler(hybrid, device="cuda", page_size=page_size, max_total_tokens=16384,
                            max_running_requests=32, cuda_graph_bs=CAPTURE)[0].model_runner
    g = torch.Generator(device=plain.device).manual_seed(0)
    for cache in token_caches(plain.caches):  # non-trivial K/V, so attention over the prefix matters
        cache.copy_(torch.randn(cache.shape, generator=g, device=plain.device))
    assert plain.phases.all() == [plain.phases.decode]
    _check_replay_equals_eager(plain, {"decode": plain.phases.decode}, page_size)


def test_prefill_graphs_equal_eager_gpu(hybrid):
    mr = prefill_runner(hybrid, None, "triton", device="cuda")
    assert all(sorted(r.graphs) == r.ladder.sizes == [16, 32, 64] for r in (mr.prefill, mr.spec.prefill))
    check_padded_prefill(mr, 2e-4)


@pytest.mark.parametrize("n", [1, 3])
def test_spec_greedy_equals_plain_and_hf_fp32_all_phases_graphed(hybrid, n):
    prompts = _prompts()
    ref = _hf_greedy(_hf(hybrid, "qwen3_next"), prompts, NEW)
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE, chunked_prefill_size=32,
              cuda_graph_max_prefill_tokens=64)
    plain, _ = build_scheduler(hybrid, **kw)
    assert [r.output_ids for r in run_greedy(plain, prompts, NEW)] == ref
    spec, _ = build_scheduler(hybrid, speculative_algorithm="MTP", speculative_num_steps=n, **kw)
    assert [r.output_ids for r in run_greedy(spec, prompts, NEW)] == ref
    mr = spec.model_runner
    assert all(r.graphs for r in mr.spec.phases.all())  # every phase captured
    assert mr.spec.spec_step_graph.graphs and mr.spec.spec_step_graph.replays > 0  # greedy steps ran as one graph
    for r in (mr.prefill, mr.spec.prefill):  # 32-token chunks: every prefill forward replayed a graph
        assert r.graphs and r.replays > 0 and r.eager_runs == 0, (r.name, r.replays, r.eager_runs)
    spec.check_idle_invariants()


def test_spec_greedy_bf16_match_rate(hybrid, capsys):
    prompts = _prompts()
    kw = dict(device="cuda", dtype=torch.bfloat16, max_total_tokens=4096, cuda_graph_bs=CAPTURE)
    a = [r.output_ids for r in run_greedy(build_scheduler(hybrid, **kw)[0], prompts, NEW)]
    b = [r.output_ids for r in run_greedy(build_scheduler(hybrid, speculative_algorithm="MTP",
                                                          speculative_num_steps=3, **kw)[0], prompts, NEW)]
    same = sum(x == y for u, v in zip(a, b) for x, y in zip(u, v))
    total = sum(len(u) for u in a)
    first_div = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
    with capsys.disabled():
        print(f"\n[hybrid bf16] spec vs plain greedy: {same}/{total} tokens equal ({100 * same / total:.1f}%), "
              f"first divergence per prompt: {first_div}")
    assert same / total > 0.5


@pytest.mark.parametrize("prefill", ["recurrent", "chunked"])
def test_no_leak_mixed_workload_gpu(hybrid, prefill):
    from test_kv_accounting import _workload

    from specserve import Engine

    prompts, params = _workload()
    kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8, speculative_algorithm="MTP",
              speculative_num_steps=3, cuda_graph_bs=[1, 2, 4, 8], schedule_conservativeness=0.0,
              linear_attn_prefill=prefill, dtype="float32")  # (the engine's GPU default is bfloat16)
    exp = Engine(model_path=hybrid, max_total_tokens=8192, **kw).generate(input_ids=prompts, sampling_params=params)
    tight = Engine(model_path=hybrid, max_total_tokens=160, **kw)
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert tight.scheduler.stats.num_retractions > 0
    tight.scheduler.check_idle_invariants()
    # A retracted request is re-prefilled: its recurrent state is rebuilt by the prefill kernels instead of the
    # step kernels, in another summation order, so a greedy near-tie may go the other way after many tokens.
    # Each engine's greedy tokens must be the target's argmax (transformers, teacher-forced) up to such ties.
    hf = _hf(hybrid, "qwen3_next")
    ties = 0
    for out in (got, exp):
        for p, sp, o in zip(prompts, params, out):
            if sp.get("temperature"):
                continue
            ids = o["output_ids"]
            logits = _hf_logits(hf, p + ids)[len(p) - 1:-1]  # [len(ids), V]: the logits each token was chosen by
            top = logits.max(dim=-1).values
            chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
            bad = (chosen < top - 1e-3).nonzero()
            assert not len(bad), (out is got, p, ids, bad[:3].tolist(), (top - chosen)[bad[:3, 0]].tolist())
            ties += int((chosen < top).sum())
    print(f"[hybrid mixed workload] tokens off the argmax by a near-tie (< 1e-3): {ties}")
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(got, exp))
    assert same >= len(prompts) - 2, f"only {same}/{len(prompts)} requests equal between tight and roomy engines"
