"""`specserve soak`: the seeded request mix, the answer checks, and a bounded soak against a live server whose small
KV pool forces retractions (valid, aborted and malformed requests interleaved; then idle with every page back)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from helpers import build_tiny_model
from server_fixtures import start_server

from specserve.bench.soak import KINDS, Outcome, SoakConfig, SoakRequest, _bad_inputs, check, make_mix, run_soak

CONTEXT = 256


def _mix(seed: int, **kw) -> list[SoakRequest]:
    return make_mix(200, seed, "tiny", CONTEXT, **kw)


def test_mix_is_seeded_and_covers_every_kind():
    a, b = _mix(5), _mix(5)
    assert [r.describe() for r in a] == [r.describe() for r in b]
    assert [r.describe() for r in a] != [r.describe() for r in _mix(6)]
    kinds = Counter(r.kind for r in a)
    assert set(kinds) == set(KINDS), kinds
    valid = [r for r in a if r.kind not in ("abort", "bad")]
    assert any(r.greedy for r in valid) and any(not r.greedy for r in valid)
    assert any(r.stop for r in valid) and any(r.exact for r in valid)
    assert {r.abort for r in a if r.abort} >= {"first"} and any(isinstance(r.abort, float) for r in a)
    # Every prompt leaves room for its tokens (one character is at most one token), some come near the context.
    room = [len(r.body.get("text") or r.body.get("prompt") or r.body["messages"][0]["content"]) + r.max_tokens
            for r in a if r.body is not None and r.kind != "bad"]
    assert max(room) < CONTEXT and max(room) > CONTEXT * 0.6
    # With many bad draws, every malformed-input template comes up.
    bad = {(r.bad, r.route, r.raw or str(r.body)) for r in _mix(1, bad_fraction=0.9) if r.kind == "bad"}
    assert len(bad) == len(_bad_inputs("tiny"))


def test_check_verdicts():
    greedy = SoakRequest(0, "completion", "/v1/completions", {}, greedy=True, max_tokens=4, exact=True)
    assert check(greedy, Outcome(200, text="abcd", tokens=4, finish="length", done=True)) is None
    assert "3 completion tokens" in check(greedy, Outcome(200, text="abc", tokens=3, finish="length", done=True))
    assert "HTTP 500" in check(greedy, Outcome(500, body="boom"))
    stop = SoakRequest(1, "chat_stream", "/v1/chat/completions", {}, stream=True, max_tokens=9, stop=["e"])
    assert check(stop, Outcome(200, text="abc", tokens=3, finish="stop", done=True)) is None
    assert "stop string" in check(stop, Outcome(200, text="abe", tokens=3, finish="stop", done=True))
    assert "[DONE]" in check(stop, Outcome(200, text="abc", finish="stop"))
    bad = SoakRequest(2, "bad", "/generate", {"text": ""}, bad="empty_prompt")
    shaped = '{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": 400}}'
    assert check(bad, Outcome(400, body=shaped)) is None
    assert "not a 4xx" in check(bad, Outcome(200, body="{}"))
    assert "OpenAI-shaped" in check(bad, Outcome(422, body='{"detail": []}'))
    for when in ("first", 0.0, 0.1):  # a zero delay is an abort too (closed before the first chunk)
        abort = SoakRequest(3, "abort", "/generate", {}, stream=True, abort=when)
        assert check(abort, Outcome(200, closed_early=True)) is None
        assert "HTTP 503" in check(abort, Outcome(503, body="gone"))


@pytest.mark.slow
def test_soak_live_server(tmp_path):
    model = build_tiny_model(str(tmp_path / "tiny"), "llama", seed=3, max_position_embeddings=512)
    # 1200 KV tokens for up to 16 running requests of up to 256 tokens, admitted on their next step only: retractions.
    srv = start_server(["--model-path", model, "--max-total-tokens", "1200", "--context-length", str(CONTEXT),
                        "--max-running-requests", "16", "--schedule-conservativeness", "0"],
                       str(tmp_path / "server.log"))
    try:
        # 64 new tokens: long decodes outgrow the pool more often than the default 32 (more retractions per run).
        cfg = SoakConfig(srv.url, num_requests=120, concurrency=12, seed=7, abort_fraction=0.12, bad_fraction=0.08,
                         max_new_tokens=64, server_pid=srv.proc.pid)
        s = asyncio.run(run_soak(cfg))
    finally:
        srv.terminate()
    assert s["failures"] == [], s["failures"]
    assert s["ok"] and s["leaks"] == {"kv_pages": 0, "idle": True}
    assert s["retractions"] >= 1, s
    assert s["aborted"] >= 1 and s["bad"] >= 1
    assert all(400 <= int(code) < 500 for code in s["bad_status"]), s["bad_status"]
    assert s["completed"] == s["requests"] - s["aborted"] - s["bad"]
    assert s["determinism_checked"] >= 1
    assert set(s["rss_kb"]) == {"server", "engine"} and all(v["start"] and v["end"] for v in s["rss_kb"].values())
