"""A chat answer's text turned into the assistant message (`ChatOutput.message`) or into stream deltas
(`ChatOutput.stream`): thinking split off by the reasoning parser, then the rest read by the tool-call parser, or,
under a required / named tool_choice, read as the JSON the constraint made the model write.

Stream deltas are OpenAI's `choices[0].delta` objects: `{"reasoning_content": ...}`, `{"content": ...}` and
`{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}, ...]}` (a call's first item carries its
id, type and name, later ones more of its arguments). The message is the stream over the whole text, joined the way
a client joins deltas (`join_deltas`), so a streamed answer, however its text was cut into updates, adds up to the
non-streamed one.

Under constrained decoding the text is JSON that only means something once whole, so it is held until the answer
ends and then sent as tool calls; text that does not read as the constraint's JSON (an answer cut by max_tokens) is
sent as content. The reasoning parser is not used there: the constraint has the model write JSON from its first
token.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.server.chat_tools import ToolPlan
from specserve.server.parsers import (
    ContentDelta,
    ReasoningDelta,
    ReasoningParser,
    ToolCallDelta,
    make_reasoning_parser,
    make_tool_call_parser,
)
from specserve.server.parsers.tool_scan import call_id

Delta = dict[str, Any]


def finish_with_tools(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools (a cut answer stays
    "length")."""
    return "tool_calls" if called and reason == "stop" else reason


class ChatOutput:
    """How one chat request's answer is read: its ToolPlan, the server's tool-call parser and, when it splits
    reasoning, its reasoning parser in the request's thinking mode."""

    def __init__(self, plan: ToolPlan, tool_call_parser: str | None, reasoning: ReasoningParser | None,
                 id_suffix: str) -> None:
        self.plan = plan
        self.tool_parser = make_tool_call_parser(tool_call_parser) if plan.mode == "auto" else None
        self.reasoning = None if plan.constrained else reasoning
        self.id_suffix = id_suffix

    @classmethod
    def for_request(cls, plan: ToolPlan, tool_call_parser: str | None, reasoning_parser: str | None,
                    separate_reasoning: bool, chat_template_kwargs: dict | None, id_suffix: str) -> ChatOutput:
        reasoning = None
        if reasoning_parser is not None and separate_reasoning:
            reasoning = make_reasoning_parser(reasoning_parser, chat_template_kwargs)
        return cls(plan, tool_call_parser, reasoning, id_suffix)

    @property
    def shows_reasoning(self) -> bool:
        """The message carries reasoning_content (None when the answer has none)."""
        return self.reasoning is not None

    def stream(self) -> ChatStream:
        return ChatStream(self)

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed assistant message for the whole answer."""
        stream = self.stream()
        return join_deltas(stream.feed(text) + stream.finish(), self.shows_reasoning)


class ChatStream:
    """One request's answer, fed the text of each engine update; `feed` and `finish` return the deltas to send."""

    def __init__(self, out: ChatOutput) -> None:
        self._out = out
        self._reasoning = out.reasoning.stream() if out.reasoning is not None else None
        self._tools = (out.tool_parser.stream(out.plan.tools, out.id_suffix)
                       if out.tool_parser is not None else None)
        self._held: list[str] = []  # constrained JSON, read when whole
        self._done = False
        self.called = False  # some tool call was sent

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed after finish")
        if self._out.plan.constrained:
            self._held.append(text)
            return []
        pieces = self._reasoning.feed(text) if self._reasoning is not None else [ContentDelta(text)]
        return self._route(pieces, final=False)

    def finish(self) -> list[Delta]:
        if self._done:
            return []
        self._done = True
        if self._out.plan.constrained:
            return self._constrained("".join(self._held))
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list, final: bool) -> list[Delta]:
        """Reasoning out as it is; content through the tool-call stream when the answer is parsed."""
        out: list = []
        for p in pieces:
            if isinstance(p, ContentDelta) and self._tools is not None:
                out += self._tools.feed(p.text)
            elif p.text:
                out.append(p)
        if final and self._tools is not None:
            out += self._tools.finish()
        if not self._out.plan.parallel:  # only the first call counts
            out = [d for d in out if not isinstance(d, ToolCallDelta) or d.index == 0]
        return self._merge(out)

    def _constrained(self, text: str) -> list[Delta]:
        calls = read_constrained(self._out.plan, text)
        if calls is None:
            return [{"content": text}] if text else []
        items = []
        for i, (name, arguments) in enumerate(calls):
            items.append({"index": i, "id": call_id(i, self._out.id_suffix), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        self.called = True
        return [{"tool_calls": items}]

    def _merge(self, pieces: list) -> list[Delta]:
        """Parser pieces as OpenAI deltas, neighbours of one kind in one delta (a call's header and arguments in one
        item)."""
        out: list[Delta] = []
        for p in pieces:
            last = out[-1] if out else None
            if isinstance(p, ReasoningDelta):
                if last is not None and set(last) == {"reasoning_content"}:
                    last["reasoning_content"] += p.text
                else:
                    out.append({"reasoning_content": p.text})
            elif isinstance(p, ContentDelta):
                if last is not None and set(last) == {"content"}:
                    last["content"] += p.text
                else:
                    out.append({"content": p.text})
            else:
                self.called = True
                item = p.to_openai()
                if last is not None and set(last) == {"tool_calls"}:
                    prev = last["tool_calls"][-1]
                    if prev["index"] == p.index and p.name is None:
                        prev["function"]["arguments"] += item["function"]["arguments"]
                    else:
                        last["tool_calls"].append(item)
                else:
                    out.append({"tool_calls": [item]})
        return out


def read_constrained(plan: ToolPlan, text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) calls in a constrained answer, or None when it is not the constraint's JSON:
    an array of {"name", "parameters"} (required) or the named function's arguments object."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return None
    names = {t["function"]["name"] for t in plan.tools or []}
    if plan.mode == "named":
        if not isinstance(value, dict):
            return None
        return [(plan.function, _dumps(value))]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for call in value:
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        params = call.get("parameters", {})
        if not isinstance(params, dict):
            return None
        calls.append((call["name"], _dumps(params)))
    return calls if plan.parallel else calls[:1]


def _dumps(value: Any) -> str:
    # as the tool-call parsers write arguments (server/parsers/tool_scan.py)
    return json.dumps(value, ensure_ascii=False)


def join_deltas(deltas: list[Delta], with_reasoning: bool = False) -> dict[str, Any]:
    """The assistant message the deltas add up to, as a client joins them: text concatenated, each call's
    arguments concatenated. content is None when empty and tool calls were made, "" otherwise."""
    content, reasoning = [], []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content.append(d.get("content") or "")
        reasoning.append(d.get("reasoning_content") or "")
        for item in d.get("tool_calls") or []:
            call = calls.get(item["index"])
            if call is None:
                calls[item["index"]] = {"id": item["id"], "type": "function",
                                        "function": {"name": item["function"]["name"],
                                                     "arguments": item["function"].get("arguments", "")}}
            else:
                call["function"]["arguments"] += item["function"].get("arguments", "")
    text = "".join(content)
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if with_reasoning:
        msg["reasoning_content"] = "".join(reasoning) or None
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg
