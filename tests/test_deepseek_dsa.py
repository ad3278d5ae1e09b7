"""MLA + DeepSeek sparse attention (DeepSeek-V3.2, GLM-5 with a "shared" indexer layer) on small random checkpoints:
- with index_topk >= the sequence (sparse == dense exactly): logits == transformers for a chunked prefill and
  4-token verifies;
- with a truly sparse index_topk: logits == transformers for a chunked prefill and decode steps (8 index heads and a
  prompt checked to have no tie at any top-k boundary, where transformers' torch.topk may choose either key);
  every phase agrees with every other (one-shot prefill == chunked prefill == the last position of each verify;
  greedy MTP == plain for N 1..3, page sizes 1 and 16, chunked prefill, retraction);
- the tie-break: equal index scores keep the earlier token, in the top-k mask itself and through the model (an
  indexer whose scores all tie selects each query's first index_topk tokens in every phase);
- graph static replay == eager for every phase, and the one-graph spec step."""

import pytest
import torch
from deepseek_helpers import (
    build_tiny_dsa,
    check_selection_is_tie_free,
    hf_logits_and_index_scores,
    random_mla_mtp_tensors,
)
from helpers import _index_all_shards
from safetensors.torch import save_file
from spec_fixtures import build_scheduler, run_greedy
from test_kv_accounting import test_pool_returns_to_start_after_mixed_workload_with_retractions as mixed_workload
from test_overlap_schedule import test_arrivals_and_aborts_while_a_step_is_in_flight as overlap_arrivals
from test_overlap_schedule import test_first_tokens_that_end_a_request_while_its_prefill_is_in_flight as overlap_t0
from test_prefill_graph import SMALL_BATCHES, SMALL_MAX_TOKENS, check_padded_prefill, prefill_runner, prefill_runners
from test_qwen3_next import _hf_logits, _prefill, _runner
from test_runners import _spec_runner, check_one_graph_step, check_phase_replay
from test_spec_greedy import _prompts

from specserve.attention.torch_mla_backend import topk_mask
from specserve.batch import CacheKind
from specserve.graphs.padding import LiveInputs
from specserve.kvcache.manager import KVHandle
from specserve.layers.dsa_indexer import DSAIndexer

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
# tokens of the greedy runs through the Triton kernels (slow under Triton's CPU interpreter): a few MTP steps of 3
# requests (padded to a batch of 4); with index_topk 5 the 2-token prompt's queries cross it on the way
TRITON_NEW = 4
CPU = torch.device("cpu")


def _with_mtp(folder: str, seed: int) -> str:
    """Add a random DeepSeek-layout MTP layer (its block with an indexer) to a DSA checkpoint."""
    import json

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    t = random_mla_mtp_tensors(cfg, f"model.layers.{cfg.num_hidden_layers}.", seed)
    g = torch.Generator().manual_seed(seed + 7)
    p = f"model.layers.{cfg.num_hidden_layers}.self_attn.indexer."
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    t.update({p + "wq_b.weight": torch.randn(hi * di, cfg.q_lora_rank, generator=g) / cfg.q_lora_rank ** 0.5,
              p + "wk.weight": torch.randn(di, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5,
              p + "k_norm.weight": 1 + 0.1 * torch.randn(di, generator=g), p + "k_norm.bias": 0.1 * torch.randn(di),
              p + "weights_proj.weight": torch.randn(hi, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5})
    save_file({k: v.contiguous() for k, v in t.items()}, f"{folder}/mtp.safetensors")
    with open(f"{folder}/config.json") as f:
        c = json.load(f)
    c["num_nextn_predict_layers"] = 1
    with open(f"{folder}/config.json", "w") as f:
        json.dump(c, f, indent=2)
    _index_all_shards(folder)
    return folder


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    out = {}
    for arch in ("deepseek_v32", "glm_moe_dsa"):
        out[f"{arch}_dense"] = _with_mtp(build_tiny_dsa(str(root / f"{arch}_d"), arch, seed=61, index_topk=1024), 62)
        out[f"{arch}_sparse"] = _with_mtp(build_tiny_dsa(str(root / f"{arch}_s"), arch, seed=63, index_topk=5), 64)
    return out


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv,k", [(40, 5), (300, 64), (7, 10)])
def test_ranked_topk_is_the_stable_sorts_first_k(kv, k):
    """The int64-key top-k == the first k of a stable descending sort: many exact ties, +0.0 and -0.0 (a tie),
    negative, huge and -inf scores, hidden keys."""
    from specserve.attention.torch_mla_backend import ranked_topk

    g = torch.Generator().manual_seed(kv)
    pool = torch.tensor([0.0, -0.0, 1.5, -2.0, 3e38, -3e38, 1e-40, float("-inf"), 7.0])
    scores = pool[torch.randint(0, len(pool), (6, kv), generator=g)]
    valid = torch.rand((6, kv), generator=g) < 0.8
    want = torch.sort((scores.masked_fill(~valid, float("-inf")) + 0.0), dim=-1, descending=True,
                      stable=True).indices[:, :min(k, kv)]
    assert torch.equal(ranked_topk(scores, valid, k), want)


def test_topk_mask_tie_break_and_bounds():
    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, 1.0]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    assert topk_mask(scores, valid, 3).tolist() == [[True, True, False, True, False, False]]  # tie: earlier 0
    assert topk_mask(scores, valid, 10).tolist() == valid.tolist()  # k >= valid: all valid, never an invalid one
    ties = torch.zeros(2, 7)
    assert topk_mask(ties, torch.ones(2, 7, dtype=torch.bool), 4)[0].tolist() == [True] * 4 + [False] * 3


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_dense_equivalent_logits_match_hf(dsa, arch):
    """index_topk >= every sequence: the sparse model is the dense one, so transformers is the oracle."""
    path = dsa[f"{arch}_dense"]
    hf = _hf(path)
    mr, t = _runner(path, n=3)
    specs = [s.kind for s in t.model.cache_specs()]
    assert specs.count(CacheKind.INDEX_KEYS) == (2 if arch == "glm_moe_dsa" else 3)  # GLM: layer 2 is "shared"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (k,), generator=g).tolist() for k in (9, 1, 30)]
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p) + 8])
    for p, got in zip(prompts, _prefill(mr, t, prompts, handles, chunk=16)):
        torch.testing.assert_close(got, _hf_logits(hf, p), rtol=1e-4, atol=1e-4)
    seqs = [list(p) for p in prompts]
    rows = torch.tensor([h.row for h in handles])
    for _ in range(2):
        more = [torch.randint(3, 250, (4,), generator=g).tolist() for _ in prompts]
        s = torch.tensor([len(x) for x in seqs])
        out = mr.spec.phases.target_verify.run(LiveInputs(
            3, torch.tensor(sum(more, [])), (s[:, None] + torch.arange(4)).reshape(-1), rows, s + 4,
            int(s.max()) + 4))["logits"]
        for b, m in enumerate(more):
            seqs[b] += m
            torch.testing.assert_close(out[b], _hf_logits(hf, seqs[b])[-4:], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dsa_tie_free(tmp_path_factory):
    """index_topk 5 with 8 index heads (not 2): ReLU still zeroes many (head, key) scores and some whole keys, but
    rarely enough that the test's prompt has no tie at any row's top-k boundary (checked, not assumed)."""
    root = tmp_path_factory.mktemp("dsa_k")
    return {arch: build_tiny_dsa(str(root / arch), arch, seed=71, index_topk=5, index_n_heads=8)
            for arch in ("deepseek_v32", "glm_moe_dsa")}


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_logits_match_hf(dsa_tie_free, arch):
    """index_topk 5 of up to 28 tokens against transformers, whose indexer masks attention to its own top-k: a
    chunked prefill (16 + 8) and 4 decode steps. Precondition, from transformers' index scores: no tie at a top-k
    boundary (torch.topk's choice among ties is unspecified), so the logits agree only if our indexer (its RoPE
    layout: rotate-half for V3.2, interleaved for GLM) and top-k choose the same keys in every layer (GLM's layer
    2 reusing layer 1's choice)."""
    path = dsa_tie_free[arch]
    hf = _hf(path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (28,), generator=g).tolist()
    want, seen = hf_logits_and_index_scores(hf, ids)  # [28, V]
    assert len(seen) == (2 if arch == "glm_moe_dsa" else 3)  # GLM: layer 2 is "shared", no indexer of its own
    assert check_selection_is_tie_free(seen, 5) == len(seen) * (28 - 5)  # every row past the 5th is sparse
    assert any(bool((scores == 0).any()) for scores, _ in seen)  # exact ReLU ties there are, off the boundary
    mr, t = _runner(path, n=0)
    assert [s.kind for s in t.model.cache_specs()].count(CacheKind.INDEX_KEYS) == len(seen)
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [28])
    got = _prefill(mr, t, [ids[:24]], [h], chunk=16)[0]
    torch.testing.assert_close(got, want[:24], rtol=1e-4, atol=1e-4)
    rows = torch.tensor([h.row])
    for p in range(24, 28):
        out = mr.phases.decode.run(LiveInputs(1, torch.tensor([ids[p]]), torch.tensor([p]), rows,
                                                  torch.tensor([p + 1]), p + 1))["logits"]  # [1, V]
        torch.testing.assert_close(out[0], want[p], rtol=1e-4, atol=1e-4, msg=f"decode at {p}")


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_phases_agree(dsa, arch):
    """index_topk 5 of up to 40 tokens: one-shot prefill == chunked prefill (chunks of 7) == verify steps."""
    path = dsa[f"{arch}_sparse"]
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 250, (40,), generator=g).tolist()
    logits = {}
    for chunk in (40, 7):
        mr, t = _runner(path, n=3)
        h = KVHandle()
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [48])
        logits[chunk] = _prefill(mr, t, [prompt], [h], chunk=chunk)[0]
    torch.testing.assert_close(logits[7], logits[40], rtol=1e-4, atol=1e-4)
    mr, t = _runner(path, n=3)  # the same model attending densely: the selection matters
    for m in t.model.modules():
        if isinstance(m, DSAIndexer):
            m.topk = 1024
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [48])
    dense = _prefill(mr, t, [prompt], [h], chunk=40)[0]
    assert (dense[:5] - logits[40][:5]).abs().max() < 1e-4  # up to 5 tokens every key is chosen
    assert (dense[10:] - logits[40][10:]).abs().max() > 1e-2
    # the same positions as 4-token verifies after a 28-token prefill
    mr, t = _runner(path, n=3)
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [48])
    _prefill(mr, t, [prompt[:28]], [h], chunk=28)
    rows = torch.tensor([h.row])
    for s0 in (28, 32, 36):
        live = LiveInputs(1, torch.tensor(prompt[s0:s0 + 4]), torch.arange(s0, s0 + 4), rows,
                          torch.tensor([s0 + 4]), s0 + 4)
        out = mr.spec.phases.target_verify.run(live)["logits"][0]
        torch.testing.assert_close(out, logits[40][s0:s0 + 4], rtol=1e-4, atol=1e-4, msg=f"verify at {s0}")


def test_eager_prefill_in_query_blocks_is_the_same(dsa):
    """A long piece's queries in blocks (torch_mla_backend.query_blocks, bounded score memory): the MLA attention
    and the indexer's scores in blocks of 1 to 4 queries give the one-block logits, for two requests in one batch."""
    from specserve.attention.torch_mla_backend import query_blocks

    assert query_blocks(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)] and query_blocks(3, 100, 1) == [(0, 1), (1, 2),
                                                                                                        (2, 3)]
    path = dsa["glm_moe_dsa_sparse"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 23)]
    logits = []
    for max_scores in (None, 200):
        mr, t = _runner(path, n=1)
        if max_scores is not None:
            for kind in (CacheKind.MLA, CacheKind.INDEX_KEYS):
                mr.prefill.eager_backends[kind].max_scores = max_scores  # MLA: a query's 4 heads x 40 keys = 160
        handles = [KVHandle(), KVHandle()]
        assert all(mr.kv.assign_row(h) for h in handles) and mr.kv.ensure(handles, [48, 48])
        logits.append(_prefill(mr, t, prompts, handles, chunk=40))
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_triton_eager_prefill_as_token_rows_equals_the_reference(dsa, arch):
    """Eager prefill through the Triton backends runs as token rows over the batch's longest KV (each query's
    top-k by the index kernels, attention over only the chosen rows): the torch reference's logits, truly sparse,
    for two requests of different lengths in chunks of 9 (prefixes, a request finishing before the other)."""
    from specserve.attention.torch_mla_backend import TokenRows

    path = dsa[f"{arch}_sparse"]
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (19, 12)]  # forwards of 9 + 9, 9 + 3, 1
    logits = []
    for backend in ("torch", "triton"):
        mr, t = _runner(path, n=0, attention_backend=backend)
        handles = [KVHandle(), KVHandle()]
        assert all(mr.kv.assign_row(h) for h in handles) and mr.kv.ensure(handles, [24, 24])
        logits.append(_prefill(mr, t, prompts, handles, chunk=9))
        if backend == "triton":
            meta = mr.prefill.eager_backends[CacheKind.INDEX_KEYS].meta
            # the last forward: the longer request's last token alone (the other finished), over its 19 keys
            assert isinstance(meta, TokenRows) and meta.width == 19 and meta.lens.tolist() == [19]
    for a, b in zip(*logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def greedy_plain(dsa):
    prompts = _prompts()
    out = {}
    for key, path in dsa.items():
        sched, _ = build_scheduler(path, max_total_tokens=4096)
        out[key] = [r.output_ids for r in run_greedy(sched, prompts, NEW)]
    return prompts, out


@pytest.mark.parametrize("key,n,page_size", [
    (key, n, page_size) for key in ("deepseek_v32_dense", "deepseek_v32_sparse", "glm_moe_dsa_sparse")
    for n, page_size in ((1, 1), (2, 16), (3, 1), (3, 16))] + [("glm_moe_dsa_dense", 3, 16)])
def test_spec_greedy_equals_plain(dsa, greedy_plain, key, n, page_size):
    prompts, ref = greedy_plain
    sched, _ = build_scheduler(dsa[key], page_size=page_size, max_total_tokens=4096, chunked_prefill_size=16,
                               speculative_algorithm="MTP", speculative_num_steps=n)
    assert isinstance(sched.model_runner.draft.decoder.self_attn.indexer, DSAIndexer)  # the MTP block indexes too
    reqs = run_greedy(sched, prompts, NEW)
    assert [r.output_ids for r in reqs] == ref[key]
    assert all(r.spec_verify_ct > 0 for r in reqs)


def test_dense_equivalent_greedy_matches_hf(dsa, greedy_plain):
    from test_qwen3_next import _hf_greedy

    prompts, ref = greedy_plain
    assert ref["deepseek_v32_dense"] == _hf_greedy(_hf(dsa["deepseek_v32_dense"]), prompts, NEW)


def test_all_tied_scores_select_the_earliest_tokens_in_every_phase(dsa):
    """weights_proj zeroed: every index score is 0, so each query keeps its first index_topk (5) tokens, in prefill,
    plain decode, target verify, draft decode (its last step) and draft extend."""
    path = dsa["deepseek_v32_sparse"]
    first5 = lambda sel: bool(sel[..., :5].all()) and not sel[..., 5:].any()  # [..., kv] over the first 5 keys
    prompt = list(range(3, 23))
    mr, t = _runner(path, n=3)
    plain, tp = _runner(path, n=0)
    for m in list(t.model.modules()) + list(mr.draft.modules()) + list(tp.model.modules()):
        if isinstance(m, DSAIndexer):
            m.weights_proj.weight.data.zero_()
    h, hp = KVHandle(), KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [32])
    assert plain.kv.assign_row(hp) and plain.kv.ensure([hp], [32])
    _prefill(mr, t, [prompt], [h], chunk=20)
    sel = mr.prefill.eager_backends[CacheKind.INDEX_KEYS].last[0]  # [20, 20] the last layer's selection
    want = torch.zeros(20, 20, dtype=torch.bool)
    for i in range(20):
        want[i, :min(i + 1, 5)] = True
    assert torch.equal(sel, want)
    _prefill(plain, tp, [prompt], [hp], chunk=20)
    decode = plain.phases.decode
    decode.run(LiveInputs(1, torch.tensor([5]), torch.tensor([20]), torch.tensor([hp.row]), torch.tensor([21]), 21))
    dsel = decode.backends[CacheKind.INDEX_KEYS].last[0, 0]  # [1, max_kv]
    assert dsel.shape[-1] >= 21 and first5(dsel), "decode"
    rows = torch.tensor([h.row])
    verify = mr.spec.phases.target_verify
    verify.run(LiveInputs(1, torch.tensor([5, 6, 7, 8]), torch.arange(20, 24), rows, torch.tensor([24]), 24))
    vsel = verify.backends[CacheKind.INDEX_KEYS].last[0, 0]  # [4, max_kv]
    assert vsel.shape[-1] >= 24 and first5(vsel), "target verify"
    g = torch.Generator().manual_seed(0)
    extend = mr.spec.phases.draft_extend
    extend.run(LiveInputs(1, torch.tensor([5, 6, 7, 8]), torch.arange(20, 24), rows, torch.tensor([24]), 24,
                          accept_len=torch.tensor([1]), hidden=torch.randn(4, mr.draft.feature_size, generator=g)))
    esel = extend.backends[CacheKind.INDEX_KEYS].last[0, 0]  # [4, max_kv]
    assert esel.shape[-1] >= 24 and first5(esel), "draft extend"
    dd = mr.spec.phases.draft_decode  # 2 steps, at positions 22 and 23 over 23 and 24 keys
    dd.run(LiveInputs(1, torch.tensor([9]), torch.tensor([22]), rows, torch.tensor([23]), 23 + 3,
                      hidden=torch.randn(1, mr.cfg.hidden_size, generator=g)))
    ddsel = dd.backends[CacheKind.INDEX_KEYS].last[0, 0]  # [1, max_kv] of the last step
    assert ddsel.shape[-1] >= 24 and first5(ddsel), "draft decode"


@pytest.mark.parametrize("spec", [None, 3])
def test_mixed_workload_with_retractions(dsa, spec):
    mixed_workload(dsa, spec, 16, key="glm_moe_dsa_sparse")


def test_overlap_schedule_arrivals_and_aborts(dsa):
    overlap_arrivals(dsa, key="glm_moe_dsa_sparse")
    overlap_arrivals(dsa, key="glm_moe_dsa_sparse", spec=dict(speculative_algorithm="MTP", speculative_num_steps=3))
    overlap_t0(dsa, dict(speculative_algorithm="MTP", speculative_num_steps=2), key="glm_moe_dsa_sparse")


def test_phase_replay_equals_eager(dsa):
    mr = _spec_runner(dsa["glm_moe_dsa_sparse"], n=3)
    check_phase_replay(mr)
    check_one_graph_step(mr, [7, 5, 3, 1, 2, 8, 6], 1e-4)


def test_fp8_indexer_keys(dsa):
    """--indexer-cache-dtype fp8_e4m3: index keys stored in fp8 with a float32 scale per token (sized as such), the
    dequantised keys within fp8's rounding of the bf16 ones, and speculation still lossless against plain decoding
    with the same cache."""
    path = dsa["deepseek_v32_sparse"]
    prompts = _prompts()
    outs = []
    for spec in ({}, {"speculative_algorithm": "MTP", "speculative_num_steps": 3}):
        sched, _ = build_scheduler(path, max_total_tokens=4096, indexer_cache_dtype="fp8_e4m3", **spec)
        pool = sched.model_runner.caches.pools[CacheKind.INDEX_KEYS]
        assert pool.rows[0].dtype == torch.float8_e4m3fn and pool.scales is not None
        outs.append([r.output_ids for r in run_greedy(sched, prompts, NEW)])
        sched.check_idle_invariants()
    assert outs[0] == outs[1]
    # sizing: 16 fp8 values + a 4-byte scale per token for each of the 3 indexers (+ the MTP block's)
    from specserve.kvcache.cache_spec import bytes_per_token

    specs = [s for s in sched.model_runner.target.cache_specs() if s.kind is CacheKind.INDEX_KEYS]
    assert bytes_per_token(specs, torch.float32, {CacheKind.INDEX_KEYS: torch.float8_e4m3fn}) == 3 * (16 + 4)
    # dequantised keys against the keys as computed: within fp8 e4m3's relative step (2^-3) of each row's scale
    mr, t = _runner(path, n=0, indexer_cache_dtype="fp8_e4m3")
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [20])
    _prefill(mr, t, [list(range(3, 23))], [h], chunk=20)
    backend = mr.prefill.eager_backends[CacheKind.INDEX_KEYS]
    slots = mr.req_to_token.table[h.row, :20]
    deq = backend._keys(slots, 0)  # [20, 16]
    layer = t.model.model.layers[0]
    with torch.no_grad():
        x = t.model.model.embed_tokens(torch.tensor(list(range(3, 23))))
        iq = layer.self_attn.indexer(torch.arange(20), layer.input_layernorm(x),
                                     layer.self_attn.q_a_layernorm(layer.self_attn.q_a_proj(layer.input_layernorm(x))))
    err = (deq - iq.k).abs().amax(dim=-1) / iq.k.abs().amax(dim=-1)
    assert float(err.max()) <= 2 ** -3


def test_fp8_indexer_rounds_the_queries_as_the_keys(dsa):
    """With fp8 index keys the reference scores e4m3 queries (each token's head row at its own scale, as the keys
    and as DeepSeek-V3.2's fp8 indexer); with bf16 keys the queries as they are."""
    from specserve.kernels.reference import quantise_rows_fp8

    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(3)) * 3
    q8, scale = quantise_rows_fp8(q)
    for dtype, want in (("fp8_e4m3", q8.float() * scale[..., None]), ("auto", q)):
        mr, _ = _runner(dsa["deepseek_v32_sparse"], n=0, indexer_cache_dtype=dtype)
        got = mr.prefill.eager_backends[CacheKind.INDEX_KEYS]._queries(q)
        assert torch.equal(got, want), dtype
    assert not torch.equal(q8.float() * scale[..., None], q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under Triton's interpreter")
def test_fp8_indexer_triton_equals_the_reference(dsa):
    """--indexer-cache-dtype fp8_e4m3 with the Triton backends (the scores kernel rounding the queries itself,
    q_fp8) and with the torch reference (rounding them in _queries): the same greedy MTP tokens."""
    from specserve.attention.torch_mla_backend import TritonIndexBackend

    outs = []
    for backend in ("torch", "triton"):
        sched, _ = build_scheduler(dsa["deepseek_v32_sparse"], max_total_tokens=4096, attention_backend=backend,
                                   indexer_cache_dtype="fp8_e4m3", speculative_algorithm="MTP",
                                   speculative_num_steps=2)
        kind = type(sched.model_runner.spec.phases.target_verify.backends[CacheKind.INDEX_KEYS])
        assert (kind is TritonIndexBackend) == (backend == "triton")
        outs.append([r.output_ids for r in run_greedy(sched, _prompts()[:3], TRITON_NEW)])
        sched.check_idle_invariants()
    assert outs[0] == outs[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under Triton's interpreter; on a GPU: "
                    "test_gpu_mla.py::test_triton_mla_backend_equals_reference_gpu")
@pytest.mark.parametrize("key", ["deepseek_v32_sparse", "glm_moe_dsa_dense"])
def test_triton_mla_backend_equals_the_reference(dsa, greedy_plain, key):
    """--attention-backend triton: decode / verify / draft phases through the Triton absorbed-MLA and indexer-score
    kernels (under the interpreter on CPU), sparse selections included; greedy MTP tokens == the torch reference's
    plain ones."""
    from specserve.attention.torch_mla_backend import TritonIndexBackend, TritonMLABackend

    prompts, ref = greedy_plain
    sched, _ = build_scheduler(dsa[key], max_total_tokens=4096, attention_backend="triton",
                               speculative_algorithm="MTP", speculative_num_steps=2)
    backends = sched.model_runner.spec.phases.target_verify.backends
    assert isinstance(backends[CacheKind.MLA], TritonMLABackend)
    assert isinstance(backends[CacheKind.INDEX_KEYS], TritonIndexBackend)
    reqs = run_greedy(sched, prompts[:3], TRITON_NEW)
    assert [r.output_ids for r in reqs] == [o[:TRITON_NEW] for o in ref[key][:3]]


def test_topk_slots_lists_the_masks_choice():
    """The per-query slot lists name exactly the keys topk_mask keeps (ties included), valid ones first."""
    from specserve.attention.torch_mla_backend import topk_slots

    g = torch.Generator().manual_seed(0)
    bs, w, kv, k = 3, 4, 12, 5
    scores = torch.randint(0, 3, (bs, w, kv), generator=g).float()  # many exact ties
    lens = torch.tensor([12, 4, 7])
    valid = torch.arange(kv)[None, None, :] < (lens[:, None] - w + torch.arange(w)[None, :] + 1)[..., None]
    kv_slots = torch.randint(1, 100, (bs, kv), generator=g)
    mask = topk_mask(scores, valid, k)
    sel = topk_slots(scores, valid, kv_slots, k)
    for b in range(bs):
        for i in range(w):
            row = sel.slots[b * w + i, :int(sel.counts[b * w + i])]
            assert sorted(row.tolist()) == sorted(kv_slots[b][mask[b, i]].tolist())
            assert int(sel.counts[b * w + i]) == int(mask[b, i].sum())


def test_prefill_graph_token_rows_equal_eager(dsa):
    """The Triton MLA and index backends capture prefill as token rows (attention/torch_mla_backend.py TokenRows):
    the padded static replay of the target's and the MTP layer's extend, over shrinking and growing batches with
    prefixes, equals the eager reference prefill (outputs and every cache slot but the padding's), truly sparse.
    GLM-5 only: its layers 0, 1 and the MTP block select with their own indexer and layer 2 reuses layer 1's choice,
    so it runs every backend path of V3.2 (whose indexer differs in its RoPE layout, torch code run alike by the
    replay and the eager reference) and one more. Padded to 32 tokens (SMALL_BATCHES) and rows of 128 columns: the
    cost under Triton's CPU interpreter grows with the padded tokens and the index kernel's key blocks."""
    from specserve.attention.torch_mla_backend import (
        TorchIndexBackend,
        TorchMLABackend,
        TritonIndexBackend,
        TritonMLABackend,
    )

    reference = {TritonMLABackend: TorchMLABackend, TritonIndexBackend: TorchIndexBackend}
    mr = prefill_runner(dsa["glm_moe_dsa_sparse"], None, "triton", max_tokens=SMALL_MAX_TOKENS, context_len=128)
    for runner in prefill_runners(mr).values():
        kinds = {type(b).__name__ for b in runner.backends.values()}
        assert {"TritonMLABackend", "TritonIndexBackend"} <= kinds
        # the eager side on the torch reference backends over the same pools (Triton's eager prefill is token rows
        # as well: test_triton_eager_prefill_as_token_rows_equals_the_reference)
        runner.eager_backends = {k: reference.get(type(b), type(b))(b.req_to_token, b.kv_pool)
                                 for k, b in runner.eager_backends.items()}
    check_padded_prefill(mr, 1e-4, SMALL_BATCHES, SMALL_MAX_TOKENS)
