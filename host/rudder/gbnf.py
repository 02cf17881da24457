"""GBNF (llama.cpp's grammar format, the EBNF that vLLM's `grammar` and SGLang's `ebnf` take) to
the Lark subset of the `grammar` controller (docs/grammar.md).

GBNF works on characters; the grammar controller lexes the output into terminals first, with
maximal munch. So that the translation keeps GBNF's meaning exactly, every terminal it makes is
one character: a literal `"ab"` becomes `"a" "b"`, a class `[a-z]` becomes `/[a-z]/`, `.` becomes
`/[\\s\\S]/`. Lexemes are then single characters and the Earley parser sees GBNF's own grammar.
`{m,n}` repetitions are expanded; rules not reachable from `root` are dropped (Lark refuses
them). Not supported (a clear error): lookahead and the other xgrammar extensions.

    to_lark('root ::= "yes" | "no"')  ->  'start: ("y" "e" "s") | ("n" "o")'
"""

from __future__ import annotations

import re

__all__ = ["GBNFError", "is_gbnf", "to_lark"]


class GBNFError(ValueError):
    """The text is not a GBNF grammar this translation handles; the message says where."""


_TOKEN = re.compile(r'''
    (?P<ws>[ \t\r\n]+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?.])
''', re.X | re.S)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "/": "/"}
_MAX_EXPANSION = 256  # {m,n} copies of one item, at most


def is_gbnf(text: str) -> bool:
    """Whether a grammar text is GBNF (rules defined with `::=`) rather than Lark (`:`)."""
    return "::=" in text


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            line = text.count("\n", 0, pos) + 1
            raise GBNFError(f"GBNF line {line}: unexpected {text[pos:pos + 12]!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group(), pos))
        pos = m.end()
    return out


def _unescape(body: str, where: str) -> str:
    """The characters of a GBNF string body (escapes \\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH)."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1:i + 2]
        width = {"x": 2, "u": 4, "U": 8}.get(nxt)
        if width:
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
                raise GBNFError(f"{where}: bad escape \\{nxt}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            raise GBNFError(f"{where}: unknown escape \\{nxt}")
    return "".join(out)


def _lark_char(c: str) -> str:
    """One character as a Lark string literal."""
    if c in '"\\':
        return f'"\\{c}"'
    if c == "\n":
        return '"\\n"'
    if c == "\t":
        return '"\\t"'
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f'"\\x{ord(c):02x}"'
    return f'"{c}"'


def _lark_class(cls: str) -> str:
    """A GBNF class `[...]` as a Lark regex terminal: the same class, `/` escaped."""
    return "/" + cls.replace("/", "\\/") + "/"


class _Parser:
    def __init__(self, text: str):
        self.toks = _tokens(text)
        self.i = 0
        self.text = text

    def where(self) -> str:
        pos = self.toks[self.i][2] if self.i < len(self.toks) else len(self.text)
        return f"GBNF line {self.text.count(chr(10), 0, pos) + 1}"

    def peek(self, k: int = 0):
        return self.toks[self.i + k] if self.i + k < len(self.toks) else (None, None, None)

    def rules(self) -> dict[str, list]:
        rules: dict[str, list] = {}
        while self.i < len(self.toks):
            kind, name, _ = self.peek()
            if kind != "name" or self.peek(1)[0] != "define":
                raise GBNFError(f"{self.where()}: expected a rule `name ::= ...`")
            if name in rules:
                raise GBNFError(f"{self.where()}: rule {name!r} is defined twice")
            self.i += 2
            rules[name] = self.alternatives()
        if not rules:
            raise GBNFError("the GBNF grammar is empty")
        return rules

    def alternatives(self) -> list:
        alts = [self.sequence()]
        while self.peek()[1] == "|" and self.peek()[0] == "op":
            self.i += 1
            alts.append(self.sequence())
        return alts

    def sequence(self) -> list:
        items = []
        while True:
            kind, value, _ = self.peek()
            if kind is None or (kind == "op" and value in "|)"):
                return items
            if kind == "name" and self.peek(1)[0] == "define":
                return items  # the next rule begins
            items.append(self.postfix(self.atom()))

    def atom(self):
        kind, value, _ = self.peek()
        where = self.where()
        self.i += 1
        if kind == "string":
            return ("seq", [("char", c) for c in _unescape(value[1:-1], where)])
        if kind == "cls":
            if value == "[]":
                raise GBNFError(f"{where}: an empty character class matches nothing")
            _unescape(value[1:-1].replace("\\]", "]").replace("\\-", "-").replace("\\^", "^"), where)
            return ("class", value)
        if kind == "name":
            return ("ref", value)
        if kind == "op" and value == "(":
            alts = self.alternatives()
            if self.peek()[1] != ")":
                raise GBNFError(f"{self.where()}: expected ')'")
            self.i += 1
            return ("alt", alts)
        if kind == "op" and value == ".":
            return ("any",)
        raise GBNFError(f"{where}: unexpected {value!r}")

    def postfix(self, item):
        while True:
            kind, value, _ = self.peek()
            if kind == "op" and value in "*+?":
                self.i += 1
                item = ("rep", item, {"*": (0, None), "+": (1, None), "?": (0, 1)}[value])
            elif kind == "rep":
                self.i += 1
                lo, _, hi = value[1:-1].replace(" ", "").partition(",")
                low = int(lo or 0)
                high = low if "," not in value else (int(hi) if hi else None)
                if high is not None and high < low:
                    raise GBNFError(f"{self.where()}: bad repetition {value}")
                if max(low, high or 0) > _MAX_EXPANSION:
                    raise GBNFError(f"{self.where()}: repetition {value} is over {_MAX_EXPANSION}")
                item = ("rep", item, (low, high))
            else:
                return item


def _refs(node, out: set) -> None:
    kind = node[0]
    if kind == "ref":
        out.add(node[1])
    elif kind == "seq":
        for n in node[1]:
            _refs(n, out)
    elif kind == "alt":
        for alt in node[1]:
            for n in alt:
                _refs(n, out)
    elif kind == "rep":
        _refs(node[1], out)


def to_lark(text: str) -> str:
    """The Lark text of a GBNF grammar whose start rule is `root`."""
    rules = _Parser(text).rules()
    if "root" not in rules:
        raise GBNFError("a GBNF grammar needs a `root` rule")
    reachable, todo = set(), ["root"]
    while todo:
        name = todo.pop()
        if name in reachable:
            continue
        if name not in rules:
            raise GBNFError(f"rule {name!r} is used but not defined")
        reachable.add(name)
        found: set = set()
        for alt in rules[name]:
            for item in alt:
                _refs(item, found)
        todo.extend(found - reachable)

    names = {"root": "start"}
    for name in rules:
        if name in reachable and name != "root":
            base = "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower())
            candidate, k = base, 1
            while candidate in names.values():
                k += 1
                candidate = f"{base}_{k}"
            names[name] = candidate

    def emit(node) -> str:
        kind = node[0]
        if kind == "char":
            return _lark_char(node[1])
        if kind == "seq":
            return "(" + " ".join(emit(n) for n in node[1]) + ")" if node[1] else ""
        if kind == "class":
            return _lark_class(node[1])
        if kind == "any":
            return r"/[\s\S]/"
        if kind == "ref":
            return names[node[1]]
        if kind == "alt":
            return "(" + alternatives(node[1]) + ")"
        inner, (low, high) = emit(node[1]), node[2]
        if not inner:
            return ""
        if (low, high) == (0, None):
            return f"({inner})*"
        if (low, high) == (1, None):
            return f"({inner})+"
        required = " ".join([inner] * low)
        if high is None:
            return f"({required} ({inner})*)"
        optional = ""
        for _ in range(high - low):  # x{0,3}: (x (x (x)?)?)?
            optional = f"({inner} {optional})?" if optional else f"({inner})?"
        return f"({required} {optional})".replace("( ", "(").replace(" )", ")") if required else optional

    def alternatives(alts: list) -> str:
        parts = [" ".join(p for p in (emit(item) for item in alt) if p) for alt in alts]
        if any(not p for p in parts):  # an empty alternative: optional instead (Lark needs items)
            kept = [p for p in parts if p]
            if not kept:
                raise GBNFError("a rule that only matches the empty string is not supported")
            return "(" + " | ".join(kept) + ")?"
        return " | ".join(parts)

    lines = [f"{names[name]}: {alternatives(rules[name])}" for name in rules if name in reachable]
    return "\n".join(lines) + "\n"
