"""`qwen3_coder`: the XML-ish tool calls of Qwen3-Coder (and Qwen3.5/Qwen3-Next's coder templates).

    I'll look that up.
    <tool_call>
    <function=search>
    <parameter=query>
    best pizza in Naples
    </parameter>
    <parameter=limit>
    5
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end (the template puts it there), and is then converted by the parameter's type
in the request's tool schema: integer/number/boolean/object/array parsed, a string (or an unknown parameter, or no
tool list) kept as written. A value that does not fit its type stays a string rather than failing the call.
As in SGLang, a missing `</parameter>` (the next `<parameter=` or the end closes it) or `</function>` is tolerated.
"""

from __future__ import annotations

import re

from specserve.server.parsers.tool_scan import FunctionCall, ToolCallParser
from specserve.server.parsers.tool_schema import ToolSet
from specserve.server.parsers.values import convert_by_type

_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAM = "<parameter="
_PARAM_END = "</parameter>"
_SPACE = re.compile(r"\s*")


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    block_start = "<tool_call>"
    block_end = "</tool_call>"

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        body = inner.strip()
        if not body.startswith(_FUNCTION) or ">" not in body:
            return None
        name_end = body.index(">")
        name = body[len(_FUNCTION):name_end].strip()
        body = body[name_end + 1:]
        close = body.find(_FUNCTION_END)
        if close != -1:
            if body[close + len(_FUNCTION_END):].strip():
                return None
            body = body[:close]
        args = {}
        pos = 0
        while True:
            pos = _SPACE.match(body, pos).end()
            if pos == len(body):
                return FunctionCall(name, args)
            if not body.startswith(_PARAM, pos) or body.find(">", pos) == -1:
                return None
            key_end = body.find(">", pos)
            key = body[pos + len(_PARAM):key_end].strip()
            if not key:
                return None
            value_start = key_end + 1
            ends = [i for i in (body.find(_PARAM_END, value_start), body.find(_PARAM, value_start)) if i != -1]
            value_end = min(ends, default=len(body))
            value = _trim_newline(body[value_start:value_end])
            args[key] = convert_by_type(value, tools.param_type(name, key))
            pos = value_end + len(_PARAM_END) if body.startswith(_PARAM_END, value_end) else value_end
