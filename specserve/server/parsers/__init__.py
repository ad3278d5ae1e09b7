"""Tool-call and reasoning parsers for the OpenAI routes: pure Python, no torch (the HTTP process never loads it).

A finished answer is parsed in one go (`parse`); a streamed one is fed piece by piece to a stream object
(`feed` / `finish`). Both drive the same state machine, and that machine only decides at a point the text already
fixes, so the pieces can be split anywhere (a speculative step commits several tokens at once) and the joined
stream always equals the one-shot parse.

Names follow SGLang's `--tool-call-parser` and `--reasoning-parser` choices; see registry.py.
"""

from __future__ import annotations

from specserve.server.parsers.deltas import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
)
from specserve.server.parsers.reasoning import ReasoningParser, ReasoningStream
from specserve.server.parsers.registry import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    make_reasoning_parser,
    make_tool_call_parser,
)
from specserve.server.parsers.tool_scan import ToolCallParser, ToolCallStream
from specserve.server.parsers.tool_schema import ToolSet

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ContentDelta",
    "ParsedOutput",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "ToolSet",
    "make_reasoning_parser",
    "make_tool_call_parser",
]
