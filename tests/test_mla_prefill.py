"""--mla-prefill: eager prefill of dense MLA layers absorbed (one latent key/value head) or decompressed ("mha":
kv_b_proj turns each request's cached latent rows into per-head keys and values, then ordinary causal attention),
on the small random DeepSeek-V3 checkpoints of test_deepseek_v3.py:
- mha prefill logits == transformers (q-LoRA and not, page sizes 1 and 16, chunks that attend a cached prefix);
- mha == absorbed within float32 rounding, also with heads in groups and queries in blocks (bounded memory);
- greedy MTP == plain == transformers with mha prefill; the draft's prefill and the prefill graphs stay absorbed;
- DSA layers (GLM-5) stay absorbed under mha: the logits are the absorbed ones exactly, and the engine says so."""

import logging

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek, build_tiny_dsa
from spec_fixtures import build_scheduler, run_greedy
from test_qwen3_next import _hf_greedy, _hf_logits, _prefill, _runner
from test_spec_greedy import _prompts

from specserve.attention.mla_prefill import prefill_is_mha
from specserve.batch import CacheKind
from specserve.kvcache.manager import KVHandle
from specserve.server_args import ServerArgs

pytestmark = pytest.mark.usefixtures("one_thread")
LENS = (9, 1, 30, 40)  # in chunks of 16: the 30- and 40-token prompts' later chunks attend their cached prefix
NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_prefill")
    return {"qlora": build_tiny_deepseek(str(root / "q"), seed=51, mtp=True),
            "no_qlora": build_tiny_deepseek(str(root / "noq"), seed=52, q_lora_rank=None, rope_interleave=False),
            "dsa": build_tiny_dsa(str(root / "dsa"), "glm_moe_dsa", seed=53, index_topk=8)}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt_ids(lens=LENS, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]


def _prefill_logits(path, prompts, mla_prefill, page_size=1, max_scores=None, max_kv_values=None, **kw):
    """A fresh runner's chunked prefill (chunks of 16, every request in each forward) -> (logits per prompt, the
    eager MLA backend); kw: more server args (e.g. kv_cache_dtype)."""
    mr, t = _runner(path, n=0, mla_prefill=mla_prefill, page_size=page_size, **kw)
    mla = mr.prefill.eager_backends[CacheKind.MLA]
    if max_scores is not None:
        mla.max_scores, mla.max_kv_values = max_scores, max_kv_values
    handles = [KVHandle() for _ in prompts]
    for h, p in zip(handles, prompts):
        assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(p)])
    logits = _prefill(mr, t, prompts, handles, chunk=16)
    for h in handles:
        mr.kv.release(h)
    return logits, mla


def test_the_choice():
    """auto is mha (measured faster on the H200 at every chunk and prefix); the flag takes only its three values."""
    assert [prefill_is_mha(c) for c in ("auto", "absorbed", "mha")] == [True, False, True]
    assert ServerArgs(mla_prefill="mha").mla_prefill == "mha" and ServerArgs().mla_prefill == "auto"
    with pytest.raises(ValueError, match="--mla-prefill"):
        ServerArgs(mla_prefill="flash")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("key", ["qlora", "no_qlora"])
def test_mha_prefill_logits_match_hf(models, key, page_size):
    hf = _hf(models[key])
    prompts = _prompt_ids()
    logits, mla = _prefill_logits(models[key], prompts, "mha", page_size)
    assert mla.prefill_mha
    for p, got in zip(prompts, logits):
        torch.testing.assert_close(got, _hf_logits(hf, p), rtol=1e-4, atol=1e-4)


def test_mha_prefill_equals_absorbed(models):
    """The same scores, another order of the sums: equal within float32 rounding (and not bit for bit: the other
    path ran). With heads in groups of 2 (5000 decompressed values: a head's 40 keys x 56 values is 2240) and
    queries in blocks of 2 (200 scores over 2 heads x 40 keys) the result is the one-block one."""
    prompts = _prompt_ids()
    absorbed, mla = _prefill_logits(models["qlora"], prompts, "absorbed")
    assert not mla.prefill_mha
    mha, _ = _prefill_logits(models["qlora"], prompts, "mha")
    blocked, _ = _prefill_logits(models["qlora"], prompts, "mha", max_scores=200, max_kv_values=5000)
    for a, m, b in zip(absorbed, mha, blocked):
        torch.testing.assert_close(m, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, m, rtol=1e-5, atol=1e-5)
    assert not all(torch.equal(a, m) for a, m in zip(absorbed, mha))


def test_greedy_mtp_equals_plain_with_mha_prefill(models):
    """Plain and MTP (N = 2) serving with mha prefill, chunks of 16, page size 16: transformers' greedy tokens.
    The target's eager prefill ran decompressed; the draft's prefill (a draft phase) stayed absorbed."""
    prompts = _prompts()
    ref = _hf_greedy(_hf(models["qlora"]), prompts, NEW)
    for n in (0, 2):
        kw = {"speculative_algorithm": "MTP", "speculative_num_steps": n} if n else {}
        sched, _ = build_scheduler(models["qlora"], page_size=16, max_total_tokens=4096, chunked_prefill_size=16,
                                   mla_prefill="mha", **kw)
        reqs = run_greedy(sched, prompts, NEW)
        assert [r.output_ids for r in reqs] == ref, f"N = {n}"
        assert sched.model_runner.prefill.eager_backends[CacheKind.MLA].prefill_mha
        if n:
            assert all(r.spec_verify_ct > 0 for r in reqs)
            assert not sched.model_runner.spec.prefill.eager_backends[CacheKind.MLA].prefill_mha


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_graphs_stay_absorbed(models, backend):
    """A prefill under a graph (the CPU's static replay of the padded batch; with the Triton backend as token rows
    through its kernel, as on a GPU) attends absorbed with --mla-prefill mha, and equals the eager (decompressed)
    forward of the same batch."""
    from test_prefill_graph import _batch

    mr, _ = _runner(models["qlora"], n=2, mla_prefill="mha", cuda_graph_max_prefill_tokens=64,
                    attention_backend=backend)
    mr.capture_graphs()
    runner = mr.prefill
    handles, x = _batch(mr, [30, 0], [5, 4], seed=1)
    x.hidden = None
    want = runner.forward(runner._eager_batch(x)).clone()
    assert runner.eager_backends[CacheKind.MLA].prefill_mha
    replays = runner.replays
    got = runner.run(x)
    assert runner.replays == replays + 1 and not runner.backends[CacheKind.MLA].prefill_mha
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for h in handles:
        mr.kv.release(h)


def test_dsa_layers_stay_absorbed(models, caplog):
    """GLM-5 layers (an indexer, or a shared one) attend their top-k rows absorbed under mha too (a truly sparse
    index_topk of 8): the batch chose mha, the logits are the absorbed ones bit for bit, and the engine warns."""
    prompts = _prompt_ids((30, 12))
    absorbed, _ = _prefill_logits(models["dsa"], prompts, "absorbed")
    with caplog.at_level(logging.WARNING, logger="specserve.engine.model_runner"):
        mha, mla = _prefill_logits(models["dsa"], prompts, "mha")
    assert mla.prefill_mha and "sparse-attention (DSA) layers" in caplog.text
    for a, m in zip(absorbed, mha):
        assert torch.equal(a, m)
