"""`deepseekv32`: DeepSeek-V3.2's DSML tool calls (the bars are U+FF5C).

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Each invoke is one call. A parameter with string="true" is text (stripped, as SGLang does); any other is JSON,
kept as text when it does not read. An invoke may instead hold one JSON object with all the arguments, which
SGLang accepts too.
"""

from __future__ import annotations

import re
from typing import Any

from specserve.server.parsers.tool_scan import FunctionCall, ToolCallParser
from specserve.server.parsers.tool_schema import ToolSet
from specserve.server.parsers.values import loads_json

FUNCTION_CALLS = "<｜DSML｜function_calls>"
FUNCTION_CALLS_END = "</｜DSML｜function_calls>"
INVOKE = "<｜DSML｜invoke"
INVOKE_END = "</｜DSML｜invoke>"

_HEAD = re.compile(r'\s+name="([^"]*)"\s*>', re.DOTALL)
_PARAM = re.compile(
    r'\s*<｜DSML｜parameter\s+name="([^"]*)"\s+string="([^"]*)"\s*>(.*?)</｜DSML｜parameter>', re.DOTALL)


def _param_value(raw: str, is_string: str) -> Any:
    raw = raw.strip()
    if is_string == "true":
        return raw
    ok, value = loads_json(raw)
    return value if ok else raw


def _read_params(body: str) -> dict[str, Any] | None:
    stripped = body.strip()
    if stripped.startswith("{"):
        ok, value = loads_json(stripped)
        return value if ok and isinstance(value, dict) else None
    args: dict[str, Any] = {}
    pos = 0
    while True:
        match = _PARAM.match(body, pos)
        if match is None:
            return None if body[pos:].strip() else args
        if not match.group(1):
            return None
        args[match.group(1)] = _param_value(match.group(3), match.group(2))
        pos = match.end()


class DeepSeekV32Parser(ToolCallParser):
    name = "deepseekv32"
    block_start = INVOKE
    block_end = INVOKE_END
    wrappers = (FUNCTION_CALLS, FUNCTION_CALLS_END)

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        head = _HEAD.match(inner)
        if head is None:
            return None
        args = _read_params(inner[head.end():])
        return None if args is None else FunctionCall(head.group(1).strip(), args)
