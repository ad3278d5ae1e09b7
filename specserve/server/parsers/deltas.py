"""What the parsers hand back: stream deltas (content, reasoning, tool-call pieces) and a finished answer's result.

Tool-call deltas follow OpenAI's streaming shape: a call's first delta carries its index, id, type and name, later
ones only more `arguments` text for that index. `ParsedOutput.from_deltas` joins a stream the way a client does,
which is also how the one-shot `parse` builds its answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ContentDelta:
    """Answer text for the `content` field."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text for the `reasoning_content` field."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call: the header (id and name) or more of its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's `choices[].delta.tool_calls[]` item."""
        if self.name is not None:
            # OpenAI's first chunk of a call carries arguments "" as well; clients that concatenate need the key.
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments or ""}}
        return {"index": self.index, "function": {"arguments": self.arguments or ""}}


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is a JSON object's text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A finished answer split into its text (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def openai_tool_calls(self) -> list[dict[str, Any]] | None:
        """The message's `tool_calls` field: None rather than [] when there are none, as OpenAI sends it."""
        return [call.to_openai() for call in self.tool_calls] or None

    @classmethod
    def from_deltas(cls, deltas: Iterable[ContentDelta | ToolCallDelta]) -> ParsedOutput:
        """Join a stream's deltas as a client would: content concatenated, each call's arguments concatenated."""
        text: list[str] = []
        heads: dict[int, ToolCallDelta] = {}
        args: dict[int, list[str]] = {}
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                text.append(delta.text)
                continue
            if delta.name is not None:
                heads[delta.index] = delta
            args.setdefault(delta.index, []).append(delta.arguments or "")
        calls = [ToolCall(id=heads[i].id or "", name=heads[i].name or "", arguments="".join(args[i]))
                 for i in sorted(heads)]
        return cls(content="".join(text) or None, tool_calls=calls)
