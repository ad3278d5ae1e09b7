"""`specserve bench-spec` on a tiny target with a random draft folder: the acceptance table per file and N, the
speed rows side by side with plain, and the lossless check it prints (spec outputs == plain outputs), with and
without context lookup (then also with spec steps phase by phase beside the one-graph steps, an int8 draft, and
eager prefill)."""

import json

import pytest
import torch

from specserve.bench.spec_speed import Bench, SpeedConfig, build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("lookup", [False, True])
def test_bench_spec_tables_and_lossless_check(tiny_models, tmp_path, lookup, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("abc abc abc", "hello there", "x y z")))
    out = tmp_path / "res.jsonl"
    argv = ["--model-path", tiny_models["llama"], "--speculative-draft-model-path", tiny_models["llama_draft"],
            "--prompts", str(prompts), "--prompts-per-file", "3", "--max-new-tokens", "12", "--accept-steps", "1,2",
            "--speed-steps", "2", "--concurrency", "1,2", "--speed-prompts", "3", "--context-length", "256",
            "--device", "cpu", "--output-file", str(out), "--repeats", "2"] + (
                ["--speculative-ngram-lookup", "--compare-spec-step-graph", "--speculative-draft-model-quantization",
                 "int8", "--compare-draft-quantization", "--compare-prefill-graph"] if lookup else [])
    assert main(argv) == 0
    res = json.loads(out.read_text().splitlines()[-1])
    assert res["draft_quantization"] == ("int8" if lookup else "none")  # a given model: none unless asked
    acc = res["acceptance"]["p.jsonl"]
    assert set(acc) == {"1", "2"} and all(1.0 <= v <= 1 + int(n) for n, v in acc.items())
    speed = res["speed"]
    rows = [(r["concurrency"], r["N"], r.get("spec_step_graph"), r.get("draft_quantization"), r["prefill_graph"])
            for r in speed]
    if lookup:  # also each N phase by phase, with the head in float, and plain and N with eager prefill
        per_c = [(0, None, None, True), (2, True, "int8", True), (2, False, "int8", True), (2, True, "none", True),
                 (0, None, None, False), (2, True, "int8", False)]
    else:
        per_c = [(0, None, None, True), (2, True, "none", True)]
    assert rows == [(c, *r) for c in (1, 2) for r in per_c]
    for r in speed:
        # at most 3 x 12 tokens (the random target may emit EOS early), the same count for spec as for plain
        assert 0 < r["output_tokens"] <= 36 and r["tok_per_s"] > 0
        assert len(r["tok_per_s_runs"]) == 2 and min(r["tok_per_s_runs"]) <= r["tok_per_s"] <= max(r["tok_per_s_runs"])
        assert r["output_tokens"] == speed[0]["output_tokens"]
        assert 0 < r["prefill_share"] < 1 and r["decode_tok_per_s"] > r["tok_per_s"]  # prefill steps were timed
        if r["N"]:
            assert r["same_as_plain"] == 3  # float32 CPU: speculative greedy text is plain greedy text
    assert "3/3 outputs = plain" in capsys.readouterr().out


def test_bench_spec_sampled(tiny_models, tmp_path, capsys):
    """--temperature / --top-p reach every run (the same prompts sampled give other outputs than greedy, plain and
    speculative alike), and no lossless text comparison is claimed (sampled speculation is lossless in
    distribution only)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("abc abc abc", "hello there", "x y z")))
    out = tmp_path / "res.jsonl"
    base = ["--model-path", tiny_models["llama"], "--speculative-draft-model-path", tiny_models["llama_draft"],
            "--prompts", str(prompts), "--prompts-per-file", "3", "--max-new-tokens", "12", "--accept-steps", "2",
            "--speed-steps", "2", "--concurrency", "2", "--speed-prompts", "3", "--context-length", "256",
            "--device", "cpu", "--output-file", str(out), "--repeats", "1"]
    assert main(base) == 0
    assert main(base + ["--temperature", "0.8", "--top-p", "0.9", "--compare-draft-sampling"]) == 0
    greedy, sampled = (json.loads(line) for line in out.read_text().splitlines())
    assert greedy["sampling"]["temperature"] == 0.0
    assert sampled["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": -1, "min_p": 0.0}
    prompt_ids = [[5, 6, 7, 8], [9, 10, 11]]
    for n in (0, 2):
        outs = []
        for extra in ([], ["--temperature", "0.8", "--top-p", "0.9"]):
            b = Bench(build_parser().parse_args(base + extra))
            outs.append([r.output_ids for r in b.run(b.scheduler(SpeedConfig(n), 2), prompt_ids, 12).reqs])
        assert outs[0] != outs[1]
    assert [(r["N"], r.get("draft_sampling")) for r in sampled["speed"]] == [(0, None), (2, "argmax"), (2, "sample")]
    for r in sampled["speed"]:
        assert "same_as_plain" not in r and r["output_tokens"] > 0
        if r["N"]:
            assert 1.0 <= r["accept_length"] <= 3.0 and r["spec_plain_steps"] == 0  # adaptive is off on a CPU
    assert "sampled: temperature 0.8" in capsys.readouterr().out


def test_bench_spec_compares_mtp_chains(tiny_models, tmp_path):
    """--compare-mtp-chain gives every N of the acceptance table once per chained hidden state (after the draft's
    final norm, before it), and each run's draft really chains that way."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("abc abc abc", "hello there")))
    out = tmp_path / "res.jsonl"
    argv = ["--model-path", tiny_models["llama"], "--speculative-draft-model-path", tiny_models["llama_draft"],
            "--prompts", str(prompts), "--prompts-per-file", "2", "--max-new-tokens", "10", "--accept-steps", "1,3",
            "--speed-steps", "", "--context-length", "256", "--device", "cpu", "--output-file", str(out)]
    assert main(argv + ["--compare-mtp-chain"]) == 0
    acc = json.loads(out.read_text().splitlines()[-1])["acceptance"]["p.jsonl"]
    assert set(acc) == {"1/normed", "1/prenorm", "3/normed", "3/prenorm"}
    assert all(1.0 <= v <= 1 + int(k.split("/")[0]) for k, v in acc.items())
    assert acc["1/normed"] == acc["1/prenorm"]  # one draft step reads the target's hidden state only
    b = Bench(build_parser().parse_args(argv))
    for chain in ("prenorm", "normed"):
        b.scheduler(SpeedConfig(3, mtp_chain=chain), 2)
        assert b.draft.chain_prenorm == (chain == "prenorm")


def test_bench_spec_compares_fp8(tiny_models, tmp_path, capsys):
    """--compare-fp8 gives every N of the acceptance table again with FP8 weights (target and draft, online as
    --quantization fp8) and an fp8_e4m3 KV cache on the same prompts, with the relative change of the mean accept
    length, and adds FP8 rows (plain and N) to the speed table, each against the FP8 plain run; the FP8 runs really
    hold FP8 weights and an 8-bit cache."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("abc abc abc", "hello there")))
    out = tmp_path / "res.jsonl"
    argv = ["--model-path", tiny_models["llama"], "--speculative-draft-model-path", tiny_models["llama_draft"],
            "--prompts", str(prompts), "--prompts-per-file", "2", "--max-new-tokens", "10", "--accept-steps", "2",
            "--speed-steps", "2", "--concurrency", "2", "--repeats", "1", "--context-length", "256",
            "--device", "cpu", "--output-file", str(out), "--compare-fp8"]
    assert main(argv) == 0
    res = json.loads(out.read_text().splitlines()[-1])
    acc = res["acceptance"]
    assert set(acc["p.jsonl"]) == {"2", "2/fp8"} and all(1.0 <= v <= 3.0 for v in acc["p.jsonl"].values())
    change = acc["fp8_relative_change"]["2"]
    assert change == round(acc["mean"]["2/fp8"] / acc["mean"]["2"] - 1, 4)
    assert [(r["N"], r["fp8"]) for r in res["speed"]] == [(0, False), (2, False), (0, True), (2, True)]
    fp8_spec = res["speed"][3]
    assert fp8_spec["same_as_plain"] == 2  # greedy spec == greedy plain holds in FP8 too (against the FP8 plain)
    assert "FP8 weights + FP8 KV vs float32" in capsys.readouterr().out
    b = Bench(build_parser().parse_args(argv))
    sched = b.scheduler(SpeedConfig(2, fp8=True), 2)
    mr = sched.model_runner
    assert mr.kv_dtype == torch.float8_e4m3fn
    target, draft = b.fp8_models
    assert any(getattr(m, "is_fp8", False) for m in target.model.modules())
    assert any(getattr(m, "is_fp8", False) for m in draft.modules())
    assert not any(getattr(m, "is_fp8", False) for m in b.target.model.modules())  # the float run's target untouched
