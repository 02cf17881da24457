"""The JSON Schema engine's options (docs/json-schema.md, "Options"): declared properties by
default (`"x-rudder-undeclared": "forbid"`), the specification's reading a switch away
(`"allow"`), no key twice in one object (both modes), and `"x-rudder-strict": true`.

Every case runs in the product's sandbox (rudder.controller.ControllerRuntime) on the
byte-level test tokenizer, where a refusal names its byte (tests/test_json_schema.py's Drive),
or on small BPE vocabularies built here, whose tokens span the bytes that end a key.
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.build import CONTROLLERS_DIR, builtin_controller, compile_command
from rudder.paths import zig_cache_dir
from rudder.tokenizer import Tokenizer
from test_controllers import run_request, text_of
from test_json_schema import Drive, Refused, _runtime, allowed, compact

ALLOW = {"x-rudder-undeclared": "allow"}


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.byte_level(512)


@pytest.fixture(scope="module")
def rt(byte_tok):
    runtime = _runtime(byte_tok)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def module(rt):
    return rt.load(builtin_controller("json"))


def _writes(rt, module, tok, schema, doc: str) -> bool:
    """Does the controller let `doc` be written to its end?"""
    try:
        Drive(rt, module, tok, schema, doc).run().ctl.close()
        return True
    except Refused:
        return False


def _masks(rt, module, tok, schema, prefix: str):
    """The answer after `prefix` (written one byte at a time): (allowed bytes, forced bytes)."""
    ctl = rt.start(module, json.dumps(schema))
    try:
        branches = ctl.mid_process(0, 0, [tok.bos_token_id])
        for t in tok.encode(prefix):
            branches = ctl.mid_process(0, 0, [t])
        [b] = branches
        if b.mask is None:
            return set(), b"".join(tok.token_bytes[t] for t in b.ff[0])
        mask = np.asarray(b.mask)
        return {tok.token_bytes[t] for t in range(tok.vocab_size) if allowed(mask, t)}, b""
    finally:
        ctl.close()


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key twice: {keys}"
    return dict(pairs)


# ---------------------------------------------------------------------------- declared properties

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "nick": {"type": "string"}},
          "required": ["name", "age"]}   # (pydantic's shape: no additionalProperties)

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": ["string", "null"]}}, "required": ["street"]}

NESTED = {"type": "object", "properties": {"who": PERSON, "home": {"$ref": "#/$defs/address"},
                                           "past": {"type": "array", "items": {"$ref": "#/$defs/address"}}},
          "required": ["who"], "$defs": {"address": ADDRESS}}

MERGED = {"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "string"}}}]}

UNION = {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}, "required": ["kind", "r"]},
                   {"type": "object", "properties": {"kind": {"const": "box"}, "w": {"type": "number"}}, "required": ["kind", "w"]}]}

CONDITIONAL = {"type": "object", "properties": {"t": {"enum": ["a", "b"]}},
               "if": {"properties": {"t": {"const": "a"}}}, "then": {"properties": {"n": {"type": "integer"}}, "required": ["n"]}}

#: (name, schema, document, written in forbid mode): every document is valid JSON Schema-wise
#: (checked), and in "allow" mode every one is written.
FORBID_CASES = [
    ("declared keys", PERSON, '{"name":"Al","age":3,"nick":"A"}', True),
    ("an undeclared key", PERSON, '{"name":"Al","age":3,"x":1}', False),
    ("an undeclared key first", PERSON, '{"x":1,"name":"Al","age":3}', False),
    ("nested", NESTED, '{"who":{"name":"Al","age":3},"home":{"street":"s"},"past":[{"street":"t","zip":null}]}', True),
    ("nested, an undeclared key inside", NESTED, '{"who":{"name":"Al","age":3,"x":1}}', False),
    ("a $ref'd object, an undeclared key", NESTED, '{"who":{"name":"Al","age":3},"home":{"street":"s","x":1}}', False),
    ("in an array item", NESTED, '{"who":{"name":"Al","age":3},"past":[{"street":"t","x":1}]}', False),
    ("allOf keeps both parts' keys", MERGED, '{"a":1,"b":"x"}', True),
    ("allOf, another key", MERGED, '{"a":1,"c":"x"}', False),
    ("anyOf alternatives", UNION, '{"kind":"box","w":2}', True),
    ("anyOf alternatives, a key of the other one", UNION, '{"kind":"box","w":2,"r":1}', False),
    ("if/then: keys they name", CONDITIONAL, '{"t":"a","n":1}', True),
    ("if/then: other keys", CONDITIONAL, '{"t":"b","z":1}', False),
    ("a required name not in properties", {"type": "object", "properties": {"a": {}}, "required": ["b"]}, '{"a":1,"b":[2]}', True),
    ("patternProperties", {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x_": {"type": "integer"}}},
     '{"a":1,"x_1":2,"x_2":3}', True),
    ("patternProperties, a key outside", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}, '{"x_1":2,"y":3}', False),
    ("type object: any key", {"type": "object"}, '{"a":1,"b":{"c":[]}}', True),
    ("no schema: any key", {}, '{"a":1,"b":{"c":[]}}', True),
    ("additionalProperties: true", {**PERSON, "additionalProperties": True}, '{"name":"Al","age":3,"x":1}', True),
    ("additionalProperties: a schema", {**PERSON, "additionalProperties": {"type": "integer"}}, '{"name":"Al","age":3,"x":1}', True),
    ("additionalProperties in one part of allOf", {"allOf": [MERGED, {"additionalProperties": True}]}, '{"a":1,"z":0}', True),
    ("unevaluatedProperties: a schema", {**PERSON, "unevaluatedProperties": {"type": "integer"}}, '{"name":"Al","age":3,"x":1}', True),
    ("minProperties past the names", {"type": "object", "properties": {"a": {}}, "minProperties": 2}, '{"a":1,"b":2}', True),
    ("prefixItems: ends after the prefix", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1,"a",3]', False),
    ("prefixItems: the prefix", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1,"a"]', True),
    ("prefixItems with items", {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, '[1,"a","b"]', True),
    ("prefixItems, and items in another part of allOf", {"allOf": [{"prefixItems": [{}]}, {"items": {"type": "string"}}]},
     '["a","b"]', True),
    ("draft 4 items list", {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array", "items": [{"type": "integer"}]}, "[1,2]", False),
    ("draft 4 items list with additionalItems", {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array",
                                                 "items": [{"type": "integer"}], "additionalItems": {"type": "integer"}}, "[1,2]", True),
    ("minItems past the prefix", {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "[1,2]", True),
    ("an array with neither", {"type": "array"}, '[1,"a",[{}]]', True),
    ("an enum lists its objects whole", {"properties": {"a": {}}, "enum": [{"a": 1, "b": 2}]}, '{"a":1,"b":2}', True),
]


@pytest.mark.parametrize("name,schema,doc,written", FORBID_CASES, ids=[c[0] for c in FORBID_CASES])
def test_declared_properties_by_default(rt, module, byte_tok, name, schema, doc, written):
    assert jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(doc))
    assert _writes(rt, module, byte_tok, schema, doc) == written
    assert _writes(rt, module, byte_tok, {**schema, "x-rudder-undeclared": "forbid"}, doc) == written
    assert _writes(rt, module, byte_tok, {**schema, **ALLOW}, doc)   # the specification's reading


def test_after_the_last_declared_key_only_the_end_is_offered(rt, module, byte_tok):
    allowed_bytes, forced = _masks(rt, module, byte_tok, PERSON, '{"name":"Al","age":3,"nick":"A"')
    assert (allowed_bytes, forced) == (set(), b"}")
    allowed_bytes, _ = _masks(rt, module, byte_tok, {**PERSON, **ALLOW}, '{"name":"Al","age":3,"nick":"A"')
    assert {b",", b"}"} <= allowed_bytes


#: What is generated in forbid mode, as JSON Schema says it with every default written out.
CLOSED = {
    "person": (PERSON, {**PERSON, "additionalProperties": False}),
    "nested": (NESTED, {**NESTED, "additionalProperties": False,
                        "properties": {**NESTED["properties"], "who": {**PERSON, "additionalProperties": False}},
                        "$defs": {"address": {**ADDRESS, "additionalProperties": False}}}),
    "merged": (MERGED, {**MERGED, "unevaluatedProperties": False}),
    "union": (UNION, {"anyOf": [{**a, "additionalProperties": False} for a in UNION["anyOf"]]}),
    "tuple": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]},
              {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False}),
}


@pytest.mark.parametrize("name", list(CLOSED))
def test_random_walks_write_only_declared_keys(name):
    """Whatever the mask lets a random walk write validates against the schema with
    `additionalProperties: false` (or `items: false`) written out: an undeclared key is never
    offered, at any position. The byte-level tokenizer: every state is visited."""
    schema, closed = CLOSED[name]
    tok = Tokenizer.byte_level(512)
    runtime = ControllerRuntime(tok, Limits(mid_process_ms=2000))
    module = runtime.load(builtin_controller("json"))
    favour = [tok.encode(c)[0] for c in ',"{']
    done = 0
    for seed in range(8):
        r = random.Random(seed)

        def pick(allowed_ids, seq):
            present = set(allowed_ids.tolist())
            for t in favour:
                if t in present and r.random() < 0.5:
                    return t
            return allowed_ids[r.randrange(len(allowed_ids))]

        [s] = run_request(runtime, module, json.dumps(schema), [tok.bos_token_id], pick, max_steps=1500, max_tokens=400)
        if s.finish != "length":
            jsonschema.validate(json.loads(text_of(tok, s.generated)), closed)
            done += 1
    runtime.close()
    assert done >= 4


@pytest.mark.parametrize("value,message", [
    ('"open"', 'x-rudder-undeclared must be "forbid" or "allow" at #'),
    ("false", 'x-rudder-undeclared must be "forbid" or "allow" at #'),
])
def test_a_malformed_undeclared_option_is_refused(byte_tok, value, message):
    runtime = _runtime(byte_tok)
    try:
        with pytest.raises(ControllerError) as info:
            runtime.start(runtime.load(builtin_controller("json")), '{"type":"object","x-rudder-undeclared":' + value + "}")
        assert message in f"{info.value}\n{info.value.log_tail}"
    finally:
        runtime.close()


# ---------------------------------------------------------------------------- no key twice

EXTRAS = {"type": "object", "additionalProperties": True}

#: (schema, document, what comes before the closing quote refused, or None: written)
DUPLICATE_CASES = [
    (EXTRAS, '{"a":1,"a":2}', '{"a":1,"a'),
    (EXTRAS, '{"a":1,"b":2,"a":3}', '{"a":1,"b":2,"a'),
    (EXTRAS, '{"a":1,"ab":2,"b":3}', None),   # (a key that starts like a written one)
    (EXTRAS, '{"":1,"":2}', '{"":1,"'),
    (EXTRAS, '{"a\\"b":1,"a\\"b":2}', '{"a\\"b":1,"a\\"b'),   # escapes: the decoded key counts
    (EXTRAS, '{"a":{"a":1,"b":{"a":2}},"b":[{"a":1},{"a":1}]}', None),   # each object its own keys
    (EXTRAS, '{"a":{"x":1,"y":2},"b":{"x":1},"a":3}', '{"a":{"x":1,"y":2},"b":{"x":1},"a'),   # (the nested objects' keys are gone)
    ({"type": "array", "items": EXTRAS}, '[{"x":1,"y":2},{"x":1,"y":2}]', None),
    ({"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
     '{"id":1,"n":2,"n":3}', '{"id":1,"n":2,"n'),
    ({"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": True}, '{"id":1,"id":2}', '{"id":1,"id'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"x1":1,"x2":2,"x1":3}', '{"x1":1,"x2":2,"x1'),
    ({"type": "object", "required": ["r"], "additionalProperties": True}, '{"r":1,"r":2}', '{"r":1,"r'),
    (EXTRAS | ALLOW, '{"a":1,"a":2}', '{"a":1,"a'),   # in both modes
]


@pytest.mark.parametrize("schema,doc,before", DUPLICATE_CASES, ids=[c[1] for c in DUPLICATE_CASES])
def test_no_key_twice(rt, module, byte_tok, schema, doc, before):
    """A key equal to one written in the same object is refused at its closing quote (a
    declared one, an extra one, a key matching a pattern); keys of other objects do not count."""
    if before is None:
        json.loads(doc, object_pairs_hook=_unique_keys)
        Drive(rt, module, byte_tok, schema, doc).run().ctl.close()
        return
    assert doc.startswith(before) and doc[len(before)] == '"'
    with pytest.raises(Refused) as info:
        Drive(rt, module, byte_tok, schema, doc).run()
    assert info.value.lo == len(before), str(info.value)


def test_the_closing_quote_of_a_written_key_is_masked(rt, module, byte_tok):
    allowed_bytes, _ = _masks(rt, module, byte_tok, EXTRAS, '{"a":1,"a')
    assert b'"' not in allowed_bytes and b"b" in allowed_bytes
    allowed_bytes, _ = _masks(rt, module, byte_tok, EXTRAS, '{"a":1,"b')
    assert b'"' in allowed_bytes


RESTRICTED = {
    "two names by pattern": {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}},
    "one character": {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": 1, "pattern": "^[xyz]$"}},
    "one name, then extras": {"type": "object", "patternProperties": {"^k$": {"type": "integer"}}, "additionalProperties": {"type": "boolean"},
                              "propertyNames": {"maxLength": 2}},
    "at least two": {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "minProperties": 2},
    "one name or endless ones": {"type": "object", "patternProperties": {"^(ab|x+)$": {"type": "integer"}}},
}


def test_no_more_keys_once_every_name_is_written(rt, module, byte_tok):
    """Extra keys limited to a few names: once they are all written, no key is offered (the
    comma would lead nowhere), and a key that could only end as a written one is not begun."""
    schema = RESTRICTED["two names by pattern"]
    allowed_bytes, _ = _masks(rt, module, byte_tok, schema, '{"a":1,"b":2')
    assert b"," not in allowed_bytes and b"}" in allowed_bytes
    _, forced = _masks(rt, module, byte_tok, schema, '{"a":1,')
    assert forced.startswith(b'"b"')
    schema = {**RESTRICTED["one name or endless ones"], "x-rudder-ff": False}   # (endless names need no search; "ab" does)
    allowed_bytes, _ = _masks(rt, module, byte_tok, schema, '{"ab":1,"')
    assert allowed_bytes == {b"x"}
    allowed_bytes, _ = _masks(rt, module, byte_tok, schema, '{"x":1,"')
    assert allowed_bytes == {b"a", b"x"}
    allowed_bytes, _ = _masks(rt, module, byte_tok, schema, '{"x":1,"x')
    assert allowed_bytes == {b"x"}


@pytest.mark.parametrize("name", list(RESTRICTED))
def test_random_walks_never_dead_end_nor_repeat_a_key(name):
    schema = RESTRICTED[name]
    tok = Tokenizer.byte_level(512)
    runtime = ControllerRuntime(tok, Limits(mid_process_ms=2000))
    module = runtime.load(builtin_controller("json"))
    favour = [tok.encode(c)[0] for c in ',"\\']
    done = 0
    for seed in range(10):
        r = random.Random(seed)

        def pick(allowed_ids, seq):
            present = set(allowed_ids.tolist())
            for t in favour:
                if t in present and r.random() < 0.4:
                    return t
            return allowed_ids[r.randrange(len(allowed_ids))]

        [s] = run_request(runtime, module, json.dumps(schema), [tok.bos_token_id], pick, max_steps=600, max_tokens=300)
        if s.finish != "length":
            doc = json.loads(text_of(tok, s.generated), object_pairs_hook=_unique_keys)
            jsonschema.validate(doc, schema)
            done += 1
    runtime.close()
    assert done >= 5


@pytest.fixture(scope="module")
def small_table_module(rt, tmp_path_factory):
    """The json controller built with a key table of 64 nodes (the bound is a build constant)."""
    out = tmp_path_factory.mktemp("json-small-table") / "json.wasm"
    cmd = compile_command([CONTROLLERS_DIR / "json.c"], out)
    cmd.insert(cmd.index("cc") + 1, "-DRUDDER_JS_MAX_KEY_NODES=64")
    cache = str(zig_cache_dir())
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "ZIG_GLOBAL_CACHE_DIR": cache, "ZIG_LOCAL_CACHE_DIR": cache})
    return rt.load(out)


def test_past_the_key_table_bound_the_request_fails_clearly(rt, small_table_module, byte_tok):
    """Each extra key written is a node of the request's key table (and so is each key a mask
    walk ends). Past the bound the request fails with a message, never writes a key twice."""
    few = compact({f"k{i}": i for i in range(10)})
    Drive(rt, small_table_module, byte_tok, EXTRAS, few).run().ctl.close()
    many = compact({f"k{i}": i for i in range(100)})
    with pytest.raises(ControllerError) as info:
        Drive(rt, small_table_module, byte_tok, EXTRAS, many).run()
    assert "json: too many distinct extra keys in one request" in f"{info.value}\n{info.value.log_tail}"


# ---------------------------------------------------------------------------- the answer cache

def bpe(words: list[str]) -> Tokenizer:
    """A byte-level BPE whose merges make each of `words` one token."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from rudder.tokenizer import byte_to_unicode

    b2u = byte_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in b2u.items()})
    merges = []
    for w in words:
        u = "".join(b2u[b] for b in w.encode())
        cur = u[0]
        for ch in u[1:]:
            if cur + ch not in vocab:
                vocab[cur + ch] = len(vocab)
                merges.append((cur, ch))
            cur += ch
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(tok, eos_token_id=2, bos_token_id=1, vocab_size=len(vocab) + 5)


#: Tokens that end a key in several ways (`a"`, `.":`), write a key whole (`""`), or reach a
#: later key within one token (`","a"`: then the keys written are part of every position).
CACHE_TOKENIZERS = {"ends": ['":', '",', '"}', '""', '."', 'a"', 'ab"', '":"', '"},{"', "ab", "abc"],
                    "reaches": ['":', '","a"', '","b"', '":1,"a"', "ab"]}


_keys = st.sampled_from(["a", "ab", "abc", "b", "", "a.", "x"])
_values = st.recursive(st.sampled_from([1, "ab", None]), lambda inner: st.dictionaries(_keys, inner, max_size=4), max_leaves=8)
_docs = st.dictionaries(_keys, _values, min_size=1, max_size=6)


@pytest.mark.parametrize("name", list(CACHE_TOKENIZERS))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=_docs, second=_docs)
def test_cached_answers_are_the_answers(name, first, second):
    """Positions leave out the keys written where the answer cannot depend on them (values,
    keys of objects that wrote none), and show which endings would repeat a key elsewhere.
    Walking a document after another in the same request (answers from the cache) gives the
    masks a fresh request computes."""
    runtime, module = _cache_runtime(name)
    tok = runtime.tokenizer
    schema = json.dumps({"type": "object", "additionalProperties": True, "x-rudder-ff": False})
    one, two = tok.encode(compact(first)), tok.encode(compact(second))
    warm = runtime.start(module, schema, Limits(max_ff_tokens=0))
    cold = runtime.start(module, schema, Limits(max_ff_tokens=0))
    try:
        branches = warm.mid_process(0, 0, [tok.bos_token_id])
        for t in one:
            branches = warm.mid_process(0, 0, [t])
        branches = warm.mid_process(0, len(one), [])   # back to the start
        got = []
        for t in two:
            [b] = branches
            got.append(np.asarray(b.mask).tobytes())
            assert allowed(b.mask, t)
            branches = warm.mid_process(0, 0, [t])
        branches = cold.mid_process(0, 0, [tok.bos_token_id])
        for k, t in enumerate(two):
            [b] = branches
            assert np.asarray(b.mask).tobytes() == got[k], (compact(first), compact(second), tok.decode(two[:k]))
            branches = cold.mid_process(0, 0, [t])
    finally:
        warm.close()
        cold.close()


_CACHE_RT: dict = {}


def _cache_runtime(name):
    if name not in _CACHE_RT:
        runtime = ControllerRuntime(bpe(CACHE_TOKENIZERS[name]), Limits(mid_process_ms=2000))
        _CACHE_RT[name] = (runtime, runtime.load(builtin_controller("json")))
    return _CACHE_RT[name]


def test_a_token_that_reaches_a_later_key_sees_the_keys_written():
    """`","a"` ends a string value and writes the key a whole: refused where a is written,
    allowed where it is not, at otherwise equal positions of one request."""
    runtime, module = _cache_runtime("reaches")
    tok = runtime.tokenizer
    token = tok.token_bytes.index(b'","a"')
    one_byte = {b: i for i, b in enumerate(tok.token_bytes) if len(b) == 1}
    ctl = runtime.start(module, json.dumps(EXTRAS), Limits(max_ff_tokens=0))
    try:
        ctl.mid_process(0, 0, [tok.bos_token_id])
        [b] = ctl.mid_process(0, 0, [one_byte[bytes([c])] for c in b'{"b":"x'])
        assert allowed(b.mask, token)
        [b] = ctl.mid_process(0, 7, [one_byte[bytes([c])] for c in b'{"a":"x'])   # (7 tokens back)
        assert not allowed(b.mask, token)
        [b] = ctl.mid_process(0, 7, [one_byte[bytes([c])] for c in b'{"c":"x'])
        assert allowed(b.mask, token)
    finally:
        ctl.close()


# ---------------------------------------------------------------------------- strict

STRICT = {"x-rudder-strict": True}


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     'strict: "uniqueItems" is not enforced (an array with duplicates could be generated) at #/properties/tags'),
    ({"type": "object", "properties": {"n": {"type": "integer", "format": "int64"}}},
     'strict: "format" "int64" is not enforced (not one of the formats docs/json-schema.md lists) at #/properties/n'),
    ({"type": "object", "properties": {"x": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}},
     'strict: "oneOf" alternatives may overlap (neither their types nor a required const/enum key tells them apart) at #/properties/x'),
    ({"$defs": {"a": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]},
                "b": {"type": "object", "properties": {"k": {"enum": ["y", "z"]}}, "required": ["k"]}},
      "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
     'strict: "oneOf" alternatives may overlap'),   # (tags that share "y")
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object", "properties": {"k": {"const": "b"}}}]},
     'strict: "oneOf" alternatives may overlap'),   # (the tag is not required: {} matches both)
    ({"type": "string", **ALLOW}, 'x-rudder-undeclared "allow" contradicts x-rudder-strict (strict generates the declared properties only) at #'),
    ({"x-rudder-strict": "yes"}, "x-rudder-strict must be true or false at #"),
])
def test_strict_refuses_what_it_would_relax(byte_tok, schema, message):
    runtime = _runtime(byte_tok)
    try:
        with pytest.raises(ControllerError) as info:
            runtime.start(runtime.load(builtin_controller("json")), json.dumps({**STRICT, **schema}))
        assert info.value.kind == "start"
        assert "json: " + message in f"{info.value}\n{info.value.log_tail}"
    finally:
        runtime.close()


@pytest.mark.parametrize("schema,doc", [
    ({"type": "array", "uniqueItems": True, "maxItems": 1}, "[1]"),   # (at most one item: nothing to repeat)
    ({"type": "array", "uniqueItems": False}, "[1,1]"),
    ({"type": "string", "format": "date"}, '"2024-02-28"'),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, "3"),
    ({"oneOf": [{"const": "a"}, {"enum": ["b", 3]}]}, "3"),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"],   # a tag declared beside, narrowed in each
      "oneOf": [{"properties": {"k": {"const": "a"}, "x": {"type": "integer"}}}, {"properties": {"k": {"const": "b"}}}]},
     '{"k":"a","x":1}'),
])
def test_strict_takes_what_it_can_honour(rt, module, byte_tok, schema, doc):
    Drive(rt, module, byte_tok, {**STRICT, **schema}, doc).run().ctl.close()


def _pydantic_schema() -> dict:
    from enum import Enum
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        bark: float

    class Address(BaseModel):
        street: str
        zip: Optional[str] = None

    class Person(BaseModel):
        name: str
        age: int = Field(ge=0)
        color: Color
        home: Address
        past: list[Address]
        pet: Union[Cat, Dog] = Field(discriminator="pet_type")
        nick: Optional[str] = None

    return Person.model_json_schema()


def test_a_pydantic_models_schema_compiles_in_strict_mode(rt, module, byte_tok):
    """A nested model, Optional (anyOf with null), an enum, a list of models and a
    discriminated union (oneOf of $refs tagged by a const): honoured whole in strict mode."""
    schema = {**_pydantic_schema(), **STRICT}
    assert "oneOf" in json.dumps(schema)
    doc = '{"name":"Al","age":3,"color":"red","home":{"street":"x","zip":null},"past":[{"street":"y"}],"pet":{"pet_type":"dog","bark":1.5}}'
    jsonschema.validate(json.loads(doc), schema)
    Drive(rt, module, byte_tok, schema, doc).run().ctl.close()
    for bad in ['{"name":"Al","x":1', '{"name":"Al","age":3,"color":"red","home":{"street":"x","y":1']:
        assert not _writes(rt, module, byte_tok, schema, bad + "}")


# ---------------------------------------------------------------------------- fixed on the way

def test_contains_counts_object_items(rt, module, byte_tok):
    schema = {"type": "array", "items": {"type": "object"}, "contains": {"type": "object", "required": ["a"]}}
    Drive(rt, module, byte_tok, schema, '[{"b":1},{"a":1}]').run().ctl.close()
    assert not _writes(rt, module, byte_tok, schema, '[{"b":1}]')
