"""`glm45` (alias `glm`) and `glm47`: GLM's key/value tool calls.

glm45 (GLM-4.5, GLM-4.6) puts the function name on its own line:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>北京</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

glm47 (GLM-4.7, GLM-5) writes the same without any newline:

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value></tool_call>

Keys and values are stripped. A value whose parameter the tool schema types as a string is kept as written; any
other value is read as JSON (then as a Python literal), and kept as a string when neither reads, as SGLang does:
so without a tool list `3` is the number 3 and `北京` the string "北京".
"""

from __future__ import annotations

import re
from typing import Any

from specserve.server.parsers.tool_scan import FunctionCall, ToolCallParser
from specserve.server.parsers.tool_schema import ToolSet
from specserve.server.parsers.values import STRING_TYPES, loads_lenient

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _value(raw: str, kind: str | None) -> Any:
    if kind in STRING_TYPES:
        return raw
    ok, value = loads_lenient(raw)
    return value if ok else raw


def _read_pairs(name: str, text: str, tools: ToolSet) -> FunctionCall | None:
    args: dict[str, Any] = {}
    pos = 0
    while pos < len(text):
        match = _PAIR.match(text, pos)
        if match is None:
            return None if text[pos:].strip() else FunctionCall(name, args)
        key = match.group(1).strip()
        if not key:
            return None
        args[key] = _value(match.group(2).strip(), tools.param_type(name, key))
        pos = match.end()
    return FunctionCall(name, args)


class Glm45Parser(ToolCallParser):
    name = "glm45"
    block_start = "<tool_call>"
    block_end = "</tool_call>"

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        # The name is the first line; a call without arguments may have no newline at all.
        name, _, rest = inner.partition("\n")
        return _read_pairs(name.strip(), rest, tools)


class Glm47Parser(ToolCallParser):
    name = "glm47"
    block_start = "<tool_call>"
    block_end = "</tool_call>"

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        # The name runs up to the first key; whitespace around it is tolerated.
        cut = inner.find("<arg_key>")
        cut = len(inner) if cut == -1 else cut
        return _read_pairs(inner[:cut].strip(), inner[cut:], tools)
