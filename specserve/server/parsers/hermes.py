"""`qwen25` (alias `qwen`): Hermes-style JSON tool calls, as Qwen2.5, Qwen3 (non-coder) and Hermes models write them.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

One JSON object per block, with "name" and "arguments" ("parameters" is accepted too, as SGLang does). Arguments
written as a JSON string holding an object are unwrapped, since some fine-tunes double-encode them.
"""

from __future__ import annotations

from specserve.server.parsers.tool_scan import FunctionCall, ToolCallParser
from specserve.server.parsers.tool_schema import ToolSet
from specserve.server.parsers.values import loads_json


class Qwen25Parser(ToolCallParser):
    name = "qwen25"
    block_start = "<tool_call>"
    block_end = "</tool_call>"

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        ok, obj = loads_json(inner.strip())
        if not ok or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if args is None:
            args = {}
        if isinstance(args, str):
            ok, args = loads_json(args)
            if not ok:
                return None
        if not isinstance(args, dict):
            return None
        return FunctionCall(obj["name"], args)
