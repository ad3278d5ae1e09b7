"""Client input that used to stall the server or get a 500 (issue 16): a huge body is refused with a 413 before it
is read whole and never delays /health; a lone surrogate escape (prompt, chat content, /generate text, stop
strings) and a body nested 100 000 levels deep are 400s that keep the keep-alive connection usable; a user message
without content and out-of-range stop_token_ids are 400s; a prompt longer than the context can hold is refused by
its length alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from helpers import build_tiny_model
from server_fixtures import LiveServer, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_hardening")
    model = build_tiny_model(str(root / "tiny"), "llama", seed=5)
    srv = start_server(["--model-path", model, "--max-total-tokens", "4096", "--max-request-body-mb", "1",
                        "--skip-warmup"], str(root / "server.log"))
    yield srv
    srv.terminate()


GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}


def _good_after(client: httpx.Client, url: str) -> None:
    """The same keep-alive connection serves a good request after a bad one."""
    r = client.post(url + "/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_oversized_body_is_413_and_health_stays_fast(server):
    big = b'{"model": "tiny", "prompt": "' + b"a " * 700_000 + b'"}'  # 1.4 MB > 1 MB
    times = []

    def probe():
        for _ in range(10):
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            times.append(time.perf_counter() - t0)
            time.sleep(0.05)

    th = threading.Thread(target=probe)
    th.start()
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=30)
    took = time.perf_counter() - t0
    th.join()
    assert r.status_code == 413, r.text
    assert "max-request-body-mb" in r.json()["error"]["message"]
    assert took < 5 and max(times) < 2, (took, times)
    # without a Content-Length (chunked upload): refused as it streams in
    r = httpx.post(server.url + "/generate", content=iter([b'{"text": "', b"b" * 600_000, b"c" * 600_000, b'"}']),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_prompt_longer_than_the_context_can_hold_is_refused_untokenised(server):
    r = httpx.post(server.url + "/v1/completions", json={**GOOD, "prompt": "x" * 400_000}, timeout=30)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]


BAD_TEXT = [
    ("/v1/completions", {**GOOD, "prompt": "hi \ud800"}),
    ("/v1/completions", {**GOOD, "prompt": ["ok", "hi \udc00 there"]}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\ud800"}]}),
    ("/generate", {"text": "x \ud83d", "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {**GOOD, "stop": ["\ud800"]}),
]


@pytest.mark.parametrize("route,body", BAD_TEXT, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_TEXT)])
def test_lone_surrogates_are_400_and_the_connection_lives(server, route, body):
    raw = json.dumps(body).encode()  # ASCII escapes, as a client sends "\ud800" (httpx cannot encode the character)
    with httpx.Client(timeout=30) as client:
        r = client.post(server.url + route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "Unicode" in r.json()["error"]["message"]
        _good_after(client, server.url)


def test_deeply_nested_body_is_400(server):
    nested = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with httpx.Client(timeout=30) as client:
        r = client.post(server.url + "/v1/completions", content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        _good_after(client, server.url)


@pytest.mark.parametrize("body,needle", [
    ({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user"}]}, "content"),
    ({**GOOD, "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
])
def test_more_invalid_requests_are_400(server, body, needle):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert server.wait_idle()["num_http_requests"] == 0


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_queue")
    model = build_tiny_model(str(root / "tiny"), "llama", seed=6, max_position_embeddings=4096)  # long requests
    srv = start_server(["--model-path", model, "--max-total-tokens", "8192", "--max-running-requests", "1",
                        "--max-queued-requests", "2", "--skip-warmup", "--show-internal-info"],  # (the engine's pid)
                       str(root / "server.log"))
    yield srv
    srv.terminate()


def test_max_queued_requests_answers_503_with_retry_after(small_queue_server):
    """With the engine paused nothing leaves the queue: two requests wait (--max-queued-requests 2), the next ones get
    a 503 with Retry-After at once; resumed, the two waiting ones complete."""
    srv = small_queue_server
    pid = srv.server_info()["engine_pid"]
    body = {**GOOD, "max_tokens": 40, "ignore_eos": True}
    results = []

    def one():
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        results.append((r.status_code, r.headers.get("retry-after"), r.json()))

    os.kill(pid, signal.SIGSTOP)
    try:
        waiting = [threading.Thread(target=one) for _ in range(2)]
        for t in waiting:
            t.start()
        deadline = time.time() + 10
        while srv.server_info()["num_http_requests"] < 2:  # both are queued here
            assert time.time() < deadline
            time.sleep(0.05)
        for _ in range(3):
            one()  # refused at once
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in waiting:
        t.join()
    codes = sorted(c for c, _, _ in results)
    assert codes == [200, 200, 503, 503, 503], codes
    for code, retry, js in results:
        if code == 503:
            assert retry == "1" and "max-queued-requests" in js["error"]["message"]
        else:
            assert js["usage"]["completion_tokens"] == 40
    info = srv.wait_idle()
    assert info["kv_free_pages"] == info["kv_initial_free_pages"]


FOUND_BY_FUZZING = [  # tests/test_fuzz_routes.py found these 500s; each is a 400 now
    ("/v1/completions", b"9" * 4301, "not valid JSON"),  # an int past Python's 4300-digit parsing limit
    ("/v1/completions", b'{"rid": ' + b"9" * 4301 + b"}", "not valid JSON"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hello", "max_tokens": 4, "rid": "\\ud800"}', "rid"),
    ("/generate", b'{"text": "hello", "rid": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "rid"),
    ("/generate", b'{"text": "hello", "sampling_params": {"max_new_tokens": 4, "\\ud800": null}}', "unknown"),
    ("/v1/chat/completions", json.dumps({  # a client's own template would run on the server's tokenizer thread
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}).encode(), "chat_template"),
]


@pytest.mark.parametrize("route,raw,needle", FOUND_BY_FUZZING, ids=[str(i) for i in range(len(FOUND_BY_FUZZING))])
def test_inputs_found_by_fuzzing_are_400(server, route, raw, needle):
    with httpx.Client(timeout=30) as client:
        r = client.post(server.url + route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        _good_after(client, server.url)


def test_a_queued_request_whose_client_left_costs_no_prefill(small_queue_server):
    """A request waits (the engine process is paused) and its client gives up: the engine takes the request and its
    abort together and drops it before any prefill (its prompt-token count does not move)."""
    srv = small_queue_server
    info = srv.server_info()
    before, pid = info["num_prompt_tokens"], info["engine_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/generate", json={"input_ids": list(range(5, 40)),
                                                    "sampling_params": {"max_new_tokens": 4}}, timeout=0.5)
        time.sleep(1.0)  # the HTTP process notices the disconnect and sends the abort
    finally:
        os.kill(pid, signal.SIGCONT)
    # a request after it: the engine takes its messages in order, so once this one is answered the first was
    # handled (dropped, or prefilled)
    r = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 200
    info = srv.wait_idle()
    usage = r.json()["usage"]  # (prompt tokens the prefix cache gave are not prefilled)
    prefilled = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert info["num_prompt_tokens"] - before == prefilled
    assert info["num_http_requests"] == 0 and info["kv_free_pages"] == info["kv_initial_free_pages"]


def test_request_timeout_aborts_and_answers_with_what_it_has(tmp_path):
    model = build_tiny_model(str(tmp_path / "tiny"), "llama", seed=7)
    srv = start_server(["--model-path", model, "--max-total-tokens", "4096", "--request-timeout", "0.3",
                        "--skip-warmup"], str(tmp_path / "server.log"))
    try:
        body = {**GOOD, "max_tokens": 480, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        js = r.json()
        assert js["choices"][0]["finish_reason"] == "abort" and js["usage"]["completion_tokens"] < 480
        short = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=60).json()  # fast ones are unaffected
        assert short["choices"][0]["finish_reason"] == "length"
        info = srv.wait_idle()
        assert info["kv_free_pages"] == info["kv_initial_free_pages"]
    finally:
        srv.terminate()
