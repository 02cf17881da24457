"""Which controller an OpenAI-shaped request asks for, whatever dialect it speaks.

| field(s)                                            | controller |
| --------------------------------------------------- | ---------- |
| `response_format` json_schema / json_object         | `json` (the schema / any object) |
| vLLM `structured_outputs` json / json_object        | `json` (+ whitespace and additionalProperties options) |
| vLLM `structured_outputs` regex / choice / grammar  | `regex` / `choices` / `grammar` |
| vLLM `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` | as structured_outputs |
| SGLang `json_schema` / `regex` / `ebnf`             | `json` / `regex` / `grammar` |
| `rudder` json_schema / regex / choice / grammar     | the same built-ins |
| `rudder` controller (+ controller_arg, controller_limits) | any controller: tag or module id |
| `tools` with tool_choice auto / required / named     | `grammar` / `json` (tools.py) |
| `n` > 1 without any of these                        | `fork` with n |

`response_format: {"type": "text"}` asks for nothing. Two fields that both constrain the output
are a 400 naming them (even when they agree: one source of truth per request).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import structured
from ..structured import Constraint, ConstraintError
from .errors import APIError
from .tools import ToolPlan


@dataclass
class Steer:
    """A request's controller: a name (tag, module id or built-in), its argument, the limits it
    asks for, its declared backtrack depth (None: ask the registry), the request field
    it came from and a hint added to a refusal."""

    controller: str
    arg: str = ""
    limits: dict | None = None
    max_backtrack: int | None = None
    param: str | None = None
    hint: str = ""


def _check(build, *args, **kw) -> Constraint:
    try:
        return build(*args, **kw)
    except ConstraintError as e:
        raise APIError("invalid_request", str(e), param=e.param) from None


def steer_of(body, tools: ToolPlan | None = None) -> Steer | None:
    """The controller an OpenAI request (chat or completion) asks for, or None."""
    found: list[Steer] = []

    def add(c: Constraint, hint: str = "") -> None:
        found.append(Steer(c.controller, c.arg, param=c.source, max_backtrack=0, hint=hint))

    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        if not isinstance(spec.get("schema"), (dict, bool)):
            raise APIError("invalid_request", "response_format json_schema needs json_schema.schema (an object)",
                           param="response_format")
        add(_check(structured.json_schema, spec["schema"], source="response_format"))
    elif fmt is not None and fmt.type == "json_object":
        add(_check(structured.any_json_object, source="response_format"))

    so = body.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise APIError("invalid_request", "structured_outputs.structural_tag is not supported by this server",
                           param="structured_outputs", code="unsupported_parameter")
        ws = _ws(so.whitespace_pattern, so.disable_any_whitespace, "structured_outputs")
        if so.json_ is not None:
            add(_check(structured.json_schema, so.json_, source="structured_outputs.json", whitespace=ws,
                       no_additional_properties=bool(so.disable_additional_properties)))
        if so.json_object:
            add(_check(structured.any_json_object, source="structured_outputs.json_object", whitespace=ws))
        if so.regex is not None:
            add(_check(structured.regex, so.regex, source="structured_outputs.regex"))
        if so.choice is not None:
            add(_check(structured.choice, so.choice, source="structured_outputs.choice"))
        if so.grammar is not None:
            add(_check(structured.grammar, so.grammar, source="structured_outputs.grammar"))

    if body.guided_json is not None:
        ws = _ws(body.guided_whitespace_pattern, None, "guided_whitespace_pattern")
        add(_check(structured.json_schema, body.guided_json, source="guided_json", whitespace=ws))
    elif body.guided_whitespace_pattern is not None and (so is None or so.json_ is None):
        raise APIError("invalid_request", "guided_whitespace_pattern goes with guided_json",
                       param="guided_whitespace_pattern")
    if body.guided_regex is not None:
        add(_check(structured.regex, body.guided_regex, source="guided_regex"))
    if body.guided_choice is not None:
        add(_check(structured.choice, body.guided_choice, source="guided_choice"))
    if body.guided_grammar is not None:
        add(_check(structured.grammar, body.guided_grammar, source="guided_grammar"))

    if body.json_schema is not None:  # SGLang
        add(_check(structured.json_schema, body.json_schema, source="json_schema"))
    if body.regex is not None:
        add(_check(structured.regex, body.regex, source="regex"))
    if body.ebnf is not None:
        add(_check(structured.grammar, body.ebnf, source="ebnf"))

    ext = body.rudder
    if ext is not None:
        if ext.json_schema is not None:
            add(_check(structured.json_schema, ext.json_schema, source="rudder.json_schema"))
        if ext.regex is not None:
            add(_check(structured.regex, ext.regex, source="rudder.regex"))
        if ext.choice is not None:
            add(_check(structured.choice, ext.choice, source="rudder.choice"))
        if ext.grammar is not None:
            add(_check(structured.grammar, ext.grammar, source="rudder.grammar"))
        if ext.controller is not None:
            found.append(Steer(ext.controller, ext.arg, ext.controller_limits, ext.max_backtrack,
                               "rudder.controller"))
        elif ext.controller_limits is not None:  # limits for the built-in a shorthand picked
            if not found:
                raise APIError("invalid_request", "rudder.controller_limits needs a controller or a constraint",
                               param="rudder.controller_limits")
            found[-1].limits = ext.controller_limits
        if ext.max_backtrack is not None and ext.controller is None:
            raise APIError("invalid_request", "rudder.max_backtrack declares a rudder.controller's backtracking",
                           param="rudder.max_backtrack")

    if tools is not None and tools.constraint is not None:
        add(tools.constraint, tools.hint)

    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise APIError("invalid_request", f"{a} and {b} both constrain the output: give one", param=b)
    n = getattr(body, "n", 1)
    if n > 1:
        if found:
            raise APIError("invalid_request", f"n > 1 works without a constraint only (it forks one request "
                           f"with the fork controller; {found[0].param} is one): send n requests", param="n")
        return Steer("fork", str(n), param="n", max_backtrack=0)
    return found[0] if found else None


def _ws(pattern, disable, source) -> str | None:
    try:
        return structured.whitespace_of(pattern, disable, source)
    except ConstraintError as e:
        raise APIError("invalid_request", str(e), param=e.param) from None
