"""Structural tags (vLLM, SGLang and XGrammar's `structural_tag`): free text with tagged regions
whose contents are constrained, the way tool calls and reasoning are framed. Both forms clients
send are read:

- the original one: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text;
  where a trigger appears, one of the structures whose `begin` starts with it follows (its JSON
  Schema between `begin` and `end`), then free text again;
- XGrammar's `{"format": {...}}` of format objects: `const_string`, `json_schema`, `regex`,
  `grammar`, `any_text`, `sequence`, `or`, `tag`, `optional`, `star`, `plus`, `repeat`,
  `tags_with_separator` and `triggered_tags`.

A `triggered_tags` format (or the original form) becomes the `triggers` controller: free text,
each trigger a segment whose grammar is the rest of its tags (`begin` after the trigger, the
content, the `end`). A `triggered_tags` that ends a top-level `sequence` follows the sequence's
other elements (the `triggers` controller's `start`). Everything else is one Lark grammar for
the `grammar` controller: JSON Schemas as `%json {...}` (the one JSON Schema engine), regexes as
terminals, `any_text` in a tag as one terminal "any text up to the first end string". A part
this server does not support is refused with its path (ConstraintError, a 400 over HTTP).
"""

from __future__ import annotations

import json
from typing import Any

from .gbnf import GBNFError, is_gbnf, to_lark
from .structured import Constraint, ConstraintError, json_schema, lark_literal

__all__ = ["structural_tag"]

_SUPPORTED = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "tag", "optional",
              "star", "plus", "repeat", "tags_with_separator", "triggered_tags")
_MAX_REPEAT = 32


def structural_tag(spec: Any, *, source: str = "structural_tag") -> Constraint:
    """The controller and argument for a structural tag (a dict or its JSON text)."""
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ConstraintError(f"{source}: not valid JSON ({e})", source) from None
    if not isinstance(spec, dict):
        raise ConstraintError(f"{source}: a structural tag is an object", source)
    kind = spec.get("type", "structural_tag")
    if kind != "structural_tag":
        raise ConstraintError(f"{source}: type must be \"structural_tag\", not {kind!r}", source)
    if "format" in spec:
        _only(spec, ("type", "format"), source)
        return _Compiler(source).top(spec["format"], f"{source}.format")
    if "structures" in spec:
        _only(spec, ("type", "structures", "triggers"), source)
        tags = []
        for i, s in enumerate(_list(spec, "structures", source)):
            where = f"{source}.structures[{i}]"
            if not isinstance(s, dict):
                raise ConstraintError(f"{where}: a structure is an object {{begin, schema, end}}", source)
            _only(s, ("begin", "schema", "end"), where)
            tags.append({"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                         "content": {"type": "json_schema", "json_schema": s.get("schema")}})
        fmt = {"type": "triggered_tags", "triggers": spec.get("triggers"), "tags": tags}
        return _Compiler(source).top(fmt, source)
    raise ConstraintError(f"{source}: give \"format\" (XGrammar's form) or \"structures\" and \"triggers\"", source)


def _only(obj: dict, keys: tuple, where: str) -> None:
    unknown = [k for k in obj if k not in keys]
    if unknown:
        raise ConstraintError(f"{where}: {unknown[0]!r} is not supported here (known: {', '.join(keys)})",
                              where.split(".")[0].split("[")[0])


def _list(obj: dict, key: str, where: str) -> list:
    v = obj.get(key)
    if not isinstance(v, list) or not v:
        raise ConstraintError(f"{where}.{key}: a non-empty list", where.split(".")[0])
    return v


class _Compiler:
    """Formats to Lark rules (one grammar), or the top-level triggered_tags to `triggers`."""

    def __init__(self, source: str):
        self.source = source
        self.rules: list[str] = []
        self.n = 0

    def fail(self, where: str, why: str):
        raise ConstraintError(f"{where}: {why}", self.source)

    # -- the top level: a grammar, or free text with triggers --------------------------------

    def top(self, fmt: Any, where: str) -> Constraint:
        kind = self.kind(fmt, where)
        if kind == "triggered_tags":
            return self.triggers(fmt, where, start=None)
        if kind == "sequence" and fmt.get("elements") and isinstance(fmt["elements"][-1], dict) \
                and fmt["elements"][-1].get("type") == "triggered_tags":
            _only(fmt, ("type", "elements"), where)
            head = fmt["elements"][:-1]
            where_last = f"{where}.elements[{len(head)}]"
            start = self.grammar({"type": "sequence", "elements": head}, where, last=False) if head else None
            return self.triggers(fmt["elements"][-1], where_last, start=start)
        return Constraint("grammar", self.grammar(fmt, where), self.source)

    def grammar(self, fmt: Any, where: str, last: bool = True) -> str:
        self.rules = []
        body = self.item(fmt, where, last)
        return "\n".join([f"start: {body}", *self.rules]) + "\n"

    def triggers(self, fmt: dict, where: str, start: str | None) -> Constraint:
        _only(fmt, ("type", "triggers", "tags", "at_least_one", "stop_after_first", "excludes"), where)
        if fmt.get("excludes"):
            self.fail(f"{where}.excludes", "excluded strings in free text are not supported")
        triggers = _list(fmt, "triggers", where)
        if not all(isinstance(t, str) and t for t in triggers):
            self.fail(f"{where}.triggers", "triggers are non-empty strings")
        if len(triggers) > 16 or any(len(t.encode()) > 64 for t in triggers):
            self.fail(f"{where}.triggers", "at most 16 triggers of at most 64 bytes each")
        tags = _list(fmt, "tags", where)
        alts: dict[str, list[str]] = {t: [] for t in triggers}
        rules: dict[str, list[str]] = {t: [] for t in triggers}
        for i, tag in enumerate(tags):
            w = f"{where}.tags[{i}]"
            if self.kind(tag, w) != "tag":
                self.fail(w, "triggered_tags take tags ({\"type\": \"tag\", ...})")
            begin = tag.get("begin")
            if not isinstance(begin, str):
                self.fail(f"{w}.begin", "a string")
            matching = [t for t in triggers if begin.startswith(t)]
            if len(matching) != 1:
                self.fail(f"{w}.begin", f"must start with exactly one trigger ({len(matching)} do)")
            self.rules = []   # each trigger's grammar holds the rules of its own tags
            alts[matching[0]].append(self.tag(dict(tag, begin=begin[len(matching[0]):]), w, begin_may_be_empty=True))
            rules[matching[0]].extend(self.rules)
        stop = fmt.get("stop_after_first", False)
        least = fmt.get("at_least_one", False)
        for name, value in (("stop_after_first", stop), ("at_least_one", least)):
            if not isinstance(value, bool):
                self.fail(f"{where}.{name}", "true or false")
        segments = []
        for t in triggers:
            if not alts[t]:
                self.fail(f"{where}.triggers", f"no tag begins with the trigger {t!r}")
            text = "\n".join([f"start: {' | '.join(alts[t])}", *rules[t]]) + "\n"
            segments.append({"begin": t, "grammar": text, "stop": stop})
        arg: dict = {"triggers": segments}
        if least:
            arg["at_least_one"] = True
        if start is not None:
            arg["start"] = {"grammar": start}
        return Constraint("triggers", json.dumps(arg, ensure_ascii=False), self.source, max_backtrack=1)

    # -- formats as Lark items ----------------------------------------------------------------

    def kind(self, fmt: Any, where: str) -> str:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            self.fail(where, "a format is an object with a \"type\"")
        if fmt["type"] not in _SUPPORTED:
            self.fail(where, f"the format type {fmt['type']!r} is not supported by this server "
                             f"(supported: {', '.join(_SUPPORTED)})")
        return fmt["type"]

    def rule(self, body: str) -> str:
        self.n += 1
        name = f"st_{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def item(self, fmt: Any, where: str, last: bool = False) -> str:
        """The Lark item for a format; `last`: nothing follows it in the output (any_text may
        stand there: elsewhere it could never end)."""
        kind = self.kind(fmt, where)
        if kind == "const_string":
            _only(fmt, ("type", "value"), where)
            if not isinstance(fmt.get("value"), str) or not fmt["value"]:
                self.fail(f"{where}.value", "a non-empty string")
            return lark_literal(fmt["value"])
        if kind == "json_schema":
            _only(fmt, ("type", "json_schema", "style", "any_order"), where)
            if fmt.get("style", "json") != "json":
                self.fail(f"{where}.style", f"only \"json\" is supported, not {fmt['style']!r}")
            if fmt.get("any_order"):
                self.fail(f"{where}.any_order", "properties come in the schema's order here")
            try:
                schema = json.loads(json_schema(fmt.get("json_schema"), source=f"{where}.json_schema").arg)
            except ConstraintError as e:
                raise ConstraintError(str(e), self.source) from None
            return "%json " + json.dumps(schema, ensure_ascii=False)
        if kind == "regex":
            _only(fmt, ("type", "pattern"), where)
            if not isinstance(fmt.get("pattern"), str) or not fmt["pattern"]:
                self.fail(f"{where}.pattern", "a non-empty string")
            return "/" + _slashes(fmt["pattern"]) + "/"
        if kind == "grammar":
            _only(fmt, ("type", "grammar"), where)
            return self.embedded(fmt.get("grammar"), f"{where}.grammar")
        if kind == "any_text":
            self.any_text_options(fmt, where)
            if not last:
                self.fail(where, "any_text is supported as a tag's content or at the end of the output")
            return self.rule(r"/[\s\S]+/") + "?"
        if kind in ("sequence", "or"):
            _only(fmt, ("type", "elements"), where)
            elements = _list(fmt, "elements", where)
            items = [self.item(e, f"{where}.elements[{i}]", last and (kind == "or" or i == len(elements) - 1))
                     for i, e in enumerate(elements)]
            return self.rule(" ".join(items) if kind == "sequence" else " | ".join(items))
        if kind == "tag":
            return self.tag(fmt, where)
        if kind in ("optional", "star", "plus"):
            _only(fmt, ("type", "content"), where)
            inner = self.item(fmt.get("content"), f"{where}.content")
            return f"({inner}){'?' if kind == 'optional' else '*' if kind == 'star' else '+'}"
        if kind == "repeat":
            _only(fmt, ("type", "min", "max", "content"), where)
            lo, hi = fmt.get("min"), fmt.get("max")
            if not isinstance(lo, int) or not isinstance(hi, int) or lo < 0 or (hi != -1 and hi < lo) \
                    or max(lo, hi) > _MAX_REPEAT or hi == 0:
                self.fail(where, f"min and max are counts with min <= max <= {_MAX_REPEAT}, max >= 1 "
                                 "(max -1: no bound)")
            inner = self.item(fmt.get("content"), f"{where}.content")
            parts = [inner] * lo + ([f"{inner}*"] if hi == -1 else [f"{inner}?"] * (hi - lo))
            return self.rule(" ".join(parts))
        if kind == "tags_with_separator":
            _only(fmt, ("type", "tags", "separator", "at_least_one", "stop_after_first"), where)
            sep = fmt.get("separator")
            if not isinstance(sep, str):
                self.fail(f"{where}.separator", "a string")
            alts = []
            for i, tag in enumerate(_list(fmt, "tags", where)):
                if self.kind(tag, f"{where}.tags[{i}]") != "tag":
                    self.fail(f"{where}.tags[{i}]", "a tag ({\"type\": \"tag\", ...})")
                alts.append(self.tag(tag, f"{where}.tags[{i}]"))
            one = self.rule(" | ".join(alts))
            body = one if fmt.get("stop_after_first") else \
                f"{one} ({lark_literal(sep)} {one})*" if sep else f"{one}+"
            return self.rule(body) if fmt.get("at_least_one") else f"({self.rule(body)})?"
        self.fail(where, "triggered_tags are supported at the top level (or ending a top-level sequence)")

    def tag(self, fmt: dict, where: str, begin_may_be_empty: bool = False) -> str:
        _only(fmt, ("type", "begin", "content", "end"), where)
        begin, end = fmt.get("begin"), fmt.get("end")
        if not isinstance(begin, str) or (not begin and not begin_may_be_empty):
            self.fail(f"{where}.begin", "a string (token begins are not supported)")
        ends = [end] if isinstance(end, str) else end
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            self.fail(f"{where}.end", "a string or a list of strings (token ends are not supported)")
        content = fmt.get("content")
        head = [lark_literal(begin)] if begin else []
        if self.kind(content, f"{where}.content") == "any_text":
            self.any_text_options(content, f"{where}.content")
            if len(ends) != 1 or not ends[0]:
                self.fail(f"{where}.end", "any_text content needs one non-empty end string")
            return self.rule(" ".join(head + ["/" + _slashes(until(ends[0])) + "/"]))
        body = self.item(content, f"{where}.content")
        tail = [e for e in ends if e]
        end_item = "" if not tail else lark_literal(tail[0]) if len(ends) == 1 else \
            "(" + " | ".join(lark_literal(e) if e else '""' for e in ends) + ")"
        return self.rule(" ".join(head + [body] + ([end_item] if end_item else [])))

    def any_text_options(self, fmt: dict, where: str) -> None:
        _only(fmt, ("type", "excludes", "max_tokens", "max_chars"), where)
        for key in ("excludes", "max_tokens", "max_chars"):
            if fmt.get(key) not in (None, []):
                self.fail(f"{where}.{key}", "not supported for any_text")

    def embedded(self, text: Any, where: str) -> str:
        """Another grammar (GBNF/EBNF as XGrammar takes it, or Lark) inside this one: its rules
        and terminals renamed apart, its start rule as the item."""
        if not isinstance(text, str) or not text.strip():
            self.fail(where, "a non-empty grammar")
        if is_gbnf(text):
            try:
                text = to_lark(text)
            except GBNFError as e:
                self.fail(where, f"GBNF grammar: {e}")
        self.n += 1
        prefix = f"g{self.n}_"
        renamed = _rename(text, prefix)
        if any(line.lstrip().startswith("%") for line in renamed.splitlines()):
            self.fail(where, "directives (%ignore, %import) are not supported in an embedded grammar")
        self.rules.extend(line for line in renamed.splitlines() if line.strip())
        return prefix + "start"


def _rename(lark: str, prefix: str) -> str:
    """Every rule and terminal name of a Lark text with `prefix` (lower case: rules keep their
    kind; terminals become `PREFIX_NAME`), strings, regexes and comments untouched."""
    out, i, n = [], 0, len(lark)
    while i < n:
        ch = lark[i]
        if ch == '"':
            j = i + 1
            while j < n and lark[j] != '"':
                j += 2 if lark[j] == "\\" else 1
            out.append(lark[i:j + 1])
            i = j + 1
        elif ch == "/" and lark.startswith("//", i):
            j = lark.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif ch == "/":
            j = i + 1
            while j < n and lark[j] != "/":
                j += 2 if lark[j] == "\\" else 1
            out.append(lark[i:j + 1])
            i = j + 1
        elif ch == "%":
            j = i + 1
            while j < n and (lark[j].isalnum() or lark[j] == "_"):
                j += 1
            out.append(lark[i:j])
            i = j
        elif ch.isalpha() or ch == "_":
            j = i
            while j < n and (lark[j].isalnum() or lark[j] == "_"):
                j += 1
            name = lark[i:j].lstrip("?!")
            out.append(prefix.upper() + name if name.isupper() else prefix + name)
            i = j
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _slashes(pattern: str) -> str:
    """A regex as a Lark `/.../` literal: each unescaped `/` escaped."""
    out, escaped = [], False
    for ch in pattern:
        out.append("\\/" if ch == "/" and not escaped else ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


def _escape(ch: str, in_class: bool) -> str:
    if ch.isalnum() or ord(ch) > 0x7F:
        return ch
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    if ord(ch) < 0x20:
        return f"\\x{ord(ch):02x}"
    return "\\" + ch if (in_class and ch in "\\]^-[") or (not in_class and not ch == " ") else ch


def until(end: str) -> str:
    """A regex (rudder_regex syntax) of the texts that end with `end` and hold it nowhere else:
    "any text up to the first end string". Built from the automaton that looks for `end`
    (Knuth-Morris-Pratt), its states eliminated into one expression."""
    m = len(end)
    chars = sorted(set(end))

    def step(q: int, c: str | None) -> int:  # c None: any character not in `end`
        while True:
            if c is not None and end[q] == c:
                return q + 1
            if q == 0:
                return 0
            q = _failure(end)[q - 1]

    # table[(i, j)]: the regex of one step from state i to state j (states 0..m; m accepts): the
    # characters of `end` that lead there, and with them "any other" as a negated class
    table: dict[tuple[int, int], str] = {}
    for q in range(m):
        groups: dict[int, set[str]] = {}
        for c in chars:
            groups.setdefault(step(q, c), set()).add(c)
        rest = step(q, None)
        for j in set(groups) | {rest}:
            these = groups.get(j, set())
            if j == rest:
                table[(q, j)] = "[^" + "".join(_escape(c, True) for c in chars if c not in these) + "]"
            elif len(these) == 1:
                table[(q, j)] = _escape(next(iter(these)), False)
            else:
                table[(q, j)] = "[" + "".join(_escape(c, True) for c in sorted(these)) + "]"
    for k in range(m - 1, 0, -1):  # eliminate states m-1 .. 1, keeping 0 (start) and m (accept)
        loop = table.pop((k, k), None)
        star = f"(?:{loop})*" if loop else ""
        ins = [(i, r) for (i, j), r in table.items() if j == k and i != k]
        outs = [(j, r) for (i, j), r in table.items() if i == k and j != k]
        for i, r_in in ins:
            for j, r_out in outs:
                path = f"{r_in}{star}{r_out}"
                table[(i, j)] = f"(?:{table[(i, j)]}|{path})" if (i, j) in table else path
        for key in [key for key in table if k in key]:
            del table[key]
    loop0 = table.get((0, 0))
    return (f"(?:{loop0})*" if loop0 else "") + table[(0, m)]


def _failure(s: str) -> list[int]:
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
