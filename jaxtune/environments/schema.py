"""A tool's JSON schema from its Python signature and Google-style docstring (`json_schema`), the schema a chat
template's `tools` takes: what transformers' `get_json_schema` writes (tested equal), without importing transformers.

Types: int, float, str, bool, None, Any, list[X], tuple[X, Y] (prefixItems), dict[str, X] (additionalProperties),
unions (a list of type names or anyOf; None as "nullable"), Literal and Enum (enum). A description ending in
`(choices: [...])` gives an enum. What cannot be written is a `JaxtuneError` naming the tool and the argument.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union

from jaxtune.errors import JaxtuneError

_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE: dict[Any, dict] = {**{t: {"type": name} for t, name in _SCALARS.items()}, list: {"type": "array"},
                          tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}

# The docstring's sections: the description runs to the first "Args:", "Returns:" or "Raises:" line; an argument is
# a "name:" or "name (type):" line at the block's indentation, its description running on over deeper lines.
_SECTION = re.compile(r"^\s*(Args|Returns|Raises):\s*$", re.MULTILINE)
_ARGUMENT = re.compile(r"^(\s*)(\w+)(?:\s*\([^()\n]*\))?:\s*(.*)$")


def _enum(values: list, where: str) -> dict:
    kinds = []
    for v in values:
        if type(v) not in _SCALARS:
            raise JaxtuneError(f"{where}: enum value {v!r} is not a JSON scalar")
        kinds.append(_SCALARS[type(v)])
    kinds = list(dict.fromkeys(kinds))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint, where: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        if not list(hint):
            raise JaxtuneError(f"{where}: Enum {hint.__name__} has no members")
        return _enum([m.value for m in hint], where)
    if origin is None:
        if hint in _BARE:
            return dict(_BARE[hint])
        raise JaxtuneError(f"{where}: type {hint!r} has no JSON schema (int, float, str, bool, list, tuple, dict, "
                           "Literal, Enum and unions of them do)")
    if origin is Union or origin is types.UnionType:
        subs = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum(list(args), where)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise JaxtuneError(f"{where}: write {hint} as list[...] (a one-item or open tuple has no fixed schema)")
        return {"type": "array", "prefixItems": [_type_schema(a, where) for a in args]} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if len(args) == 2 else {})}
    raise JaxtuneError(f"{where}: type {hint!r} has no JSON schema")


def _sections(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    parts = _SECTION.split(doc)
    description = parts[0].strip()
    named = dict(zip(parts[1::2], parts[2::2]))
    arguments: dict[str, str] = {}
    indent, current = None, None
    for line in (named.get("Args") or "").splitlines():
        if not line.strip():
            continue
        match = _ARGUMENT.match(line)
        if match and (indent is None or len(match.group(1)) <= indent):
            indent, current = len(match.group(1)), match.group(2)
            arguments[current] = match.group(3).strip()
        elif current is not None:
            arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    returns = named.get("Returns")
    return description, arguments, returns.strip() if returns and returns.strip() else None


def json_schema(function: Callable) -> dict:
    """{"type": "function", "function": {"name", "description", "parameters"[, "return"]}} of a typed, documented
    function (a method's untyped `self`/`cls` left out); arguments without a default are "required"."""
    name = getattr(function, "__name__", "tool")
    doc = (inspect.getdoc(function) or "").strip()
    if not doc:
        raise JaxtuneError(f"tool {name}: no docstring to describe it (Google style, with an Args: section)")
    description, described, returns = _sections(doc)
    signature, hints = inspect.signature(function), typing.get_type_hints(function)
    properties, required = {}, []
    for k, (arg, parameter) in enumerate(signature.parameters.items()):
        if k == 0 and arg in ("self", "cls") and parameter.annotation is inspect.Parameter.empty:
            continue
        where = f"tool {name}: argument {arg!r}"
        if arg not in hints:
            raise JaxtuneError(f"{where} has no type hint")
        if arg not in described:
            raise JaxtuneError(f"{where} is not described in the docstring's Args: section")
        schema, text = _type_schema(hints[arg], where), described[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        properties[arg] = {**schema, "description": text}
        if parameter.default is inspect.Parameter.empty:
            required.append(arg)
    parameters: dict = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    out: dict = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:
            out["return"] = _type_schema(hints["return"], f"tool {name}: return")
        except JaxtuneError:  # the model never writes the return value: an unwritable type is left out
            pass
        else:
            if returns is not None:
                out["return"]["description"] = returns
    return {"type": "function", "function": out}
