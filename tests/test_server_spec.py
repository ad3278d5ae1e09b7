"""A live server with MTP speculation (tiny target + a separate random draft checkpoint) under the overlap schedule
(a GPU's default, forced on this CPU): accept length in usage.spec (OpenAI routes), meta_info (/generate),
/get_server_info and /metrics; then SIGTERM during an in-flight stream ends the stream with finish_reason "abort" and
the server exits 0 with its engine process gone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from helpers import build_draft_folder, build_tiny_model
from server_fixtures import LiveServer, start_server


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_spec")
    model = build_tiny_model(str(root / "tiny"), "llama", seed=5)
    draft = build_draft_folder(str(root / "draft"), model, seed=9)
    srv = start_server(["--model-path", model, "--max-total-tokens", "4096", "--speculative-algorithm", "MTP",
                        "--speculative-draft-model-path", draft, "--speculative-num-steps", "2",
                        "--served-model-name", "tiny-mtp", "--enable-overlap-schedule",  # the GPU's schedule
                        "--enable-return-hidden-states", "--show-internal-info"],
                       str(root / "server.log"))
    yield srv
    srv.terminate()


def _check_spec(spec: dict, completion_tokens: int) -> None:
    # Every verify yields 1..N+1 tokens; the first token comes from prefill, not from a verify.
    assert spec["verify_ct"] >= 1
    assert 1.0 <= spec["accept_length"] <= 3.0
    assert spec["verify_ct"] <= completion_tokens - 1


def test_usage_reports_accept_length(spec_server):
    from openai import OpenAI

    client = OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model="tiny-mtp", prompt="abc", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    _check_spec(r.usage.spec, 8)
    chunks = list(client.chat.completions.create(model="tiny-mtp", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 6
    _check_spec(chunks[-1].usage.spec, 6)
    g = httpx.post(spec_server.url + "/generate", json={"text": "abc", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
    m = g["meta_info"]
    _check_spec({"verify_ct": m["spec_verify_ct"], "accept_length": m["spec_accept_length"]}, 8)
    # Same greedy prompt through both routes: same verify count (the engine is deterministic here).
    assert m["spec_verify_ct"] == r.usage.spec["verify_ct"]
    info = spec_server.server_info()
    assert info["spec_enabled"] and info["spec_verify_ct"] > 0 and info["avg_spec_accept_length"] >= 1.0
    assert info["speculative_algorithm"] == "MTP" and info["speculative_num_steps"] == 2
    assert info["overlap_schedule"] is True and 0 < info["num_overlapped_steps"] <= info["num_decode_steps"]
    assert 0 <= info["num_overlapped_prefills"] < info["num_prefill_steps"]
    metrics = httpx.get(spec_server.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("specserve:spec_accept_length{"))
    assert float(line.split()[-1]) >= 1.0


def test_generate_returns_hidden_states(spec_server):
    """return_hidden_states on /generate: SGLang's meta_info.hidden_states (the prompt's [P, H], then one [H] per
    output token but the last), streamed in the final event; a request that does not ask gets none."""
    body = {"input_ids": [[5, 6, 7, 8], [9, 10]], "return_hidden_states": [True, False],
            "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}}
    asked, plain = httpx.post(spec_server.url + "/generate", json=body, timeout=60).json()
    hidden = asked["meta_info"]["hidden_states"]
    assert len(hidden) == 7 and len(hidden[0]) == 4 and all(len(h) == len(hidden[0][0]) for h in hidden[1:])
    assert "hidden_states" not in plain["meta_info"]
    events = []
    with httpx.stream("POST", spec_server.url + "/generate", timeout=60,
                      json={**body, "input_ids": [5, 6, 7, 8], "return_hidden_states": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    streamed = events[-1]["meta_info"]["hidden_states"]  # greedy: the same positions (batch-size rounding apart)
    assert len(streamed) == len(hidden) and all(
        abs(x - y) < 1e-4 for a, b in zip(streamed[1:], hidden[1:]) for x, y in zip(a, b))
    assert all(abs(x - y) < 1e-4 for a, b in zip(streamed[0], hidden[0]) for x, y in zip(a, b))
    assert all("hidden_states" not in e["meta_info"] for e in events[:-1])
    spec_server.wait_idle()


def test_sigterm_with_a_stream_in_flight_exits_0(spec_server):
    engine_pid = spec_server.server_info()["engine_pid"]
    events: list = []
    first = threading.Event()

    def consume():
        body = {"text": "go on", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        with httpx.stream("POST", spec_server.url + "/generate", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(60), spec_server.log()
    t0 = time.time()
    rc = spec_server.terminate(signal.SIGTERM, timeout=60)
    t.join(30)
    assert rc == 0, spec_server.log()
    assert time.time() - t0 < 30
    assert events[-1] == "[DONE]"
    last = events[-2]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 2000
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
    assert "shut down" in spec_server.log()
