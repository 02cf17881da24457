"""Structured output without naming a controller: a JSON Schema, a regex, a list of choices or a
grammar becomes one of the built-in constraint controllers with its argument.

Shared by the Python API (`SamplingParams(json_schema=...)`, the CLI's `--json-schema`) and the
server, which maps every dialect clients send (OpenAI `response_format`, vLLM
`structured_outputs` and `guided_*`, SGLang's fields, our `rudder` field) onto these.

| asked for                  | controller | argument                                            |
| -------------------------- | ---------- | --------------------------------------------------- |
| a JSON Schema              | `json`     | the schema, options as root keywords (docs/json-schema.md) |
| any JSON object            | `json`     | `{"type": "object"}`                                |
| a regex                    | `regex`    | the pattern                                         |
| one of several strings     | `choices`  | a JSON array of the strings                         |
| a grammar (Lark or GBNF)   | `grammar`  | Lark text (GBNF is translated: rudder/gbnf.py)      |
| a structural tag           | `triggers` or `grammar` | structural_tag.py                      |
| any of these after thinking | `triggers` | the constraint as its `start` (constraint_plan.py) |

JSON Schemas generate only the properties they declare unless they allow more
(`undeclared="allow"` is the specification's reading; docs/json-schema.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .gbnf import GBNFError, is_gbnf, to_lark

__all__ = ["Constraint", "ConstraintError", "any_json_object", "choice", "grammar", "json_schema", "lark_literal",
           "regex"]

UNDECLARED = ("forbid", "allow")

# Whitespace patterns vLLM clients send that our `json` controller can honour exactly.
_COMPACT = {"", "()", "(?:)"}
_JSON_WHITESPACE = {r"[ \t\n\r]*", r"[ \n\t\r]*", r"[\n\t\r ]*", r"[ \t\r\n]*", r"[\s]*", r"\s*"}


class ConstraintError(ValueError):
    """A constraint that cannot be built; `param` names the field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """A built-in controller and its argument; `source` is the field that asked for it."""

    controller: str
    arg: str
    source: str = ""
    max_backtrack: int = 0  # tokens the controller may take back (`triggers`: one, at a trigger)


def _load_schema(schema: Any, source: str) -> Any:
    if isinstance(schema, (bytes, str)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(f"{source}: the schema is not valid JSON ({e})", source) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{source}: a JSON Schema is an object (or true/false)", source)
    return schema


def _no_additional_properties(node: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without additionalProperties
    gets `false` (a copy; the caller's schema is untouched)."""
    if isinstance(node, list):
        return [_no_additional_properties(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _no_additional_properties(v) for k, v in node.items()}
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema(schema: Any, *, source: str = "json_schema", whitespace: str | None = None,
                no_additional_properties: bool = False, undeclared: str | None = None,
                strict: bool = False) -> Constraint:
    """The `json` controller for a schema (a dict, a bool or JSON text). `whitespace`: None (the
    controller's default, compact), "compact" or "flexible". `undeclared`: None (the default,
    "forbid": an object that names its properties generates only those), or "allow" (the
    specification's reading: undeclared properties may come too). `strict`: the declared shape
    exactly; what the engine cannot honour whole is refused by name."""
    schema = _load_schema(schema, source)
    if no_additional_properties:
        schema = _no_additional_properties(schema)
    if undeclared is not None and undeclared not in UNDECLARED:
        raise ConstraintError(f"{source}: undeclared properties are \"forbid\" or \"allow\", not {undeclared!r}",
                              source)
    if strict and undeclared == "allow":
        raise ConstraintError(f"{source}: a strict schema generates only declared properties: "
                              "undeclared=\"allow\" contradicts it", source)
    options = {"x-rudder-whitespace": whitespace, "x-rudder-undeclared": undeclared,
               "x-rudder-strict": True if strict else None}
    options = {k: v for k, v in options.items() if v is not None}
    if options:
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(f"{source}: options need an object schema (the schema is false)", source)
        schema = {**schema, **options}
    return Constraint("json", json.dumps(schema, ensure_ascii=False), source)


def any_json_object(*, source: str = "json_object", whitespace: str | None = None) -> Constraint:
    return json_schema({"type": "object"}, source=source, whitespace=whitespace)


def whitespace_of(pattern: str | None, disable_any_whitespace: bool | None, source: str) -> str | None:
    """vLLM's whitespace options as our `x-rudder-whitespace` (None: the default, compact)."""
    if pattern is not None:
        if pattern in _COMPACT:
            return "compact"
        if pattern in _JSON_WHITESPACE:
            return "flexible"
        raise ConstraintError(f"{source}: whitespace_pattern {pattern!r} is not supported: give \"\" (no "
                              r"whitespace) or [ \t\n\r]* (JSON whitespace)", source)
    if disable_any_whitespace is None:
        return None
    return "compact" if disable_any_whitespace else "flexible"


def regex(pattern: Any, *, source: str = "regex") -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"{source}: a regex is a non-empty string", source)
    return Constraint("regex", pattern, source)


def choice(options: Any, *, source: str = "choice") -> Constraint:
    if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
        raise ConstraintError(f"{source}: choices are a non-empty list of strings", source)
    if any(not o for o in options):
        raise ConstraintError(f"{source}: a choice must not be empty", source)
    return Constraint("choices", json.dumps(list(options), ensure_ascii=False), source)


def grammar(text: Any, *, source: str = "grammar") -> Constraint:
    """A Lark grammar as is, or a GBNF one (`root ::= ...`) translated to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError(f"{source}: a grammar is a non-empty string", source)
    if is_gbnf(text):
        try:
            text = to_lark(text)
        except GBNFError as e:
            raise ConstraintError(f"{source}: GBNF grammar: {e}", source) from None
    return Constraint("grammar", text, source)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (docs/grammar.md)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
