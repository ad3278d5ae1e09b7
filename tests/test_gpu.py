"""GPU tests (skipped on CPU; run on the H200 and recorded in BENCHMARKS.md):

- CUDA-graph replay equals the eager run for every phase runner, with shrinking then growing batch sizes (also
  with an aux-layer draft), and so does the greedy step captured as one graph (also with context lookup);
- greedy speculative output equals greedy plain output on the GPU in float32 (random MTP layer, and an oracle
  drafter that exercises every accept path); in bfloat16 the match rate is measured and printed;
- no KV leak after a mixed workload with retractions;
- graphs on and --disable-cuda-graph give the same greedy tokens;
- the overlap schedule (on by default on a GPU) gives the synchronous schedule's tokens, with retractions, arrivals
  while a step is in flight and aborts.
"""

import pytest
import torch
from spec_fixtures import ForcedSteps, OracleDraft, build_scheduler
from test_prefill_graph import check_padded_prefill, prefill_runner
from test_runners import _inputs, check_one_graph_step, token_caches
from test_spec_greedy import _hf_greedy, _prompts, _run

from specserve.engine.model_runner import ModelRunner
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.server_args import ServerArgs

pytestmark = pytest.mark.gpu
CAPTURE = [1, 2, 4, 8, 16]


def _cuda_spec_runner(path, n, page_size, dtype=torch.float32, draft_path=None, lookup=False):
    dev = torch.device("cuda")
    t = load_target(ModelSource.resolve(path), dtype, dev, 600)
    draft = load_mtp_draft(t, draft_path, dtype, dev, 600)
    args = ServerArgs(model_path=path, page_size=page_size, max_total_tokens=16384, max_running_requests=32,
                      speculative_algorithm="MTP", speculative_num_steps=n, cuda_graph_bs=CAPTURE,
                      speculative_ngram_lookup=lookup)
    mr = ModelRunner(args, t.model, t.config, draft, dev, dtype, 512)
    mr.capture_graphs()
    g = torch.Generator(device=dev).manual_seed(0)
    for cache in token_caches(mr.caches) + token_caches(mr.spec.caches):  # K/V or latent rows of every layer
        cache.copy_(torch.randn(cache.shape, generator=g, device=dev))
    return mr


def _to(live, dev):
    fields = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in vars(live).items()}
    return type(live)(**fields)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("models", [("llama_mtp", None), ("llama", "llama_draft_aux")])
def test_graph_replay_equals_eager_every_phase(tiny_models, n, page_size, models):
    """Also with an aux-layer draft (feature-wide verify output and draft-extend input)."""
    target, draft = models
    mr = _cuda_spec_runner(tiny_models[target], n, page_size, draft_path=draft and tiny_models[draft])
    check_phase_replay_gpu(mr, seed=n)


def check_phase_replay_gpu(mr, seed: int = 0, sizes=(13, 9, 5, 3, 1, 2, 7, 16), tol: float = 2e-4) -> None:
    """Every speculative phase captured; each one's graph replay == its eager forward, shrinking then growing."""
    assert all(r.graphs for r in mr.spec.phases.all()), "every phase must be captured"
    for runner in mr.spec.phases.all():
        name = runner.name
        for i, bs in enumerate(sizes):
            handles, live = _inputs(mr, name, bs, seed=100 * i + seed)
            live = _to(live, mr.device)
            eager = {k: v.clone() for k, v in runner.forward_phase(live, runner.eager_backends, False).items()}
            out = runner.run(live)
            for k in eager:
                torch.testing.assert_close(out[k], eager[k], rtol=tol, atol=tol, msg=f"{name} bs={bs} {k}")
            for h in handles:
                mr.kv.release(h)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("models,lookup", [(("llama_mtp", None), False), (("llama", "llama_draft_aux"), True)])
def test_one_graph_spec_step_equals_eager_phases_gpu(tiny_models, n, page_size, models, lookup):
    """The greedy step captured as one CUDA graph against its phases run eagerly, shrinking then growing."""
    target, draft = models
    mr = _cuda_spec_runner(tiny_models[target], n, page_size, draft_path=draft and tiny_models[draft],
                           lookup=lookup)
    assert mr.spec.spec_step_graph.graphs
    check_one_graph_step(mr, [13, 9, 5, 3, 1, 2, 7, 16], 2e-4)


def test_prefill_graphs_equal_eager_gpu(tiny_models):
    """Prefill (target and draft extend) captured per padded token count, against the eager forward: shrinking and
    growing token and request counts, with prefixes; over the bound runs eagerly."""
    mr = prefill_runner(tiny_models["llama"], tiny_models["llama_draft_aux"], "triton", device="cuda")
    assert all(sorted(r.graphs) == r.ladder.sizes == [16, 32, 64] for r in (mr.prefill, mr.spec.prefill))
    check_padded_prefill(mr, 2e-4)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_spec_greedy_equals_plain_fp32(tiny_models, n):
    prompts = _prompts()
    ref = _hf_greedy(tiny_models["llama_mtp"], prompts)
    plain, _ = build_scheduler(tiny_models["llama_mtp"], device="cuda", max_total_tokens=4096,
                               cuda_graph_bs=CAPTURE)
    assert [r.output_ids for r in _run(plain, prompts)] == ref
    spec, _ = build_scheduler(tiny_models["llama_mtp"], device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE,
                              speculative_algorithm="MTP", speculative_num_steps=n)
    assert [r.output_ids for r in _run(spec, prompts)] == ref
    seqs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, ref))}
    oracle = OracleDraft(64, seqs, wrong_every=5, vocab=256)
    # every step speculates (the accept length is the point; adaptive speculation would take plain steps here)
    spec, _ = build_scheduler(tiny_models["llama_mtp"], draft=oracle, device="cuda", max_total_tokens=4096,
                              cuda_graph_bs=CAPTURE, speculative_algorithm="MTP", speculative_num_steps=n,
                              speculative_adaptive=False)
    reqs = _run(spec, prompts)
    assert [r.output_ids for r in reqs] == ref
    assert spec.stats.spec_accept_length > 1.0 + 0.4 * min(n, 3)
    assert all(r.graphs for r in spec.model_runner.spec.phases.all())
    graph = spec.model_runner.spec.spec_step_graph
    assert graph.graphs and graph.replays > 0  # greedy steps: the one-graph step


def test_spec_greedy_bf16_match_rate(tiny_models, capsys):
    prompts = _prompts()
    plain, _ = build_scheduler(tiny_models["llama_mtp"], device="cuda", dtype=torch.bfloat16,
                               max_total_tokens=4096, cuda_graph_bs=CAPTURE)
    a = [r.output_ids for r in _run(plain, prompts)]
    spec, _ = build_scheduler(tiny_models["llama_mtp"], device="cuda", dtype=torch.bfloat16, max_total_tokens=4096,
                              cuda_graph_bs=CAPTURE, speculative_algorithm="MTP", speculative_num_steps=3)
    b = [r.output_ids for r in _run(spec, prompts)]
    same = sum(x == y for u, v in zip(a, b) for x, y in zip(u, v))
    first_div = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
    total = sum(len(u) for u in a)
    with capsys.disabled():
        print(f"\n[bf16] spec vs plain greedy: {same}/{total} tokens equal ({100 * same / total:.1f}%), "
              f"first divergence per prompt: {first_div}")
    assert same / total > 0.5  # bf16 rounding may flip near-ties; most tokens still agree


def test_no_kv_leak_mixed_workload_gpu(tiny_models):
    from test_kv_accounting import _workload

    from specserve import Engine

    prompts, params = _workload()
    kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8, speculative_algorithm="MTP",
              speculative_num_steps=3, cuda_graph_bs=[1, 2, 4, 8])
    roomy = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=8192, **kw)
    tight = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=160, **kw)
    exp = roomy.generate(input_ids=prompts, sampling_params=params)
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert tight.scheduler.stats.num_retractions > 0
    tight.scheduler.check_idle_invariants()
    roomy.scheduler.check_idle_invariants()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in exp]


def test_graphs_on_and_off_give_same_tokens(tiny_models):
    from specserve import Engine

    prompts = _prompts(2)
    sp = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    outs = []
    for off in (False, True):
        eng = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
                     speculative_num_steps=3, disable_cuda_graph=off, cuda_graph_bs=CAPTURE)
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)])
        runners = eng.core.model_runner.spec.phases.all()
        assert all(bool(r.graphs) != off for r in runners)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("pattern", [[True, False], [True]])
def test_adaptive_plain_steps_gpu(tiny_models, pattern):
    """Adaptive speculation is on by default on CUDA: the target's width-1 runner and the one-graph plain step are
    captured, and plain steps interleaved with speculative ones (forced; the draft catching up before each
    speculative step) give transformers' greedy tokens."""
    prompts = _prompts()
    ref = _hf_greedy(tiny_models["llama_mtp"], prompts)
    spec, _ = build_scheduler(tiny_models["llama_mtp"], device="cuda", max_total_tokens=4096, cuda_graph_bs=CAPTURE,
                              speculative_algorithm="MTP", speculative_num_steps=3)
    mr = spec.model_runner
    assert mr.adaptive_spec and mr.phases.plain_verify.graphs and mr.spec.prefill.graphs
    spec.adaptive = ForcedSteps(pattern)
    assert [r.output_ids for r in _run(spec, prompts)] == ref
    one = mr.spec.plain_step_graph
    assert one.graphs and spec.stats.spec_plain_steps > 0 and one.replays_by_kind["greedy"] > 0
    assert mr.spec.catch_ups["before_spec"] > 0 or pattern == [True]
    spec.check_idle_invariants()



@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_step_graph_gpu(tiny_models, temperature):
    """Plain decoding on CUDA runs as the one-graph plain step (decode, sampling, last-token update captured
    together): the same tokens as with CUDA graphs off (sampling noise is counter-based), greedy and sampled with a
    filter, through shrinking batches (requests of different lengths)."""
    from specserve import Engine

    prompts = _prompts(5)
    sp = [{"max_new_tokens": 8 + 3 * i, "temperature": temperature, "top_p": 0.9, "top_k": 50, "ignore_eos": True,
           "seed": i} for i in range(len(prompts))]
    outs = []
    for off in (False, True):
        eng = Engine(model_path=tiny_models["llama"], max_total_tokens=4096, disable_cuda_graph=off,
                     cuda_graph_bs=CAPTURE, dtype="float32")
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)])
        one = eng.core.model_runner.decode_step_graph
        assert bool(one.graphs) != off and (one.replays > 0) != off
        eng.core.scheduler.check_idle_invariants()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("spec", [0, 3])
@pytest.mark.parametrize("total", [8192, 160])
def test_overlap_schedule_matches_synchronous_gpu(tiny_models, total, spec):
    from test_kv_accounting import _workload
    from test_overlap_schedule import _drive, _reqs

    from specserve import Engine

    prompts, params = _workload()
    kw = dict(model_path=tiny_models["llama_mtp" if spec else "llama"], context_length=128, chunked_prefill_size=32,
              max_running_requests=8, schedule_conservativeness=0.0, max_total_tokens=total, cuda_graph_bs=[1, 2, 4, 8])
    if spec:  # every step speculates: adaptive speculation steers by measured step times, which differ between the
        # two engines, and a sampled request's tokens depend on which steps speculated (the same distribution)
        kw.update(speculative_algorithm="MTP", speculative_num_steps=spec, speculative_adaptive=False)
    sync = Engine(disable_overlap_schedule=True, **kw)
    eng = Engine(**kw)
    assert eng.scheduler.overlap and not sync.scheduler.overlap
    exp = sync.generate(input_ids=prompts, sampling_params=params)
    got = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in exp]
    st = eng.scheduler.stats
    assert st.num_overlapped_steps > st.num_decode_steps // 3 and (st.num_retractions > 0) == (total == 160)
    assert st.num_overlapped_prefills > 0  # prompts admitted while a step was in flight: their t0 read later
    mr = eng.core.model_runner
    assert (mr.spec.spec_step_graph if spec else mr.decode_step_graph).replays > 0
    eng.scheduler.check_idle_invariants()
    outs = []
    for e in (sync, eng):
        reqs = _reqs(6, 14)
        _drive(e.scheduler, reqs, {0: 0, 1: 0, 2: 3, 3: 4, 4: 9, 5: 9}, {1: 6, 4: 12})
        outs.append([r.output_ids for r in reqs])
    for i, (a, b) in enumerate(zip(*outs)):
        assert b == a if i not in (1, 4) else b == a[:len(b)]


@pytest.mark.parametrize("n", [2, 4])
def test_spec_overlap_long_accepts_gpu(tiny_models, n):
    """An oracle drafter (runs of accepted drafts: S advances by 1..N+1 on the device between reads), float32
    graphs: the overlap schedule's tokens == the synchronous schedule's."""
    from spec_fixtures import run_greedy
    from test_overlap_schedule import _oracle_scheduler

    outs = []
    for overlap in (False, True):
        sched, prompts, ref = _oracle_scheduler(tiny_models, n, overlap, device="cuda", cuda_graph_bs=CAPTURE)
        reqs = run_greedy(sched, prompts, len(ref[0]))
        outs.append([r.output_ids for r in reqs])
        assert sched.model_runner.spec.spec_step_graph.replays > 0 and (sched.stats.num_overlapped_steps > 0) == overlap
        assert max(sched.stats.recent_accept) == n + 1
    assert outs[0] == outs[1]


def test_qkv_prep_in_the_gemv_epilogue_gpu(tiny_models):
    """--decode-gemv triton takes Llama's and Qwen3's q/k prep (Qwen3's q/k norms, rotary, K/V store) into the qkv
    GEMV's epilogue (kernels/triton_gemv.py norm_gemv_rope_store; 'auto' on the shapes of gemv_policy.FASTER_PREP /
    FASTER_NORM_PREP only) and gives cuBLAS's greedy tokens in float32, plain and speculative, through the graphs.
    One request at a time: the epilogue takes one row (at more rows these shapes run the skinny GEMM, which has
    none, and the layer the separate prep), so plain decode and the draft's steps run it; the target's verify rows
    do not."""
    from specserve import Engine
    from specserve.models.decoder_layer import PreNormDecoderLayer

    prompts = _prompts(3)
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    mtp = dict(speculative_algorithm="MTP", speculative_num_steps=3)
    for path, spec in (("llama", {}), ("llama_mtp", mtp), ("qwen3_mtp", mtp)):  # qwen3: the q/k norms too
        outs = {}
        for mode in ("cublas", "triton"):
            eng = Engine(model_path=tiny_models[path], max_total_tokens=4096, dtype="float32", decode_gemv=mode,
                         cuda_graph_bs=CAPTURE, **spec)
            layers = [m for m in eng.core.model_runner.target.modules() if isinstance(m, PreNormDecoderLayer)]
            assert layers and all(m.fused_prep == (mode == "triton") for m in layers)
            outs[mode] = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
        assert outs["triton"] == outs["cublas"]
