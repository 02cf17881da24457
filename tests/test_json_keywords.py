"""The JSON Schema keywords of docs/json-schema.md, one case at a time: each schema with valid
documents (every token allowed, written out as a model would: tests/test_json_schema.py's
Drive) and invalid ones (refused before their end). Then the shapes tool calling produces
(unions of tools, tagged unions, nullable objects, allOf merges, recursive refs) as property
tests: random valid documents are allowed, and what a random-weights model writes under them
validates with `jsonschema`; and end to end on SmolLM2 (`model`).

Every case runs in the product's sandbox (rudder.controller.ControllerRuntime) on the
byte-level test tokenizer, where a refusal names its byte.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rudder.controller.build import builtin_controller
from rudder.tokenizer import Tokenizer
from test_json_schema import Drive, Refused, _runtime, compact

TOOLS = {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"},
                                      "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                    "required": ["city"], "additionalProperties": False}},
     "required": ["name", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "get_time"},
                                      "arguments": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                    "required": ["zone"], "additionalProperties": False}},
     "required": ["name", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "get_news"},
                                      "arguments": {"type": "object", "properties": {"topic": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                                                    "required": ["topic", "limit"], "additionalProperties": False}},
     "required": ["name", "arguments"], "additionalProperties": False},
]}

# BFCL's "call one of these" shape: each tool an object keyed by its name
TOOLS_BY_KEY = {"anyOf": [
    {"type": "object", "properties": {"math.area": {"type": "object", "properties": {"radius": {"type": "number"}}, "required": ["radius"], "additionalProperties": False}},
     "required": ["math.area"], "additionalProperties": False},
    {"type": "object", "properties": {"math.area_box": {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"}}, "required": ["w", "h"], "additionalProperties": False}},
     "required": ["math.area_box"], "additionalProperties": False},
]}

TAGGED = {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}},
     "required": ["kind", "radius"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "exclusiveMinimum": 0}},
     "required": ["kind", "side"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"}, "h": {"type": "integer"}},
     "required": ["kind", "w", "h"], "additionalProperties": False},
]}


def _tag(kind, **props):   # one alternative of a tagged union: its tag first
    return {"type": "object", "properties": {"kind": kind, **props}, "required": ["kind", *props], "additionalProperties": False}


def _many_tools(n: int) -> dict:
    """n tools named t0..t{n-1} (t1 is a prefix of t10..t19), with typed arguments; one more
    tool whose name is an enum that overlaps another's (t3: either one's arguments)."""
    kinds = [{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}, {"enum": ["lo", "hi"]}]
    alts = [{"type": "object", "properties": {"name": {"const": f"t{i}"},
                                              "arguments": {"type": "object", "properties": {f"a{i}": kinds[i % 4]},
                                                            "required": [f"a{i}"], "additionalProperties": False}},
             "required": ["name", "arguments"], "additionalProperties": False} for i in range(n)]
    alts.append({"type": "object", "properties": {"name": {"enum": ["t3", "other"]}, "arguments": {"type": "null"}},
                 "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": alts}


MANY_TOOLS = _many_tools(40)

NULLABLE = {"type": "object", "properties": {
    "owner": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
    "backup": {"type": ["object", "null"], "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}},
    "required": ["owner", "backup"], "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name"], "additionalProperties": False}}}

ALL_OF = {"allOf": [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0}}, "required": ["id"]},
    {"properties": {"id": {"maximum": 99}, "tags": {"type": "array", "items": {"type": "string"}}}},
    {"$ref": "#/$defs/named"}],
    "unevaluatedProperties": False,
    "$defs": {"named": {"properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]}}}

RECURSIVE = {"$ref": "#/$defs/tree", "$defs": {"tree": {
    "type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2}},
    "required": ["v"], "additionalProperties": False}}}

LINKED = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["v", "next"], "additionalProperties": False}

#: name -> (schema, valid documents, invalid documents)
ESCAPED_KEYS = {"type": "object", "properties": {'a"b': {"type": "integer"}}, "additionalProperties": {"type": "string"},
                "patternProperties": {"^k\\\\": {"type": "boolean"}}, "propertyNames": {"maxLength": 4}}

CASES = {
    # (extra keys: in the specification's reading, "x-rudder-undeclared": "allow"; tests/test_json_undeclared.py has the default)
    "annotations are ignored": (
        {"x-rudder-undeclared": "allow", "type": "object", "id": "x", "readonly": True, "example": {"a": 1}, "links": [], "self": {"vendor": "v"},
         "_format": "foo", "esriDocumentation": {}, "x-anything": 1, "format": "int32", "contentMediaType": "text/plain",
         "properties": {"a": {"type": "integer", "title": "A", "$comment": "c"}}, "required": ["a"]},
        ['{"a":1}', '{"a":1,"b":"extra keys are allowed"}'], ['{"a":"1"}', "{}"]),
    # keys and enum values that must be escaped when the engine writes them (a quote, a backslash)
    "keys and literals with escapes": (
        {"type": "object", "properties": {'say "hi"': {"type": "integer"}, "a\\b": {"enum": [{"p": "c:\\d"}, ["\""]]}},
         "required": ['say "hi"', "a\\b"], "additionalProperties": False},
        ['{"say \\"hi\\"":1,"a\\\\b":{"p":"c:\\\\d"}}', '{"say \\"hi\\"":2,"a\\\\b":["\\""]}'],
        ['{"say \\"hi\\"":1,"a\\b":{"p":"c:\\\\d"}}', '{"say \\"hi\\"":1,"a\\\\b":{"p":"c:d"}}']),
    # extra keys may hold a quote or a backslash, escaped as a declared key is written; patterns and
    # lengths see the unescaped characters
    "extra keys with escapes": (ESCAPED_KEYS,
        ['{"a\\"b":1,"x\\"y":"s","k\\\\":true}', '{"\\\\\\"":"two characters"}'],
        ['{"a\\"b":"declared: an integer"}', '{"k\\\\z":"a pattern key: a boolean"}',
         '{"\\\\\\"\\\\\\"x":"five characters"}']),
    "tool call union": (TOOLS, ['{"name":"get_weather","arguments":{"city":"Oslo"}}', '{"name":"get_news","arguments":{"topic":"x","limit":3}}'],
                        ['{"name":"get_time","arguments":{"city":"Oslo"}}', '{"name":"get_news","arguments":{"topic":"x","limit":11}}',
                         '{"name":"get_fax","arguments":{}}']),
    "tools keyed by name": (TOOLS_BY_KEY, ['{"math.area":{"radius":2.5}}', '{"math.area_box":{"w":1,"h":2}}'],
                            ['{"math.area":{"w":1}}', '{"math.area_box":{"w":1}}']),
    "tagged union": (TAGGED, ['{"kind":"circle","radius":1.5}', '{"kind":"rect","w":2,"h":3}'],
                     ['{"kind":"circle","side":1}', '{"kind":"rect","w":2.5,"h":3}', '{"kind":"square","side":0}']),
    "many tools": (MANY_TOOLS, ['{"name":"t1","arguments":{"a1":5}}', '{"name":"t12","arguments":{"a12":"x"}}',
                                '{"name":"t3","arguments":{"a3":"hi"}}', '{"name":"t3","arguments":null}', '{"name":"other","arguments":null}'],
                   ['{"name":"t1","arguments":{"a12":"x"}}', '{"name":"t12","arguments":{"a1":5}}', '{"name":"t4","arguments":null}',
                    '{"name":"t40","arguments":{}}', '{"name":"t","arguments":{}}']),
    "tags that overlap": ({"anyOf": [_tag({"const": "a"}, x={"type": "integer"}), _tag({"enum": ["a", "b"]}, y={"type": "string"})]},
                          ['{"kind":"a","x":1}', '{"kind":"a","y":"s"}', '{"kind":"b","y":"s"}'], ['{"kind":"b","x":1}', '{"kind":"c","y":"s"}']),
    "tags that are prefixes": ({"anyOf": [_tag({"const": "get"}, x={"type": "integer"}), _tag({"const": "get_all"}, y={"type": "integer"})]},
                               ['{"kind":"get","x":1}', '{"kind":"get_all","y":2}'], ['{"kind":"get","y":1}', '{"kind":"ge","x":1}']),
    "a tag after another key": ({"anyOf": [{**_tag({"const": "a"}), "properties": {"id": {"type": "integer"}, "kind": {"const": "a"}}, "required": ["id", "kind"]},
                                           {**_tag({"const": "b"}), "properties": {"id": {"type": "string"}, "kind": {"const": "b"}}, "required": ["id", "kind"]}]},
                                ['{"id":1,"kind":"a"}', '{"id":"1","kind":"b"}'], ['{"id":1,"kind":"b"}']),
    "tags with extra keys allowed": ({"x-rudder-undeclared": "allow", "anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                                                {"type": "object", "properties": {"kind": {"const": "b"}, "n": {"type": "integer"}}, "required": ["kind", "n"]}]},
                                     ['{"kind":"a","z":[1]}', '{"kind":"b","n":1,"z":2}'], ['{"kind":"b","z":2}', '{"kind":"c"}']),
    "a tagged union in an array": ({"type": "array", "items": TAGGED},
                                   ['[{"kind":"circle","radius":1},{"kind":"rect","w":1,"h":2}]', "[]"], ['[{"kind":"circle","w":1}]']),
    "nullable objects": (NULLABLE, ['{"owner":null,"backup":null}', '{"owner":{"name":"Al","age":3},"backup":{"name":"B"}}'],
                         ['{"owner":{},"backup":null}', '{"owner":null,"backup":{"age":1}}']),
    "allOf merged": (ALL_OF, ['{"id":5,"name":"x"}', '{"id":99,"tags":["a"],"name":"y"}'],
                     ['{"id":100,"name":"x"}', '{"id":5}', '{"id":5,"name":""}', '{"id":5,"name":"x","z":1}']),
    "recursive refs": (RECURSIVE, ['{"v":1}', '{"v":1,"kids":[{"v":2,"kids":[{"v":3}]},{"v":4}]}'],
                       ['{"v":1,"kids":[{"v":2},{"v":3},{"v":4}]}', '{"v":1,"kids":[{}]}']),
    "recursion through #": (LINKED, ['{"v":1,"next":{"v":2,"next":null}}'], ['{"v":1,"next":{"v":2}}']),
    "a ref into properties": ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}, "b": {"$ref": "#/properties/a"}}},
                              ['{"a":3,"b":4}'], ['{"a":3,"b":2}']),
    "a combinator beside siblings": (
        {"type": "object", "properties": {"p": {"type": "string"}}, "required": ["p"],
         "anyOf": [{"properties": {"q": {"type": "integer"}}, "required": ["q"]}, {"properties": {"r": {"type": "boolean"}}, "required": ["r"]}]},
        ['{"p":"x","q":1}', '{"p":"x","r":true}'], ['{"p":"x"}', '{"q":1}']),
    "type arrays": ({"type": ["integer", "string", "null"], "minimum": 2, "maxLength": 2}, ["3", '"ab"', "null"], ["1", '"abc"', "true"]),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}, "_id$": {"type": "string"}},
                           "additionalProperties": False},
                          ['{"x_a":1,"b_id":"z"}', "{}"],
                          ['{"y":1}', '{"x_a":"1"}', '{"x_id":1}']),   # (x_id: both patterns, no value can)
    "additionalProperties as a schema": ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
                                         ['{"a":"s","b":1,"c":2}', '{"b":1}'], ['{"a":"s","b":"x"}']),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}},
                      ['{"ab":1,"xyz":[]}'], ['{"Ab":1}', '{"abcd":1}']),
    "propertyNames as an enum": ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": {"type": "integer"}},
                                 ['{"a":1,"b":2}', '{"b":2}'], ['{"c":1}']),
    "min/maxProperties": ({"type": "object", "minProperties": 2, "maxProperties": 3},
                          ['{"a":1,"b":2}', '{"a":1,"b":2,"c":3}'], ['{"a":1}', '{"a":1,"b":2,"c":3,"d":4}']),
    "dependentRequired": ({"type": "object", "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
                           "dependentRequired": {"card": ["cvv"]}, "additionalProperties": False},
                          ['{"card":"1","cvv":"2"}', '{"cvv":"2"}', "{}"], ['{"card":"1"}']),
    "dependencies, both forms": ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "string"}},
                                  "dependencies": {"a": ["b"], "c": {"properties": {"b": {"minimum": 5}}}}},
                                 ['{"a":1,"b":2}', '{"b":7,"c":"x"}'], ['{"a":1}', '{"b":2,"c":"x"}']),
    "additionalItems (draft 4)": ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": {"type": "boolean"}},
                                  ['[1,"a",true,false]', "[1]"], ['[1,"a",2]', '["a"]']),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, ["[1]", "[]"], ["[1,2]"]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}, "minContains": 2},
                 ["[10,1,20]", "[11,12]"], ["[1,2,10]", "[]"]),
    "enum and const of any value": ({"enum": [{"a": [1, 2]}, [None, True], "x\ny", 1.5, None]},
                                    ['{"a":[1,2]}', "[null,true]", '"x\\ny"', "1.5", "null"],
                                    ['{"a":[1]}', "[null]", '"xy"', "1.6"]),
    "integer multipleOf": ({"type": "integer", "multipleOf": 7, "minimum": -30, "maximum": 30}, ["0", "21", "-28"], ["22", "35"]),
    "decimal multipleOf": ({"type": "number", "multipleOf": 0.01}, ["1.5", "3"], ["1.255"]),
    "pattern, lengths and format together": ({"type": "string", "format": "email", "pattern": "^a", "minLength": 7, "maxLength": 12},
                                             ['"ab@cd.co"', '"ab@cd.org"'], ['"b@cd.de"', '"a@b.c"', '"abcdefg@hi.com"']),
    "not and if/then/else": ({"type": "object", "properties": {"t": {"enum": ["a", "b"]}, "n": {"type": "integer"}, "s": {"not": {"pattern": "^x"}}},
                              "if": {"properties": {"t": {"const": "a"}}}, "then": {"required": ["n"]}, "else": {"not": {"required": ["n"]}}},
                             ['{"t":"a","n":1}', '{"t":"b"}', '{"t":"b","s":"yx"}'], ['{"t":"a"}', '{"t":"b","n":1}', '{"t":"b","s":"xy"}']),
}

FORMATS = {
    "date": (["2024-02-28"], ["2024-02-30", "2024-2-1"]),
    "time": (["12:34:56Z", "23:59:59.5+02:00"], ["24:00:00Z", "12:34"]),
    "date-time": (["2024-01-31T12:00:00Z"], ["2024-01-31 12:00:00Z"]),
    "duration": (["P1D", "PT1H30M", "P2W"], ["P", "1D", "PT"]),
    "email": (["a.b@example.com"], ["ab.com"]),
    "hostname": (["example.com", "a-b.c"], ["-a.com"]),
    "ipv4": (["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
    "ipv6": (["::1", "2001:db8::ff00:42:8329"], ["2001:::1", "12345::"]),
    "uri": (["https://example.com/a?b=c#d"], ["example.com", "a b:c"]),
    "uri-reference": (["../a/b?c", "#x"], ["a b"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567-e89b-12d3-a456-42661417400"]),
}


#: formats that jsonschema's FormatChecker checks here as the RFCs say
CHECKED_FORMATS = {"date", "email", "ipv4", "ipv6", "uuid"}


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


def _cases():
    for name, (schema, good, bad) in CASES.items():
        yield from (pytest.param(schema, doc, True, id=f"{name}: {doc}") for doc in good)
        yield from (pytest.param(schema, doc, False, id=f"{name}: not {doc}") for doc in bad)
    for fmt, (good, bad) in FORMATS.items():
        yield from (pytest.param({"type": "string", "format": fmt}, json.dumps(v), True, id=f"format {fmt}: {v}") for v in good)
        yield from (pytest.param({"type": "string", "format": fmt}, json.dumps(v), False, id=f"format {fmt}: not {v}") for v in bad)


@pytest.mark.parametrize("schema,doc,valid", list(_cases()))
def test_keyword(rt, module, byte_tok, schema, doc, valid):
    """The table is right (jsonschema agrees, formats checked), and the controller agrees:
    a valid document is written to its end, an invalid one refused before its end."""
    checker = jsonschema.FormatChecker()
    v = jsonschema.validators.validator_for(schema)(schema, format_checker=checker)
    if schema.get("format") in (None, *CHECKED_FORMATS):   # (jsonschema has no RFC 3339 checker for the others here)
        assert v.is_valid(json.loads(doc)) == valid, (schema, doc)
    if valid:
        Drive(rt, module, byte_tok, schema, doc).run().ctl.close()
    else:
        with pytest.raises(Refused):
            Drive(rt, module, byte_tok, schema, doc).run()


@pytest.mark.parametrize("doc", ['{"x\\/y":"s"}', '{"x\\u0041":"s"}', '{"a\\u0022b":1}', '{"x\\ny":"s"}'])
def test_an_extra_key_has_one_spelling(rt, module, byte_tok, doc):
    """Valid documents, refused by design (docs/json-schema.md): an extra key takes only the
    escapes a declared key is written with (\\" and \\\\), so that each key has one spelling and
    "a\\u0022b", the declared key a"b, can never be taken for an extra key of another schema."""
    assert jsonschema.validators.validator_for(ESCAPED_KEYS)(ESCAPED_KEYS).is_valid(json.loads(doc))
    with pytest.raises(Refused):
        Drive(rt, module, byte_tok, ESCAPED_KEYS, doc).run()


BUILDS_ON = {"$defs": {"base": {"properties": {"id": {"type": "integer"}}}},
             "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"name": {"type": "string"}}}],
             "properties": {"kind": {"const": "leaf"}}, "required": ["id", "kind"]}


@pytest.mark.parametrize("doc,ours", [('{"id":1,"name":"a","kind":"leaf"}', True), ('{"id":1,"kind":"leaf"}', True),
                                      ('{"kind":"leaf","id":1}', False), ('{"name":"a","id":1,"kind":"leaf"}', False)])
def test_merged_properties_come_in_the_order_the_schema_builds_on(rt, module, byte_tok, doc, ours):
    """docs/json-schema.md, "Property order": the $ref's and allOf members' properties, then the
    schema's own. The other orders are valid JSON Schema-wise, and refused by design."""
    assert jsonschema.validators.validator_for(BUILDS_ON)(BUILDS_ON).is_valid(json.loads(doc))
    if ours:
        Drive(rt, module, byte_tok, BUILDS_ON, doc).run().ctl.close()
    else:
        with pytest.raises(Refused):
            Drive(rt, module, byte_tok, BUILDS_ON, doc).run()


# ---------------------------------------------------------------------------- the shapes of tool calling

def _inst(s, r, depth, root):
    """A random valid instance of the shapes below (their keywords only)."""
    if "$ref" in s:
        target = root
        for part in s["$ref"].lstrip("#/").split("/"):
            target = target[part] if part else target
        return _inst(target, r, depth, root)
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return r.choice(s["enum"])
    for kw in ("anyOf", "oneOf"):
        if kw in s:
            alts = s[kw] if depth < 3 else [a for a in s[kw] if a.get("type") == "null"] or s[kw]
            return _inst(r.choice(alts), r, depth, root)
    if "allOf" in s:
        out = {}
        for part in s["allOf"]:
            out.update(_inst({**part, "type": "object"}, r, depth, root))
        return out
    t = s.get("type", "object")
    if isinstance(t, list):
        t = r.choice(t if depth < 3 else [x for x in t if x == "null"] or t)
    if t == "null":
        return None
    if t == "boolean":
        return r.random() < 0.5
    if t == "object":
        out = {}
        for k, sub in s.get("properties", {}).items():
            if k in s.get("required", []) or (r.random() < 0.5 and depth < 3):
                out[k] = _inst(sub, r, depth + 1, root)
        return out
    if t == "array":
        return [_inst(s["items"], r, depth + 1, root) for _ in range(r.randint(0, min(2, s.get("maxItems", 2)) if depth < 3 else 0))]
    if t == "string":
        return "".join(r.choice("abcé 😀\"\\") for _ in range(r.randint(max(1, s.get("minLength", 0)), 6)))
    if t == "integer":
        return r.randint(s.get("minimum", -99), s.get("maximum", 99))
    if t == "number":
        return round(r.uniform(0.5, 9.5), 2)
    raise AssertionError(s)


SHAPES = {"tools": TOOLS, "many tools": MANY_TOOLS, "tools keyed by name": TOOLS_BY_KEY, "tagged": TAGGED, "nullable": NULLABLE,
          "recursive": RECURSIVE, "linked": LINKED}


@pytest.mark.parametrize("name", list(SHAPES))
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1))
def test_every_valid_document_of_a_shape_is_allowed(rt, module, byte_tok, name, seed):
    schema = SHAPES[name]
    doc = _inst(schema, random.Random(seed), 0, schema)
    jsonschema.validate(doc, schema)   # the generator is right
    Drive(rt, module, byte_tok, schema, compact(doc)).run().ctl.close()


@pytest.mark.parametrize("name", list(SHAPES) + ["allOf merged"])
def test_what_a_random_model_writes_validates(name):
    """Random weights sample wildly: whatever completes validates."""
    from rudder import SamplingParams

    schema = SHAPES.get(name) or ALL_OF
    llm = _tiny()
    params = [SamplingParams(max_tokens=200, seed=s, temperature=1.0) for s in range(8)]
    outs = llm.generate(["Write JSON."] * len(params), params, controller="json", controller_arg=json.dumps(schema))
    done = 0
    for out in outs:
        assert out.error is None, out.error
        if out.finish_reason != "length":
            jsonschema.validate(json.loads(out.text), schema)
            done += 1
    assert done >= 1


_TINY = None


def _tiny():
    global _TINY
    if _TINY is None:
        from rudder import LLM

        _TINY = LLM("tiny")
    return _TINY


# ---------------------------------------------------------------------------- SmolLM2, end to end


@pytest.mark.model
@pytest.mark.parametrize("name,prompt", [
    ("tools", "You can call get_weather(city, unit), get_time(zone) or get_news(topic, limit). What is the weather in Oslo? "
              "Answer with the tool call as JSON."),
    ("tagged", "Describe a shape (a circle, a square or a rectangle) as JSON."),
])
def test_smollm2_writes_valid_calls_for_ten_seeds(tmp_path, name, prompt):
    """`rudder run --controller json` on SmolLM2, ten seeds: seed 0 as a real command (its own
    process), seeds 1-9 through the same CLI function in this process (typer's runner), which
    spares nine model loads. Every output is one complete document valid against the schema."""
    import subprocess
    import sys
    from pathlib import Path

    from typer.testing import CliRunner

    from rudder.cli import app

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SHAPES[name]))
    argv = ["run", "--controller", "json", "--arg", f"@{path}", "--chat", "--max-tokens", "120", "--temperature", "0.8"]
    proc = subprocess.run([sys.executable, "-m", "rudder.cli", *argv, "--seed", "0", prompt], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    texts = [proc.stdout]
    runner = CliRunner()
    for seed in range(1, 10):
        out = runner.invoke(app, [*argv, "--seed", str(seed), prompt])
        assert out.exit_code == 0, out.output
        texts.append(out.stdout)
    for text in texts:
        jsonschema.validate(json.loads(text), SHAPES[name])   # a document cut by max_tokens would not parse
