"""Structural tags (host/rudder/structural_tag.py): both forms clients send, mapped onto the
`grammar` and `triggers` controllers. Outputs of the random tiny model (every token drawn under
the masks, at temperature 1) are checked region by region with Python's `re` and `jsonschema`;
unsupported parts are refused with their path. Over HTTP: tests/test_openai_compat.py."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from rudder import LLM, SamplingParams
from rudder.structural_tag import structural_tag, until
from rudder.structured import ConstraintError

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"]}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as llm:
        yield llm


def gen(llm, tag, n=6, max_tokens=60, **kw):
    params = [SamplingParams(max_tokens=max_tokens, seed=s, structural_tag=tag, **kw) for s in range(n)]
    outs = llm.generate(["go"] * n, params)
    for o in outs:
        assert o.error is None, o.error
    return outs


def bias(llm, chars: str, value: float) -> dict:
    """logit_bias favouring each of `chars` (one token each on the tiny model's byte tokenizer)."""
    return {llm.tokenizer.encode(ch)[0]: value for ch in chars}


def fmt(f):
    return {"type": "structural_tag", "format": f}


@pytest.mark.parametrize("end", ["</think>", "</function>", "aab", "abab", "]]>", "x", "ééa", "<|end|>", "a/b\\c"])
def test_until_matches_text_up_to_the_first_end_string(end):
    """The "any text up to the end string" regex, against its definition on random strings."""
    rx = re.compile(until(end), re.S)
    rng = random.Random(end)
    alphabet = sorted(set(end)) + ["z", "\n"]
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert bool(rx.fullmatch(s)) == (s.endswith(end) and s.find(end) == len(s) - len(end)), s


def test_a_sequence_of_tags_holds_region_by_region(llm):
    tag = fmt({"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"}, "end": "</n>"},
        {"type": "or", "elements": [{"type": "const_string", "value": " ok"}, {"type": "const_string", "value": " no"}]},
        {"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "!?"}]})
    assert structural_tag(tag).controller == "grammar"
    whole = re.compile(r"Answer: <n>[0-9]{1,3}</n> (ok|no)<t>(.*?)!\?", re.S)
    outs = gen(llm, tag, max_tokens=120, logit_bias=bias(llm, "!?", 5.5))
    for o in outs:
        if o.finish_reason == "stop":
            m = whole.fullmatch(o.text)
            assert m and "!?" not in m.group(2), o.text
        else:   # cut by max_tokens: a prefix of a sentence
            assert re.match(r"Answer: <n>[0-9]{1,3}</n> (ok|no)<t>", o.text), o.text
    assert sum(o.finish_reason == "stop" for o in outs) >= 3


def test_repeat_optional_and_tags_with_separator(llm):
    item = {"type": "tag", "begin": "[", "content": {"type": "regex", "pattern": "[a-c]"}, "end": "]"}
    tag = fmt({"type": "sequence", "elements": [
        {"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "ab"}},
        {"type": "optional", "content": {"type": "const_string", "value": "?"}},
        {"type": "tags_with_separator", "tags": [item], "separator": ",", "at_least_one": True}]})
    for o in gen(llm, tag):
        if o.finish_reason == "stop":
            assert re.fullmatch(r"(ab){2,3}\??\[[a-c]\](,\[[a-c]\])*", o.text), o.text


def test_triggered_tags_leave_text_free_and_constrain_each_tag(llm):
    """Free text; after the trigger "<" one of the tags' begins follows ("<n>" or "<w>"), then
    its content and end; then free text again. A bias on "<" makes the random model trigger."""
    tag = fmt({"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</n>"},
        {"type": "tag", "begin": "<w>", "content": {"type": "const_string", "value": "hello"}, "end": "</w>"}]})
    c = structural_tag(tag)
    assert c.controller == "triggers" and c.max_backtrack == 1
    fired = 0
    for o in gen(llm, tag, max_tokens=80, logit_bias=bias(llm, "<", 3.0)):
        text, at = o.text, o.text.find("<")
        while at >= 0:   # every "<" of free text starts a tag, whole unless the output was cut
            rest = text[at:]
            ok = re.match(r"<n>[0-9]+</n>|<w>hello</w>", rest)
            if not ok:
                assert o.finish_reason == "length" and re.fullmatch(
                    r"<(n>[0-9]*(<(/(n>?)?)?)?|w>?h?e?l?l?o?<?/?w?>?)?", rest), (text, rest)
                break
            fired += 1
            at = text.find("<", at + ok.end())
    assert fired >= 3


def test_at_least_one_and_stop_after_first(llm):
    tag = fmt({"type": "triggered_tags", "triggers": ["<"], "at_least_one": True, "stop_after_first": True, "tags": [
        {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{2}"}, "end": "</n>"}]})
    arg = json.loads(structural_tag(tag).arg)
    assert arg["at_least_one"] is True and arg["triggers"][0]["stop"] is True
    stops = 0
    for o in gen(llm, tag, max_tokens=80, logit_bias=bias(llm, "<", 3.0)):
        if o.finish_reason == "stop":   # the output ends right after the first tag: nothing before EOS
            assert re.fullmatch(r"[^<]*<n>[0-9]{2}</n>", o.text, re.S), o.text
            stops += 1
    assert stops >= 3


def test_the_original_form_maps_onto_triggered_tags():
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": POINT, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"}]}
    c = structural_tag(json.dumps(tag))
    arg = json.loads(c.arg)
    assert c.controller == "triggers" and [t["begin"] for t in arg["triggers"]] == ["<function="]
    grammar = arg["triggers"][0]["grammar"]
    assert '"get_weather>"' in grammar and '"get_time>"' in grammar and grammar.count("%json") == 2
    # the JSON Schema goes through the one JSON compiler (declared properties only, by default)
    assert json.dumps(POINT)[:-1] in grammar


def test_a_triggered_tags_after_a_sequence_is_its_start():
    tag = fmt({"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "triggered_tags", "triggers": ["<n>"], "tags": [
            {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</n>"}]}]})
    arg = json.loads(structural_tag(tag).arg)
    assert "think" in arg["start"]["grammar"] and arg["triggers"][0]["begin"] == "<n>"


@pytest.mark.parametrize("tag, message", [
    ({"type": "structural_tag"}, 'give "format"'),
    (fmt({"type": "token", "token": 5}), "structural_tag.format: the format type 'token' is not supported"),
    (fmt({"type": "sequence", "elements": [{"type": "dispatch", "rules": []}]}),
     "structural_tag.format.elements[0]: the format type 'dispatch'"),
    (fmt({"type": "json_schema", "json_schema": POINT, "style": "qwen_xml"}), "format.style: only \"json\""),
    (fmt({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}]}),
     "elements[0]: any_text is supported as a tag's content or at the end"),
    (fmt({"type": "tag", "begin": "<a>", "content": {"type": "any_text", "excludes": ["x"]}, "end": "</a>"}),
     "content.excludes: not supported"),
    (fmt({"type": "triggered_tags", "triggers": ["<a"], "tags": [
        {"type": "tag", "begin": "<b>", "content": {"type": "const_string", "value": "x"}, "end": "</b>"}]}),
     "tags[0].begin: must start with exactly one trigger"),
    (fmt({"type": "sequence", "elements": [{"type": "triggered_tags", "triggers": ["<"], "tags": []}, {
        "type": "const_string", "value": "x"}]}), "triggered_tags are supported at the top level"),
    (fmt({"type": "const_string", "value": "x", "colour": "red"}), "'colour' is not supported here"),
    (fmt({"type": "json_schema", "json_schema": "nope"}), "json_schema: the schema is not valid JSON"),
])
def test_unsupported_parts_are_refused_with_their_path(tag, message):
    with pytest.raises(ConstraintError) as info:
        structural_tag(tag)
    assert message in str(info.value) and info.value.param == "structural_tag"


# -- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    from openai import OpenAI

    from rudder.server import ServerConfig
    from serve_util import LiveServer

    with LiveServer(ServerConfig(model="tiny", max_tokens=500)) as s:
        yield OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


SEQUENCE = fmt({"type": "sequence", "elements": [
    {"type": "const_string", "value": "n="},
    {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{1,2}"}, "end": "</n>"}]})


@pytest.mark.parametrize("where", ["response_format", "structured_outputs", "top-level", "rudder"])
def test_every_field_that_takes_a_structural_tag(client, where):
    body = {"response_format": {"response_format": SEQUENCE},
            "structured_outputs": {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(SEQUENCE)}}},
            "top-level": {"extra_body": {"structural_tag": json.dumps(SEQUENCE)}},
            "rudder": {"extra_body": {"rudder": {"structural_tag": SEQUENCE}}}}[where]
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=30, seed=seed, **body)
        assert re.fullmatch(r"n=<n>[0-9]{1,2}</n>", out.choices[0].message.content)


def test_the_original_form_over_http(client):
    tag = {"type": "structural_tag", "triggers": ["<"], "structures": [
        {"begin": "<n>", "schema": {"type": "integer", "minimum": 0, "maximum": 99}, "end": "</n>"}]}
    text = client.completions.create(model="tiny", prompt="hi", max_tokens=60, seed=1,
                                     logit_bias={str(3 + ord("<")): 4},
                                     extra_body={"response_format": tag}).choices[0].text
    tags = [m.start() for m in re.finditer(r"<", text)]
    assert tags, text
    at = text.find("<")
    while at >= 0:   # each trigger begins a whole tag (unless the output was cut)
        m = re.match(r"<n>[0-9]{1,2}</n>", text[at:])
        assert m or len(text) - at < 9, text
        at = text.find("<", at + (m.end() if m else 1))


def test_an_unsupported_part_is_a_400_naming_it(client):
    import openai

    bad = fmt({"type": "sequence", "elements": [{"type": "const_string", "value": "x"}, {"type": "token", "token": 1}]})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=bad)
    err = info.value.body
    assert err["param"] == "response_format" and "format.elements[1]: the format type 'token'" in err["message"]
