"""The `json` controller (controllers/json.c) and the JSON Schema engine of the guest SDK.

(a) every valid document (random instances of several schemas, serialized with the engine's
    whitespace policy) is allowed token by token; (b) sampled outputs validate with the
    `jsonschema` package; (c) bad schemas fail with a clear error; (d) fast-forward happens and
    backtracking rewinds exactly; (e) invalid documents are refused at the very byte that
    breaks them; (f) the CLI end to end.
The controller runs in the product's sandbox (rudder.controller.ControllerRuntime) without a
model, as in test_controllers.py: at every step the document's own canonical tokenization of
what is left picks the token. Three tokenizers: the byte-level test tokenizer (one byte per
token: a refusal names its byte exactly), a small BPE built here (tokens of several bytes), and
SmolLM2's (`model` tests: it needs the fetched files).
"""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.build import builtin_controller
from rudder.tokenizer import Tokenizer
from test_guest_sdk import tiny_bpe_tokenizer

REPO = Path(__file__).resolve().parents[1]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "city": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "active"],
    "additionalProperties": False,
}

NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "score": {"type": "number", "exclusiveMinimum": -1, "maximum": 1},
        "author": {
            "type": "object",
            "properties": {"first": {"type": "string"}, "last": {"type": ["string", "null"]}},
            "required": ["first"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "kind": {"enum": ["book", "paper", 42, None, "a \"quoted\" one"]},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}], "items": False},
    },
    "required": ["title", "author", "kind"],
    "additionalProperties": False,
}

RECURSIVE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
            "required": ["value"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}

FORMATS = {
    "type": "object",
    "properties": {
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"},
        "ip": {"type": "string", "format": "ipv4"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "note": {"type": "string", "pattern": "ok", "maxLength": 12},
    },
    "required": ["day", "at", "id", "ip", "code", "note"],
    "additionalProperties": False,
}

EXTRAS = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "label": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}},
    "required": ["id"],
    "additionalProperties": {"type": "number"},
    "maxProperties": 5,
    "propertyNames": {"maxLength": 8},
}

ANY = {}

SCHEMAS = {"person": PERSON, "nested": NESTED, "recursive": RECURSIVE, "formats": FORMATS, "extras": EXTRAS, "any": ANY}


# ---------------------------------------------------------------------------- instances


def text(r: random.Random, lo: int = 0, hi: int = 12) -> str:
    alphabet = string.ascii_letters + string.digits + " .,:;-_!?'\"\\/\n\té😀中{}[]"
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


def key_text(r: random.Random) -> str:   # extra keys: plain characters (no escapes)
    return "".join(r.choice(string.ascii_letters + " é") for _ in range(r.randint(1, 8)))


def fmt_value(r: random.Random, fmt: str) -> str:
    day = f"{r.randint(1000, 2999)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    if fmt == "date":
        return day
    if fmt == "date-time":
        return f"{day}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}" + r.choice(["Z", "+02:00", ".123Z"])
    if fmt == "uuid":
        return str(uuid.UUID(int=r.getrandbits(128)))
    if fmt == "ipv4":
        return ".".join(str(r.randint(0, 255)) for _ in range(4))
    if fmt == "email":
        return f"{r.choice(['bob', 'a.b', 'x_1'])}@{r.choice(['example', 'mail'])}.{r.choice(['com', 'org'])}"
    raise AssertionError(fmt)


def instance(schema, r: random.Random, root=None, depth: int = 0):
    """A random valid instance of `schema` (the subset used in SCHEMAS)."""
    root = root if root is not None else schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part] if part else target
        return instance(target, r, root, depth)
    if "enum" in schema:
        return r.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema:
        return instance(r.choice(schema["anyOf"]), r, root, depth)
    t = schema.get("type")
    if isinstance(t, list):
        t = r.choice(t)
    if t is None:  # any JSON
        t = r.choice(["object", "array", "string", "number", "integer", "boolean", "null"] if depth < 3 else ["string", "integer"])
        if t == "object":
            return {key_text(r): instance({}, r, root, depth + 1) for _ in range(r.randint(0, 3))}
        if t == "array":
            return [instance({}, r, root, depth + 1) for _ in range(r.randint(0, 3))]
    if t == "object":
        out = {}
        for k, sub in schema.get("properties", {}).items():
            if k in schema.get("required", []) or r.random() < 0.5:
                out[k] = instance(sub, r, root, depth + 1)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for _ in range(r.randint(0, 2)):
                k = key_text(r)
                if k not in schema.get("properties", {}) and k not in out:
                    out[k] = instance(extra, r, root, depth + 1)
        return out
    if t == "array":
        if "prefixItems" in schema:
            return [instance(s, r, root, depth + 1) for s in schema["prefixItems"]]
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 3)
        return [instance(schema["items"], r, root, depth + 1) for _ in range(r.randint(lo, hi if depth < 3 else lo))]
    if t == "string":
        if "format" in schema:
            return fmt_value(r, schema["format"])
        if schema.get("pattern") == "^[A-Z]{2}-[0-9]{3}$":
            return "".join(r.choice(string.ascii_uppercase) for _ in range(2)) + "-" + f"{r.randint(0, 999):03d}"
        if schema.get("pattern") == "ok":
            return text(r, 0, 5) + "ok" + text(r, 0, 5)
        return text(r, schema.get("minLength", 0), schema.get("maxLength", 12))
    if t == "integer":
        return r.randint(schema.get("minimum", -10**6), schema.get("maximum", 10**6))
    if t == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1000) + 0.01)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 1000) - 0.01)
        return min(max(round(r.uniform(lo, hi), r.randint(0, 4)), lo), hi)
    if t == "boolean":
        return r.random() < 0.5
    if t == "null":
        return None
    raise AssertionError(schema)


def compact(doc) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------- driving


def _runtime(tokenizer) -> ControllerRuntime:
    return ControllerRuntime(tokenizer, Limits(mid_process_ms=2000, init_ms=5000))


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def rt(tok):
    runtime = _runtime(tok)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def module(rt):
    return rt.load(builtin_controller("json"))


@pytest.fixture(scope="module", params=["byte", "bpe", pytest.param("smollm2", marks=pytest.mark.model)])
def any_tok(request):
    """A tokenizer per param: byte-level, the small test BPE (offline), SmolLM2 (`model`)."""
    if request.param == "byte":
        return Tokenizer.byte_level(512)
    if request.param == "bpe":
        return tiny_bpe_tokenizer()
    return request.getfixturevalue("smollm2_tokenizer")


@pytest.fixture(scope="module")
def any_rt(any_tok):
    runtime = _runtime(any_tok)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def any_module(any_rt):
    return any_rt.load(builtin_controller("json"))


@pytest.fixture(scope="module")
def byte_rt():
    runtime = _runtime(Tokenizer.byte_level(512))
    yield runtime
    runtime.close()


def allowed(mask, t: int) -> bool:
    return bool((int(mask[t >> 5]) >> (t & 31)) & 1)


_BY_BYTES: dict = {}


def next_token(tok, rest: bytes) -> int:
    """The first token of the canonical tokenization of `rest`; inside a character (after a
    token that ended mid-character) the longest token that is a prefix of it."""
    try:
        return tok.encode(rest.decode())[0]
    except UnicodeDecodeError:
        table = _BY_BYTES.setdefault(id(tok), {})
        if not table:
            table.update({b: i for i, b in enumerate(tok.token_bytes) if b and i not in tok.special_token_ids})
        return next(table[rest[:n]] for n in range(min(len(rest), 64), 0, -1) if rest[:n] in table)


class Refused(Exception):
    """The controller would not let the document be written: the bytes `lo..hi` of it (one
    byte with the byte-level tokenizer) are where it said no. `how`: "mask" (the token that
    writes them is not allowed), "ff" (a fast-forward forces other bytes there), "stop" (no
    branch: it stopped before them), "eos" (the complete document may not end)."""

    def __init__(self, how: str, lo: int, hi: int, data: bytes, log: str):
        super().__init__(f"{how} refusal at bytes {lo}..{hi} after {data[:lo]!r}; log: {log[-300:]}")
        self.how, self.lo, self.hi = how, lo, hi


def _common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Drive:
    """Feeds a document to the controller as if the model wrote it: at a masked step the first
    token of the canonical tokenization of the rest, extended by its ff list if it has one.
    Where the controller says no, `run` raises Refused naming the bytes; anything else that
    breaks the ABI's rules is an AssertionError."""

    def __init__(self, rt, module, tok, schema, text: str):
        self.tok, self.data = tok, text.encode()
        self.schema = schema if isinstance(schema, str) else json.dumps(schema)
        self.ctl = rt.start(module, self.schema)
        self.tokens: list[int] = []
        self.masks: list[np.ndarray | None] = []   # the mask answered before each generated token
        self.n_ff = self.n_sampled = 0

    def complete(self, prefix: bytes) -> bool:
        try:
            jsonschema.validate(json.loads(prefix), json.loads(self.schema))
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    def refused(self, how: str, lo: int, hi: int) -> Refused:
        return Refused(how, lo, hi, self.data, self.ctl.log_text())

    def run(self):
        eos, tok, data = self.tok.eos_token_id, self.tok, self.data
        bos = tok.bos_token_id if tok.bos_token_id is not None else 1
        branches = self.ctl.mid_process(0, 0, [bos, *tok.encode("user\nWrite JSON.")])
        pos = 0
        while True:
            assert len(branches) <= 1
            if not branches:   # stopped: the document must be complete
                if pos < len(data):
                    raise self.refused("stop", pos, pos + 1)
                return self
            [b] = branches
            if b.mask is None:
                append = list(b.ff[0])
                self.n_ff += len(append)
                self.masks += [None] * len(append)
            else:
                mask = np.array(b.mask)
                if pos == len(data):
                    if not allowed(mask, eos):
                        raise self.refused("eos", pos, pos + 1)
                    return self
                if allowed(mask, eos):   # only where the text so far is a complete document
                    assert self.complete(data[:pos]), f"EOS allowed before the end, after {data[:pos]!r}"
                t = next_token(tok, data[pos:])
                if not allowed(mask, t):
                    raise self.refused("mask", pos, pos + len(tok.token_bytes[t]))
                append = next((list(lst) for lst in b.ff if lst[0] == t), [t])
                self.n_sampled += 1
                self.n_ff += len(append) - 1
                self.masks += [mask] + [None] * (len(append) - 1)
            got = b"".join(tok.token_bytes[x] for x in append)
            if not data[pos:].startswith(got):   # forced bytes that are not the document's
                at = pos + _common_prefix(got, data[pos:])
                raise self.refused("ff", at, at + 1)
            pos += len(got)
            self.tokens += append
            branches = self.ctl.mid_process(0, 0, append)


# ---------------------------------------------------------------------------- (a) valid documents


@pytest.mark.parametrize("name", list(SCHEMAS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_valid_document_is_allowed(any_rt, any_module, any_tok, name, seed):
    schema = SCHEMAS[name]
    doc = instance(schema, random.Random(seed))
    jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())   # the generator is right
    d = Drive(any_rt, any_module, any_tok, schema, compact(doc)).run()
    d.ctl.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_flexible_whitespace_allows_indented_documents(any_rt, any_module, any_tok, seed):
    schema = {**NESTED, "x-rudder-whitespace": "flexible"}
    doc = instance(NESTED, random.Random(seed))
    Drive(any_rt, any_module, any_tok, schema, json.dumps(doc, indent=2, ensure_ascii=False)).run().ctl.close()


# ---------------------------------------------------------------------------- (e) invalid documents

GOOD_PERSON = '{"name":"Al","age":3,"city":"X","active":true}'


def _at(doc: str, mark: str, k: int = 0) -> tuple[str, int]:
    return doc, doc.index(mark) + k


#: (document, the index of its first byte that no valid document can have there)
INVALID_PERSONS = [
    _at('{"age":3,"name":"Al","city":"X","active":true}', "age"),            # "name" comes first
    _at('{"name":"Al","age":3,"active":true}', "active"),                    # "city" is required first
    _at('{"name":"Al","age":151,"city":"X","active":true}', "151", 2),       # maximum 150: the last digit
    _at('{"name":"","age":3,"city":"X","active":true}', '""', 1),            # minLength 1: the closing quote
    _at('{"name":"Al","age":3,"email":"nope","city":"X","active":true}', 'nope"', 4),  # no "@": its quote
    (GOOD_PERSON + " ", len(GOOD_PERSON)),                                   # compact: no trailing space
    _at('{"name":"Al","age":3,"city":"X","active":true,"x":1}', ',"x"'),     # no additional property
    _at('{"name":"Al","age":03,"city":"X","active":true}', "03", 1),         # no leading zero: the 3
]


def test_the_invalid_documents_table_is_right():
    """Each document above is invalid, and what comes before the byte named is the beginning
    of a valid document (so that byte is the first wrong one)."""
    validator = jsonschema.Draft202012Validator(PERSON, format_checker=jsonschema.FormatChecker())
    completions = ['name":"Al","age":3,"city":"X","active":true}', 'city":"X","active":true}',
                   '0,"city":"X","active":true}', 'A","age":3,"city":"X","active":true}',
                   '@x.org","city":"X","active":true}', "", "}", ',"city":"X","active":true}']
    for (doc, at), rest in zip(INVALID_PERSONS, completions):
        try:
            bad = not validator.is_valid(json.loads(doc))
        except ValueError:
            bad = True   # not even JSON (a leading zero)
        # Two break the engine's documented policy, not the schema (docs/json-schema.md):
        # properties come in schema order, and compact JSON has no whitespace.
        assert bad != (doc.startswith('{"age"') or doc.endswith(" ")), doc
        assert validator.is_valid(json.loads(doc[:at] + rest)), (doc[:at], rest)


@pytest.mark.parametrize("doc,at", INVALID_PERSONS, ids=[str(at) for _, at in INVALID_PERSONS])
def test_invalid_documents_are_refused_at_the_offending_byte(any_rt, any_module, any_tok, doc, at):
    """A wrong key order, a missing required key, a value out of range, a bad format, a
    trailing space, an extra key, a leading zero: the controller refuses exactly the token that
    carries the first offending byte (not an earlier one, not a later one), and a fast-forward
    that writes other bytes shows up as a refusal where they differ."""
    with pytest.raises(Refused) as info:
        Drive(any_rt, any_module, any_tok, PERSON, doc).run()
    r = info.value
    assert r.lo <= at < r.hi, (str(r), at)
    if max(map(len, any_tok.token_bytes)) == 1:
        assert (r.lo, r.hi) == (at, at + 1)   # byte-level: the very byte


# ---------------------------------------------------------------------------- (c) errors


def _exploding(depth: int) -> dict:
    """Each level is a oneOf of two variants of the level below (through $ref, so the text
    stays small): merged, the top level has 2^depth alternatives."""
    defs = {"l0": {"type": "string"}}
    for i in range(depth):
        below = {"$ref": f"#/$defs/l{i}"}
        defs[f"l{i + 1}"] = {"oneOf": [{"allOf": [below, {"minLength": i}]}, {"allOf": [below, {"maxLength": 100 - i}]}]}
    return {"$defs": defs, "$ref": f"#/$defs/l{depth}"}


@pytest.mark.parametrize("schema,message", [
    ({"type": "array", "items": {"contains": {}, "maxContains": 1}}, 'unsupported keyword "maxContains" at #/items'),
    ({"$dynamicRef": "#x"}, 'unsupported keyword "$dynamicRef" at #'),
    ({"type": "object", "properties": {"x": {"not": {"multipleOf": 2}}}},
     'unsupported "not" (or "if"): no generator for the values outside this schema (it is checked only on enum/const values) at #/properties/x/not'),
    ({"$ref": "#/$defs/missing"}, "$ref points to nothing"),
    ({"$ref": "other.json#/x"}, 'only references into this document ("#...") are supported, not the $ref "other.json#/x" at #'),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "a $ref cycle"),
    ({"type": "strin"}, 'unknown type in "type"'),
    ({"type": "string", "pattern": "(a"}, "unsupported pattern (pattern 0 at byte"),
    ({"type": "string", "pattern": "^(?!x)"}, "lookaround is not supported"),
    ({"type": "number", "multipleOf": 0.3}, "multipleOf that is neither an integer nor a power of ten"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no JSON value satisfies the schema"),
    ({"type": "string", "format": "uuid", "maxLength": 10}, "no JSON value satisfies the schema"),
    (_exploding(12), "the schema is too complex"),
    ('{"type": "object",', "the schema is not valid JSON"),
    ("[1, 2", "the schema is not valid JSON"),
    ('{"type": 1}', "unknown type"),
])
def test_bad_schemas_fail_clearly(byte_rt, schema, message):
    """The schema is checked at request start, whatever the vocabulary: the byte-level one."""
    arg = schema if isinstance(schema, str) else json.dumps(schema)
    with pytest.raises(ControllerError) as info:
        byte_rt.start(byte_rt.load(builtin_controller("json")), arg)
    assert info.value.kind == "start"
    full = f"{info.value}\n{info.value.log_tail}"
    assert "json: " in full and message in full, full


# ---------------------------------------------------------------------------- (d) ff and backtrack


def test_fast_forward_and_backtrack(any_rt, any_module, any_tok):
    rt, module, tok = any_rt, any_module, any_tok
    doc = compact({"name": "Ada Lovelace", "age": 36, "city": "London", "active": False})
    d = Drive(rt, module, tok, PERSON, doc).run()
    total = len(d.tokens)
    assert d.n_ff / total > 0.3, (d.n_ff, total)   # keys, quotes, colons and commas are forced
    # Rewind k tokens: the controller answers exactly as it did the first time at that point.
    for k in [1, 3, total // 2, total - 1]:
        ctl = Drive(rt, module, tok, PERSON, doc)
        branches = ctl.ctl.mid_process(0, 0, [1, *tok.encode("user\nWrite JSON.")])
        branches = ctl.ctl.mid_process(0, 0, d.tokens)           # everything at once
        branches = ctl.ctl.mid_process(0, k, [])                 # then take k back
        [b] = branches
        at = total - k
        if d.masks[at] is not None:
            assert b.mask is not None and np.array_equal(np.array(b.mask), d.masks[at])
        else:   # that token was fast-forwarded: the same forced text comes again
            want = b"".join(tok.token_bytes[x] for x in d.tokens[at:])
            got = b"".join(tok.token_bytes[x] for x in b.ff[0])
            assert b.mask is None and want.startswith(got)
        ctl.ctl.close()
    d.ctl.close()


def test_ff_can_be_disabled(any_rt, any_module, any_tok):
    rt, module, tok = any_rt, any_module, any_tok
    doc = compact({"name": "Ada", "age": 36, "city": "London", "active": False})
    d = Drive(rt, module, tok, {**PERSON, "x-rudder-ff": False}, doc).run()
    assert d.n_ff == 0 and d.n_sampled == len(d.tokens)


def test_rejected_token_fails_the_request(any_rt, any_module, any_tok):
    rt, module, tok = any_rt, any_module, any_tok
    ctl = rt.start(module, json.dumps(PERSON))
    ctl.mid_process(0, 0, [1, *tok.encode("user\nhi")])
    with pytest.raises(Exception) as info:
        ctl.mid_process(0, 0, tok.encode("[1]"))
    assert "does not continue valid JSON" in f"{info.value}\n{getattr(info.value, 'log_tail', '')}"


def _masks_of_walk(ctl, tok, ids: list[int], first: bool) -> list[bytes]:
    """The mask before each token of `ids`, back at the start first; the walk must end there."""
    branches = ctl.mid_process(0, 0, [tok.bos_token_id]) if first else ctl.mid_process(0, len(ids), [])
    masks = []
    for t in ids:
        [b] = branches
        masks.append(b.mask.tobytes())
        assert allowed(b.mask, t)
        branches = ctl.mid_process(0, 0, [t])
    assert branches == []   # complete: nothing can follow
    return masks


@pytest.mark.model
def test_cached_answers_equal_computed_ones_past_the_cache_bounds(rt, module, tok):
    # The token layer keeps answers by position and each distinct mask once, up to bounds
    # (guest-sdk/rudder_constraint.c: 2048 positions, 128 masks), then starts over. This walk
    # meets more of both: 200 keys of their own (one mask each, no ff) and a 2100-item bounded
    # array (a position per item). Walked again in the same request, every step is served from
    # the cache or computed after it started over; each must be the first walk's mask.
    r = random.Random(5)
    keys = ["".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(4, 9))) for _ in range(200)]
    keys = list(dict.fromkeys(keys))
    schema = {"type": "object", "x-rudder-ff": False, "required": [*keys, "list"], "additionalProperties": False,
              "properties": {**{k: {"type": "integer"} for k in keys},
                             "list": {"type": "array", "maxItems": 5000, "items": {"type": "integer"}}}}
    doc = {**{k: i for i, k in enumerate(keys)}, "list": [r.randint(0, 9) for _ in range(2100)]}
    ids = tok.encode(compact(doc))
    ctl = rt.start(module, json.dumps(schema))
    try:
        first = _masks_of_walk(ctl, tok, ids, first=True)
        assert len(set(first)) > 128   # (the walk does go past the mask bound)
        again = _masks_of_walk(ctl, tok, ids, first=False)
        assert again == first
    finally:
        ctl.close()


# ---------------------------------------------------------------------------- (b) sampled outputs


@pytest.mark.parametrize("name", ["person", "nested", "recursive", "formats", "extras", "any"])
def test_tiny_model_outputs_validate(name):
    """Random weights sample wildly: every output under the constraint still validates."""
    from rudder import SamplingParams

    llm = _tiny()
    schema = SCHEMAS[name]
    params = [SamplingParams(max_tokens=300, seed=s, temperature=1.0) for s in range(8)]
    outs = llm.generate(["Write JSON."] * len(params), params, controller="json", controller_arg=json.dumps(schema))
    for out in outs:
        assert out.error is None, out.error
        if out.finish_reason == "length":
            continue   # cut off: nothing to validate (random weights ramble inside strings)
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
    assert sum(o.finish_reason != "length" for o in outs) >= 1   # not vacuous


_TINY = None


def _tiny():
    global _TINY
    if _TINY is None:
        from rudder import LLM

        _TINY = LLM("tiny")
    return _TINY


@pytest.fixture(scope="module")
def smollm2_llm():
    from rudder import LLM

    return LLM("smollm2")


@pytest.mark.model
@pytest.mark.parametrize("name", ["person", "nested", "formats", "recursive"])
def test_smollm2_outputs_validate(smollm2_llm, name):
    from rudder import SamplingParams

    schema = SCHEMAS[name]
    prompt = "Describe a person (or a thing) as JSON matching this schema: " + json.dumps(schema)
    # A tree ends within 160 tokens for about one seed in four (5 of seeds 0-15, then 4 with the
    # paired KV cache's arithmetic): 16 seeds, so that one finishing is not a matter of luck.
    seeds = 16 if name == "recursive" else 4
    params = [SamplingParams(max_tokens=160, seed=s, temperature=0.8) for s in range(seeds)]
    outs = smollm2_llm.generate([prompt] * len(params), params, chat=True, controller="json", controller_arg=json.dumps(schema))
    done = 0
    for out in outs:
        assert out.error is None, out.error
        if out.finish_reason == "length":
            continue
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
        done += 1
    assert done >= 1, [o.text for o in outs]   # not vacuous (a small model may ramble in a tree)


# ---------------------------------------------------------------------------- (e) the CLI


@pytest.mark.model
def test_cli_gives_valid_json(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(PERSON))
    for seed in (1, 2, 3):
        proc = subprocess.run([sys.executable, "-m", "rudder.cli", "run", "--controller", "json", "--arg", f"@{path}",
                               "--chat", "--seed", str(seed), "--max-tokens", "120", "--temperature", "0.7",
                               "Invent a person who lives in Paris."],
                              capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        jsonschema.validate(json.loads(proc.stdout), PERSON, format_checker=jsonschema.FormatChecker())


# ---------------------------------------------------------------------------- no dead ends


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_never_dead_end(name):
    """Any token the mask allows leads somewhere: random walks (favouring brackets, to reach
    the nesting limit) never meet an empty mask, and what completes validates. The byte-level
    test tokenizer: one byte per token, every state is visited."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_controllers import run_request, text_of

    from rudder.tokenizer import Tokenizer

    tok = Tokenizer.byte_level(512)
    runtime = ControllerRuntime(tok, Limits(mid_process_ms=2000))
    module = runtime.load(builtin_controller("json"))
    favour = [tok.encode(c)[0] for c in '{[",:']
    for seed in range(8):
        r = random.Random(seed)

        def pick(allowed, seq):
            present = set(allowed.tolist())
            for t in favour:
                if t in present and r.random() < (0.8 if seed % 2 else 0.1):
                    return t
            return allowed[r.randrange(len(allowed))]

        [s] = run_request(runtime, module, json.dumps(SCHEMAS[name]), [tok.bos_token_id], pick, max_steps=3000, max_tokens=1500)
        if s.finish != "length":
            jsonschema.validate(json.loads(text_of(tok, s.generated)), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
    runtime.close()


def test_nesting_limit(any_rt, any_module, any_tok):
    """31 levels of arrays are allowed (docs/json-schema.md); the 32nd opening bracket is refused,
    and so is nothing before it."""
    Drive(any_rt, any_module, any_tok, {}, "[" * 31 + "]" * 31).run().ctl.close()
    with pytest.raises(Refused) as info:
        Drive(any_rt, any_module, any_tok, {}, "[" * 40 + "]" * 40).run()
    assert info.value.lo <= 31 < info.value.hi, str(info.value)
