"""`specserve bench` and `specserve eval gsm8k` against a live `python -m specserve.launch_server` subprocess serving
a tiny random checkpoint with an MTP layer (speculation on, so accept lengths flow end to end)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import build_tiny_model, shared_data_dir  # noqa: E402

from specserve.bench import eval_cli, serving  # noqa: E402
from specserve.bench.datasets import random_requests  # noqa: E402
from specserve.bench.target import resolve_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_live")
    # a long context so that few-shot GSM8K prompts fit (the tiny tokenizer spends one token per character)
    model = build_tiny_model(str(root / "tiny_mtp"), "llama", seed=11, mtp_layout="deepseek",
                             max_position_embeddings=4096)
    port = _free_port()
    log_path = root / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.launch_server", "--model-path", model, "--host", "127.0.0.1",
             "--port", str(port), "--speculative-algorithm", "MTP", "--speculative-num-steps", "2",
             "--log-level", "warning", "--show-internal-info"],  # (the bench reads the tokenizer from its path)
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + STARTUP_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"server did not come up (rc={proc.poll()}):\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield {"url": url, "port": port, "model": model, "root": root}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


FIELDS = ["backend", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
          "request_throughput", "input_throughput", "output_throughput", "total_throughput", "concurrency",
          "accept_length", "server_accept_length"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "p99")]


def _bench(live, tmp_path, backend, *extra):
    out = tmp_path / f"{backend}.jsonl"
    rc = serving.main(["--base-url", live["url"], "--backend", backend, "--num-prompts", "4",
                       "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.5",
                       "--seed", "2", "--disable-tqdm", "--output-file", str(out), *extra])
    assert rc == 0
    return _lines(out)


@pytest.mark.parametrize("backend", ["specserve", "openai", "openai-chat"])
def test_bench_live(live, tmp_path, backend):
    (line,) = _bench(live, tmp_path, backend, "--max-concurrency", "2")
    for f in FIELDS:
        assert f in line, f
    reqs = random_requests(resolve_tokenizer(live["model"], None), 4, 16, 8, 0.5, seed=2)
    assert line["completed"] == 4 and line["failed"] == 0, line["errors"]
    assert line["total_output_tokens"] == sum(r.output_len for r in reqs)  # ignore_eos: exact lengths
    if backend == "specserve":
        assert line["total_input_tokens"] == sum(r.prompt_len for r in reqs)  # ids sent as they are
    assert line["accept_length"] is not None and 1.0 <= line["accept_length"] <= 3.0  # N = 2 drafts
    assert line["server_accept_length"] is not None and line["server_accept_length"] >= 1.0
    assert line["mean_ttft_ms"] > 0 and line["output_throughput"] > 0


def test_bench_live_sweep_plot(live, tmp_path):
    png = tmp_path / "sweep.png"
    lines = _bench(live, tmp_path, "openai", "--max-concurrency", "1,2", "--plot", str(png))
    assert [ln["max_concurrency"] for ln in lines] == [1, 2] and all(ln["completed"] == 4 for ln in lines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _gsm8k_file(tmp_path) -> str:
    data = shared_data_dir()
    path = os.path.join(data, "gsm8k", "test.jsonl") if data else None
    if path and os.path.exists(path):
        return path
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("\n".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}\n#### {a + b}"})
                           for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 1))) + "\n")
    return str(p)


@pytest.mark.parametrize("api,shots", [("completion", "1"), ("chat", "0")])
def test_eval_gsm8k_live(live, tmp_path, api, shots):
    out = tmp_path / "eval.jsonl"
    rc = eval_cli.main(["gsm8k", "--data", _gsm8k_file(tmp_path), "--num-examples", "4", "--num-threads", "4",
                        "--api", api, "--num-shots", shots, "--max-tokens", "16", "--base-url", live["url"],
                        "--output-file", str(out), "--disable-tqdm"])
    assert rc == 0
    (line,) = _lines(out)
    assert line["num_examples"] == 4 and line["failed"] == 0, line["errors"]
    assert 0 <= line["correct"] <= 4 and line["accuracy"] == pytest.approx(line["correct"] / 4)
    assert line["invalid"] == pytest.approx(line["num_invalid"] / 4)
    assert 0 < line["output_tokens"] <= 4 * 16 and line["latency"] > 0
    assert line["accept_length"] is not None and line["accept_length"] >= 1.0


def test_bench_cli_entry_point(live, tmp_path, capsys):
    from specserve.cli import main as cli_main

    out = tmp_path / "cli.jsonl"
    rc = cli_main(["bench", "--port", str(live["port"]), "--backend", "openai", "--num-prompts", "2",
                   "--random-input-len", "8", "--random-output-len", "4", "--output-file", str(out)])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    (line,) = _lines(out)
    assert line["completed"] == 2 and line["total_output_tokens"] == sum(
        rq.output_len for rq in random_requests(resolve_tokenizer(live["model"], None), 2, 8, 4, 0.0, seed=1))
