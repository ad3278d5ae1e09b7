"""Greedy speculative output == greedy plain output == transformers' greedy generate, token for token, for a batch
of mixed-length prompts, N in 1..5, page sizes 1 and 16, with MTP layers in both checkpoint layouts, and with an
oracle drafter that makes every accept path (0..N accepted + bonus) happen."""

import pytest
import torch
from spec_fixtures import OracleDraft, build_scheduler, run_greedy

from specserve import Engine

PROMPT_LENS = (5, 17, 2, 33, 9)
NEW = 24


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(path, prompts, new=NEW):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def _run(sched, prompts, new=NEW):
    return run_greedy(sched, prompts, new)


@pytest.fixture(scope="module")
def reference(tiny_models):
    prompts = _prompts()
    return prompts, {k: _hf_greedy(tiny_models[k], prompts) for k in ("llama_mtp", "qwen3_mtp", "llama")}


@pytest.mark.parametrize("page_size", [1, 16])
def test_plain_greedy_matches_hf(tiny_models, reference, page_size):
    prompts, ref = reference
    sched, _ = build_scheduler(tiny_models["llama"], page_size=page_size, max_total_tokens=4096)
    assert [r.output_ids for r in _run(sched, prompts)] == ref["llama"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_with_mtp_layer_in_target(tiny_models, reference, n, page_size):
    """DeepSeek-V3 layout: model.layers.{L}.* inside the target checkpoint (random weights)."""
    prompts, ref = reference
    for key in ("llama_mtp", "qwen3_mtp"):
        sched, _ = build_scheduler(tiny_models[key], page_size=page_size, max_total_tokens=4096,
                                   speculative_algorithm="MTP", speculative_num_steps=n)
        reqs = _run(sched, prompts)
        assert [r.output_ids for r in reqs] == ref[key], key
        assert all(r.spec_verify_ct > 0 for r in reqs)


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("draft", ["llama_draft", "llama_draft_aux"])
def test_spec_greedy_with_separate_draft_folder(tiny_models, reference, n, page_size, draft):
    """llama_draft_aux reads the target's layers 0 and 1 beside its final hidden state (EAGLE-3 style)."""
    prompts, ref = reference
    sched, t = build_scheduler(tiny_models["llama"], draft_path=tiny_models[draft], page_size=page_size,
                               max_total_tokens=4096, speculative_algorithm="EAGLE", speculative_num_steps=n)
    assert [r.output_ids for r in _run(sched, prompts)] == ref["llama"]
    if draft == "llama_draft_aux":
        h = t.config.hidden_size
        assert t.model.feature_size == 3 * h
        assert sched.model_runner.spec.phases.draft_extend.buffers.hidden.shape[-1] == 3 * h


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_greedy_oracle_drafter_exercises_acceptance(tiny_models, reference, n, page_size):
    prompts, ref = reference
    seqs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, ref["llama"]))}
    oracle = OracleDraft(64, seqs, wrong_every=5, vocab=256)
    sched, _ = build_scheduler(tiny_models["llama"], draft=oracle, page_size=page_size, max_total_tokens=4096,
                               speculative_algorithm="MTP", speculative_num_steps=n)
    reqs = _run(sched, prompts)
    assert [r.output_ids for r in reqs] == ref["llama"]
    accept = sum(r.spec_accepted_drafts + r.spec_verify_ct for r in reqs) / sum(r.spec_verify_ct for r in reqs)
    # 1 in 5 drafts is wrong: acceptance must be well above 1 (all-rejected) for every N
    assert accept > 1.0 + 0.4 * min(n, 3), accept
    counts = [r.spec_accepted_drafts for r in reqs]
    assert max(counts) > 0


def test_engine_generate_spec_equals_plain(tiny_models):
    path = tiny_models["llama_mtp"]
    prompts = _prompts(1)
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = Engine(model_path=path, max_total_tokens=4096).generate(input_ids=prompts, sampling_params=sp)
    eng = Engine(model_path=path, max_total_tokens=4096, speculative_algorithm="NEXTN", speculative_num_steps=3)
    spec = eng.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    for o in spec:
        m = o["meta_info"]
        assert m["spec_verify_ct"] > 0 and 1.0 <= m["spec_accept_length"] <= 4.0
        assert m["completion_tokens"] == 16 and m["finish_reason"]["type"] == "length"
