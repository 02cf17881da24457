"""Which controller an OpenAI-shaped request asks for, whatever dialect it speaks.

| field(s)                                            | controller |
| --------------------------------------------------- | ---------- |
| `response_format` json_schema / json_object         | `json` (the schema / any object; `strict` honoured) |
| `response_format` / `structured_outputs` / top-level `structural_tag` | `triggers` or `grammar` (structural_tag.py) |
| vLLM `structured_outputs` json / json_object        | `json` (+ whitespace and additionalProperties options) |
| vLLM `structured_outputs` regex / choice / grammar  | `regex` / `choices` / `grammar` |
| vLLM `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` | as structured_outputs |
| SGLang `json_schema` / `regex` / `ebnf`             | `json` / `regex` / `grammar` |
| `rudder` json_schema / regex / choice / grammar     | the same built-ins |
| `rudder` controller (+ controller_arg, controller_limits) | any controller: tag or module id |
| `tools` with tool_choice auto / required / named     | `grammar` / `json` (tools.py) |
| `n` > 1 without any of these                        | `fork` with n |

`response_format: {"type": "text"}` asks for nothing. Two fields that both constrain the output
are a 400 naming them (even when they agree: one source of truth per request). `json_undeclared:
"allow"` lets every JSON Schema of the request generate undeclared properties (the default is
only the declared ones). With `--reasoning-parser`, a chat's constraint applies after the
thinking (`triggers` with a `reasoning` phase; `thinking_token_budget` ends the thinking).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import structured
from ..constraint_plan import with_reasoning
from ..reasoning import Reasoning
from ..structural_tag import structural_tag
from ..structured import Constraint, ConstraintError
from .errors import APIError
from .tools import ToolPlan


@dataclass
class Steer:
    """A request's controller: a name (tag, module id or built-in), its argument, the limits it
    asks for, its declared backtrack depth (None: ask the registry) and the request field
    it came from."""

    controller: str
    arg: str = ""
    limits: dict | None = None
    max_backtrack: int | None = None
    param: str | None = None


def _check(build, *args, **kw) -> Constraint:
    try:
        return build(*args, **kw)
    except ConstraintError as e:
        raise APIError("invalid_request", str(e), param=e.param) from None


def steer_of(body, tools: ToolPlan | None = None, reasoning: Reasoning | None = None) -> Steer | None:
    """The controller an OpenAI request (chat or completion) asks for, or None. `reasoning`: the
    output thinks first (a chat on a server with --reasoning-parser); the constraint follows."""
    found: list[Steer] = []
    constraints: list[Constraint] = []
    undeclared = getattr(body, "json_undeclared", None)
    schemas: list[str] = []   # the fields that gave a JSON Schema

    def add(c: Constraint) -> None:
        constraints.append(c)
        found.append(Steer(c.controller, c.arg, param=c.source, max_backtrack=c.max_backtrack))

    def schema(value, source: str, **kw) -> None:
        schemas.append(source)
        add(_check(structured.json_schema, value, source=source, undeclared=undeclared, **kw))

    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        if not isinstance(spec.get("schema"), (dict, bool)):
            raise APIError("invalid_request", "response_format json_schema needs json_schema.schema (an object)",
                           param="response_format")
        strict = spec.get("strict")
        if strict not in (None, True, False):
            raise APIError("invalid_request", "response_format json_schema.strict is true or false",
                           param="response_format")
        schema(spec["schema"], "response_format", strict=bool(strict))
    elif fmt is not None and fmt.type == "json_object":
        add(_check(structured.any_json_object, source="response_format"))
    elif fmt is not None and fmt.type == "structural_tag":
        tag = {k: v for k, v in (("format", fmt.format), ("structures", fmt.structures), ("triggers", fmt.triggers))
               if v is not None}
        add(_check(structural_tag, tag, source="response_format"))

    so = body.structured_outputs
    if so is not None:
        ws = _ws(so.whitespace_pattern, so.disable_any_whitespace, "structured_outputs")
        if so.json_ is not None:
            schema(so.json_, "structured_outputs.json", whitespace=ws,
                   no_additional_properties=bool(so.disable_additional_properties))
        if so.json_object:
            add(_check(structured.any_json_object, source="structured_outputs.json_object", whitespace=ws))
        if so.regex is not None:
            add(_check(structured.regex, so.regex, source="structured_outputs.regex"))
        if so.choice is not None:
            add(_check(structured.choice, so.choice, source="structured_outputs.choice"))
        if so.grammar is not None:
            add(_check(structured.grammar, so.grammar, source="structured_outputs.grammar"))
        if so.structural_tag is not None:
            add(_check(structural_tag, so.structural_tag, source="structured_outputs.structural_tag"))

    if body.guided_json is not None:
        ws = _ws(body.guided_whitespace_pattern, None, "guided_whitespace_pattern")
        schema(body.guided_json, "guided_json", whitespace=ws)
    elif body.guided_whitespace_pattern is not None and (so is None or so.json_ is None):
        raise APIError("invalid_request", "guided_whitespace_pattern goes with guided_json",
                       param="guided_whitespace_pattern")
    if body.guided_regex is not None:
        add(_check(structured.regex, body.guided_regex, source="guided_regex"))
    if body.guided_choice is not None:
        add(_check(structured.choice, body.guided_choice, source="guided_choice"))
    if body.guided_grammar is not None:
        add(_check(structured.grammar, body.guided_grammar, source="guided_grammar"))
    if body.structural_tag is not None:  # vLLM's older top-level field
        add(_check(structural_tag, body.structural_tag, source="structural_tag"))

    if body.json_schema is not None:  # SGLang
        schema(body.json_schema, "json_schema")
    if body.regex is not None:
        add(_check(structured.regex, body.regex, source="regex"))
    if body.ebnf is not None:
        add(_check(structured.grammar, body.ebnf, source="ebnf"))

    ext = body.rudder
    if ext is not None:
        if ext.json_schema is not None:
            schema(ext.json_schema, "rudder.json_schema")
        if ext.regex is not None:
            add(_check(structured.regex, ext.regex, source="rudder.regex"))
        if ext.choice is not None:
            add(_check(structured.choice, ext.choice, source="rudder.choice"))
        if ext.grammar is not None:
            add(_check(structured.grammar, ext.grammar, source="rudder.grammar"))
        if ext.structural_tag is not None:
            add(_check(structural_tag, ext.structural_tag, source="rudder.structural_tag"))
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
        schemas.append("tools")   # (json_undeclared reached the tools' schemas through ToolPlan)
        add(tools.constraint)

    if undeclared is not None and not schemas:
        raise APIError("invalid_request", "json_undeclared applies to response_format json_schema, guided_json, "
                       "structured_outputs.json, json_schema, rudder.json_schema or tools, and the request has none",
                       param="json_undeclared")
    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise APIError("invalid_request", f"{a} and {b} both constrain the output: give one", param=b)
    budget = getattr(body, "thinking_token_budget", None)
    if budget is not None and reasoning is None:
        raise APIError("invalid_request", "thinking_token_budget needs a server started with --reasoning-parser",
                       param="thinking_token_budget")
    n = getattr(body, "n", 1)
    if n > 1:
        if found:
            raise APIError("invalid_request", f"n > 1 works without a constraint only (it forks one request "
                           f"with the fork controller; {found[0].param} is one): send n requests", param="n")
        if budget is not None:
            raise APIError("invalid_request", "n > 1 with thinking_token_budget: send n requests", param="n")
        return Steer("fork", str(n), param="n", max_backtrack=0)
    if reasoning is not None and (constraints or budget is not None):
        if found and not constraints:
            raise APIError("invalid_request", "thinking_token_budget works with the built-in constraints, not with "
                           "rudder.controller", param="thinking_token_budget")
        if found and found[0].param == "rudder.controller":
            return found[0]   # a controller of the client's own sees the thinking too
        thinking = Reasoning(reasoning.start, reasoning.end, budget)
        c = _check(with_reasoning, constraints[0] if constraints else None, thinking)
        limits = found[0].limits if found else None
        return Steer(c.controller, c.arg, limits, c.max_backtrack, c.source)
    return found[0] if found else None


def _ws(pattern, disable, source) -> str | None:
    try:
        return structured.whitespace_of(pattern, disable, source)
    except ConstraintError as e:
        raise APIError("invalid_request", str(e), param=e.param) from None
