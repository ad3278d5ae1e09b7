"""`specserve bench-compare` against two live tiny servers (speculating and plain): a point per input length x
concurrency with both servers' TPOT and throughput, their ratio, the speculating server's accept length over that
run, the geometric mean, one JSON line per point and the PNG; plus the pieces on their own."""

from __future__ import annotations

import json
import math

import pytest
from helpers import build_tiny_model
from server_fixtures import start_server

from specserve.bench.compare import compare_point, format_table, geomean
from specserve.bench.compare import main as compare_main


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    model = build_tiny_model(str(root / "m"), "llama", seed=11, mtp_layout="deepseek")
    # --show-internal-info: the bench reads the tokenizer from the server's whole model path
    common = ["--model-path", model, "--max-total-tokens", "4096", "--log-level", "warning", "--show-internal-info"]
    spec = start_server(common + ["--speculative-algorithm", "MTP", "--speculative-num-steps", "2"],
                        str(root / "spec.log"))
    try:
        plain = start_server(common, str(root / "plain.log"))
    except BaseException:
        spec.terminate()
        raise
    yield spec, plain
    spec.terminate()
    plain.terminate()


@pytest.mark.timeout(300)
def test_compare_two_live_servers(servers, tmp_path, capsys):
    spec, plain = servers
    out, png = tmp_path / "points.jsonl", tmp_path / "compare.png"
    rc = compare_main(["--spec-url", spec.url, "--plain-url", plain.url, "--input-lens", "8,16", "--output-len", "6",
                       "--concurrency", "1,2", "--output-file", str(out), "--plot", str(png)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["input_len"], r["max_concurrency"]) for r in rows] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for r in rows:
        assert r["completed"] == [2 * r["max_concurrency"]] * 2 and r["num_prompts"] == 2 * r["max_concurrency"]
        assert r["speedup"] == pytest.approx(r["spec_output_throughput"] / r["plain_output_throughput"])
        assert r["spec_accept_length"] >= 1.0  # the speculating server verified drafts in that run
    text = capsys.readouterr().out
    assert "geomean output-throughput speedup over 4 points" in text
    assert png.stat().st_size > 1000


def test_table_and_geomean():
    spec = {"output_throughput": 300.0, "median_tpot_ms": 10.0, "num_prompts": 4, "server_accept_length": 2.5,
            "completed": 4}
    plain = {"output_throughput": 200.0, "median_tpot_ms": 20.0, "num_prompts": 4, "completed": 4}
    rows = [compare_point(spec, plain, 1024, 2), compare_point({**spec, "output_throughput": 100.0}, plain, 4096, 2)]
    assert rows[0]["speedup"] == 1.5 and rows[1]["speedup"] == 0.5
    assert geomean([1.5, 0.5]) == pytest.approx(math.sqrt(0.75))
    table = format_table(rows)
    assert "1.50x" in table and "0.50x" in table and f"{math.sqrt(0.75):.3f}x" in table


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        compare_main(["--spec-url", "http://x", "--plain-url", "http://y", "--concurrency", "0"])
    assert e.value.code == 2
