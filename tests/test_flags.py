"""`specserve serve`'s flags: the reference's own SGLang launch commands parse (with SGLang's meaning, or one clear
line for a value that only means something elsewhere or is not supported yet), and docs/flags.md is what the flags
say (scripts/gen_flags_doc.py writes it)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.server.launch import build_parser, parse_args

ROOT = Path(__file__).resolve().parents[1]

# The launch commands of the pull requests the project re-creates (the model path a stand-in).
REFERENCE = [
    "--model-path /model --host 0.0.0.0 --port 30080 --tp-size 2 --ep-size 1 --kv-cache-dtype bf16 --page-size 64 "
    "--context-length 132096 --max-running-requests 64 --mem-fraction-static 0.88 --disable-radix-cache "
    "--trust-remote-code",
    "--model-path /model --trust-remote-code --host 0.0.0.0 --port 30080 --tp 2 --ep-size 2 --attention-backend aiter "
    "--kv-cache-dtype bf16 --page-size 64 --context-length 132096 --max-running-requests 64 --mem-fraction-static 0.88 "
    "--disable-radix-cache --cuda-graph-backend-decode full --cuda-graph-max-bs-decode 64 --speculative-algorithm "
    "EAGLE --speculative-num-steps 4 --speculative-eagle-topk 1 --sampling-defaults openai",
    "--model-path M --host 0.0.0.0 --port 8016 --trust-remote-code --tp-size 4 --mem-fraction-static 0.8 "
    "--disable-radix-cache --max-running-requests 128 --enable-return-hidden-states --kv-cache-dtype fp8_e4m3 "
    "--model-loader-extra-config '{\"online_quant_config\":{\"global_quant_config\":\"ptpc_fp8\",\"exclude_layer\":"
    "[\"lm_head\",\"model.embed_tokens\",\"*.mlp.gate\",\"*expert*\"]}}' --speculative-algorithm EAGLE "
    "--speculative-draft-attention-backend aiter --speculative-num-steps 3 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 4",
]
# (flag, value) in the commands -> the one line it is answered with
REFUSED = {
    ("--attention-backend", "aiter"): "argument --attention-backend: aiter is AMD ROCm's kernel library",
    ("--speculative-draft-attention-backend", "aiter"): "argument --speculative-draft-attention-backend: aiter is "
                                                        "AMD ROCm's kernel library",
}


def _pairs(argv: list[str]) -> set[tuple[str, str]]:
    return set(zip(argv, argv[1:])) & set(REFUSED)


def _without(argv: list[str], pairs: set[tuple[str, str]]) -> list[str]:
    """argv less the given (flag, value) pairs."""
    out, i = [], 0
    while i < len(argv):
        if tuple(argv[i:i + 2]) in pairs:
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("specserve serve: error: ") and "usage:" not in err[0], err
    assert err[1] == "(see specserve serve --help)"
    return err[0]


@pytest.mark.parametrize("cmd", range(len(REFERENCE)))
def test_reference_launch_commands(cmd, capsys):
    argv = shlex.split(REFERENCE[cmd])
    refused = _pairs(argv)
    a = parse_args(_without(argv, refused))  # the rest parses
    assert a.trust_remote_code and a.disable_radix_cache and a.host == "0.0.0.0"
    for pair in refused:  # each refused value alone: its one line, the flag named
        assert REFUSED[pair] in _error(_without(argv, refused - {pair}), capsys)
    assert len(refused) == (0, 1, 1)[cmd]
    if cmd == 0:
        assert (a.tp_size, a.ep_size, a.moe_expert_parallel) == (2, 1, False)  # each expert split over the ranks
        assert (a.kv_cache_dtype, a.page_size, a.context_length, a.max_running_requests, a.mem_fraction_static) == \
            ("bfloat16", 64, 132096, 64, 0.88)
    elif cmd == 1:
        assert (a.tp_size, a.ep_size, a.moe_expert_parallel) == (2, 2, True)  # the experts partitioned
        assert (a.cuda_graph_max_bs, a.cuda_graph_backend_decode, a.sampling_defaults) == (64, "full", "openai")
        assert (a.speculative_algorithm, a.speculative_num_steps, a.speculative_num_draft_tokens) == ("EAGLE", 4, 5)
    else:
        assert (a.tp_size, a.ep_size, a.max_running_requests, a.port) == (4, 4, 128, 8016)
        assert a.enable_return_hidden_states
        assert (a.speculative_num_steps, a.speculative_num_draft_tokens) == (3, 4)
        assert a.kv_cache_dtype == "fp8_e4m3"  # FP8 K/V (MHA layers; an MLA model is refused at engine start)


def test_sglang_flag_values(capsys):
    assert parse_args(["--speculative-draft-attention-backend", "torch"]).speculative_draft_attention_backend == \
        "torch"
    assert parse_args(["--model-loader-extra-config", "{}"]).model_loader_extra_config == "{}"
    assert parse_args(["--cuda-graph-max-bs", "8", "--cuda-graph-max-bs-decode", "8"]).cuda_graph_max_bs == 8
    assert parse_args(["--cuda-graph-bs-decode", "1", "2"]).cuda_graph_bs == [1, 2]
    for argv, needle in ((["--cuda-graph-max-bs", "8", "--cuda-graph-max-bs-decode", "16"], "differ"),
                         (["--cuda-graph-backend-decode", "piecewise"], "full CUDA graphs only"),
                         (["--kv-cache-dtype", "fp4_e2m1"], "FP4 KV caches are not supported yet"),
                         (["--tp", "4", "--ep-size", "2"], "--ep-size 2 must be 1"),
                         (["--model-loader-extra-config", "{"], "not JSON"),
                         (["--model-loader-extra-config", '{"quantization": "fp8"}'], "unsupported keys"),
                         (["--model-loader-extra-config", '{"online_quant_config": {"global_quant_config": "w4a16"}}'],
                          "'w4a16' is not supported"),
                         (["--model-loader-extra-config",
                           '{"online_quant_config": {"global_quant_config": "ptpc_fp8", "exclude_layer": "lm_head"}}'],
                          "must be a list"),
                         (["--quantization", "awq"], "invalid choice")):
        assert needle in _error(argv, capsys)
    from specserve.server_args import ServerArgs

    # Engine(**kwargs) takes the same values and gives the same messages
    assert ServerArgs(model_path="/m", kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    for name in ("fp8_e4m3", "fp8_e5m2"):
        assert parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == ServerArgs(model_path="/m",
                                                                                   kv_cache_dtype=name).kv_cache_dtype
    with pytest.raises(ValueError, match="--attention-backend: aiter is AMD ROCm"):
        ServerArgs(model_path="/m", attention_backend="aiter")


# ---------------------------------------------------------------------- docs/flags.md
def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_flags_doc", ROOT / "scripts" / "gen_flags_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flags_doc_is_up_to_date():
    doc = ROOT / "docs" / "flags.md"
    assert _gen_module().render(build_parser()) == doc.read_text(), \
        "docs/flags.md is out of date: run python scripts/gen_flags_doc.py"


def test_flags_doc_lists_every_serve_flag():
    """Every option string `specserve serve --help` shows is in docs/flags.md's tables, and no other."""
    r = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--help"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    # the option lines (indented two spaces; help text sits further right)
    shown = {s for line in r.stdout.splitlines() if re.match(r"^  -", line)
             for s in re.findall(r"(?<![\w-])--?[a-z][\w-]*", line)}
    doc = (ROOT / "docs" / "flags.md").read_text()
    documented = {s for line in doc.splitlines() if line.startswith("| `")
                  for s in re.findall(r"`(--?[a-z][\w-]*)`", line.split(" | ")[0])}
    assert shown == documented, (sorted(shown - documented), sorted(documented - shown))


def test_help_texts_cite_no_figures_or_sections():
    """Help texts say what a flag does; measured figures and BENCHMARKS sections belong in the docs."""
    bad = [a.option_strings[0] for a in build_parser()._actions
           if a.help and (re.search(r"§|BENCHMARKS|\d+(\.\d+)?x\b|\d+(\.\d+)? ?(ms|GB/s|tok/s)\b", a.help))]
    assert not bad, bad
