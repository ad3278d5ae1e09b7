"""The hybrid linear-attention family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE and the Qwen3.5-MoE vision-language layout
read as text) on small random checkpoints, against transformers:
- logits of a chunked prefill (several requests, one prompt longer than a chunk), a step decode, and 4-token
  verifies; after each verify the accept commit makes accept count a = 0..N current and the next verify continues
  from that slot (== transformers over prompt + accepted tokens);
- greedy MTP (the checkpoint's `mtp.*` layer) == plain == transformers greedy, N 1..4, page sizes 1 and 16,
  chunked prefill; retraction and aborts in a mixed workload return the KV and state pools to their start;
- the graph runners' static replay == eager with shrinking and growing batches (decode/verify phases, the
  one-graph spec step, prefill padded to a token ladder), and lossless speculative sampling on a hybrid target."""

import pytest
import torch
from hybrid_helpers import ARCHS, build_tiny_hybrid
from spec_fixtures import build_scheduler, run_greedy
from test_kv_accounting import test_abort_frees_kv as abort_workload
from test_kv_accounting import test_pool_returns_to_start_after_mixed_workload_with_retractions as mixed_workload
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
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.models.qwen3_next import HybridForCausalLM
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
    assert isinstance(t.model, HybridForCausalLM)
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
    for kind in ("qwen3_5", "qwen3_5_moe_vl"):  # dense MLPs everywhere; the VL checkpoint loads as text
        m = load_target(ModelSource.resolve(hybrids[kind]), torch.float32, CPU, 600).model
        want = GatedMLP if kind == "qwen3_5" else SparseMoEBlock
        assert all(type(lay.mlp) is want for lay in m.model.layers)
        assert sum(isinstance(x, GatedDeltaNet) for x in m.modules()) == 3


def _runner(path, n=3, **kw):
    t = load_target(ModelSource.resolve(path), torch.float32, CPU, 600)
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
    verify = mr.spec.runners["target_verify"]
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


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
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
        out = mr.runners["decode"].run(LiveInputs(2, tok, s, rows, s + 1, int(s.max()) + 1))
        for b in range(2):
            seqs[b].append(int(tok[b]))
            torch.testing.assert_close(out["logits"][b], _hf_logits(hf, seqs[b])[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def greedy_ref(hybrids):
    prompts = _prompts()
    return prompts, {k: _hf_greedy(_hf(hybrids[k], k), prompts, NEW) for k in ("qwen3_next", "qwen3_5")}


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
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
    assert isinstance(sched.mr.draft.decoder.mlp, SparseMoEBlock)
    reqs = run_greedy(sched, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref["qwen3_next"]
    assert all(r.spec_verify_ct > 0 for r in reqs)


def test_spec_greedy_dense_qwen3_5(hybrids, greedy_ref):
    prompts, ref = greedy_ref
    sched, _ = build_scheduler(hybrids["qwen3_5"], max_total_tokens=4096, speculative_algorithm="MTP",
                               speculative_num_steps=3)
    assert isinstance(sched.mr.draft.decoder.mlp, GatedMLP)
    assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == ref["qwen3_5"]


def test_phase_replay_equals_eager_and_isolation(hybrids):
    mr = _spec_runner(hybrids["qwen3_next"], n=3)
    runner = mr.spec.runners["target_verify"]
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
    assert mr.spec.spec_step.capture_bs == CAPTURE


@pytest.mark.parametrize("spec", [None, 3])
def test_mixed_workload_with_retractions(hybrids, spec):
    """A tight pool retracts and re-prefills (fresh zeroed state rows); outputs equal a roomy engine's; pages,
    page-table rows and state rows all come back."""
    mixed_workload(hybrids, spec, 16, key="qwen3_next")


def test_abort_frees_pages_and_state_rows(hybrids):
    abort_workload(hybrids, key="qwen3_5_moe")


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
