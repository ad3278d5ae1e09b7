"""The machinery every tool-call format shares: find call blocks in (streamed) text, hand each finished block to
the format to read, and route everything else to content.

A format names its block markers (e.g. `<tool_call>` ... `</tool_call>`), optional wrapper markers around a run
of calls (DeepSeek's `<｜tool▁calls▁begin｜>`), and reads one block's inside into a name and an arguments object.
Content is the text outside the calls and wrappers. Whitespace next to a call is layout and is dropped, except
that the whitespace before a call still separates the text before it from text after it: `Let me check.\\n<call>`
gives `Let me check.`, and `Let me check.\\n<call>\\nDone.` gives `Let me check.\\nDone.`. An answer without calls
is unchanged. A block that does not read as a call (bad JSON, a name the request's tools lack) stays in the
content verbatim, and so does a block the answer ends inside.

A call is emitted whole once its block closes: the header delta (id, name) and one delta with its arguments as
json.dumps(..., ensure_ascii=False) of the parsed object, so a streamed call's joined arguments are byte-identical
to the one-shot result. Nothing is emitted earlier because a block can still turn out malformed, and then it must
become content instead.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from specserve.server.parsers.deltas import ContentDelta, ParsedOutput, ToolCallDelta
from specserve.server.parsers.markers import find_marker
from specserve.server.parsers.tool_schema import ToolSet

Delta = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class FunctionCall:
    """What a format reads out of one block, before the tool list and the id are applied."""

    name: str
    arguments: dict[str, Any]


def plausible_name(name: str) -> bool:
    # A real function name has no spaces or angle brackets; seeing them means the block was cut wrongly.
    return bool(name) and not any(c.isspace() or c in "<>" for c in name)


class ToolCallParser(ABC):
    """One tool-call format. Stateless: `parse` reads a finished answer, `stream` starts a per-request stream."""

    name: ClassVar[str]
    block_start: ClassVar[str]
    block_end: ClassVar[str]
    # Markers around a run of calls; dropped from the content, they carry nothing themselves.
    wrappers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        """The call in one block (`inner` is the text between block_start and block_end), or None if malformed."""

    def stream(self, tools: ToolSet | list[Any] | None = None, id_suffix: str = "") -> ToolCallStream:
        return ToolCallStream(self, ToolSet.of(tools), id_suffix)

    def parse(self, text: str, tools: ToolSet | list[Any] | None = None, id_suffix: str = "") -> ParsedOutput:
        # The stream machine run over the whole text: one definition of the format, so the two cannot drift apart.
        stream = self.stream(tools, id_suffix)
        return ParsedOutput.from_deltas(stream.feed(text) + stream.finish())


def call_id(index: int, suffix: str) -> str:
    return f"call_{index}_{suffix}" if suffix else f"call_{index}"


class _ContentSink:
    """Content text with the whitespace around calls reduced (see the module docstring). Trailing whitespace is
    held back until later text shows whether a call follows it; once one does, that whitespace is only emitted as
    the separator before more content."""

    def __init__(self) -> None:
        self._space = ""  # trailing whitespace not emitted yet
        self._space_before_call = False  # a call came after that whitespace
        self._after_call = False  # nothing but whitespace since the last call
        self._emitted = False  # some non-whitespace content went out

    def text(self, s: str) -> list[Delta]:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return []
            self._after_call = False
        if self._space_before_call and not self._emitted:
            self._space = ""  # between the start and a call it separates nothing
        self._space_before_call = False
        s = self._space + s
        body = s.rstrip()
        self._space = s[len(body):]
        if not body:
            return []
        self._emitted = True
        return [ContentDelta(body)]

    def call(self) -> None:
        self._space_before_call = True
        self._after_call = True

    def flush(self) -> list[Delta]:
        space, self._space = self._space, ""
        return [ContentDelta(space)] if space and not self._space_before_call else []


class ToolCallStream:
    """One request's streamed answer through a tool-call format: `feed` each new piece, `finish` at the end."""

    def __init__(self, fmt: ToolCallParser, tools: ToolSet, id_suffix: str = "") -> None:
        self._fmt = fmt
        self._tools = tools
        self._suffix = id_suffix
        self._markers = (fmt.block_start, *fmt.wrappers)
        self._content = _ContentSink()
        self._buf = ""
        self._in_block = False
        # Inside a block: how far the end marker has been looked for already, so a long block is not rescanned
        # from its start on every piece.
        self._searched = 0
        self._calls = 0
        self._done = False

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed after finish")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        if self._done:
            return []
        self._done = True
        return self._drain(final=True) + self._content.flush()

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        fmt = self._fmt
        while self._buf:
            if self._in_block:
                start = max(len(fmt.block_start), self._searched)
                end = self._buf.find(fmt.block_end, start)
                if end == -1:
                    self._searched = max(start, len(self._buf) - len(fmt.block_end) + 1)
                    if final:  # the answer ended inside a block: it was never a call
                        out += self._content.text(self._buf)
                        self._buf, self._in_block = "", False
                    break
                stop = end + len(fmt.block_end)
                block, self._buf = self._buf[:stop], self._buf[stop:]
                self._in_block, self._searched = False, 0
                out += self._close_block(block, block[len(fmt.block_start):end])
                continue
            pos, marker = find_marker(self._buf, self._markers, final)
            out += self._content.text(self._buf[:pos])
            self._buf = self._buf[pos:]
            if marker is None:
                break
            if marker == fmt.block_start:
                self._in_block = True
            else:
                self._content.call()
                self._buf = self._buf[len(marker):]
        return out

    def _close_block(self, block: str, inner: str) -> list[Delta]:
        try:
            call = self._fmt.read_block(inner, self._tools)
            arguments = None if call is None else json.dumps(call.arguments, ensure_ascii=False, allow_nan=False)
        except Exception:  # noqa: BLE001 - model output must never break the response; a block that trips a
            # reader bug falls back to content like any malformed block, the same way in both paths.
            call, arguments = None, None
        if call is None or arguments is None or not plausible_name(call.name) or not self._tools.accepts(call.name):
            return self._content.text(block)
        self._content.call()
        index = self._calls
        self._calls += 1
        return [ToolCallDelta(index, id=call_id(index, self._suffix), name=call.name),
                ToolCallDelta(index, arguments=arguments)]
