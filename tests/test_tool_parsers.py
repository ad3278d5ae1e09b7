"""Tool-call parsers (specserve/server/parsers): each format's one-shot result against hand-written OpenAI objects,
and the every-split invariant: however a streamed answer is cut into pieces, the joined stream equals the one-shot
parse (content concatenated; per call its id, name and byte-identical arguments).

Pure Python, no model.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_splits import all_splits, random_pieces

from specserve.server.parsers import (
    TOOL_CALL_PARSERS,
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolSet,
    make_tool_call_parser,
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}, "score": {"type": "number"},
            "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

SUFFIX = "r1"

# DeepSeek's special tokens (fullwidth bars U+FF5C, spaces U+2581)
DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DSML = "｜DSML｜"


def call(index: int, name: str, arguments: str) -> dict:
    return {"id": f"call_{index}_{SUFFIX}", "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    content: str | None
    calls: list[dict] = field(default_factory=list)
    tools: list | None = field(default_factory=lambda: TOOLS)


def _hermes(obj: str) -> str:
    return f"<tool_call>\n{obj}\n</tool_call>"


BAD_HERMES = _hermes('{"name": "get_weather", "arguments": {"city": }')

CASES = [
    # --- qwen25 (Hermes JSON) ---
    Case("qwen25-text-before", "qwen25",
         'Let me check.\n' + _hermes('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'),
         "Let me check.", [call(0, "get_weather", '{"city": "Paris", "days": 3}')]),
    Case("qwen25-two-calls-unicode", "qwen25",
         _hermes('{"name": "get_weather", "arguments": {"city": "東京"}}') + "\n"
         + _hermes('{"name":"get_time","arguments":{}}'),
         None, [call(0, "get_weather", '{"city": "東京"}'), call(1, "get_time", "{}")]),
    Case("qwen25-nested", "qwen25",
         _hermes('{"name": "search", "arguments": {"query": "café ☕", "filters": {"price": [1, 2.5], '
                 '"open": true, "tags": null}}}'),
         None, [call(0, "search", '{"query": "café ☕", "filters": {"price": [1, 2.5], "open": true, "tags": null}}')]),
    Case("qwen25-parameters-and-string-args", "qwen25",
         _hermes('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
         + _hermes('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'),
         None, [call(0, "get_weather", '{"city": "Oslo"}'), call(1, "get_weather", '{"city": "Rome"}')]),
    Case("qwen25-text-after", "qwen25",
         "I will check.\n" + _hermes('{"name": "get_time", "arguments": {}}') + "\nDone.\n",
         "I will check.\nDone.\n", [call(0, "get_time", "{}")]),
    Case("qwen25-call-first-then-text", "qwen25",
         "\n" + _hermes('{"name": "get_time", "arguments": {}}') + "\n\nIt is noon.",
         "It is noon.", [call(0, "get_time", "{}")]),
    Case("qwen25-malformed-json", "qwen25", "Sure.\n" + BAD_HERMES, "Sure.\n" + BAD_HERMES),
    Case("qwen25-unknown-name", "qwen25", _hermes('{"name": "launch_rocket", "arguments": {}}'),
         _hermes('{"name": "launch_rocket", "arguments": {}}')),
    Case("qwen25-unknown-name-no-tools", "qwen25", _hermes('{"name": "launch_rocket", "arguments": {"n": 1}}'),
         None, [call(0, "launch_rocket", '{"n": 1}')], tools=None),
    Case("qwen25-valid-then-malformed", "qwen25",
         _hermes('{"name": "get_time", "arguments": {}}') + "\n" + BAD_HERMES,
         BAD_HERMES, [call(0, "get_time", "{}")]),
    Case("qwen25-truncated", "qwen25", 'Checking.\n<tool_call>\n{"name": "get_weather", "argu',
         'Checking.\n<tool_call>\n{"name": "get_weather", "argu'),
    Case("qwen25-no-call", "qwen25", "Plain answer <b>bold</b> with a < sign.\n\n",
         "Plain answer <b>bold</b> with a < sign.\n\n"),
    # --- qwen3_coder (XML parameters, converted by the schema) ---
    Case("qwen3_coder-text-before", "qwen3_coder",
         "I'll search.\n<tool_call>\n<function=search>\n<parameter=query>\nbest pizza\n</parameter>\n"
         "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
         "I'll search.", [call(0, "search", '{"query": "best pizza", "limit": 5}')]),
    Case("qwen3_coder-types", "qwen3_coder",
         "<tool_call>\n<function=search>\n<parameter=score>\n4.5\n</parameter>\n<parameter=exact>\nTrue\n"
         "</parameter>\n<parameter=filters>\n{\"open\": true, \"price\": [1, 2]}\n</parameter>\n"
         "<parameter=tags>\n[\"a\", \"ü\"]\n</parameter>\n<parameter=limit>\nfive\n</parameter>\n</function>\n"
         "</tool_call>",
         None, [call(0, "search", '{"score": 4.5, "exact": true, "filters": {"open": true, "price": [1, 2]}, '
                                  '"tags": ["a", "ü"], "limit": "five"}')]),
    Case("qwen3_coder-multiline-string-two-calls", "qwen3_coder",
         "<tool_call>\n<function=search>\n<parameter=query>\ndef f():\n    return \"北京\"\n\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         None, [call(0, "search", '{"query": "def f():\\n    return \\"北京\\"\\n"}'), call(1, "get_time", "{}")]),
    Case("qwen3_coder-no-tools-keeps-strings", "qwen3_coder",
         "<tool_call>\n<function=search>\n<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>",
         None, [call(0, "search", '{"limit": "5"}')], tools=None),
    Case("qwen3_coder-missing-closers", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</tool_call>",
         None, [call(0, "get_weather", '{"city": "Lima", "days": 2}')]),
    Case("qwen3_coder-junk", "qwen3_coder",
         "Hm.\n<tool_call>\n<function=search>\ngarbage\n</function>\n</tool_call>",
         "Hm.\n<tool_call>\n<function=search>\ngarbage\n</function>\n</tool_call>"),
    Case("qwen3_coder-unknown-name", "qwen3_coder",
         "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
         "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
    # --- glm45 (name on its own line) ---
    Case("glm45-text-before", "glm45",
         "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
         "Checking.", [call(0, "get_weather", '{"city": "北京", "days": 3}')]),
    Case("glm45-string-typed-number", "glm45",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n</tool_call>\n"
         "<tool_call>get_time\n</tool_call>",
         None, [call(0, "get_weather", '{"city": "2024"}'), call(1, "get_time", "{}")]),
    Case("glm45-no-tools-reads-json", "glm45",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n</tool_call>",
         None, [call(0, "get_weather", '{"city": 2024}')], tools=None),
    Case("glm45-object-value", "glm45",
         "<tool_call>search\n<arg_key>filters</arg_key>\n<arg_value>{\"open\": true, \"n\": [1]}</arg_value>\n"
         "</tool_call>",
         None, [call(0, "search", '{"filters": {"open": true, "n": [1]}}')]),
    Case("glm45-given-glm47-text", "glm45",
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"),
    Case("glm45-missing-value", "glm45",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>"),
    # --- glm47 (no newlines) ---
    Case("glm47-two-calls", "glm47",
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>days</arg_key>"
         "<arg_value>3</arg_value></tool_call><tool_call>get_time</tool_call>",
         None, [call(0, "get_weather", '{"city": "北京", "days": 3}'), call(1, "get_time", "{}")]),
    Case("glm47-text-before-python-literal", "glm47",
         "On it.<tool_call>search<arg_key>filters</arg_key><arg_value>{'open': True}</arg_value></tool_call>",
         "On it.", [call(0, "search", '{"filters": {"open": true}}')]),
    Case("glm47-unknown-name", "glm47",
         "<tool_call>format_disk<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
         "<tool_call>format_disk<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"),
    # --- deepseekv3 (type, name, fenced JSON) ---
    Case("deepseekv3-two-calls", "deepseekv3",
         f"Let me look.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Tokyo\"}}\n```"
         f"{DS_CALL_END}\n{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\", \"days\": 2}}\n```"
         f"{DS_CALL_END}{DS_CALLS_END}",
         "Let me look.", [call(0, "get_weather", '{"city": "Tokyo"}'),
                          call(1, "get_weather", '{"city": "Paris", "days": 2}')]),
    Case("deepseekv3-nested", "deepseekv3",
         f"{DS_CALLS}{DS_CALL}function{DS_SEP}search\n```json\n{{\"query\": \"ß\", \"filters\": {{\"a\": [1]}}}}\n"
         f"```{DS_CALL_END}{DS_CALLS_END}",
         None, [call(0, "search", '{"query": "ß", "filters": {"a": [1]}}')]),
    Case("deepseekv3-malformed", "deepseekv3",
         f"X{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{bad}}\n```{DS_CALL_END}{DS_CALLS_END}",
         f"X{DS_CALL}function{DS_SEP}get_weather\n```json\n{{bad}}\n```{DS_CALL_END}"),
    # --- deepseekv31 (name, then bare JSON) ---
    Case("deepseekv31-two-calls", "deepseekv31",
         f"Sure{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Tokyo\"}}{DS_CALL_END}"
         f"{DS_CALL}search{DS_SEP}{{\"query\": \"x\", \"filters\": {{\"a\": [1, {{\"b\": null}}]}}}}{DS_CALL_END}"
         f"{DS_CALLS_END}",
         "Sure", [call(0, "get_weather", '{"city": "Tokyo"}'),
                  call(1, "search", '{"query": "x", "filters": {"a": [1, {"b": null}]}}')]),
    Case("deepseekv31-unknown-name", "deepseekv31",
         f"{DS_CALLS}{DS_CALL}nuke{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",
         f"{DS_CALL}nuke{DS_SEP}{{}}{DS_CALL_END}"),
    Case("deepseekv31-truncated", "deepseekv31",
         f"Ok{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"ci",
         f"Ok{DS_CALL}get_weather{DS_SEP}{{\"ci"),
    # --- deepseekv32 (DSML) ---
    Case("deepseekv32-params", "deepseekv32",
         f"Checking.\n\n<{DSML}function_calls>\n<{DSML}invoke name=\"get_weather\">\n"
         f"<{DSML}parameter name=\"city\" string=\"true\">San Francisco</{DSML}parameter>\n"
         f"<{DSML}parameter name=\"days\" string=\"false\">3</{DSML}parameter>\n</{DSML}invoke>\n"
         f"<{DSML}invoke name=\"get_time\">\n</{DSML}invoke>\n</{DSML}function_calls>",
         "Checking.", [call(0, "get_weather", '{"city": "San Francisco", "days": 3}'), call(1, "get_time", "{}")]),
    Case("deepseekv32-json-body", "deepseekv32",
         f"<{DSML}function_calls>\n<{DSML}invoke name=\"search\">\n{{\"query\": \"日本\", \"tags\": [\"x\"]}}\n"
         f"</{DSML}invoke>\n</{DSML}function_calls>",
         None, [call(0, "search", '{"query": "日本", "tags": ["x"]}')]),
    Case("deepseekv32-object-param", "deepseekv32",
         f"<{DSML}function_calls><{DSML}invoke name=\"search\"><{DSML}parameter name=\"filters\" string=\"false\">"
         f"{{\"a\": {{\"b\": [true]}}}}</{DSML}parameter></{DSML}invoke></{DSML}function_calls>",
         None, [call(0, "search", '{"filters": {"a": {"b": [true]}}}')]),
    Case("deepseekv32-malformed", "deepseekv32",
         f"<{DSML}function_calls>\n<{DSML}invoke name=\"search\">\noops\n</{DSML}invoke>\n</{DSML}function_calls>",
         f"<{DSML}invoke name=\"search\">\noops\n</{DSML}invoke>"),
]


def _streamed(parser, text_pieces, tools) -> ParsedOutput:
    stream = parser.stream(tools, id_suffix=SUFFIX)
    deltas = []
    for piece in text_pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    return ParsedOutput.from_deltas(deltas)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parse_matches_openai_objects(case):
    out = make_tool_call_parser(case.parser).parse(case.text, case.tools, id_suffix=SUFFIX)
    assert out.content == case.content
    assert (out.openai_tool_calls() or []) == case.calls
    for c in out.tool_calls:
        json.loads(c.arguments)  # arguments are always a JSON object's text


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_split_streams_the_same(case):
    parser = make_tool_call_parser(case.parser)
    tools = ToolSet.of(case.tools)  # read once: thousands of streams follow
    whole = parser.parse(case.text, tools, id_suffix=SUFFIX)
    for n, pieces in enumerate(all_splits(case.text, seed=len(case.text), randoms=30)):
        got = _streamed(parser, pieces, tools)
        assert got == whole, (n, pieces)


def test_every_format_has_a_case():
    assert {c.parser for c in CASES} == set(TOOL_CALL_PARSERS) - {"qwen", "glm"}


def test_stream_deltas_in_openai_shape():
    text = CASES[0].text + "\n" + _hermes('{"name": "get_time", "arguments": {}}')
    stream = make_tool_call_parser("qwen25").stream(TOOLS, id_suffix=SUFFIX)
    deltas = stream.feed(text) + stream.finish()
    assert deltas[0] == ContentDelta("Let me check.")
    assert [d.to_openai() for d in deltas[1:]] == [
        {"index": 0, "id": "call_0_r1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}},
        {"index": 1, "id": "call_1_r1", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]


def test_possible_marker_is_held_back_then_released():
    stream = make_tool_call_parser("qwen25").stream(TOOLS)
    assert stream.feed("Hello <tool_") == [ContentDelta("Hello")]  # " <tool_" may still open a call
    assert stream.feed("box") == [ContentDelta(" <tool_box")]  # it did not
    assert stream.feed("\n<tool_call>\n{\"name\": \"get_time\", ") == []
    deltas = stream.feed('"arguments": {}}\n</tool_call>')
    assert [type(d) for d in deltas] == [ToolCallDelta, ToolCallDelta]
    assert stream.finish() == []


def test_fullwidth_marker_cut_mid_token_is_held_back():
    stream = make_tool_call_parser("deepseekv31").stream(TOOLS)
    assert stream.feed("Sure<｜tool▁ca") == [ContentDelta("Sure")]
    assert stream.feed("lls▁begin｜>") == []
    assert stream.feed(f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}")[0].name == "get_time"


def test_tools_as_objects():
    """Tools given as objects with attributes (pydantic models) read like dicts."""

    class Fn:
        name = "get_weather"
        parameters = {"properties": {"days": {"type": "integer"}}}

    class Tool:
        type = "function"
        function = Fn()

    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>"
    out = make_tool_call_parser("qwen3_coder").parse(text, [Tool()])
    assert out.tool_calls[0].arguments == '{"days": 4}'


def test_registry():
    assert {"qwen25", "qwen3_coder", "glm45", "glm47", "deepseekv3", "deepseekv31", "deepseekv32"} <= set(
        TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="unknown --tool-call-parser 'hermes2'; choices: .*qwen25"):
        make_tool_call_parser("hermes2")


def test_package_does_not_import_torch():
    code = "import sys, specserve.server.parsers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# Fragments the fuzzer strings together: markers, pieces of markers, JSON, whitespace, unicode.
_FRAGMENTS = {
    "qwen25": ["<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "get_time", "arguments": {}}',
               '{"name": "search", "arguments": {"query": "q"}}', '{"name": ', "}", "\n", " ", "hi", "東"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=search>", "<function=get_time>", "</function>",
                    "<parameter=limit>", "<parameter=query>", "</parameter>", "5", "<par", "\n", " ", "x", "é"],
    "glm45": ["<tool_call>", "</tool_call>", "get_time", "search", "<arg_key>", "limit", "</arg_key>",
              "<arg_value>", "7", "</arg_value>", "\n", " ", "<tool", "ü"],
    "glm47": ["<tool_call>", "</tool_call>", "get_time", "search", "<arg_key>", "query", "</arg_key>",
              "<arg_value>", "[1]", "</arg_value>", "\n", "<arg_", "z"],
    "deepseekv3": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "get_time", "\n```json\n",
                   "{}", "\n```", "<｜tool", "\n", "a"],
    "deepseekv31": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "get_time", "search", "{}",
                    '{"query": "q"}', "<｜", "\n", "a"],
    "deepseekv32": [f"<{DSML}function_calls>", f"</{DSML}function_calls>", f"<{DSML}invoke", ' name="get_time">',
                    ' name="search">', f"</{DSML}invoke>", f'<{DSML}parameter name="query" string="true">',
                    f"</{DSML}parameter>", "q", "<｜DS", "\n", "{}"],
}


@pytest.mark.parametrize("name", sorted(_FRAGMENTS))
def test_fuzz_never_raises_and_every_split_agrees(name):
    parser = make_tool_call_parser(name)
    fragments = _FRAGMENTS[name]

    @settings(max_examples=120, deadline=None, database=None)
    @given(st.lists(st.sampled_from(fragments), max_size=14), st.integers(0, 2**32 - 1), st.booleans())
    def check(parts, seed, with_tools):
        text = "".join(parts)
        tools = TOOLS if with_tools else None
        whole = parser.parse(text, tools, id_suffix=SUFFIX)
        pieces = random_pieces(text, random.Random(seed), max_piece=5)
        assert _streamed(parser, pieces, tools) == whole

    check()
