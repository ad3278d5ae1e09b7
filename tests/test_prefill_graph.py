"""Prefill runners (graphs/prefill.py) on CPU, by static replay (`--cuda-graph-max-prefill-tokens` > 0):

- the padded replay of the target's extend and of the draft's extend equals the unpadded eager forward, for batches
  of shrinking then growing token counts and request counts, with and without a prefix (chunked prefill), with
  both attention backends: outputs, and every KV slot but dummy slot 0, which the padding writes;
- padding is rewritten on every replay (no stale rows of a larger batch);
- batches over the token or request bound run eagerly;
- whole engines with prefill graphs give the same greedy outputs as with eager prefill (plain and MTP, chunked).
"""

import pytest
import torch
from test_runners import token_caches

from specserve.engine.engine import Engine
from specserve.engine.model_runner import ModelRunner
from specserve.graphs.prefill import ExtendBatch, token_ladder
from specserve.kvcache.manager import KVHandle
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.server_args import ServerArgs

MAX_TOKENS = 64


def test_token_ladder():
    assert token_ladder(2048) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_ladder(100) == [16, 32, 64, 100]
    assert token_ladder(16) == [16]
    assert token_ladder(10) == [10]


def prefill_runner(path, draft_path, backend, device="cpu", max_tokens=MAX_TOKENS, context_len=512):
    """A ModelRunner (MTP N = 2) whose prefill runners pad up to max_tokens tokens (CUDA graphs on a GPU)."""
    dev = torch.device(device)
    t = load_target(ModelSource.resolve(path), torch.float32, dev, 600)
    draft = load_mtp_draft(t, draft_path, torch.float32, dev, 600)
    args = ServerArgs(model_path=path, max_total_tokens=8192, max_running_requests=20, speculative_algorithm="MTP",
                      speculative_num_steps=2, cuda_graph_bs=[1, 2], attention_backend=backend,
                      cuda_graph_max_prefill_tokens=max_tokens)
    mr = ModelRunner(args, t.model, t.config, draft, dev, torch.float32, context_len)
    g = torch.Generator().manual_seed(0)
    for cache in token_caches(mr.caches) + token_caches(mr.spec.caches):  # non-trivial prefix keys
        cache.copy_(torch.randn(cache.shape, generator=g))
    mr.capture_graphs()
    return mr


def _batch(mr, prefixes, lens, seed):
    g = torch.Generator().manual_seed(seed)
    handles = []
    for p, e in zip(prefixes, lens):
        h = KVHandle()
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [p + e + 3])
        handles.append(h)
    table = mr.req_to_token.table
    nt = sum(lens)
    loc = torch.cat([table[h.row, p:p + e] for h, p, e in zip(handles, prefixes, lens)])
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, lens)])
    seq = [p + e for p, e in zip(prefixes, lens)]
    dev = mr.device
    x = ExtendBatch(torch.randint(0, 256, (nt,), generator=g).to(dev), pos.to(dev), loc, [h.row for h in handles],
                    seq, list(lens), torch.randn(nt, mr.draft.feature_size, generator=g).to(dev))
    return handles, x


def _pools(mr):
    """KV of target and draft, and the recurrent state rows-first (index 0: the dummy slot / row)."""
    out = token_caches(mr.caches) + token_caches(mr.spec.caches)
    if mr.caches.state is not None:
        out += [mr.caches.state.conv.transpose(0, 1), mr.caches.state.ssm.transpose(0, 1)]
    return out


# (prefix, new tokens) per request: token counts 46, 5, 64, 33, 16 shrink and grow; 70 tokens and 17 requests
# are too many
BATCHES = [([0, 0, 0], [20, 17, 9]), ([0], [5]), ([10, 0, 3, 0], [16, 16, 16, 16]), ([40, 0], [30, 3]),
           ([7], [16]), ([0, 0], [40, 30]), ([0] * 17, [2] * 17)]
# The same cases for runners padding up to SMALL_MAX_TOKENS (ladder 16, 32), for kernels run by Triton's CPU
# interpreter, whose cost grows with the padded tokens: token counts 28, 5, 20 shrink and grow (20 over rows that
# 28 filled: stale), with prefixes (one longer than a 64-key block), 16 fills its size exactly; 35 tokens and 17
# requests (of 17 tokens) are too many
SMALL_MAX_TOKENS = 32
SMALL_BATCHES = [([0, 0, 0], [12, 9, 7]), ([0], [5]), ([60, 0, 3], [10, 6, 4]), ([7], [16]),
                 ([0, 0], [20, 15]), ([0] * 17, [1] * 17)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_prefill_equals_eager(tiny_models, backend):
    """triton: the kernels under Triton's CPU interpreter (no GPU), over SMALL_BATCHES; on a GPU, BATCHES."""
    small = backend == "triton" and not torch.cuda.is_available()
    max_tokens, batches = (SMALL_MAX_TOKENS, SMALL_BATCHES) if small else (MAX_TOKENS, BATCHES)
    # Triton needs the GPU's tensors when there is one (the interpreter is off then); torch runs on the CPU as before
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    mr = prefill_runner(tiny_models["llama"], tiny_models["llama_draft_aux"], backend, device, max_tokens=max_tokens)
    check_padded_prefill(mr, 1e-5, batches, max_tokens)


def prefill_runners(mr) -> dict:
    """The target's prefill runner and, with a drafter, the worker's."""
    out = {"target": mr.prefill}
    if mr.spec is not None:
        out["draft"] = mr.spec.prefill
    return out


def check_padded_prefill(mr, tol, batches=BATCHES, max_tokens=MAX_TOKENS):
    """Each prefill runner over `batches`: the padded run against the eager forward (outputs and KV pools)."""
    for name, runner in prefill_runners(mr).items():
        assert runner.ladder.sizes == sorted({16, 32, max_tokens})
        for i, (prefixes, lens) in enumerate(batches):
            handles, x = _batch(mr, prefixes, lens, seed=i)
            if name == "target":
                x.hidden = None
            saved = [t.clone() for t in _pools(mr)]
            want = runner.forward(runner._eager_batch(x)).clone()
            want_pools = [t.clone() for t in _pools(mr)]
            for t, s in zip(_pools(mr), saved):
                t.copy_(s)
            replays, eager = runner.replays, runner.eager_runs
            got = runner.run(x)
            graphed = x.num_tokens <= max_tokens and len(lens) <= runner.max_rows
            assert (runner.replays - replays, runner.eager_runs - eager) == ((1, 0) if graphed else (0, 1))
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{name} batch {i}")
            for t, w in zip(_pools(mr), want_pools):  # slot 0 is the padding's; every other slot as eager
                torch.testing.assert_close(t[1:], w[1:], rtol=tol, atol=tol, msg=f"{name} batch {i} KV")
            if graphed:
                nt, n, padded = x.num_tokens, len(lens), runner.padded_tokens(x.num_tokens)
                assert padded == min(t for t in runner.ladder.sizes if t >= nt)
                for buf in (runner.buffers.input_ids, runner.buffers.positions, runner.buffers.out_cache_loc):
                    assert torch.all(buf[nt:padded] == 0)
                m = runner.buffers.meta
                assert m[:, n].tolist() == [0, padded - nt, nt, padded - nt]  # the padding request, on row 0
                assert torch.all(m[0, n + 1:] == 0) and torch.all(m[3, n + 1:] == 0)  # idle request slots
            for h in handles:
                mr.kv.release(h)


def test_prefill_graph_off_by_default_on_cpu(tiny_models):
    t = load_target(ModelSource.resolve(tiny_models["llama"]), torch.float32, torch.device("cpu"), 600)
    mr = ModelRunner(ServerArgs(model_path=tiny_models["llama"], max_total_tokens=4096), t.model, t.config, None,
                     torch.device("cpu"), torch.float32, 512)
    assert mr.prefill.ladder.sizes == [] and mr.spec is None


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "MTP", "speculative_num_steps": 2,
                                       "speculative_ngram_lookup": True}], ids=["plain", "mtp2"])
def test_engine_outputs_with_prefill_graphs(tiny_models, spec):
    """Chunks of 40 tokens (prompts up to 90): later chunks extend a prefix; several prompts share a batch."""
    path = tiny_models["llama_mtp"] if spec else tiny_models["llama"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (90, 7, 33, 12, 50)]
    outs, runners = [], []
    for max_prefill in (0, 48):
        with Engine(path, max_total_tokens=4096, chunked_prefill_size=40, cuda_graph_max_prefill_tokens=max_prefill,
                    sampling_defaults="openai", **spec) as eng:
            res = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0,
                                                                   "ignore_eos": True})
            outs.append([r["output_ids"] for r in res])
            runners.append(list(prefill_runners(eng.core.model_runner).values()))
    assert outs[0] == outs[1]
    assert all(r.replays == 0 for r in runners[0])
    assert all(r.replays > 0 for r in runners[1])


def test_dense_prefill_graphs_have_no_attended_bound(tiny_models):
    mr = prefill_runner(tiny_models["llama"], tiny_models["llama_draft_aux"], "triton")
    assert mr.prefill.max_attended is None and mr.spec.prefill.max_attended is None
