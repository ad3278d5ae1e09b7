"""Training data for `specserve train-mtp`: reading prompts built from the prompt files' long texts, token-budgeted
training batches, and self-distillation with extra sampled passes and a generation time budget."""

import json
import re
from collections import Counter

import pytest
import torch

from specserve.train.reading import TEMPLATES, reading_prompts
from specserve.train.trainer import batch_indices

pytestmark = pytest.mark.usefixtures("one_thread")


def _texts_file(path, n):
    recs = [{"instruction": f"task {i}", "response": f"Text number {i}. " + "word " * (40 + 3 * i)} for i in range(n)]
    recs.append({"instruction": "short", "response": "too short to be a document part"})
    recs.append({"question": "q", "answer": ["List answer. " + "more " * 60]})
    path.write_text(json.dumps(recs))
    return str(path)


def test_reading_prompts_join_long_texts_to_the_asked_length(tmp_path):
    f = _texts_file(tmp_path / "a.json", 20)
    got = reading_prompts([f], 50, seed=3, min_chars=800, max_chars=2000)
    assert len(got) == 50 and all(p.source == "reading" for p in got)
    heads = {t.split("{doc}")[0] for t in TEMPLATES}
    for p in got:
        (msg,) = p.messages
        assert msg["role"] == "user"
        text = msg["content"]
        assert any(text.startswith(h) for h in heads)
        assert "too short" not in text  # texts under MIN_DOC_CHARS are never used
        parts = re.findall(r"Text number \d+\.|List answer\.", text)
        assert len(parts) == len(set(parts)) >= 2  # no text twice in one document
        assert len(text) - max(len(t) - len("{doc}") for t in TEMPLATES) >= 800
    # seeded: the same call gives the same prompts, another seed others
    again = reading_prompts([f], 50, seed=3, min_chars=800, max_chars=2000)
    assert [p.messages for p in again] == [p.messages for p in got]
    assert [p.messages for p in reading_prompts([f], 50, 4, 800, 2000)] != [p.messages for p in got]
    assert reading_prompts([f], 0, 3, 800, 2000) == []
    empty = tmp_path / "b.jsonl"
    empty.write_text(json.dumps({"question": "no long answer", "answer": "x"}) + "\n")
    assert reading_prompts([str(empty)], 5, 3, 800, 2000) == []
    with pytest.raises(ValueError):
        reading_prompts([f], 5, 3, 900, 800)


@pytest.mark.parametrize("budget", [64, 200, 1000])
def test_token_budget_batches_cover_each_epoch_once(budget):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 120, (700,), generator=g).tolist()
    it = batch_indices(lengths, batch_size=8, seed=1, batch_tokens=budget)
    for _ in range(2):  # two epochs
        seen, n = Counter(), 0
        while n < len(lengths):
            b = next(it)
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
            seen.update(b)
            n += len(b)
        assert n == len(lengths) and set(seen.values()) == {1}
    # the sequence-count mode is unchanged
    fixed = next(batch_indices(lengths, batch_size=8, seed=1))
    assert len(fixed) == 8


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from helpers import build_tiny_model

    import specserve

    path = build_tiny_model(str(tmp_path_factory.mktemp("gen") / "llama"), "llama", seed=5, vocab_size=64)
    # 8 slots: the 18-160 requests below enter the engine in waves of 2
    eng = specserve.Engine(model_path=path, device="cpu", max_total_tokens=16384, max_running_requests=8)
    yield eng
    eng.shutdown()


def _prompts(n):
    from specserve.train.data import Prompt

    words = ["ab", "cd", "efg", "hij", "kl", "mno"]
    return [Prompt([{"role": "user", "content": " ".join(words[(i + j) % 6] for j in range(3 + i % 3))}], "toy")
            for i in range(n)]


def test_extra_sampled_passes_follow_the_first_responses(tiny_engine):
    from specserve.train.data import GenerationSettings, generate_samples

    gs = GenerationSettings(num_prompts=0, max_new_tokens=24, sampled_fraction=0.0, temperature=1.0, seed=2,
                            max_prompt_len=100, extra_sampled=2)
    out = generate_samples(tiny_engine, _prompts(6), gs)
    assert len(out) == 18
    first, extra = out[:6], out[6:]
    assert not any(s.sampled for s in first) and all(s.sampled for s in extra)
    for k in range(6):  # same prompt, three responses: the greedy one and two different samples
        a, b, c = first[k], extra[k], extra[6 + k]
        assert a.prompt_ids == b.prompt_ids == c.prompt_ids
        assert len({tuple(a.response_ids), tuple(b.response_ids), tuple(c.response_ids)}) == 3
    greedy = generate_samples(tiny_engine, _prompts(6), GenerationSettings(0, 24, 0.0, 1.0, 2, 100))
    assert [s.response_ids for s in greedy] == [s.response_ids for s in first]
    tiny_engine.core.scheduler.check_idle_invariants()


def test_generation_time_budget_stops_and_frees_everything(tiny_engine):
    from specserve.train.data import MIN_PARTIAL_TOKENS, GenerationSettings, generate_samples

    gs = GenerationSettings(num_prompts=0, max_new_tokens=400, sampled_fraction=0.5, temperature=1.0, seed=2,
                            max_prompt_len=100, extra_sampled=3, time_budget_s=0.0)
    out = generate_samples(tiny_engine, _prompts(40), gs)
    assert len(out) < 160  # stopped early: not every request was answered
    assert all(len(s.response_ids) >= MIN_PARTIAL_TOKENS for s in out)
    tiny_engine.core.scheduler.check_idle_invariants()  # aborted requests gave back their KV
    # the engine still serves
    res = tiny_engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(res[0]["output_ids"]) == 4


def test_init_from_checkpoint_continues_a_head(tmp_path):
    from helpers import build_tiny_model

    from specserve.models.loader import ModelSource, load_target
    from specserve.train.export import write_draft_checkpoint
    from specserve.train.objective import build_draft, init_draft_from_checkpoint, init_draft_from_target
    from specserve.train.vocab import build_draft_vocab, vocab_of_checkpoint

    cpu = torch.device("cpu")
    path = build_tiny_model(str(tmp_path / "llama"), "llama", seed=5, vocab_size=64)
    target = load_target(ModelSource.resolve(path), torch.float32, cpu, 600)
    vocab = build_draft_vocab([list(range(3, 40))], [], 64, 24, forced=[2])
    trained = build_draft(target.config, 600, vocab, cpu)
    init_draft_from_target(trained, target.model, vocab, 0.1, seed=1)
    with torch.no_grad():
        for p in trained.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # "trained": away from the init
    write_draft_checkpoint(trained, target.config, str(tmp_path / "head"), torch.float32)
    fresh = build_draft(target.config, 600, vocab, cpu)
    init_draft_from_target(fresh, target.model, vocab, 0.01, seed=0)
    assert not torch.equal(fresh.decoder.mlp.down_proj.weight, trained.decoder.mlp.down_proj.weight)
    init_draft_from_checkpoint(fresh, target, str(tmp_path / "head"), 600)
    ours = dict(fresh.named_parameters())
    for name, p in trained.named_parameters():
        assert torch.equal(ours[name].detach(), p.detach()), name
    # --init-draft keeps the checkpoint's vocabulary, with its coverage of the new data
    kept = vocab_of_checkpoint(str(tmp_path / "head"), [[3, 4, 50], [5]], 64)
    assert torch.equal(kept.ids, vocab.ids) and kept.size == 24 and kept.coverage == 0.75
    other = build_draft_vocab([list(range(20, 60))], [], 64, 24, forced=[2])
    wrong = build_draft(target.config, 600, other, cpu)
    init_draft_from_target(wrong, target.model, other, 0.01, seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        init_draft_from_checkpoint(wrong, target, str(tmp_path / "head"), 600)
