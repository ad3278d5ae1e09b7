"""Tools on the chat route: the request's messages and tools as the chat template takes them, and what its
tool_choice asks of the answer (a `ToolPlan`).

tool_choice, as vLLM and SGLang read it:

- "auto" (the default when tools are given): the tools are rendered into the prompt and the answer is parsed with
  the server's tool-call parser (--tool-call-parser); a server without one refuses such a request.
- "none": the tools are rendered, the answer is not parsed (all of it is content).
- "required": constrained decoding to a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, at least
  one (exactly one when parallel_tool_calls is false).
- {"type": "function", "function": {"name": ...}}: constrained decoding to that function's arguments object.

The constraint is a JSON schema the engine gets as the sampling parameter `json_schema` (SGLang's name), and the
answer is then read as that JSON (server/chat_output.py), not by the tool-call parser.

Assistant tool calls of earlier turns carry their arguments as JSON text (OpenAI's shape); templates write them
with `arguments | tojson` or iterate over them, so they are handed over as objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specserve.server.errors import bad_request
from specserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

ToolMode = Literal["off", "auto", "none", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: `mode` ("off" when it has none), the tools as OpenAI dicts (for the
    template and the parser), the function a named tool_choice forces, and the JSON schema that constrains the
    answer (required and named)."""

    mode: ToolMode = "off"
    tools: list[dict[str, Any]] | None = None
    function: str | None = None
    json_schema: dict[str, Any] | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """The request's tools as plain OpenAI dicts, fields it did not send left out."""
    return [t.model_dump(exclude_none=True) for t in tools]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # A function without a parameters schema takes an object of any shape (OpenAI's reading).
    return tool["function"].get("parameters") or {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required": an array of at least one call (at most one without parallel calls), each call an
    object with a tool's name and that tool's arguments under "parameters"."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A named tool_choice: the model writes that function's arguments object itself."""
    for t in tools:
        if t["function"]["name"] == name:
            return _parameters(t)
    raise KeyError(name)


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """The request's ToolPlan, or a 400 saying what is wrong with its tools or tool_choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None:
            raise bad_request("tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolPlan()
    tools = tool_dicts(body.tools)
    names = [t["function"]["name"] for t in tools]
    if not all(names):
        raise bad_request("every tool needs a non-empty function name", param="tools")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise bad_request(f"tool names must be unique; repeated: {', '.join(dupes)}", param="tools")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")
        return ToolPlan("named", tools, name, named_schema(tools, name), parallel)
    if choice == "required":
        return ToolPlan("required", tools, None, required_schema(tools, parallel), parallel)
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if tool_call_parser is None:
        raise bad_request("tool_choice auto needs a tool-call parser: start the server with --tool-call-parser "
                          "(the model's tool-call format), or send tool_choice none, required or a named function",
                          param="tools")
    return ToolPlan("auto", tools, parallel=parallel)


# ---------------------------------------------------------------------- messages for the template
def _text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"content part of type {part.type!r} is not supported (text only)", param="messages")
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(text: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise bad_request(f"messages[{index}]: a tool call's arguments are not valid JSON: {e}",
                          param="messages") from None
    if not isinstance(value, dict):
        raise bad_request(f"messages[{index}]: a tool call's arguments must be a JSON object, got "
                          f"{type(value).__name__}", param="messages")
    return value


def _has_images(m: ChatMessage) -> bool:
    return isinstance(m.content, list) and any(part.type == "image_url" for part in m.content)


def _parts(m: ChatMessage, index: int) -> list[dict[str, Any]]:
    """A message with image parts as the template reads it: its text parts and an {"type": "image"} part per image,
    in order (Qwen3.5's template writes <|vision_start|><|image_pad|><|vision_end|> for each)."""
    out: list[dict[str, Any]] = []
    for part in m.content:
        if part.type == "image_url":
            out.append({"type": "image"})
        elif part.type == "text" and part.text is not None:
            out.append({"type": "text", "text": part.text})
        else:
            raise bad_request(f"messages[{index}]: content part of type {part.type!r} is not supported (text and "
                              "image_url)", param="messages")
    return out


def template_message(m: ChatMessage, index: int, images: bool = False) -> dict[str, Any]:
    """One message as the chat template reads it: text content ("" for none), tool calls with their arguments as
    objects, a tool result's tool_call_id and function name, an assistant turn's reasoning_content. Content with
    image parts (images: the model takes them; else a 400) is a list of text and image parts."""
    if m.content is None and m.role == "user":
        raise bad_request("a user message needs content", param="messages")
    if _has_images(m):
        if not images:
            raise bad_request(f"messages[{index}] has an image, and this model does not take images (it has no "
                              "vision tower): send text only", param="messages")
        content: Any = _parts(m, index)
    else:
        content = _text(m)
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise bad_request(f"messages[{index}]: only assistant messages have tool_calls", param="messages")
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments,
                                                                                            index)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":  # (other turns' names never reached templates; they still don't)
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def template_messages(messages: list[ChatMessage], images: bool = False) -> list[dict[str, Any]]:
    return [template_message(m, i, images) for i, m in enumerate(messages)]
