"""--speculative-token-map (models/token_map.py, MTPDraftModel.restrict_vocab): the file formats and their errors,
the restricted head against the full one, and greedy MTP with a map == plain decoding (maps that hold the tokens
the target emits, and maps that hold none of them: no draft is then ever accepted), graphs included; the
`specserve token-map` writer."""

import json

import pytest
import torch
from spec_fixtures import build_scheduler, run_greedy
from test_spec_greedy import _prompts

from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.models.token_map import load_token_map
from specserve.server_args import ServerArgs

NEW = 12


def _write(tmp_path, name, obj):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(obj))
    else:
        torch.save(obj, path)
    return str(path)


def test_load_token_map_formats(tmp_path):
    want = torch.tensor([1, 5, 7, 200])
    for name, obj in (("a.pt", torch.tensor([7, 1, 200, 5], dtype=torch.int32)), ("b.pt", [200, 7, 5, 1]),
                      ("c.json", [5, 200, 1, 7])):
        got = load_token_map(_write(tmp_path, name, obj), 256)
        assert got.dtype == torch.int64 and torch.equal(got, want), name


@pytest.mark.parametrize("name,obj,msg", [
    ("x.json", [1, 2, 256], "outside the target's vocabulary of 256"),
    ("x.json", [-1, 2], "token id -1"),
    ("x.json", [3, 4, 3], "repeat"),
    ("x.json", [], "holds no token ids"),
    ("x.json", [1.5, 2], "integer token ids"),
    ("x.json", {"ids": [1]}, "integer token ids"),
    ("x.pt", torch.tensor([[1, 2]]), "1-D"),
    ("x.pt", torch.tensor([1.0, 2.0]), "integer token ids"),
    ("x.txt", None, "expected a .pt or .json file"),
])
def test_load_token_map_errors(tmp_path, name, obj, msg):
    path = tmp_path / name
    if obj is None:
        path.write_text("1 2 3")
        path = str(path)
    else:
        path = _write(tmp_path, name, obj)
    with pytest.raises(ValueError, match=msg):
        load_token_map(path, 256)


def test_unreadable_or_missing_file(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot read it"):
        load_token_map(str(bad), 256)
    with pytest.raises(ValueError, match="no such file"):
        load_token_map(str(tmp_path / "none.pt"), 256)
    with pytest.raises(ValueError, match="no such file"):
        ServerArgs(model_path="m", speculative_algorithm="MTP", speculative_token_map=str(tmp_path / "none.pt"))
    with pytest.raises(ValueError, match="needs --speculative-algorithm"):
        ServerArgs(model_path="m", speculative_token_map=str(bad))


def _draft(path, token_map=None):
    t = load_target(ModelSource.resolve(path), torch.float32, torch.device("cpu"), 600)
    return load_mtp_draft(t, None, torch.float32, torch.device("cpu"), 600, token_map), t


def test_restricted_head_is_the_full_heads_rows(tiny_models):
    ids = torch.tensor([0, 3, 17, 40, 41, 99, 250])
    full, t = _draft(tiny_models["llama_mtp"])
    part, _ = _draft(tiny_models["llama_mtp"], ids)
    assert part.draft_vocab_size() == ids.numel() and full.draft_vocab is None
    assert part.head is not t.model.lm_head and torch.equal(part.head.weight, t.model.lm_head.weight[ids])
    h = torch.randn(5, t.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = full.compute_logits(h)[:, ids]  # [5, Vd]
    torch.testing.assert_close(part.compute_logits(h), want)
    assert torch.equal(part.draft_tokens(h), ids[want.argmax(-1)])
    vals, got_ids, lse = part.draft_candidates(h, 3)
    assert torch.isin(got_ids, ids).all()
    torch.testing.assert_close(lse, torch.logsumexp(want, -1))
    torch.testing.assert_close(vals, want.topk(3, -1).values)
    with pytest.raises(ValueError, match="already has a reduced vocabulary"):
        part.restrict_vocab(ids)


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    prompts = _prompts()
    sched, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=4096)
    return prompts, [r.output_ids for r in run_greedy(sched, prompts, NEW)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_mtp_with_token_map_equals_plain(tiny_models, plain_outputs, tmp_path, page_size):
    """A map of exactly the tokens the target emits (drafts accepted) and one of none of them (no draft ever
    accepted), both through the one-graph spec step (static replay on a CPU): the plain run's tokens."""
    prompts, plain = plain_outputs
    emitted = sorted({t for o in plain for t in o})
    vocab = load_target(ModelSource.resolve(tiny_models["llama_mtp"]), torch.float32, torch.device("cpu"),
                        600).config.vocab_size
    accepted = {}
    for name, ids in (("emitted", emitted), ("none", sorted(set(range(vocab)) - set(emitted)))):
        path = _write(tmp_path, f"{name}.json", ids)
        sched, _ = build_scheduler(tiny_models["llama_mtp"], max_total_tokens=4096, page_size=page_size,
                                   speculative_algorithm="MTP", speculative_num_steps=3,
                                   speculative_token_map=path, cuda_graph_bs=[1, 2, 4, 8])
        assert torch.equal(sched.model_runner.draft.draft_vocab, torch.tensor(ids))
        assert [r.output_ids for r in run_greedy(sched, prompts, NEW)] == plain, name
        assert sched.model_runner.spec.spec_step_graph.replays > 0
        accepted[name] = sched.stats.spec_accepted_drafts
    assert accepted["none"] == 0 and accepted["emitted"] > 0, accepted


def test_token_map_cli_writes_a_map_the_engine_reads(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    from specserve.cli import main

    path = tiny_models["llama_mtp"]
    tok = AutoTokenizer.from_pretrained(path)
    data = tmp_path / "out.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ("the cat sat", "the cat ran", "a dog")) + "\n")
    out = str(tmp_path / "map.pt")
    assert main(["token-map", "--model-path", path, "--input", str(data), "--size", "8", "--output", out]) == 0
    ids = load_token_map(out, tok.vocab_size if hasattr(tok, "vocab_size") else 256)
    words = {t for s in ("the cat sat", "the cat ran", "a dog") for t in tok.encode(s, add_special_tokens=False)}
    assert ids.numel() == 8 and set(tok.all_special_ids) <= set(ids.tolist())
    text_ids = [t for t in ids.tolist() if t not in tok.all_special_ids]
    assert set(text_ids) <= words or words <= set(text_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit):
        main(["token-map", "--model-path", path, "--input", str(bad), "--size", "8", "--output", out])


def test_engine_serves_with_a_token_map_and_rejects_a_bad_one(tiny_models, plain_outputs, tmp_path):
    """Through Engine (engine.py load_models): the map reaches the draft, the output is the plain run's; a map with
    an id past the vocabulary is a ValueError naming the file."""
    from specserve import Engine

    prompts, plain = plain_outputs
    good = _write(tmp_path, "m.json", list(range(0, 256, 3)))
    eng = Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
                 speculative_num_steps=2, speculative_token_map=good)
    try:
        assert eng.core.model_runner.draft.draft_vocab_size() == len(range(0, 256, 3))
        outs = eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": NEW, "temperature": 0.0,
                                                                    "ignore_eos": True})
        assert [o["output_ids"] for o in outs] == plain[:2]
    finally:
        eng.shutdown()
    bad = _write(tmp_path, "bad.json", [1, 5000])
    with pytest.raises(ValueError, match="bad.json.*outside the target's vocabulary"):
        Engine(model_path=tiny_models["llama_mtp"], max_total_tokens=4096, speculative_algorithm="MTP",
               speculative_token_map=bad)


def test_generate_cli_reports_load_errors_as_usage_errors(tiny_models, tmp_path, capsys):
    """`specserve generate` turns what only the checkpoint can reject (no MTP layer; a map past the vocabulary)
    into a usage error (exit 2, the reason on stderr), not a traceback."""
    from specserve.cli import main

    bad = _write(tmp_path, "bad.json", [1, 99999])
    for path, extra, msg in ((tiny_models["llama"], [], "has no MTP layer"),
                             (tiny_models["llama_mtp"], ["--speculative-token-map", bad], "outside the target's")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model-path", path, "--speculative-algorithm", "MTP", "--prompt", "x",
                  "--max-total-tokens", "2048", *extra])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
