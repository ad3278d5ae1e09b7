"""The hybrid linear-attention family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE and the Qwen3.5 / Qwen3.5-MoE
vision-language layouts read as text) on small random checkpoints, against transformers:
- logits of a chunked prefill (several requests, one prompt longer than a chunk), a step decode, and 4-token
  verifies; after each verify the accept commit makes accept count a = 0..N current and the next verify continues
  from that slot (== transformers over prompt + accepted tokens);
- config parsing: `full_attention_interval` in place of `layer_types`, `mamba_ssm_dtype` (the state pool's dtype);
- the MTP layer's draft logits in DRAFT_EXTEND against a reference assembled from transformers' modules;
- greedy MTP (the checkpoint's `mtp.*` layer) == plain == transformers greedy, N 1..4, page sizes 1 and 16
  (Qwen3-Next; Qwen3.5-MoE at one N), chunked prefill; retraction and aborts in a mixed workload return the KV and
  state pools to their start;
- the graph runners' static replay == eager with shrinking and growing batches (decode/verify phases, the
  one-graph spec step, prefill padded to a token ladder), and lossless speculative sampling on a hybrid target."""

import pytest
import torch
from hybrid_helpers import ARCHS, build_tiny_hybrid, edit_config, hf_mtp_logits
from spec_fixtures import build_scheduler, run_greedy
from test_kv_accounting import test_abort_frees_kv as abort_workload
from test_kv_accounting import test_pool_returns_to_start_after_mixed_workload_with_retractions as mixed_workload
from test_overlap_schedule import test_arrivals_and_aborts_while_a_step_is_in_flight as overlap_arrivals
from test_overlap_schedule import test_first_tokens_that_end_a_request_while_its_prefill_is_in_flight as overlap_t0
from test_overlap_schedule import test_mixed_workload_matches_synchronous as overlap_workload
from test_overlap_schedule import test_spec_mixed_workload_matches_synchronous as overlap_spec_workload
from test_prefill_graph import check_padded_prefill, prefill_runner
from test_runners import CAPTURE, _inputs, _spec_runner, check_isolation, check_one_graph_step
from test_sampling_lossless import V, _exact_joint, _gof, _samples
from test_spec_greedy import _prompts

from specserve.engine.model_runner import ModelRunner
from specserve.graphs.padding import LiveInputs
from specserve.graphs.prefill import ExtendBatch
from specserve.kvcache.manager import KVHandle
from specserve.layers.gdn import GatedDeltaNet
from specserve.layers.moe import GatedMLP, SparseMoEBlock
from specserve.models.loader import ModelSource, load_hf_config, load_mtp_draft, load_target
from specserve.models.qwen3_next import FULL, LINEAR, Qwen3NextConfig, Qwen3NextForCausalLM
from specserve.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {kind: build_tiny_hybrid(str(root / kind), kind, seed=31 + i, mtp=True) for i, kind in enumerate(ARCHS)}


def _hf(path, kind):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if kind.endswith("_vl") else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def _hf_greedy(hf, prompts, new):
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def test_family_layers_and_caches(hybrids):
    t = load_target(ModelSource.resolve(hybrids["qwen3_next"]), torch.float32, CPU, 600)
    assert isinstance(t.model, Qwen3NextForCausalLM)
    layers = t.model.model.layers
    assert [lay.kind for lay in layers] == ["linear_attention"] * 3 + ["full_attention"]
    assert [type(lay.mlp) for lay in layers] == [SparseMoEBlock, GatedMLP, SparseMoEBlock, SparseMoEBlock]
    assert layers[0].mlp.fused_shared  # the gated shared expert, as wide as a routed one: expert E of the GEMM
    assert [lay.linear_attn.cache_index for lay in layers[:3]] == [0, 1, 2]
    assert layers[3].self_attn.attn.cache_index == 0  # its index among the MHA layers, not its layer number
    specs = t.model.cache_specs()
    assert [s.kind.value for s in specs] == ["recurrent"] * 3 + ["mha"]
    assert specs[0].conv_shape == (3, 2 * 32 + 64) and specs[0].ssm_shape == (4, 16, 16)
    assert specs[0].ssm_dtype == torch.float32 and t.has_mtp
    for kind in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe_vl"):  # one MLP kind everywhere; VL checkpoints as text
        m = load_target(ModelSource.resolve(hybrids[kind]), torch.float32, CPU, 600).model
        want = SparseMoEBlock if "moe" in kind else GatedMLP
        assert all(type(lay.mlp) is want for lay in m.model.layers)
        assert sum(isinstance(x, GatedDeltaNet) for x in m.modules()) == 3


def _runner(path, n=3, hf_config=None, **kw):
    t = load_target(ModelSource.resolve(path), torch.float32, CPU, 600, hf_config=hf_config)
    draft = load_mtp_draft(t, None, torch.float32, CPU, 600) if n else None
    args = ServerArgs(model_path=path, max_total_tokens=4096, max_running_requests=8, cuda_graph_bs=[1, 2, 4],
                      **({"speculative_algorithm": "MTP", "speculative_num_steps": n} if n else {}), **kw)
    return ModelRunner(args, t.model, t.config, draft, CPU, torch.float32, 512), t


def _prefill(mr, t, prompts, handles, chunk: int):
    """Prefill every prompt in chunks of at most `chunk` tokens, all requests in each forward -> logits per
    prompt [len, V]."""
    table = mr.req_to_token.table
    done = [0] * len(prompts)
    out = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        pieces = {i: prompts[i][done[i]:done[i] + chunk] for i in live}
        ids = sum((pieces[i] for i in live), [])
        pos = [done[i] + j for i in live for j in range(len(pieces[i]))]
        loc = torch.cat([table[handles[i].row, done[i]:done[i] + len(pieces[i])] for i in live])
        x = ExtendBatch(torch.tensor(ids), torch.tensor(pos), loc, [handles[i].row for i in live],
                        [done[i] + len(pieces[i]) for i in live], [len(pieces[i]) for i in live])
        logits = t.model.compute_logits(mr.prefill.run(x))
        at = 0
        for i in live:
            out[i].append(logits[at:at + len(pieces[i])])
            at += len(pieces[i])
            done[i] += len(pieces[i])
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("kind", list(ARCHS))
def test_prefill_verify_commit_logits_match_hf(hybrids, kind):
    """Chunked prefill, then verifies whose accept commit keeps 0..N of the verified tokens, each time compared
    with transformers over the tokens kept so far."""
    path, n = hybrids[kind], 3
    hf = _hf(path, kind)
    mr, t = _runner(path, n)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (k,), generator=g).tolist() for k in (9, 1, 30)]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + 4 * (n + 1)])
    for p, got in zip(prompts, _prefill(mr, t, prompts, handles, chunk=16)):
        torch.testing.assert_close(got, _hf_logits(hf, p), rtol=1e-4, atol=1e-4)
    seqs = [list(p) for p in prompts]
    rows = torch.tensor([h.row for h in handles])
    state = mr.caches.state
    srows = torch.tensor([h.state_row for h in handles])
    verify = mr.spec.phases.target_verify
    for step, accept in enumerate(([0, 3, 1], [2, 0, 3], [1, 2, 0], [3, 1, 2])):
        more = [torch.randint(3, 250, (n + 1,), generator=g).tolist() for _ in prompts]
        s = torch.tensor([len(x) for x in seqs])
        live = LiveInputs(3, torch.tensor(sum(more, [])), (s[:, None] + torch.arange(n + 1)).reshape(-1), rows,
                          s + n + 1, int(s.max()) + n + 1)
        out = verify.run(live)  # static replay at padded batch 4
        for b, m in enumerate(more):
            ref = _hf_logits(hf, seqs[b] + m)[-(n + 1):]
            torch.testing.assert_close(out["logits"][b], ref, rtol=1e-4, atol=1e-4, msg=f"step {step} row {b}")
        # keep tokens 0..a of the verified ones: slot a holds the state after them
        state.commit(srows, torch.tensor(accept))
        for b, a in enumerate(accept):
            seqs[b] += more[b][:a + 1]
    for h in handles:
        mr.kv.release(h)
    assert state.num_free_rows == state.max_rows


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_decode_logits_match_hf(hybrids, kind):
    """Plain decode (one state slot per row, updated in place) after a chunked prefill."""
    path = hybrids[kind]
    hf = _hf(path, kind)
    mr, t = _runner(path, n=0)
    assert mr.caches.state.slots_per_row == 1
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (k,), generator=g).tolist() for k in (5, 21)]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + 4])
    _prefill(mr, t, prompts, handles, chunk=8)
    seqs = [list(p) for p in prompts]
    rows = torch.tensor([h.row for h in handles])
    for _ in range(4):
        tok = torch.randint(3, 250, (2,), generator=g)
        s = torch.tensor([len(x) for x in seqs])
        out = mr.phases.decode.run(LiveInputs(2, tok, s, rows, s + 1, int(s.max()) + 1))
        for b in range(2):
            seqs[b].append(int(tok[b]))
            torch.testing.assert_close(out["logits"][b], _hf_logits(hf, seqs[b])[-1], rtol=1e-4, atol=1e-4)


def _prefill_logits_match_hf(mr, t, hf, lens, chunk, atol=1e-4, rtol=1e-4):
    """Chunked prefill of random prompts of `lens` tokens against transformers; the pages and rows are freed."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (k,), generator=g).tolist() for k in lens]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p)])
    for p, got in zip(prompts, _prefill(mr, t, prompts, handles, chunk)):
        torch.testing.assert_close(got, _hf_logits(hf, p), rtol=rtol, atol=atol)
    for h in handles:
        mr.kv.release(h)


def test_full_attention_interval_in_place_of_layer_types(hybrids, tmp_path):
    """A config that names `full_attention_interval` and no `layer_types` (Qwen3-Next's own config.json) gets the
    layer kinds of the equivalent `layer_types`: parsed by Qwen3NextConfig (4 by default), and as a checkpoint read
    through transformers, whose logits the engine's then match (two full-attention layers: MHA cache indices 0, 1)."""
    arch = "Qwen3NextForCausalLM"
    hf_cfg = load_hf_config(ModelSource.resolve(hybrids["qwen3_next"]))
    assert Qwen3NextConfig.from_hf(hf_cfg, arch).layer_types == [LINEAR] * 3 + [FULL]
    hf_cfg.layer_types = None
    assert Qwen3NextConfig.from_hf(hf_cfg, arch).layer_types == [LINEAR] * 3 + [FULL]  # no interval either: 4
    hf_cfg.full_attention_interval = 2
    assert Qwen3NextConfig.from_hf(hf_cfg, arch).layer_types == [LINEAR, FULL] * 2
    path = build_tiny_hybrid(str(tmp_path / "m"), "qwen3_next", seed=3, layer_types=None, full_attention_interval=2)
    edit_config(path, drop=("layer_types",), full_attention_interval=2)
    mr, t = _runner(path, n=0)
    layers = t.model.model.layers
    assert [lay.kind for lay in layers] == [LINEAR, FULL] * 2 == t.config.layer_types
    assert [layers[1].self_attn.attn.cache_index, layers[3].self_attn.attn.cache_index] == [0, 1]
    assert [layers[0].linear_attn.cache_index, layers[2].linear_attn.cache_index] == [0, 1]
    hf = _hf(path, "qwen3_next")
    assert hf.config.layer_types == [LINEAR, FULL] * 2
    _prefill_logits_match_hf(mr, t, hf, (21, 6), chunk=8)


def test_mamba_ssm_dtype_sets_state_pool_dtype(hybrids):
    """mamba_ssm_dtype (float32 by default) is the SSM state's dtype, not the model's: the state pool takes it, the
    conv state keeps the model's, and with a bfloat16 state the logits stay near transformers' (float32 state).
    A dtype other than float32, bfloat16 and float16 is a ValueError naming the field."""
    src = ModelSource.resolve(hybrids["qwen3_5"])
    arch = "Qwen3_5ForCausalLM"
    hf_cfg = load_hf_config(src)
    for name, want in (("float16", torch.float16), ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16),
                       ("float32", torch.float32)):
        hf_cfg.mamba_ssm_dtype = name
        assert Qwen3NextConfig.from_hf(hf_cfg, arch).ssm_dtype == want, name
    for bad in ("int8", "bool", "float17", "auto", "float8_e4m3fn", torch.float64):
        hf_cfg.mamba_ssm_dtype = bad
        with pytest.raises(ValueError, match="mamba_ssm_dtype"):
            Qwen3NextConfig.from_hf(hf_cfg, arch)
    hf_cfg.mamba_ssm_dtype = "bfloat16"
    mr, t = _runner(hybrids["qwen3_5"], n=0, hf_config=hf_cfg)
    assert all(s.ssm_dtype == torch.bfloat16 for s in t.model.cache_specs() if s.kind.value == "recurrent")
    state = mr.caches.state
    assert state.ssm.dtype == torch.bfloat16 and state.conv.dtype == torch.float32
    # logits up to ~7: a bfloat16 state carried over two chunk boundaries is off by ~0.06, a float8 one by ~2
    _prefill_logits_match_hf(mr, t, _hf(hybrids["qwen3_5"], "qwen3_5"), (21, 6), chunk=8, atol=0.1, rtol=0.0)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mtp_draft_extend_logits_match_reference(hybrids, kind):
    """The draft's logits over a 20-token prompt in DRAFT_EXTEND (the prefill's draft pass, two chunks: the second
    attends to the draft KV of the first), fed transformers' target hidden states, against the layer assembled from
    transformers' modules (hybrid_helpers.hf_mtp_logits): checks the [embedding ; hidden] order into mtp.fc, the
    zero-centred norms, the block and the shared head (a swapped concat order or swapped norms fail it)."""
    path = hybrids[kind]
    hf = _hf(path, kind)
    mr, _ = _runner(path, n=2)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 250, (21,), generator=g)
    t = ids.shape[0] - 1
    with torch.no_grad():
        hidden = hf.model(ids[None]).last_hidden_state[0, :t]  # [T, H] after the target's final norm
    want = hf_mtp_logits(hf, path, ids[1:], hidden)
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [t])
    loc = mr.req_to_token.table[h.row, :t]
    got = []
    for a, b in ((0, 8), (8, t)):  # input at p: (token p + 1, target hidden at p)
        x = ExtendBatch(ids[a + 1:b + 1], torch.arange(a, b), loc[a:b], [h.row], [b], [b - a], hidden[a:b])
        got.append(mr.draft.compute_logits(mr.spec.prefill.run(x)))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    mr.kv.release(h)


@pytest.fixture(scope="module")
def greedy_ref(hybrids):
    prompts = _prompts()
    kinds = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
    return prompts, {k: _hf_greedy(_hf(hybrids[k], k), prompts, NEW) for k in kinds}


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_plain_greedy_matches_hf(hybrids, greedy_ref, kind):
    prompts, ref = greedy_ref
    sched, _ = build_scheduler(hybrids[kind], max_total_tokens=4096, chunked_prefill_size=16)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref[kind]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_mtp_matches_plain_and_hf(hybrids, greedy_ref, n, page_size):
    """The checkpoint's mtp.* layer (MoE block) drafts; prompts prefilled in chunks of 16 tokens."""
    prompts, ref = greedy_ref
    sched, _ = build_scheduler(hybrids["qwen3_next"], page_size=page_size, max_total_tokens=4096,
                               chunked_prefill_size=16, speculative_algorithm="MTP", speculative_num_steps=n)
    assert isinstance(sched.model_runner.draft.decoder.mlp, SparseMoEBlock)
    reqs = run_greedy(sched, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref["qwen3_next"]
    assert all(r.spec_verify_ct > 0 for r in reqs)


def test_spec_greedy_dense_qwen3_5(hybrids, greedy_ref):
    prompts, ref = greedy_ref
    sched, _ = build_scheduler(hybrids["qwen3_5"], max_total_tokens=4096, speculative_algorithm="MTP",
                               speculative_num_steps=3)
    assert isinstance(sched.model_runner.draft.decoder.mlp, GatedMLP)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["qwen3_5"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_mtp_qwen3_5_moe_matches_plain_and_hf(hybrids, greedy_ref, page_size):
    """Qwen3.5-MoE: its mtp.* layer (an MoE block) drafts, N = 2, prompts prefilled in chunks of 16 tokens -> the
    tokens of the same engine decoding plainly, and transformers' greedy tokens."""
    prompts, ref = greedy_ref
    kw = dict(page_size=page_size, max_total_tokens=4096, chunked_prefill_size=16)
    plain, _ = build_scheduler(hybrids["qwen3_5_moe"], **kw)
    spec, _ = build_scheduler(hybrids["qwen3_5_moe"], speculative_algorithm="MTP", speculative_num_steps=2, **kw)
    assert isinstance(spec.model_runner.draft.decoder.mlp, SparseMoEBlock)
    want = [r.output_ids for r in run_greedy(plain, prompts, NEW)]
    reqs = run_greedy(spec, prompts, NEW)
    assert [r.output_ids for r in reqs] == want == ref["qwen3_5_moe"]
    assert all(r.spec_verify_ct > 0 for r in reqs)


def test_phase_replay_equals_eager_and_isolation(hybrids):
    mr = _spec_runner(hybrids["qwen3_next"], n=3)
    runner = mr.spec.phases.target_verify
    state = mr.caches.state
    for i, bs in enumerate([7, 3, 1, 5, 8]):
        handles, live = _inputs(mr, "target_verify", bs, seed=10 * i)
        before = (state.conv.clone(), state.ssm.clone())
        eager = {k: v.clone() for k, v in runner.forward_phase(live, runner.eager_backends, False).items()}
        after = (state.conv.clone(), state.ssm.clone())
        state.conv.copy_(before[0])
        state.ssm.copy_(before[1])
        out = runner.run(live)
        for k in eager:
            # padded vs unpadded batches reduce in another order: logits of ~10 agree to ~1e-5 relative
            torch.testing.assert_close(out[k], eager[k], rtol=1e-4, atol=1e-4, msg=f"bs={bs} {k}")
        rows = [h.state_row for h in handles]
        for got, want in zip((state.conv, state.ssm), after):  # every live row's slots, as eager wrote them
            torch.testing.assert_close(got[:, rows], want[:, rows], rtol=1e-4, atol=1e-4)
        for h in handles:
            mr.kv.release(h)
    check_isolation(mr)
    check_one_graph_step(mr, [7, 5, 3, 1, 2, 8, 6], 1e-4)
    assert mr.spec.spec_step_graph.capture_bs == CAPTURE


@pytest.mark.parametrize("spec", [None, 3])
def test_mixed_workload_with_retractions(hybrids, spec):
    """A tight pool retracts and re-prefills (fresh zeroed state rows); outputs equal a roomy engine's; pages,
    page-table rows and state rows all come back."""
    mixed_workload(hybrids, spec, 16, key="qwen3_next")


def test_abort_frees_pages_and_state_rows(hybrids):
    abort_workload(hybrids, key="qwen3_5_moe")


def test_overlap_schedule_matches_synchronous(hybrids):
    """State rows freed, re-zeroed and reused while a plain step is in flight (stops, retractions, aborts)."""
    overlap_workload(hybrids, 160, key="qwen3_next")
    overlap_arrivals(hybrids, key="qwen3_5_moe")
    overlap_spec_workload(hybrids, 3, 160, key="qwen3_next")  # the accept commit of rows continuing on the device
    overlap_t0(hybrids, dict(speculative_algorithm="MTP", speculative_num_steps=2), key="qwen3_next")  # state rows


def test_padded_prefill_graph_equals_eager(hybrids):
    """Prefill padded to the token ladder (the padding request and idle request slots on state row 0) against the
    eager forward: outputs, KV and every live state row."""
    check_padded_prefill(prefill_runner(hybrids["qwen3_next"], None, "torch"), 1e-4)


@pytest.fixture(scope="module")
def small_vocab_hybrid(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hv12") / "m")
    # dense Qwen3.5: transformers computes the exact distribution in float64, which its MoE kernels lack
    return build_tiny_hybrid(path, "qwen3_5", seed=6, vocab_size=V, hidden_size=32, logit_scale=2.5)


def test_lossless_sampling_on_hybrid_target(small_vocab_hybrid):
    """Speculative sampling (N = 3) and plain sampling follow transformers' exact distribution (chi-square on the
    three first tokens' marginals; test_sampling_lossless.py)."""
    params = (1.0, V, 1.0)
    joint = _exact_joint(small_vocab_hybrid, params)
    for spec in ({}, {"speculative_algorithm": "MTP", "speculative_num_steps": 3}):
        s = _samples(small_vocab_hybrid, params, **spec)
        for pos in range(3):
            marg = joint.sum(axis=tuple(i for i in range(3) if i != pos))
            assert _gof(s[:, pos], marg) > 1e-3, (spec, pos)
