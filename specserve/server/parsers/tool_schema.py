"""The request's tool list, reduced to what the parsers need: which function names exist and each parameter's type.

Tools come as the request sent them (OpenAI's `{"type": "function", "function": {"name", "parameters"}}` dicts) or
as objects with the same attributes (pydantic models), so both are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, (dict, Mapping)):  # dict first: the common case, and far cheaper than the ABC check
        return obj.get(name)
    return getattr(obj, name, None)


@dataclass(frozen=True)
class ToolSet:
    """Function name -> its parameters' JSON-schema `properties`; `schemas` None means no tool list was given, and
    then every well-formed name is accepted and parameter types are unknown."""

    schemas: Mapping[str, Mapping[str, Any]] | None = None

    @classmethod
    def of(cls, tools: ToolSet | list[Any] | None) -> ToolSet:
        if isinstance(tools, ToolSet):
            return tools
        if not tools:
            return cls(None)
        schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            function = _field(tool, "function")
            name = _field(function, "name") if function is not None else None
            if not isinstance(name, str) or not name:
                continue
            params = _field(function, "parameters")
            props = _field(params, "properties") if params is not None else None
            schemas[name] = props if isinstance(props, Mapping) else {}
        return cls(schemas)

    def accepts(self, name: str) -> bool:
        return self.schemas is None or name in self.schemas

    def param_type(self, function: str, param: str) -> str | None:
        """The parameter's JSON-schema type, lower-cased; for a union like ["integer", "null"] its first non-null
        member. None when the tool, the parameter or its type is unknown."""
        if self.schemas is None:
            return None
        prop = self.schemas.get(function, {}).get(param)
        kind = prop.get("type") if isinstance(prop, Mapping) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind.strip().lower() if isinstance(kind, str) else None
