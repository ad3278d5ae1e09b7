"""server/chat_output.py over fixed answers: the assistant message (tool calls, reasoning_content, content null) for
each tool_choice mode, against hand-written OpenAI objects; and the stream: for every cut of each answer into
engine updates, the deltas are in OpenAI's shape and join (as a client joins them) to the non-streamed message.

Pure Python, no model, no server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from parser_splits import all_splits

from specserve.server.chat_output import ChatOutput, finish_with_tools, read_constrained
from specserve.server.chat_tools import ToolPlan, named_schema, required_schema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "required": ["city"],
                                                     "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SUFFIX = "req1"
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def call(index: int, name: str, arguments: str) -> dict:
    return {"id": f"call_{index}_{SUFFIX}", "type": "function", "function": {"name": name, "arguments": arguments}}


def plan(mode: str, parallel: bool = True, function: str | None = None) -> ToolPlan:
    if mode == "off":
        return ToolPlan()
    schema = {"required": required_schema(TOOLS, parallel), "named": function and named_schema(TOOLS, function)}
    return ToolPlan(mode, TOOLS, function, schema.get(mode), parallel)


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    plan: ToolPlan
    message: dict  # the expected non-streamed message
    reasoning: str | None = None  # --reasoning-parser
    kwargs: dict | None = None  # chat_template_kwargs

    def output(self) -> ChatOutput:
        return ChatOutput.for_request(self.plan, "qwen25", self.reasoning, True, self.kwargs, SUFFIX)


def msg(content, tool_calls=None, **extra) -> dict:
    out = {"role": "assistant", "content": content, **extra}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


CASES = [
    Case("plain", "Hello there, friend.", plan("off"), msg("Hello there, friend.")),
    Case("empty", "", plan("off"), msg("")),
    Case("no-tools-keeps-blocks", "Sure. " + PARIS, plan("off"), msg("Sure. " + PARIS)),
    Case("auto-text-only", "I cannot help with that.", plan("auto"), msg("I cannot help with that.")),
    Case("auto-one-call", PARIS, plan("auto"), msg(None, [call(0, "get_weather", '{"city": "Paris"}')])),
    Case("auto-text-then-call", "Let me check.\n" + PARIS, plan("auto"),
         msg("Let me check.", [call(0, "get_weather", '{"city": "Paris"}')])),
    Case("auto-two-calls", PARIS + "\n" + TIME + "\nDone.", plan("auto"),
         msg("Done.", [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_time", "{}")])),
    Case("auto-not-parallel", PARIS + "\n" + TIME, plan("auto", parallel=False),
         msg(None, [call(0, "get_weather", '{"city": "Paris"}')])),
    Case("auto-unknown-tool", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', plan("auto"),
         msg('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')),
    Case("auto-cut-inside-call", 'Checking <tool_call>\n{"name": "get_wea', plan("auto"),
         msg('Checking <tool_call>\n{"name": "get_wea')),
    Case("none-keeps-blocks", "Let me check.\n" + PARIS, plan("none"), msg("Let me check.\n" + PARIS)),
    Case("reasoning-then-call", "<think>The user wants weather.</think>\n" + PARIS, plan("auto"),
         msg(None, [call(0, "get_weather", '{"city": "Paris"}')], reasoning_content="The user wants weather."),
         reasoning="qwen3"),
    Case("reasoning-then-answer", "<think>\n2+2 is 4.\n</think>\n\nIt is 4.", plan("off"),
         msg("\n\nIt is 4.", reasoning_content="\n2+2 is 4.\n"), reasoning="qwen3"),
    Case("reasoning-unclosed", "Still thinking about it", plan("off"),
         msg("", reasoning_content="Still thinking about it"), reasoning="qwen3"),
    # enable_thinking false: the template closed the thinking in the prompt, so the answer is all content
    Case("thinking-off", "It is 4. Not </think> reasoning.", plan("off"),
         msg("It is 4. Not </think> reasoning.", reasoning_content=None), reasoning="qwen3",
         kwargs={"enable_thinking": False}),
    Case("required-two", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                         '{"name": "get_time", "parameters": {}}]', plan("required"),
         msg(None, [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_time", "{}")])),
    Case("required-not-json", '[{"name": "get_weather", "parameters": {"ci', plan("required"),
         msg('[{"name": "get_weather", "parameters": {"ci')),
    Case("required-ignores-reasoning", '[{"name": "get_time", "parameters": {}}]', plan("required"),
         msg(None, [call(0, "get_time", "{}")]), reasoning="qwen3"),
    Case("named", '{"city": "Zürich"}', plan("named", function="get_weather"),
         msg(None, [call(0, "get_weather", '{"city": "Zürich"}')])),
    Case("named-not-an-object", '["Paris"]', plan("named", function="get_weather"), msg('["Paris"]')),
]


def client_join(deltas: list[dict]) -> dict:
    """Join stream deltas as a client does (written apart from chat_output.join_deltas)."""
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for item in d.get("tool_calls", []):
            assert set(item) <= {"index", "id", "type", "function"} and "index" in item
            if item["index"] not in calls:
                assert item["id"].startswith("call_") and item["type"] == "function" and item["function"]["name"]
                calls[item["index"]] = {"id": item["id"], "name": item["function"]["name"], "arguments": ""}
            else:
                assert "id" not in item and "name" not in item["function"], "only a call's first item names it"
            calls[item["index"]]["arguments"] += item["function"].get("arguments", "")
    return {"content": content, "reasoning": reasoning,
            "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]}


def message_view(m: dict) -> dict:
    return {"content": m["content"] or "", "reasoning": m.get("reasoning_content") or "",
            "calls": [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_message_matches_openai_object(case):
    m = case.output().message(case.text)
    assert m == case.message
    for c in m.get("tool_calls", []):
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_split_streams_the_message(case):
    out = case.output()
    expected = message_view(out.message(case.text))
    for pieces in all_splits(case.text, randoms=10) if case.text else [[""]]:
        stream = out.stream()
        deltas = []
        for piece in pieces:
            deltas += stream.feed(piece)
        deltas += stream.finish()
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas), deltas  # one kind, never empty
        assert client_join(deltas) == expected, pieces
        assert stream.called == bool(expected["calls"])


def test_openai_client_accumulates_the_stream_to_the_message():
    """The openai package's own stream accumulator, fed the route's chunks, ends with the same message."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    case = next(c for c in CASES if c.id == "reasoning-then-call")
    text = "<think>Weather.</think>Let me check.\n" + PARIS + "\n" + TIME
    out = ChatOutput.for_request(case.plan, "qwen25", "qwen3", True, None, SUFFIX)
    stream = out.stream()
    deltas = [{"role": "assistant", "content": ""}]
    for i in range(0, len(text), 7):
        deltas += stream.feed(text[i:i + 7])
    deltas += stream.finish()
    state = ChatCompletionStreamState()
    for i, d in enumerate([*deltas, {}]):
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": d, "finish_reason": "tool_calls" if i == len(deltas) else None}]}))
    got = state.get_final_completion().choices[0].message
    want = out.message(text)
    assert want["content"] == got.content == "Let me check."
    assert want["reasoning_content"] == got.reasoning_content == "Weather."
    assert [c.model_dump(include={"id", "type", "function"}, exclude={"function": {"parsed_arguments"}})
            for c in got.tool_calls] == want["tool_calls"]


def test_finish_reason_with_tools():
    assert finish_with_tools("stop", True) == "tool_calls"
    assert finish_with_tools("length", True) == "length"  # a cut answer is still cut
    assert finish_with_tools("stop", False) == "stop"
    assert finish_with_tools("abort", True) == "abort"


def test_read_constrained():
    req = plan("required")
    assert read_constrained(req, '[{"name": "get_time", "parameters": {}}]') == [("get_time", "{}")]
    assert read_constrained(req, "[]") is None
    assert read_constrained(req, '[{"name": "nope", "parameters": {}}]') is None
    assert read_constrained(req, '[{"name": "get_time", "parameters": 3}]') is None
    assert read_constrained(req, '{"name": "get_time"}') is None
    one = plan("required", parallel=False)
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}]'
    assert read_constrained(one, two) == [("get_time", "{}")]
    named = plan("named", function="get_weather")
    assert read_constrained(named, ' {"city": "Oslo"} ') == [("get_weather", '{"city": "Oslo"}')]
    assert read_constrained(named, '{"city": ') is None


def test_separate_reasoning_off_keeps_thinking_in_content():
    text = "<think>hm</think>It is 4."
    out = ChatOutput.for_request(plan("off"), None, "qwen3", False, None, SUFFIX)
    assert out.message(text) == msg(text)
