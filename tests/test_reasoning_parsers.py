"""Reasoning parsers (specserve/server/parsers/reasoning.py): each format's split of thinking from the answer in
each thinking mode, and the every-split invariant (however the streamed answer is cut, the joined reasoning and
content deltas equal the one-shot parse). Pure Python, no model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_splits import all_splits, random_pieces

from specserve.server.parsers import (
    REASONING_PARSERS,
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    make_reasoning_parser,
    make_tool_call_parser,
)


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    kwargs: dict | None  # the request's chat_template_kwargs
    text: str
    reasoning: str | None
    content: str | None


TOOL_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

CASES = [
    # qwen3: thinking unless enable_thinking is false; the model writes <think> itself
    Case("qwen3-default", "qwen3", None, "<think>\nThe user wants 6*7.\n</think>\n\n42", "\nThe user wants 6*7.\n",
         "\n\n42"),
    Case("qwen3-no-think-tag", "qwen3", {}, "Still thinking</think>Answer", "Still thinking", "Answer"),
    Case("qwen3-unclosed", "qwen3", None, "<think>cut off mid-thou", "cut off mid-thou", None),
    Case("qwen3-tool-call-ends-reasoning", "qwen3", None, "<think>I should call a tool." + TOOL_CALL,
         "I should call a tool.", TOOL_CALL),
    Case("qwen3-disabled", "qwen3", {"enable_thinking": False}, "Plain answer, no </think> here? fine",
         None, "Plain answer, no </think> here? fine"),
    Case("qwen3-disabled-but-opens-think", "qwen3", {"enable_thinking": False}, "<think>hm</think>ok", "hm", "ok"),
    Case("qwen3-unicode", "qwen3", None, "<think>考虑一下：6×7</think>答案是 42 ✓", "考虑一下：6×7", "答案是 42 ✓"),
    Case("qwen3-only-end", "qwen3", None, "</think>\n\nHello", None, "\n\nHello"),
    Case("qwen3-second-think-is-content", "qwen3", None, "<think>a</think>b<think>c</think>",
         "a", "b<think>c</think>"),
    # qwen3-thinking: always thinking, the template opened <think>
    Case("qwen3-thinking", "qwen3-thinking", {"enable_thinking": False}, "Let me see.\n</think>\n\nIt is 42.",
         "Let me see.\n", "\n\nIt is 42."),
    Case("qwen3-thinking-echoed-open", "qwen3-thinking", None, "<think>x</think>y", "x", "y"),
    # glm45: like qwen3; leading whitespace before <think> is skipped
    Case("glm45-default", "glm45", None, "\n<think>Plan the trip.</think>\nGo to Rome.", "Plan the trip.",
         "\nGo to Rome."),
    Case("glm45-tool-call", "glm45", None, "<think>need weather</think>" + TOOL_CALL, "need weather", TOOL_CALL),
    Case("glm45-tool-call-unclosed", "glm45", None, "<think>need weather\n" + TOOL_CALL, "need weather\n",
         TOOL_CALL),
    Case("glm45-disabled", "glm45", {"enable_thinking": False}, "  Direct answer.", None, "  Direct answer."),
    # deepseek-r1: always thinking; R1 omits <think>, R1-0528 writes it
    Case("deepseek-r1", "deepseek-r1", None, "Okay, so 6*7...\n</think>\n\n**42**", "Okay, so 6*7...\n",
         "\n\n**42**"),
    Case("deepseek-r1-0528", "deepseek-r1", None, "<think>\nhmm\n</think>42", "\nhmm\n", "42"),
    Case("deepseek-r1-tool-call-stays-reasoning", "deepseek-r1", None, "a" + TOOL_CALL, "a" + TOOL_CALL, None),
    # deepseek-v3: thinking only with thinking: true
    Case("deepseek-v3-default", "deepseek-v3", None, "Hello! <think> is a tag.", None, "Hello! <think> is a tag."),
    Case("deepseek-v3-thinking", "deepseek-v3", {"thinking": True}, "reason</think>answer", "reason", "answer"),
    Case("deepseek-v3-string-true-is-not-true", "deepseek-v3", {"thinking": "true"}, "reason</think>answer",
         None, "reason</think>answer"),
    Case("deepseek-v3-opens-think", "deepseek-v3", {"thinking": False}, "<think>r</think>a", "r", "a"),
    # near misses of the markers stay text
    Case("not-a-think-tag", "qwen3", {"enable_thinking": False}, "<thinking>x</thinking>", None,
         "<thinking>x</thinking>"),
    Case("near-end-tag", "deepseek-r1", None, "a </thin k> b </think", "a </thin k> b </think", None),
    Case("empty", "qwen3", None, "", None, None),
    Case("whitespace-only-not-thinking", "deepseek-v3", None, " \n", None, " \n"),
]


def _streamed(parser, pieces) -> tuple[str | None, str | None]:
    stream = parser.stream()
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    assert all(d.text for d in deltas), deltas  # no empty deltas
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return reasoning or None, content or None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parse(case):
    assert make_reasoning_parser(case.parser, case.kwargs).parse(case.text) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_split_streams_the_same(case):
    parser = make_reasoning_parser(case.parser, case.kwargs)
    whole = parser.parse(case.text)
    for n, pieces in enumerate(all_splits(case.text, seed=len(case.text), randoms=20)):
        assert _streamed(parser, pieces) == whole, (n, pieces)


def test_every_format_has_a_case():
    assert {c.parser for c in CASES} == set(REASONING_PARSERS)


def test_partial_end_tag_is_held_back():
    stream = make_reasoning_parser("deepseek-r1").stream()
    assert stream.feed("abc</th") == [ReasoningDelta("abc")]
    assert stream.feed("ink>de") == [ContentDelta("de")]
    assert stream.finish() == []


def test_opening_is_held_until_settled():
    stream = make_reasoning_parser("qwen3", {"enable_thinking": False}).stream()
    assert stream.feed("\n<thi") == []  # may still be "<think>"
    assert stream.feed("s is") == [ContentDelta("\n<this is")]


@pytest.mark.parametrize(("name", "kwargs", "thinking"), [
    ("qwen3", None, True), ("qwen3", {"enable_thinking": True}, True), ("qwen3", {"enable_thinking": False}, False),
    ("qwen3", {"enable_thinking": "yes"}, False), ("glm45", {}, True), ("glm45", {"enable_thinking": False}, False),
    ("qwen3-thinking", {"enable_thinking": False}, True), ("deepseek-r1", {"thinking": False}, True),
    ("deepseek-v3", None, False), ("deepseek-v3", {"thinking": True}, True),
    ("deepseek-v3", {"enable_thinking": True}, False),
])
def test_thinking_mode_from_kwargs(name, kwargs, thinking):
    assert make_reasoning_parser(name, kwargs).thinking is thinking


def test_registry():
    assert set(REASONING_PARSERS) == {"qwen3", "qwen3-thinking", "glm45", "deepseek-r1", "deepseek-v3"}
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'r1'; choices: deepseek-r1, deepseek-v3"):
        make_reasoning_parser("r1")


def test_reasoning_then_tool_calls_compose():
    """The reasoning stream's content deltas feed the tool-call stream: cut anywhere, the result equals parsing the
    whole answer in two steps."""
    text = "<think>Weather, then time.</think>\nOne moment.\n" + TOOL_CALL
    reasoning_parser = make_reasoning_parser("qwen3")
    tool_parser = make_tool_call_parser("qwen25")
    reasoning, content = reasoning_parser.parse(text)
    expected = (reasoning, tool_parser.parse(content or ""))
    assert expected[0] == "Weather, then time." and expected[1].content == "\nOne moment."
    rng = random.Random(7)
    for _ in range(200):
        rs, ts = reasoning_parser.stream(), tool_parser.stream()
        thought, tool_deltas = [], []
        for piece in [*random_pieces(text, rng, max_piece=6), None]:
            deltas = rs.feed(piece) if piece is not None else rs.finish()
            thought += [d.text for d in deltas if isinstance(d, ReasoningDelta)]
            for d in deltas:
                if isinstance(d, ContentDelta):
                    tool_deltas += ts.feed(d.text)
        tool_deltas += ts.finish()
        assert ("".join(thought), ParsedOutput.from_deltas(tool_deltas)) == expected


_FRAGMENTS = ["<think>", "</think>", "<thi", "nk>", "</", "<tool_call>", "<tool", "x", " ", "\n", "思"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("thinking", [True, False])
def test_fuzz_every_split_agrees(name, thinking):
    parser = REASONING_PARSERS[name](thinking)

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.lists(st.sampled_from(_FRAGMENTS), max_size=12), st.integers(0, 2**32 - 1))
    def check(parts, seed):
        text = "".join(parts)
        pieces = random_pieces(text, random.Random(seed), max_piece=4)
        assert _streamed(parser, pieces) == parser.parse(text)

    check()
