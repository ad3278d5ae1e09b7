"""Reasoning parsers: split `<think>`...`</think>` thinking from the answer, by SGLang's `--reasoning-parser` names.

    <think>
    The user wants 6*7.
    </think>

    42

gives reasoning "\\nThe user wants 6*7.\\n" and content "\\n\\n42" (both kept byte for byte; callers strip if they
want). Whether the answer starts inside the thinking depends on the format and the request's thinking mode:

- `qwen3`, `glm45`: thinking unless chat_template_kwargs has `enable_thinking` other than true (the template then
  closes the think block in the prompt and the model answers directly).
- `qwen3-thinking`, `deepseek-r1`: always thinking; the template opens `<think>` itself, so the text may hold only
  the closing `</think>`.
- `deepseek-v3`: thinking only when chat_template_kwargs has `thinking: true`.

In thinking mode the text starts in reasoning and a leading `<think>` (after any whitespace) is dropped. Outside
thinking mode the text is content unless it opens with `<think>`. Reasoning ends at `</think>` (dropped) or, for
qwen3/qwen3-thinking/glm45, at a `<tool_call>` (kept, for the tool parser), since these models sometimes open a
call without closing their thinking. Unclosed reasoning (a cut answer) stays reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from specserve.server.parsers.deltas import ContentDelta, ReasoningDelta
from specserve.server.parsers.markers import find_marker

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    """One reasoning format, bound to one request's thinking mode. Stateless otherwise: `parse` reads a finished
    answer, `stream` starts the streamed one."""

    name: ClassVar[str]
    # The chat_template_kwargs key that switches thinking, and its value when the request leaves it out;
    # None for formats that always think.
    thinking_key: ClassVar[str | None] = None
    thinking_default: ClassVar[bool] = True
    # A marker that ends the reasoning implicitly and belongs to the content.
    tool_start: ClassVar[str | None] = None

    def __init__(self, thinking: bool | None = None) -> None:
        if self.thinking_key is None:
            thinking = True
        self.thinking = self.thinking_default if thinking is None else thinking

    @classmethod
    def thinking_from_kwargs(cls, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """The request's thinking mode, read as SGLang reads it: only a literal True switches it on."""
        if cls.thinking_key is None:
            return True
        return (chat_template_kwargs or {}).get(cls.thinking_key, cls.thinking_default) is True

    @classmethod
    def for_request(cls, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser:
        return cls(cls.thinking_from_kwargs(chat_template_kwargs))

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content), each None when empty."""
        # The stream machine over the whole text, so that streamed and one-shot answers cannot differ.
        stream = self.stream()
        reasoning: list[str] = []
        content: list[str] = []
        for delta in stream.feed(text) + stream.finish():
            (reasoning if isinstance(delta, ReasoningDelta) else content).append(delta.text)
        return "".join(reasoning) or None, "".join(content) or None


class ReasoningStream:
    """One request's streamed answer through a reasoning format: `feed` each new piece, `finish` at the end."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._ends = (THINK_END,) if parser.tool_start is None else (THINK_END, parser.tool_start)
        self._state = _START
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> list[ReasoningDelta | ContentDelta]:
        if self._done:
            raise RuntimeError("feed after finish")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ReasoningDelta | ContentDelta]:
        if self._done:
            return []
        self._done = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ReasoningDelta | ContentDelta]:
        out: list[ReasoningDelta | ContentDelta] = []
        while True:
            if self._state == _START:
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf, self._state = head[len(THINK_START):], _REASONING
                elif not final and THINK_START.startswith(head):
                    break  # only whitespace or part of "<think>" so far: the opening is not settled yet
                else:
                    self._state = _REASONING if self._parser.thinking else _CONTENT
            elif self._state == _REASONING:
                pos, marker = find_marker(self._buf, self._ends, final)
                if pos:
                    out.append(ReasoningDelta(self._buf[:pos]))
                self._buf = self._buf[pos:]
                if marker is None:
                    break
                if marker == THINK_END:
                    self._buf = self._buf[len(THINK_END):]
                self._state = _CONTENT
            else:
                if self._buf:
                    out.append(ContentDelta(self._buf))
                    self._buf = ""
                break
        return out


class Qwen3Reasoning(ReasoningParser):
    name = "qwen3"
    thinking_key = "enable_thinking"
    thinking_default = True
    tool_start = "<tool_call>"


class Qwen3ThinkingReasoning(ReasoningParser):
    name = "qwen3-thinking"
    tool_start = "<tool_call>"


class Glm45Reasoning(ReasoningParser):
    name = "glm45"
    thinking_key = "enable_thinking"
    thinking_default = True
    tool_start = "<tool_call>"


class DeepSeekR1Reasoning(ReasoningParser):
    name = "deepseek-r1"


class DeepSeekV3Reasoning(ReasoningParser):
    name = "deepseek-v3"
    thinking_key = "thinking"
    thinking_default = False
