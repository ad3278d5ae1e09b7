"""Phase runners on CPU ("static replay"): padding contract, staging, buffer isolation, mRoPE.

- every runner's padded replay equals the unpadded eager run, for shrinking then growing batch sizes;
- a draft-phase replay leaves the target runners' buffers (inputs and attention metadata) untouched, and back;
- mRoPE staging keeps per-row offsets (text positions are broadcast to three rows), padded rows are zeroed, and
  the draft loop advances all three rows by one per step;
- for text, three identical mRoPE rows give the same logits as 1-D RoPE.
"""

import dataclasses

import pytest
import torch
from torch import nn

from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.batch import CacheKind, ForwardBatch
from specserve.engine.model_runner import ModelRunner
from specserve.graphs.padding import LiveInputs
from specserve.graphs.phase_runners import RunnerContext, eager_phase
from specserve.kernels import reference as ref
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.manager import KVHandle
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.layers.sampler import GREEDY, SamplingBatch, sample
from specserve.models.dense import DenseForCausalLM
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.server_args import ServerArgs
from specserve.speculative.draft_runners import DraftDecodeRunner, DraftExtendRunner
from specserve.speculative.draft_state import DraftChooser
from specserve.speculative.spec_step import spec_step_device

CAPTURE = [1, 2, 4, 8]


def token_caches(caches) -> list[torch.Tensor]:
    """Every token-indexed cache tensor of a model's pools ([slots, ...], slot 0 first): MHA K and V, latent rows."""
    out = []
    for kind, pool in caches.pools.items():
        if kind is CacheKind.MHA:
            out += [*pool.k, *pool.v]
        elif kind.token_indexed:
            out += list(pool.rows)
    return out


def _spec_runner(path, n=3, page_size=1, draft_path=None, lookup=False):
    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600)
    draft = load_mtp_draft(t, draft_path, torch.float32, torch.device("cpu"), 600)
    args = ServerArgs(model_path=path, page_size=page_size, max_total_tokens=8192, max_running_requests=16,
                      speculative_algorithm="MTP", speculative_num_steps=n, cuda_graph_bs=CAPTURE,
                      speculative_ngram_lookup=lookup)
    mr = ModelRunner(args, t.model, t.config, draft, torch.device("cpu"), torch.float32, 512)
    # Non-trivial cache contents so attention over the prefix matters.
    g = torch.Generator().manual_seed(0)
    for cache in token_caches(mr.caches) + token_caches(mr.spec.caches):
        cache.copy_(torch.randn(cache.shape, generator=g))
    return mr


def _requests(mr, bs, n, seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(n + 2, 300, (bs,), generator=g)
    handles = []
    for s in seq.tolist():
        h = KVHandle()
        assert mr.kv.assign_row(h)
        assert mr.kv.ensure([h], [s + n + 1])
        handles.append(h)
    rows = torch.tensor([h.row for h in handles])
    return handles, rows, seq


def _inputs(mr, name, bs, seed):
    n = mr.num_steps
    handles, rows, s = _requests(mr, bs, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    h = mr.cfg.hidden_size
    if name == "target_verify":
        w = n + 1
        pos = (s[:, None] + torch.arange(w)).reshape(-1)
        live = LiveInputs(bs, torch.randint(0, 256, (bs * w,), generator=g), pos, rows, s + w, int(s.max()) + w)
    elif name == "draft_decode":
        live = LiveInputs(bs, torch.randint(0, 256, (bs,), generator=g), s, rows, s + 1, int(s.max()) + n,
                          hidden=torch.randn(bs, h, generator=g))
    else:  # draft_extend
        w = n + 1
        pos = (s[:, None] + torch.arange(w)).reshape(-1)
        live = LiveInputs(bs, torch.randint(0, 256, (bs * w,), generator=g), pos, rows, s + w, int(s.max()) + w,
                          accept_len=torch.randint(0, w, (bs,), generator=g),
                          hidden=torch.randn(bs * w, mr.draft.feature_size, generator=g))  # target features
    return handles, live


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("models", [("llama_mtp", None), ("llama", "llama_draft_aux")])
def test_replay_equals_eager_shrinking_and_growing(tiny_models, page_size, models):
    """Also with an aux-layer draft: the verify output and the draft extend input are then wider than H."""
    target, draft = models
    mr = _spec_runner(tiny_models[target], n=3, page_size=page_size,
                      draft_path=draft and tiny_models[draft])
    for runner in mr.spec.phases.all():
        name = runner.name
        for i, bs in enumerate([7, 5, 3, 1, 2, 8, 6]):  # shrinking, then growing
            handles, live = _inputs(mr, name, bs, seed=100 * i + len(name))
            eager = runner.forward_phase(live, runner.eager_backends, graph_mode=False)
            eager = {k: v.clone() for k, v in eager.items()}
            before = runner.replays
            out = runner.run(live)
            assert runner.replays == before + 1, "expected a padded static replay"
            for k in eager:
                assert out[k].shape == eager[k].shape
                torch.testing.assert_close(out[k], eager[k], rtol=1e-5, atol=1e-5, msg=f"{name} bs={bs} {k}")
            # the padded rows were re-zeroed: index buffers past the live rows hold the contract's values
            pbs = runner.padded_bs(bs)
            b = runner.buffers
            assert torch.all(b.req_pool_indices[bs:pbs] == 0)
            assert torch.all(b.seq_lens[bs:pbs] == runner.width)
            assert torch.all(b.positions[..., bs * runner.width:pbs * runner.width] == 0)
            assert torch.all(b.input_ids[bs * runner.width:pbs * runner.width] == 0)
            for h in handles:
                mr.kv.release(h)


def _snapshot(runner):
    tensors = dict(runner.buffers.tensors())
    for kind, backend in runner.backends.items():  # every kind's metadata
        tensors.update({f"backend.{kind.value}.{k}": v for k, v in backend.graph_buffers.items()})
    return {k: v.clone() for k, v in tensors.items()}


def test_draft_replay_leaves_target_buffers_untouched(tiny_models):
    check_isolation(_spec_runner(tiny_models["llama_mtp"], n=3))


def check_phase_replay(mr, sizes=(7, 3, 1, 5, 8), tol=1e-4):
    """Every speculative phase runner's static replay (padded to a captured size) against its eager forward, with
    shrinking and growing batch sizes."""
    for runner in mr.spec.phases.all():
        name = runner.name
        for i, bs in enumerate(sizes):
            handles, live = _inputs(mr, name, bs, seed=10 * i + len(name))
            eager = {k: v.clone() for k, v in runner.forward_phase(live, runner.eager_backends, False).items()}
            out = runner.run(live)
            for k in eager:
                torch.testing.assert_close(out[k], eager[k], rtol=tol, atol=tol, msg=f"{name} bs={bs} {k}")
            for h in handles:
                mr.kv.release(h)


def check_isolation(mr):
    """Draft replays leave the target runners' buffers and every kind's metadata untouched, and back."""
    phases = mr.spec.phases
    target, drafts = phases.target_verify, [phases.draft_decode, phases.draft_extend]
    def run(r, bs, seed):
        handles, live = _inputs(mr, r.name, bs, seed=seed)
        r.run(live)
        for h in handles:
            mr.kv.release(h)

    run(target, 5, 1)
    snap = _snapshot(target)
    assert all(CacheKind.RECURRENT not in r.backends for r in drafts)  # the MTP block is attention: no state
    for kind, backend in target.backends.items():
        assert all(backend is not r.backends.get(kind) for r in drafts)
        if kind.token_indexed:
            assert all(backend.kv_pool is not r.backends[kind].kv_pool for r in drafts)  # the draft's own pools
    for r in drafts:
        for bs in (3, 7):
            run(r, bs, bs)
    after = _snapshot(target)
    for k in snap:
        assert torch.equal(snap[k], after[k]), f"draft replay changed the target's {k}"
    # and the other way round
    dsnap = [_snapshot(r) for r in drafts]
    for bs in (2, 6):
        run(target, bs, 10 + bs)
    for r, s in zip(drafts, dsnap):
        now = _snapshot(r)
        for k in s:
            assert torch.equal(s[k], now[k]), f"target replay changed {r.name}'s {k}"


class PositionProbe(nn.Module):
    """Records the rope positions each forward receives."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden
        self.feature_size = hidden  # as a draft reading the final hidden state only
        self.seen = []

    def forward(self, fb: ForwardBatch):
        self.seen.append(fb.positions.clone())
        return torch.zeros(fb.input_ids.shape[0], self.hidden)

    def draft_tokens(self, hidden):
        return torch.zeros(hidden.shape[0], dtype=torch.int64)

    def chained(self, out):
        return out


def _probe_ctx(probe, mrope=True):
    rtt = ReqToTokenPool(16, 64, torch.device("cpu"))
    pool = KVPool(1, 64, 1, 8, torch.float32, torch.device("cpu"))
    return RunnerContext(probe, rtt, lambda: {CacheKind.MHA: TorchAttentionBackend(rtt, pool)}, torch.device("cpu"),
                         8, torch.float32, mrope, 64)


def test_mrope_staging_keeps_offsets_and_draft_loop_advances_rows():
    probe = PositionProbe(8)
    runner = DraftDecodeRunner(_probe_ctx(probe), DraftChooser(probe), num_steps=3, capture_bs=[1, 4], use_graphs=True)
    # three requests with multimodal offsets: rows differ per request
    pos3 = torch.tensor([[10, 20, 30], [4, 15, 27], [9, 21, 33]])  # [3 rows, bs]
    live = LiveInputs(3, torch.tensor([1, 2, 3]), pos3, torch.tensor([1, 2, 3]), torch.tensor([11, 21, 31]), 40,
                      hidden=torch.randn(3, 8))
    runner.run(live)
    assert len(probe.seen) == 3
    for i, seen in enumerate(probe.seen):
        assert seen.shape == (3, 4)  # padded to bs 4, all three rows
        assert torch.equal(seen[:, :3], pos3 + i), f"step {i} did not advance every mRoPE row by {i}"
        assert torch.equal(seen[:, 3], torch.full((3,), i)), "padded row must start at position 0"
    # text (1-D) live positions are broadcast to the three rows
    probe.seen.clear()
    live1 = dataclasses.replace(live, batch_size=2, input_ids=live.input_ids[:2], positions=torch.tensor([5, 8]),
                                req_pool_indices=live.req_pool_indices[:2], seq_lens=live.seq_lens[:2],
                                hidden=live.hidden[:2])
    runner.run(live1)
    assert torch.equal(probe.seen[0][:, :2], torch.tensor([[5, 8]] * 3))
    assert torch.equal(probe.seen[0][:, 2:], torch.zeros(3, 2, dtype=torch.int64)), "stale rows leaked"
    # the eager path (graphs off) advances the rows the same way
    probe.seen.clear()
    eager = DraftDecodeRunner(_probe_ctx(probe), DraftChooser(probe), num_steps=3, capture_bs=[1, 4], use_graphs=False)
    eager.run(live)
    for i, seen in enumerate(probe.seen):
        assert torch.equal(seen, pos3 + i)


def test_draft_extend_stages_mrope_rows():
    probe = PositionProbe(8)
    runner = DraftExtendRunner(_probe_ctx(probe), DraftChooser(probe), width=2, capture_bs=[4], use_graphs=True)
    pos3 = torch.tensor([[3, 4, 7, 8], [1, 2, 5, 6], [9, 10, 11, 12]])
    runner.run(LiveInputs(2, torch.arange(4), pos3, torch.tensor([1, 2]), torch.tensor([5, 9]), 16,
                          accept_len=torch.tensor([0, 1]), hidden=torch.randn(4, 8)))
    assert torch.equal(probe.seen[0][:, :4], pos3)
    assert torch.all(probe.seen[0][:, 4:] == 0)


def test_rope_three_identical_rows_equal_1d():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 16, generator=g)
    pos = torch.randint(0, 64, (9,), generator=g)
    q = torch.randn(9, 4, 16, generator=g)
    c1, s1 = ref.rope_cos_sin(cache, pos, None)
    c3, s3 = ref.rope_cos_sin(cache, pos[None].expand(3, 9), [2, 3, 3])
    torch.testing.assert_close(ref.apply_rope(q, c1, s1), ref.apply_rope(q, c3, s3), rtol=0, atol=0)
    # and different rows do change the result (the sections are really used)
    c3b, s3b = ref.rope_cos_sin(cache, torch.stack([pos, pos + 1, pos + 2]), [2, 3, 3])
    assert not torch.allclose(ref.apply_rope(q, c1, s1), ref.apply_rope(q, c3b, s3b))


def test_mrope_model_text_positions_match_1d_model(tiny_models):
    t = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, torch.device("cpu"), 600)
    cfg3 = dataclasses.replace(t.config, mrope_section=[2, 3, 3])  # head_dim 16 -> half 8
    m3 = DenseForCausalLM(cfg3, 600)
    m3.load_state_dict(t.model.state_dict())
    m3.requires_grad_(False)
    outs = []
    for model, mrope in ((t.model, False), (m3, True)):
        args = ServerArgs(model_path=tiny_models["llama"], max_total_tokens=4096, cuda_graph_bs=[1, 4])
        mr = ModelRunner(args, model, cfg3 if mrope else t.config, None, torch.device("cpu"), torch.float32, 512)
        _, rows, s = _requests(mr, 3, 0, seed=4)
        live = LiveInputs(3, torch.tensor([5, 6, 7]), s, rows, s + 1, int(s.max()) + 1)
        outs.append(mr.phases.decode.run(live)["logits"].clone())
        assert mr.phases.decode.buffers.positions.dim() == (2 if mrope else 1)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _state(mr):
    """Everything a speculative step writes: per-row state and both KV pools, less page-table row 0 and KV slot
    0 (the dummy row and slot that padded rows write)."""
    rs = mr.spec.state
    out = {"last_token": mr.last_token, "draft_token": rs.draft_token, "draft_hidden": rs.draft_hidden}
    if rs.tokens is not None:
        out["tokens"] = rs.tokens
    for name, caches in (("target", mr.caches), ("draft", mr.spec.caches)):
        out.update({f"{name}.cache{i}": c for i, c in enumerate(token_caches(caches))})
    state = mr.caches.state
    if state is not None:  # recurrent layers: every slot of every row, and the committed slots
        out.update({"state.current": state.current, "state.conv": state.conv.transpose(0, 1),
                    "state.ssm": state.ssm.transpose(0, 1)})  # [rows, L, S, ...]: row 0 first
    return {k: v[1:] for k, v in out.items()}


def check_one_graph_step(mr, sizes, tol):
    """The whole greedy step as one captured function (SpecStepGraph: a CUDA graph, or static replay on CPU)
    against the same step run phase by phase eagerly: accept lengths, tokens, per-row state and both KV pools
    (padded rows must not touch any live row)."""
    one, dev = mr.spec.spec_step_graph, mr.device
    for i, bs in enumerate(sizes):
        handles, rows, s = _requests(mr, bs, mr.num_steps, seed=50 + i)
        rows, s = rows.to(dev), s.to(dev)
        g = torch.Generator().manual_seed(i)
        rs = mr.spec.state
        mr.last_token[rows] = torch.randint(0, 256, (bs,), generator=g).to(dev)
        rs.draft_token[rows] = torch.randint(0, 256, (bs,), generator=g).to(dev)
        rs.draft_hidden[rows] = torch.randn(bs, mr.cfg.hidden_size, generator=g).to(dev, rs.draft_hidden.dtype)
        if rs.tokens is not None:  # a history with repeats, so that the lookup finds continuations
            rs.tokens[rows] = torch.randint(0, 6, (bs, rs.tokens.shape[1]), generator=g).to(dev)
        before = {k: v.clone() for k, v in _state(mr).items()}
        accept, verified = spec_step_device(mr.spec, eager_phase, rows, s, s, int(s.max()), GREEDY)
        want_state = {k: v.clone() for k, v in _state(mr).items()}
        for k, v in _state(mr).items():
            v.copy_(before[k])
        replays = one.replays
        got = one.run(rows.tolist(), s.tolist(), s.tolist())
        assert one.replays == replays + 1
        assert got.shape == (bs, mr.num_steps + 2)
        assert torch.equal(got[:, 0], accept), f"bs={bs}"
        assert torch.equal(got[:, 1:], verified), f"bs={bs}"
        for k, v in _state(mr).items():
            torch.testing.assert_close(v, want_state[k], rtol=tol, atol=tol, msg=f"bs={bs} {k}")
        for h in handles:
            mr.kv.release(h)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("models,lookup", [(("llama_mtp", None), False), (("llama", "llama_draft_aux"), True)])
def test_one_graph_spec_step_equals_eager_phases(tiny_models, page_size, models, lookup):
    """Shrinking then growing batch sizes, padded to the captured sizes; with context lookup and an aux draft."""
    target, draft = models
    mr = _spec_runner(tiny_models[target], n=3, page_size=page_size, draft_path=draft and tiny_models[draft],
                      lookup=lookup)
    check_one_graph_step(mr, [7, 5, 3, 1, 2, 8, 6], 1e-5)


def test_one_graph_spec_step_mrope_text(tiny_models):
    """An mRoPE target (and draft): the one-graph step hands the phases 1-D text positions, as prefill does, and
    equals the phases run eagerly."""
    from specserve.bench.phase_setup import random_draft

    t = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, torch.device("cpu"), 600)
    cfg3 = dataclasses.replace(t.config, mrope_section=[2, 3, 3])  # head_dim 16 -> half 8
    m3 = DenseForCausalLM(cfg3, 600)
    m3.load_state_dict(t.model.state_dict())
    m3.requires_grad_(False)
    draft = random_draft(cfg3, m3, torch.float32, torch.device("cpu"), 600)
    args = ServerArgs(model_path=tiny_models["llama"], max_total_tokens=8192, max_running_requests=16,
                      speculative_algorithm="MTP", speculative_num_steps=2, cuda_graph_bs=CAPTURE)
    mr = ModelRunner(args, m3, cfg3, draft, torch.device("cpu"), torch.float32, 512)
    assert mr.spec.phases.target_verify.ctx.mrope and mr.spec.phases.draft_extend.ctx.mrope
    check_one_graph_step(mr, [3, 1, 4], 1e-5)


def _plain_runner(path, page_size=1):
    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600)
    args = ServerArgs(model_path=path, page_size=page_size, max_total_tokens=8192, max_running_requests=16,
                      cuda_graph_bs=CAPTURE)
    mr = ModelRunner(args, t.model, t.config, None, torch.device("cpu"), torch.float32, 512)
    g = torch.Generator().manual_seed(0)
    for cache in token_caches(mr.caches):
        cache.copy_(torch.randn(cache.shape, generator=g))
    return mr


def _sampling(bs: int, vocab: int, seed: int) -> SamplingBatch:
    """Mixed rows: greedy, temperature only, and filtered (top-k, top-p, min-p)."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.arange(bs) % 3  # 0 greedy, 1 temperature, 2 filtered
    return SamplingBatch(temperature=torch.where(kind == 0, 0.0, 0.8), top_p=torch.where(kind == 2, 0.9, 1.0),
                         top_k=torch.where(kind == 2, 20, vocab), min_p=torch.where(kind == 2, 0.05, 0.0),
                         seeds=torch.randint(0, 1 << 30, (bs,), generator=g), greedy=kind == 0, all_greedy=False,
                         need_filter=True)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sampled", [False, True])
def test_decode_step_graph_equals_eager_decode(tiny_models, page_size, sampled):
    """A plain engine's decode step as one captured function (graphs/step_graph.py DecodeStepGraph: a CUDA graph, or
    static replay on CPU) against the decode runner run eagerly plus sampling: tokens, last tokens and the KV pool
    (padded rows must not touch a live row), over shrinking then growing batch sizes, greedy or mixed sampling."""
    mr = _plain_runner(tiny_models["qwen3"], page_size)
    one, decode = mr.decode_step_graph, mr.phases.decode
    vocab = mr.cfg.vocab_size
    for i, bs in enumerate([7, 5, 3, 1, 2, 8, 6]):
        handles, rows, s = _requests(mr, bs, 0, seed=70 + i)
        mr.last_token[rows] = torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(i))
        sb = _sampling(bs, vocab, i) if sampled else GREEDY
        before = [c.clone() for c in token_caches(mr.caches)] + [mr.last_token.clone()]
        live = LiveInputs(bs, mr.last_token[rows], s, rows, s + 1, int(s.max()) + 1)
        logits = decode.forward_phase(live, decode.eager_backends, graph_mode=False)["logits"]
        want = sample(logits, sb, s + 1)
        want_caches = [c.clone() for c in token_caches(mr.caches)]
        for c, b in zip(token_caches(mr.caches) + [mr.last_token], before):
            c.copy_(b)
        assert one.covers(bs, sb)
        replays = one.replays
        got = one.run(rows.tolist(), s.tolist(), s.tolist(), sb)
        assert one.replays == replays + 1 and (one.filtered if sampled else one.ladder).replays > 0
        assert torch.equal(got, want), f"bs={bs}"
        assert torch.equal(mr.last_token[rows], want)
        for c, w in zip(token_caches(mr.caches), want_caches):
            torch.testing.assert_close(c[1:], w[1:], rtol=1e-5, atol=1e-5, msg=f"bs={bs}")  # slot 0: padding's
        for h in handles:
            mr.kv.release(h)
