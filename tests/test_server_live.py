"""A live server (subprocess) on a tiny random checkpoint: OpenAI client, native /generate, concurrency, client
disconnects, bad input, metrics; last, the engine process is killed (the server turns unhealthy, does not hang)
and SIGTERM stops the server with exit code 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from helpers import build_tiny_model
from server_fixtures import LiveServer, start_server

# A chat template with a switch, so chat_template_kwargs can be seen to reach apply_chat_template.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
            "no think. {% endif %}{% endif %}")
CONTEXT = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_live")
    model = build_tiny_model(str(root / "tiny"), "llama", seed=3)
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    # --show-internal-info: the engine's pid and whole paths on the info routes (the default hides them:
    # tests/test_server_access.py)
    srv = start_server(["--model-path", model, "--max-total-tokens", "8192", "--chat-template", str(template),
                        "--show-internal-info"], str(root / "server.log"))
    yield srv
    srv.terminate()


def _openai(server: LiveServer):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _sse(lines) -> list:
    """The JSON events of an SSE stream, and the final [DONE] as the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


GREEDY = {"temperature": 0.0, "ignore_eos": True}


# ---------------------------------------------------------------------- OpenAI client
def test_openai_chat(server):
    client = _openai(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert not hasattr(r.usage, "spec") or r.usage.spec is None
    text = r.choices[0].message.content
    assert text
    # Streaming gives the same text (greedy), a finish chunk and, when asked, a usage chunk.
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # chat_template_kwargs reach the template: "no think. " adds 10 one-character tokens to the prompt.
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens + len("no think. ")


def test_openai_completions(server):
    client = _openai(server)
    r = client.completions.create(model="tiny", prompt="The sky is", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    text = r.choices[0].text
    pieces = list(client.completions.create(model="tiny", prompt="The sky is", max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == text
    assert pieces[-1].choices[0].finish_reason == "length"
    # A batch of prompts (strings and token ids) gives one choice per prompt.
    r = client.completions.create(model="tiny", prompt=["ab", "cd", "ef"], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 9
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2


def test_stop_strings_are_never_streamed(server):
    client = _openai(server)
    base = client.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    expected = base[:base.find(stop)]
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    pieces = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == expected


# ---------------------------------------------------------------------- native /generate
def test_generate_native(server):
    url = server.url + "/generate"
    sp = {"max_new_tokens": 5, **GREEDY}
    r = httpx.post(url, json={"text": "hello", "sampling_params": sp}, timeout=60).json()
    assert r["meta_info"]["completion_tokens"] == 5 and len(r["output_ids"]) == 5
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert r["meta_info"]["prompt_tokens"] == len("hello")  # the tiny tokenizer: one token per character
    assert "spec_accept_length" not in r["meta_info"]
    zero = httpx.post(url, json={"text": "hello", "sampling_params": {"max_new_tokens": 0}}, timeout=60).json()
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ids = [10, 7, 14, 14, 17]
    by_ids = httpx.post(url, json={"input_ids": ids, "sampling_params": sp}, timeout=60).json()
    assert by_ids["output_ids"] == r["output_ids"]  # "hello" tokenises to these ids
    # Streaming: cumulative text and ids, final event equals the non-streamed result, then [DONE].
    with httpx.stream("POST", url, json={"text": "hello", "sampling_params": sp, "stream": True}, timeout=60) as s:
        events = _sse(s.iter_lines())
    assert events[-1] == "[DONE]"
    body = events[:-1]
    assert [len(e["output_ids"]) for e in body] == sorted(len(e["output_ids"]) for e in body)
    assert all(body[-1]["text"].startswith(e["text"]) for e in body)
    assert body[-1]["text"] == r["text"] and body[-1]["output_ids"] == r["output_ids"]
    assert body[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # Batches: a list of texts, and a streamed list of id lists (events carry their index).
    rs = httpx.post(url, json={"text": ["a", "bb"], "sampling_params": sp}, timeout=60).json()
    assert [x["meta_info"]["prompt_tokens"] for x in rs] == [1, 2]
    with httpx.stream("POST", url, json={"input_ids": [[1, 5], [1, 6, 7]], "sampling_params": sp, "stream": True},
                      timeout=60) as s:
        events = _sse(s.iter_lines())
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and all(len(e["output_ids"]) == 5 for e in finals.values())


# ---------------------------------------------------------------------- concurrency
def test_64_concurrent_streams(server):
    async def one(client, i):
        n = 6 + i % 7
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": n, "temperature": 0.8, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = _sse([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        finish = [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"]]
        return n, usage["completion_tokens"], finish[-1]

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(got == want and finish == "length" for want, got, finish in results)
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_initial_free_pages"] and info["num_running_reqs"] == 0


# ---------------------------------------------------------------------- disconnects
def test_disconnected_stream_frees_kv(server):
    start = server.wait_idle()
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 480, **GREEDY}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as s:
        lines = s.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        during = server.server_info()
        assert during["num_running_reqs"] == 1 and during["kv_free_pages"] < start["kv_initial_free_pages"]
    # The connection is closed here, long before 480 tokens.
    info = server.wait_idle()
    assert info["num_running_reqs"] == 0 and info["kv_free_pages"] == info["kv_initial_free_pages"]
    assert info["num_generated_tokens"] - start["num_generated_tokens"] < 480
    metrics = httpx.get(server.url + "/metrics").text
    assert 'specserve:num_requests_total{finish_reason="abort",model_name="tiny"}' in metrics


def test_disconnected_non_streaming_request_frees_kv(server):
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 480, **GREEDY}
    # How long the whole request takes on this machine, so the client can hang up well before the end.
    t0 = time.perf_counter()
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    full = time.perf_counter() - t0
    start = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=full / 4))
    info = server.wait_idle()
    assert info["num_running_reqs"] == 0 and info["kv_free_pages"] == info["kv_initial_free_pages"]
    assert 0 < info["num_generated_tokens"] - start["num_generated_tokens"] < 480


# ---------------------------------------------------------------------- bad input
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "at least one message"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "2"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "n": 65}, 400, "n must be an integer in [1, 64] (--max-n)"),
    ("/v1/chat/completions", {**CHAT, "n": 2, "rid": "x"}, 400, "rid"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "needs logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, 400, "compiled"),
    ("/v1/chat/completions", {**CHAT, "regex": "a", "ebnf": "root ::= \"a\""}, 400, "only one of"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "top_k": 0}, 400, "top_k"),
    # a --model-path model without --tool-call-parser cannot read tool calls out of its answers
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "--tool-call-parser"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "none"}, 400, "only allowed when tools are given"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {**COMP, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {**COMP, "prompt": []}, 400, "empty"),
    ("/v1/completions", {**COMP, "prompt": "x" * (CONTEXT + 5)}, 400, "context length"),
    ("/v1/completions", {**COMP, "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {**COMP, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**COMP, "seed": -1}, 400, "seed"),
    ("/v1/completions", {**COMP, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**COMP, "logprobs": 2, "echo": True, "stream": True}, 400, "echo"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, 400, "logprob_start_len"),
    ("/v1/completions", {**COMP, "logprobs": 30}, 400, "top_logprobs"),
    ("/v1/completions", {**COMP, "model": "nope"}, 404, "nope"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {"input_ids": [1, 99999]}, 400, "input_ids"),
    ("/generate", {"input_ids": []}, 400, "empty"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ("/generate", {"text": "hi", "model": "other"}, 404, "other"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[f"{p}-{n}" for p, _, _, n in BAD])
def test_bad_input_gets_openai_shaped_4xx(server, path, body, status, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert needle in err["message"]
    ok = httpx.post(server.url + "/v1/completions", json=COMP, timeout=30)  # the server keeps serving
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_input_never_leaks_kv(server):
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_initial_free_pages"] and info["num_http_requests"] == 0


# ---------------------------------------------------------------------- info, health, metrics
def test_info_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    mi = httpx.get(server.url + "/get_model_info").json()
    assert mi["served_model_name"] == "tiny" and mi["is_generation"] is True
    assert os.path.isdir(mi["model_path"]) and mi["tokenizer_path"] == mi["model_path"]
    si = server.server_info()
    assert si["context_length"] == CONTEXT and si["max_total_tokens"] == 8192 and si["port"] == server.port
    assert si["kv_total_tokens"] > 0 and si["num_generated_tokens"] > 0 and si["internal_states"][0]
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "num_running_reqs", "num_queue_reqs", "token_usage",
                 "kv_used_tokens", "spec_accept_length", "num_request_errors_total"):
        assert f"specserve:{name}" in text, name
    gen = [line for line in text.splitlines() if line.startswith("specserve:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0
    assert httpx.get(server.url + "/no/such/path").json()["error"]["type"] == "not_found_error"


def test_n_choices_on_every_route(server):
    client = _openai(server)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18  # every choice counted
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed stream
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    joined, finish = {}, {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            joined[c.index] = joined.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [joined[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert set(finish.values()) == {"length"}
    comp = client.completions.create(model="tiny", prompt=["ab", "cd"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text  # greedy: the same answer twice per prompt
    out = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {
        "n": 2, "max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 9}}, timeout=60).json()
    assert isinstance(out, list) and len(out) == 2 and all(len(o["output_ids"]) == 3 for o in out)


def test_prompt_logprobs_echo_and_generate(server):
    client = _openai(server)
    r = client.completions.create(model="tiny", prompt=[5, 17, 33, 2, 90], max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 + 3
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    out = httpx.post(server.url + "/generate", json={"input_ids": [5, 17, 33, 2, 90], "return_logprob": True,
                                                     "logprob_start_len": 1, "sampling_params": {
                                                         "max_new_tokens": 3, "temperature": 0}}, timeout=60).json()
    ilp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in ilp] == [17, 33, 2, 90]
    assert [x[0] for x in ilp] == pytest.approx(lp.token_logprobs[1:5], abs=1e-4)  # the same prompt's logprobs


# ---------------------------------------------------------------------- prefix cache
def _metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + "{")]
    return float(line.split()[-1])


def test_prefix_cache_multi_turn_chat_and_flush(server):
    client = _openai(server)
    kw = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
    turn1 = [{"role": "user", "content": "tell me about the cat who sat on the warm mat by the door"}]
    r1 = client.chat.completions.create(messages=turn1, max_tokens=12, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and what did the dog do then?"}]
    r2 = client.chat.completions.create(messages=turn2, max_tokens=10, **kw)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # turn 1's prompt is a prefix of turn 2's (the template only appends): the cache gives at least that much
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens, (cached, r1.usage, r2.usage)
    # the same prompt again, streamed: the usage chunk reports its cached tokens too (all but the last token)
    chunks = list(client.chat.completions.create(messages=turn2, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r2.choices[0].message.content
    info = server.wait_idle()
    assert info["prefix_cache"]["enabled"] is True and info["prefix_cache"]["cached_pages"] > 0
    assert info["prefix_cache"]["hit_tokens"] >= cached and 0 < info["prefix_cache"]["hit_rate"] < 1
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "specserve:cached_pages") > 0 and _metric(metrics, "specserve:cache_hit_rate") > 0
    assert _metric(metrics, "specserve:cached_tokens_total") >= cached + r2.usage.prompt_tokens - 1

    r = httpx.post(server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed."), r.text
    assert server.server_info()["prefix_cache"]["cached_pages"] == 0
    assert _metric(httpx.get(server.url + "/metrics").text, "specserve:cached_pages") == 0
    again = client.chat.completions.create(messages=turn2, max_tokens=10, **kw)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == r2.choices[0].message.content  # the cache never changes outputs
    completion = client.completions.create(model="tiny", prompt="the cat who sat on the warm mat", max_tokens=2)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # completions report it too


def test_generate_reports_cached_tokens_for_a_repeated_prompt(server):
    url = server.url + "/generate"
    body = {"text": "a long prompt that the prefix cache should keep around " * 4,
            "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    assert httpx.get(server.url + "/flush_cache", timeout=30).status_code == 200  # GET works as well
    first = httpx.post(url, json=body, timeout=60).json()
    second = httpx.post(url, json=body, timeout=60).json()
    n = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == n - 1
    assert second["output_ids"] == first["output_ids"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
        events = _sse(s.iter_lines())
    assert events[-2]["meta_info"]["cached_tokens"] == n - 1 and events[-2]["output_ids"] == first["output_ids"]


def test_flush_cache_refused_while_a_request_runs(server):
    server.wait_idle()
    body = {"text": "keep me busy", "sampling_params": {"max_new_tokens": 480, **GREEDY}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as s:
        lines = s.iter_lines()  # (kept: a dropped line iterator closes the connection, which aborts the request)
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        for method in ("POST", "GET"):
            r = httpx.request(method, server.url + "/flush_cache", timeout=30)
            assert r.status_code == 400 and "not flushed" in r.text and "1 requests are running" in r.text, r.text
        info = server.server_info()
        assert info["num_running_reqs"] == 1 and info["prefix_cache"]["cached_pages"] > 0  # nothing was flushed
    server.wait_idle()
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    assert server.server_info()["prefix_cache"]["cached_pages"] == 0


# ---------------------------------------------------------------------- failure and shutdown (keep last)
def test_engine_death_makes_server_unhealthy_then_exits_1(server):
    """503s (the server does not hang), then, after a grace period, the HTTP process exits with 1 on its own."""
    pid = server.server_info()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 20
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.time() < deadline, "the server did not notice the engine died"
        time.sleep(0.1)
    r = httpx.post(server.url + "/v1/completions", json=COMP, timeout=10)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health_generate", timeout=10).status_code == 503
    assert httpx.get(server.url + "/get_server_info").json()["engine_alive"] is False
    assert server.proc.wait(timeout=60) == 1, server.log()

