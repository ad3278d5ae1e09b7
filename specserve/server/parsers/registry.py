"""The parser names `--tool-call-parser` and `--reasoning-parser` accept (SGLang's spellings) and their factories."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specserve.server.parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from specserve.server.parsers.deepseek_dsml import DeepSeekV32Parser
from specserve.server.parsers.glm import Glm45Parser, Glm47Parser
from specserve.server.parsers.hermes import Qwen25Parser
from specserve.server.parsers.qwen3_coder import Qwen3CoderParser
from specserve.server.parsers.reasoning import (
    DeepSeekR1Reasoning,
    DeepSeekV3Reasoning,
    Glm45Reasoning,
    Qwen3Reasoning,
    Qwen3ThinkingReasoning,
    ReasoningParser,
)
from specserve.server.parsers.tool_scan import ToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "deepseekv32": DeepSeekV32Parser,
    "glm": Glm45Parser,  # SGLang's alias
    "glm45": Glm45Parser,
    "glm47": Glm47Parser,
    "qwen": Qwen25Parser,  # SGLang's alias
    "qwen25": Qwen25Parser,
    "qwen3_coder": Qwen3CoderParser,
}

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1Reasoning,
    "deepseek-v3": DeepSeekV3Reasoning,
    "glm45": Glm45Reasoning,
    "qwen3": Qwen3Reasoning,
    "qwen3-thinking": Qwen3ThinkingReasoning,
}


def _lookup(table: Mapping[str, type], name: str, flag: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {flag} {name!r}; choices: {', '.join(sorted(table))}") from None


def make_tool_call_parser(name: str) -> ToolCallParser:
    """The format for a `--tool-call-parser` name; ValueError (listing the choices) for an unknown one."""
    return _lookup(TOOL_CALL_PARSERS, name, "--tool-call-parser")()


def make_reasoning_parser(name: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser:
    """The format for a `--reasoning-parser` name, in the thinking mode the request's chat_template_kwargs pick."""
    return _lookup(REASONING_PARSERS, name, "--reasoning-parser").for_request(chat_template_kwargs)
