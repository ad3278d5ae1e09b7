"""Turning argument text into JSON values: strict JSON, a lenient fallback, and conversion by a schema type.

Every result must serialise back with json.dumps(allow_nan=False), since the arguments go out as JSON text; so
NaN/Infinity are refused and Python literals are kept only when they are plain JSON data.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is strict JSON (no NaN/Infinity), else (False, None)."""
    try:
        return True, json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return False, None


def _is_json_data(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def loads_lenient(text: str) -> tuple[bool, Any]:
    """Strict JSON, else a Python literal (models trained on Python write `True`, `None`, single quotes)."""
    ok, value = loads_json(text)
    if ok:
        return ok, value
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    if isinstance(value, tuple):
        value = list(value)
    return (True, value) if _is_json_data(value) else (False, None)


# Schema type names (JSON Schema's and the looser ones models' tool lists use) whose values stay text.
STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def _to_int(text: str) -> Any:
    try:
        return int(text.strip())
    except ValueError:
        return text


def _to_number(text: str) -> Any:
    body = text.strip()
    try:
        # "3" stays an integer; "3.0" and "3e0" say float on purpose.
        if "." not in body and "e" not in body.lower():
            return int(body)
        number = float(body)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def convert_by_type(text: str, kind: str | None) -> Any:
    """A raw parameter value converted to its schema type; the raw text whenever the type is unknown, a string
    type, or the text does not fit the type (the call is kept, the client sees what the model wrote)."""
    if kind is None or kind in STRING_TYPES:
        return text
    if text.strip().lower() == "null":
        return None
    if kind.startswith(_INT_PREFIXES):
        return _to_int(text)
    if kind.startswith(("num", "float", "double")):
        return _to_number(text)
    if kind in ("boolean", "bool"):
        word = text.strip().lower()
        return {"true": True, "false": False}.get(word, text)
    ok, value = loads_lenient(text.strip())
    return value if ok else text
