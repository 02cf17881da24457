"""The constraint a request asks for, composed: a SamplingParams' structured-output field (one of
json_schema, regex, choice, grammar, structural_tag) as its built-in controller, and any of them
after a reasoning phase (the `triggers` controller: free thinking, then the constraint as its
`start`). Shared by the Python API (LLM) and the server (dialects.py)."""

from __future__ import annotations

import json

from .reasoning import Reasoning
from .structural_tag import structural_tag
from .structured import Constraint, ConstraintError, choice, grammar, json_schema, lark_literal, regex

__all__ = ["from_params", "with_reasoning"]


def from_params(params) -> Constraint | None:
    """The constraint a SamplingParams asks for (json_schema, regex, choice, grammar or
    structural_tag), if any, after its thinking when it asks for reasoning."""
    fields = params.constraint_fields()
    if len(fields) > 1:
        raise ConstraintError(f"give one of json_schema, regex, choice, grammar and structural_tag, not "
                              f"{' and '.join(fields)}", fields[1])
    if params.json_undeclared is not None and fields != ["json_schema"]:
        raise ConstraintError("json_undeclared applies to json_schema", "json_undeclared")
    constraint = None
    if fields:
        name = fields[0]
        value = getattr(params, name)
        if name == "json_schema":
            constraint = json_schema(value, source=name, undeclared=params.json_undeclared)
        elif name == "structural_tag":
            constraint = structural_tag(value, source=name)
        else:
            constraint = {"regex": regex, "choice": choice, "grammar": grammar}[name](value, source=name)
    try:
        reasoning = Reasoning.of(params.reasoning)
    except ValueError as e:
        raise ConstraintError(str(e), "reasoning") from None
    if reasoning is not None:
        return with_reasoning(constraint, reasoning)
    return constraint


def segment_of(c: Constraint) -> dict:
    """A built-in constraint as a `triggers` segment (its `json`, `regex` or `grammar`)."""
    if c.controller == "json":
        return {"json": json.loads(c.arg)}
    if c.controller in ("regex", "grammar"):
        return {c.controller: c.arg}
    if c.controller == "choices":
        return {"grammar": "start: " + " | ".join(lark_literal(o) for o in json.loads(c.arg))}
    raise ConstraintError(f"{c.source}: this constraint cannot follow a reasoning phase", c.source)


def with_reasoning(c: Constraint | None, reasoning) -> Constraint | None:
    """Free thinking until `reasoning.end`, then `c` (if any) until the output ends. The end
    marker is fast-forwarded once `reasoning.budget` tokens are generated. None: nothing to
    constrain (no constraint and no budget: the thinking is only split off the text)."""
    arg: dict = {"reasoning": {"end": reasoning.end, "budget": reasoning.budget}}
    if c is not None and c.controller == "triggers":   # a structural tag: its phases after the thinking
        inner = json.loads(c.arg)
        if "reasoning" in inner:
            raise ConstraintError(f"{c.source}: already has a reasoning phase", c.source)
        arg.update(inner)
    elif c is not None:
        arg["start"] = {**segment_of(c), "stop": True}
    elif reasoning.budget is None:
        return None
    return Constraint("triggers", json.dumps(arg, ensure_ascii=False), c.source if c else "reasoning", max_backtrack=1)
