"""`deepseekv3` and `deepseekv31`: DeepSeek's special-token tool calls (the bars are U+FF5C, the spaces U+2581).

deepseekv3 (DeepSeek-V3, V3-0324, R1-0528) has a type, the name, and the arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

deepseekv31 (DeepSeek-V3.1, V3.1-Terminus) has the name first and bare JSON:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>

(shown on two lines; the model writes no newline between the two end markers, though whitespace there is fine).

Each `<｜tool▁call▁begin｜>`...`<｜tool▁call▁end｜>` is one call; the outer `<｜tool▁calls▁begin｜>` /
`<｜tool▁calls▁end｜>` only group them and are dropped from the content.
"""

from __future__ import annotations

import re

from specserve.server.parsers.tool_scan import FunctionCall, ToolCallParser
from specserve.server.parsers.tool_schema import ToolSet
from specserve.server.parsers.values import loads_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def _object(text: str) -> dict | None:
    ok, value = loads_json(text.strip())
    return value if ok and isinstance(value, dict) else None


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseekv3"
    block_start = CALL_BEGIN
    block_end = CALL_END
    wrappers = (CALLS_BEGIN, CALLS_END)

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        kind, sep, rest = inner.partition(SEP)
        if not sep or kind.strip() != "function":
            return None
        name, _, body = rest.partition("\n")
        fenced = _FENCED.fullmatch(body)
        args = _object(fenced.group(1)) if fenced else None
        return None if args is None else FunctionCall(name.strip(), args)


class DeepSeekV31Parser(ToolCallParser):
    name = "deepseekv31"
    block_start = CALL_BEGIN
    block_end = CALL_END
    wrappers = (CALLS_BEGIN, CALLS_END)

    def read_block(self, inner: str, tools: ToolSet) -> FunctionCall | None:
        name, sep, body = inner.partition(SEP)
        args = _object(body) if sep else None
        return None if args is None else FunctionCall(name.strip(), args)
