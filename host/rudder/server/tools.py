"""Tool calling, as vLLM does it over the OpenAI API, mapped onto our constraint controllers.

SmolLM2's chat template has no tool syntax, so this server uses one (Hermes' style, which many
open models know): the tools are listed in the system message as JSON inside `<tools>...</tools>`,
and a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice`:
- a named function: the output is constrained (the `json` controller) to
  `{"name": <that name>, "arguments": <its parameters schema>}`;
- "required": the same over the request's tools: one tool gives one object schema; several give
  `anyOf` of such objects (a tagged union on "name": the `json` controller reads the name, then
  follows that tool's arguments);
- "auto" (the default with tools): the `grammar` controller allows either text (not starting
  with `<`) or one or more `<tool_call>` blocks, each holding a JSON value of the same call
  schema as "required" (a `%json` element of the grammar: the `json` controller's engine, every
  keyword it knows);
- "none": the tools are not shown and the output is text.

With a reasoning model (`--reasoning-parser`) the thinking comes first, so the named and
"required" modes constrain the answer after it to `<tool_call>` blocks (as "auto" does, without
the text alternative).

In the constrained modes (named, "required") the prompt already ends with `<tool_call>` and the
output is the bare JSON object. Replies carry `tool_calls` (finish_reason "tool_calls");
streams carry them as deltas: the call's id, type and name first, then its arguments in pieces.
Earlier turns render back into the same syntax: an assistant message's `tool_calls` as
`<tool_call>` blocks, a `tool` message as `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..structured import Constraint
from .errors import APIError

__all__ = ["ToolCallParser", "ToolPlan", "render_messages"]

# -- the request's tools ------------------------------------------------------------------------

@dataclass
class ToolPlan:
    """What a request's tools and tool_choice ask for: the constraint, how to read the output
    (`mode`: "json" for one bare call object, "tagged" for text or <tool_call> blocks) and the
    prompt's tool section."""

    tools: list[dict]
    choice: str                      # "auto", "required", "none" or "named"
    named: str | None = None
    parallel: bool = True
    constraint: Constraint | None = None
    mode: str | None = None

    @classmethod
    def of(cls, tools: list | None, tool_choice: Any, parallel: bool | None, *, undeclared: str | None = None,
           reasoning: bool = False) -> "ToolPlan | None":
        """`undeclared`: the request's json_undeclared, for every tool's parameters. `reasoning`:
        the model thinks first, so a call cannot begin in the prompt: the named and "required"
        modes constrain the answer to <tool_call> blocks (mode "tagged") instead of a bare object."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise APIError("invalid_request", "tool_choice needs tools", param="tool_choice")
            return None
        functions = [_function(t, i) for i, t in enumerate(tools)]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise APIError("invalid_request", "tools: function names must be unique", param="tools")
        if undeclared == "allow" and any(f["strict"] for f in functions):
            raise APIError("invalid_request", "json_undeclared \"allow\" contradicts a strict tool (a strict schema "
                           "generates only declared properties)", param="json_undeclared")
        plan = cls(functions, "auto", parallel=parallel is not False)
        if tool_choice is None or tool_choice == "auto":
            plan.constraint = Constraint("grammar", _tagged_grammar(functions, plan.parallel, undeclared, text=True),
                                         "tools")
            plan.mode = "tagged"
            return plan
        if tool_choice == "none":
            plan.choice = "none"
            return plan
        if tool_choice == "required":
            plan.choice, chosen = "required", functions
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            chosen = [f for f in functions if f["name"] == name]
            if not chosen:
                raise APIError("invalid_request", f"tool_choice names {name!r}, which is not in tools",
                               param="tool_choice")
            plan.choice, plan.named = "named", name
        else:
            raise APIError("invalid_request", 'tool_choice is "none", "auto", "required" or '
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if reasoning:   # after the thinking: <tool_call> blocks only (one for a named function)
            parallel = plan.parallel and plan.choice == "required"
            plan.constraint = Constraint("grammar", _tagged_grammar(chosen, parallel, undeclared, text=False),
                                         "tool_choice")
            plan.mode = "tagged"
        else:
            plan.constraint = Constraint("json", json.dumps(_call_schema(chosen, undeclared), ensure_ascii=False),
                                         "tool_choice")
            plan.mode = "json"
        return plan

    def system_text(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.tools)
        return ("You can call functions. They are described here as JSON Schema:\n<tools>\n" + listed +
                "\n</tools>\nTo call one, answer with\n<tool_call>\n"
                '{"name": <function name>, "arguments": <the arguments as a JSON object>}\n</tool_call>')

    @property
    def prompt_suffix(self) -> str:
        """Text after the assistant header: in the constrained modes the call has begun."""
        return "<tool_call>\n" if self.mode == "json" else ""


def _function(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise APIError("invalid_request", f"tools[{i}]: only {{\"type\": \"function\", \"function\": {{...}}}} "
                       "tools are supported", param="tools")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise APIError("invalid_request", f"tools[{i}].function.name must be 1-64 letters, digits, _ . -",
                       param="tools")
    params = f.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise APIError("invalid_request", f"tools[{i}].function.parameters must be a JSON Schema object",
                       param="tools")
    out = {"name": name, "parameters": params, "strict": bool(f.get("strict"))}
    if f.get("description"):
        out["description"] = f["description"]
    return out


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of `node` whose local $refs ("#...") point under `base` (the schema moved there)."""
    if isinstance(node, list):
        return [_rebase_refs(n, base) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        else:
            out[k] = _rebase_refs(v, base)
    return out


def _call_schema(functions: list[dict], undeclared: str | None = None) -> dict:
    """{"name": const, "arguments": parameters} for one function, anyOf of those for several;
    every tool_choice mode constrains with it. A strict tool makes the whole schema strict (the
    json engine's root option: a keyword it cannot honour whole is refused)."""
    def one(f: dict, base: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": _rebase_refs(f["parameters"], base)},
                "required": ["name", "arguments"], "additionalProperties": False}

    if len(functions) == 1:
        schema = one(functions[0], "#/properties/arguments")
    else:
        schema = {"anyOf": [one(f, f"#/anyOf/{i}/properties/arguments") for i, f in enumerate(functions)]}
    if any(f["strict"] for f in functions):
        schema["x-rudder-strict"] = True
    if undeclared is not None:
        schema["x-rudder-undeclared"] = undeclared
    return schema


# -- "auto": a grammar of text or tool calls ------------------------------------------------------

def _tagged_grammar(functions: list[dict], parallel: bool, undeclared: str | None, text: bool) -> str:
    """Lark: <tool_call> blocks (one, or several when parallel) whose object is the same call
    schema as the bare-object modes', embedded with `%json`; with `text`, text not starting with
    "<" instead ("auto")."""
    schema = json.dumps(_call_schema(functions, undeclared), ensure_ascii=False)
    return "\n".join([
        "start: TEXT | calls" if text else "start: calls",
        "calls: call" + (" (NL? call)*" if parallel else ""),
        f'call: "<tool_call>" NL? %json {schema} NL? "</tool_call>"',
        *([r"TEXT: /[^<][\s\S]*/"] if text else []),  # text: anything that does not begin a call
        r"NL: /\n/",
    ]) + "\n"


# -- the prompt ----------------------------------------------------------------------------------

def render_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Messages for the chat template (string contents): the tools in the system message (unless
    tool_choice is "none"), earlier calls and results in our syntax."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = fn.get("arguments")
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                          ensure_ascii=False) + "\n</tool_call>")
            content = (content + "\n" if content else "") + "\n".join(calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None and plan.choice != "none":
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + plan.system_text()}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


# -- reading calls out of the output ---------------------------------------------------------------

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class ToolCallParser:
    """Reads released output text as it comes, in `mode` "json" (one bare call object) or
    "tagged" (text, or <tool_call> blocks). `feed` returns events for a stream: ("content", text),
    ("call", index, id, name), ("args", index, text)."""

    mode: str
    buf: str = ""
    pos: int = 0               # how much of buf has been consumed
    state: str = "start"
    calls: list[_Call] = field(default_factory=list)
    content: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        events: list[tuple] = []
        while True:
            before = (self.state, self.pos)
            getattr(self, f"_on_{self.state}")(events)
            if (self.state, self.pos) == before:
                return events

    # states ------------------------------------------------------------------------------------

    def _on_start(self, events):
        rest = self.buf[self.pos:]
        if self.mode == "json":
            self.state = "header"
        elif rest[:1] == "<":
            self.state = "open"
        elif rest:
            self.state = "text"

    def _on_text(self, events):
        rest = self.buf[self.pos:]
        if rest:
            self.content += rest
            self.pos = len(self.buf)
            events.append(("content", rest))

    def _on_open(self, events):
        rest = self.buf[self.pos:].lstrip()
        skipped = len(self.buf) - self.pos - len(rest)
        if len(rest) >= len(_OPEN):
            if not rest.startswith(_OPEN):  # not a call after all (only an unconstrained output)
                self.state = "text"
                return
            self.pos += skipped + len(_OPEN)
            self.state = "header"

    def _on_header(self, events):
        m = _HEADER.match(self.buf, self.pos)
        if m is None or m.end() == len(self.buf):  # wait for the arguments to begin
            return
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = m.group(1)
        call = _Call(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        events.append(("call", len(self.calls) - 1, call.id, name))
        self.pos = m.end()
        self.state = "args"
        self._depth, self._in_string, self._escape = 0, False, False

    def _on_args(self, events):
        """Arguments up to the end of their JSON value (strings and nesting tracked)."""
        start, i, end = self.pos, self.pos, None
        while i < len(self.buf) and end is None:
            c = self.buf[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        end = i + 1
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:  # the call's own "}": a scalar value ended before it
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
            elif c == '"':
                self._in_string = True
            elif c == "," and self._depth == 0:
                end = i
                break
            i += 1
        stop = end if end is not None else i
        piece = self.buf[start:stop]
        if piece:
            call = self.calls[-1]
            call.arguments += piece
            events.append(("args", len(self.calls) - 1, piece))
        self.pos = stop
        if end is not None:
            self.calls[-1].done = True
            self.state = "close"

    def _on_close(self, events):
        rest = self.buf[self.pos:]
        stripped = rest.lstrip()
        if not stripped:
            return
        if stripped[0] != "}":
            return
        consumed = len(rest) - len(stripped) + 1
        if self.mode == "json":
            self.pos += consumed
            self.state = "end"
            return
        after = stripped[1:].lstrip()
        if len(after) >= len(_CLOSE):
            if after.startswith(_CLOSE):
                self.pos += len(rest) - len(after) + len(_CLOSE)
                self.state = "between"

    def _on_between(self, events):
        rest = self.buf[self.pos:].lstrip()
        if rest.startswith("<"):
            self.pos = len(self.buf) - len(rest)
            self.state = "open"

    def _on_end(self, events):
        self.pos = len(self.buf)

    # results -----------------------------------------------------------------------------------

    def finish(self) -> list[tuple]:
        """At the end: text still waiting to be told apart from a call is content."""
        events = []
        if self.state in ("start", "open") and self.pos < len(self.buf) and not self.calls:
            rest = self.buf[self.pos:]
            self.content += rest
            events.append(("content", rest))
            self.pos = len(self.buf)
        return events

    def tool_calls(self) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]
