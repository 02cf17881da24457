"""The OpenAI-compatible API as clients use it: a real server on loopback, the official `openai`
client, every structured-output dialect (validated with jsonschema and re), tool calls read by the
client's own types, logprobs against the Python API, legacy completions, refusals of what is not
supported, cancellation when the client goes away, streams that never show text taken back,
AICI's protocol, and the metrics.

The tiny random-weight model does the mechanics (its tokens are bytes: token id = byte + 3);
tests marked `model` use SmolLM2 where the text matters."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from rudder import LLM, SamplingParams
from rudder.server import ServerConfig
from rudder.server.schemas import UNSUPPORTED
from serve_util import LiveServer, build_rewind


def tok(ch: str) -> str:
    """The tiny model's token id of a one-byte character, as logit_bias keys are sent."""
    return str(ord(ch) + 3)


# Short JSON from random weights: quotes and closing braces favoured.
SHORT_JSON = {tok('"'): 6, tok("}"): 6}
PERSON = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "colour": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "colour"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "unit": {"enum": ["C", "F"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "unit"], "additionalProperties": False}}
# closed: absent additionalProperties allows extra keys, which the random tiny model never ends
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                            "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    cfg = ServerConfig(model="tiny", max_tokens=2000, max_concurrent=8, max_queue=16)
    with LiveServer(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_llm():
    with LLM("tiny") as llm:
        yield llm


def chat(client, content="hi", **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


# -- structured outputs, every dialect -------------------------------------------------------------

def _json_checks():
    schema_text = json.dumps(PERSON)
    return [
        ("response_format json_schema", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": PERSON, "strict": True}}), PERSON),
        ("structured_outputs.json", dict(extra_body={"structured_outputs": {"json": PERSON}}), PERSON),
        ("structured_outputs.json text", dict(extra_body={"structured_outputs": {"json": schema_text}}), PERSON),
        ("guided_json", dict(extra_body={"guided_json": PERSON, "guided_decoding_backend": "xgrammar"}), PERSON),
        ("sglang json_schema", dict(extra_body={"json_schema": schema_text}), PERSON),
        ("rudder.json_schema", dict(extra_body={"rudder": {"json_schema": PERSON}}), PERSON),
        ("response_format json_object", dict(response_format={"type": "json_object"},
                                             logit_bias=SHORT_JSON), {"type": "object"}),
        ("structured_outputs.json_object", dict(extra_body={"structured_outputs": {"json_object": True}},
                                                logit_bias=SHORT_JSON), {"type": "object"}),
    ]


@pytest.mark.parametrize("name, kw, schema", _json_checks(), ids=[c[0] for c in _json_checks()])
def test_json_dialects(client, name, kw, schema):
    for seed in range(3):
        out = chat(client, seed=seed, max_tokens=200, **kw)
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_whitespace_and_additional_properties_options(client):
    loose = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "object"}},
             "required": ["a", "b"]}
    flexible = {"structured_outputs": {"json": loose, "disable_any_whitespace": False,
                                       "disable_additional_properties": True}}
    spaced = False
    for seed in range(6):
        out = chat(client, seed=seed, max_tokens=600, extra_body=flexible,
                   logit_bias={tok(" "): 1, tok("\n"): -100, tok("\t"): -100, tok("\r"): -100, tok("}"): 6})
        assert out.choices[0].finish_reason == "stop"
        value = json.loads(out.choices[0].message.content)
        assert value["b"] == {}  # disable_additional_properties: the inner object takes no keys
        spaced |= " " in out.choices[0].message.content
    assert spaced  # flexible whitespace was allowed (and chosen, with a bias for it)
    closed = {**loose, "properties": {**loose["properties"], "b": {"type": "object", "additionalProperties": False}},
              "additionalProperties": False}  # no strings: a space could only be whitespace
    compact = chat(client, seed=0, max_tokens=200, logit_bias={tok(" "): 8, tok("}"): 6},
                   extra_body={"guided_json": closed, "guided_whitespace_pattern": ""})
    assert compact.choices[0].finish_reason == "stop"
    assert " " not in compact.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="whitespace_pattern"):
        chat(client, extra_body={"structured_outputs": {"json": loose, "whitespace_pattern": "[ ]{4}"}})


def test_only_declared_properties_unless_json_undeclared_allows_more(client):
    """A schema without additionalProperties: only its properties (the default, as vLLM's); with
    "json_undeclared": "allow" extra keys come too (a bias on "," makes the random model add them),
    in response_format and in a tool's parameters alike; strict refuses "allow"."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    bias = {tok(","): 4, tok('"'): 4}   # extra keys, if they may come
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    named = {"type": "function", "function": {"name": "f"}}
    for mode in (None, "allow"):
        extra = {} if mode is None else {"json_undeclared": mode}
        texts = []
        for seed in range(6):
            out = chat(client, seed=seed, max_tokens=60, response_format=fmt, logit_bias=bias, extra_body=extra)
            texts.append(out.choices[0].message.content)
            out = chat(client, seed=seed, max_tokens=60, tools=[tool], tool_choice=named, logit_bias=bias,
                       extra_body=extra)
            call = out.choices[0].message.tool_calls
            texts.append(call[0].function.arguments if call else out.choices[0].message.content)
        if mode is None:   # the one key, then the end
            assert all(re.fullmatch(r'\{"a":-?[0-9]*\}?', t) for t in texts), texts
        else:              # extra keys (they may come before the declared one)
            assert sum(not t.startswith('{"a":') or not re.fullmatch(r'\{"a":-?[0-9]*\}?', t) for t in texts) >= 4, texts
    with pytest.raises(openai.BadRequestError, match="undeclared"):
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                             "strict": True}},
             extra_body={"json_undeclared": "allow"})
    with pytest.raises(openai.BadRequestError, match="json_undeclared applies to"):
        chat(client, extra_body={"json_undeclared": "allow", "guided_regex": "a+"})


def test_strict_refuses_what_it_cannot_honour_with_the_path(client):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}, "required": ["tags"]}
    loose = chat(client, max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}})   # relaxed (documented) when not strict
    assert loose.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                             "strict": True}})
    assert "uniqueItems" in info.value.body["message"] and "#/properties/tags" in info.value.body["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError, match="uniqueItems"):
            chat(client, tools=[tool], tool_choice=tool_choice)


REGEX = r"(yes|no)-[0-9]{2}"
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"\n'
LARK = 'start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]/ | "zz"\n'
GRAMMAR_TEXT = r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)"


@pytest.mark.parametrize("name, body, pattern", [
    ("structured_outputs.regex", {"structured_outputs": {"regex": REGEX}}, REGEX),
    ("guided_regex", {"guided_regex": REGEX}, REGEX),
    ("sglang regex", {"regex": REGEX}, REGEX),
    ("rudder.regex", {"rudder": {"regex": REGEX}}, REGEX),
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["left", "right"]}}, "left|right"),
    ("guided_choice", {"guided_choice": ["left", "right"]}, "left|right"),
    ("rudder.choice", {"rudder": {"choice": ["left", "right"]}}, "left|right"),
    ("structured_outputs.grammar lark", {"structured_outputs": {"grammar": LARK}}, GRAMMAR_TEXT),
    ("structured_outputs.grammar gbnf", {"structured_outputs": {"grammar": GBNF}}, GRAMMAR_TEXT),
    ("guided_grammar", {"guided_grammar": GBNF}, GRAMMAR_TEXT),
    ("sglang ebnf", {"ebnf": GBNF}, GRAMMAR_TEXT),
    ("rudder.grammar", {"rudder": {"grammar": LARK}}, GRAMMAR_TEXT),
])
def test_text_dialects(client, name, body, pattern):
    for seed in range(3):
        out = chat(client, seed=seed, extra_body=body, logit_bias={tok(")"): 4})
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.choices[0].message.content), (name, out.choices[0].message.content)


def test_completions_take_the_dialects_too(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=20, extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, out.choices[0].text)
    plain = chat(client, response_format={"type": "text"}, max_tokens=5, seed=1)  # asks for nothing
    assert plain.choices[0].finish_reason == "length"


def test_conflicting_constraints_are_a_400_naming_both(client):
    cases = [
        dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
        dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        dict(extra_body={"regex": "a", "rudder": {"grammar": LARK}}),
        dict(extra_body={"guided_json": {}, "rudder": {"controller": "fork", "controller_arg": "2"}}),
        dict(tools=[{"type": "function", "function": WEATHER}], tool_choice="required",
             extra_body={"guided_regex": "a"}),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **kw)
        assert "both constrain the output" in e.value.body["message"], kw
        assert e.value.body["param"]


def test_a_controller_refusal_says_why_in_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "contains": {"type": "null"}, "maxContains": 1}}})
    err = e.value.body
    assert 'unsupported keyword "maxContains"' in err["message"] and err["code"] == "start"
    assert err["type"] == "controller_error" and err["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"guided_regex": "(ab"})
    assert "regex" in e.value.body["message"] and "refused" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="GBNF"):
        chat(client, extra_body={"ebnf": "root ::= undefined-rule"})


# -- tool calls ------------------------------------------------------------------------------------

def _args_valid(call, fn: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


def test_named_and_required_tool_calls_follow_the_schema(client):
    tools = [{"type": "function", "function": WEATHER}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        for seed in range(3):
            out = chat(client, "weather?", tools=tools, tool_choice=choice, seed=seed, max_tokens=100)
            msg = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls" and msg.content is None
            [call] = msg.tool_calls  # the client's own types
            assert isinstance(call, openai.types.chat.ChatCompletionMessageToolCall)
            assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
            _args_valid(call, WEATHER)


def test_named_tool_among_several(client):
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
    out = chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=2)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _args_valid(call, CLOCK)


def test_required_over_several_tools(client):
    """Several tools under "required": a union of call objects (a tagged union on "name").
    The model picks the tool (here steered by a bias on the letter after "get_"), and the
    arguments follow the schema of the tool it named."""
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
    for seed, (letter, fn) in enumerate((("w", WEATHER), ("t", CLOCK), ("w", WEATHER), ("t", CLOCK))):
        out = chat(client, tools=tools, tool_choice="required", seed=seed, max_tokens=100,
                   logit_bias={tok(letter): 30})
        assert out.choices[0].finish_reason == "tool_calls"
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == fn["name"]
        _args_valid(call, fn)


def test_auto_is_text_or_a_call(client):
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
    # "<" begins a call: favoured, the model calls; banned, it writes text
    called = chat(client, tools=tools, seed=4, max_tokens=120, logit_bias={tok("<"): 100, tok("}"): 3},
                  parallel_tool_calls=False)
    assert called.choices[0].finish_reason == "tool_calls"
    [call] = called.choices[0].message.tool_calls
    _args_valid(call, WEATHER if call.function.name == "get_weather" else CLOCK)  # days' bounds too
    text = chat(client, tools=tools, tool_choice="auto", seed=4, max_tokens=10, logit_bias={tok("<"): -100})
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert not text.choices[0].message.content.startswith("<")
    none = chat(client, tools=tools, tool_choice="none", seed=4, max_tokens=10, logit_bias={tok("<"): 100})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.startswith("<")


# Keywords beyond plain types in a tool's arguments: keys by pattern, a count, a format, a pattern.
LOG = {"name": "log_days", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["days", "code"],
    "properties": {"days": {"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 2},
                   "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "patternProperties": {"^n_[a-z]$": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def test_auto_calls_follow_every_keyword_of_the_schema(client):
    """tool_choice "auto" holds the same call schema as "required", embedded in its grammar
    (`%json`): keys by pattern, minItems, formats and patterns hold in the arguments, for a
    strict tool and a loose one; and a text reply stays possible."""
    for strict in (True, False):
        tools = [{"type": "function", "function": {**LOG, "strict": strict}}]
        for seed in range(2):
            out = chat(client, tools=tools, seed=seed, max_tokens=300, parallel_tool_calls=False,
                       logit_bias={tok("<"): 100, **SHORT_JSON})
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
            [call] = out.choices[0].message.tool_calls
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, LOG["parameters"], format_checker=jsonschema.FormatChecker())
        text = chat(client, tools=tools, seed=1, max_tokens=10, logit_bias={tok("<"): -100})
        assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_tool_calls_stream_as_deltas(client):
    tools = [{"type": "function", "function": WEATHER}]
    kw = dict(tools=tools, tool_choice="required", seed=5, max_tokens=100)
    whole = chat(client, **kw).choices[0].message.tool_calls[0]
    chunks = list(chat(client, stream=True, **kw))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(c.index == 0 for c in calls) and len(calls) > 2  # the arguments come in pieces
    assert "".join(c.function.arguments or "" for c in calls) == whole.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)


def test_earlier_calls_and_results_are_part_of_the_prompt(client):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                         tools=[{"type": "function", "function": WEATHER}], tool_choice="none")
    assert out.usage.prompt_tokens > len("<tool_response>\n-3 C\n</tool_response>")
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        chat(client, tools=[{"type": "function", "function": WEATHER}],
             tool_choice={"type": "function", "function": {"name": "nope"}})


# -- logprobs, penalties, logit_bias -----------------------------------------------------------------

def test_chat_logprobs_match_the_python_api(client, tiny_llm):
    messages = [{"role": "user", "content": "tell me"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3)
    ref = tiny_llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == 8
    for entry, want in zip(content, ref.logprobs):
        assert entry.logprob == pytest.approx(want["logprob"], abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top one
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for ch in chat(client, "tell me", stream=True, max_tokens=8, temperature=0, logprobs=True,
                                 top_logprobs=3) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_logprobs_under_a_constraint_list_only_allowed_alternatives(client):
    """A token the mask refused has no probability: it is never a top alternative (nor a -inf that
    JSON cannot carry)."""
    for stream in (False, True):
        kw = dict(max_tokens=4, logprobs=True, top_logprobs=5, extra_body={"structured_outputs": {
            "choice": ["left", "right"]}})
        if stream:
            entries = [e for ch in chat(client, stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                       for e in ch.choices[0].logprobs.content]
        else:
            entries = chat(client, **kw).choices[0].logprobs.content
        assert entries
        for e in entries:
            assert all(alt.logprob > float("-inf") for alt in e.top_logprobs)
            assert len(e.top_logprobs) <= 2   # "l..." or "r...": the first token has two choices at most


def test_completion_logprobs_and_forced_tokens(client):
    # printable ASCII only: the top_logprobs dicts are keyed by token text, which must differ
    ascii_only = {str(t): -100 for t in range(512) if not 32 + 3 <= t <= 126 + 3}
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=2,
                                    logit_bias=ascii_only)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-6)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=2,
                                         logit_bias=ascii_only, stream=True)
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    top = [t for p in parts for t in p.top_logprobs]
    assert len(top) == len(lp.top_logprobs)
    assert all(a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-6)
               for a, b in zip(top, lp.top_logprobs))
    forced = chat(client, max_tokens=20, logprobs=True, extra_body={"rudder": {"controller": "force",
                                                                              "controller_arg": "Ahoy"}})
    assert forced.choices[0].message.content == "Ahoy"
    assert [e.logprob for e in forced.choices[0].logprobs.content] == [0.0] * 4  # forced: no alternative


def test_penalties_and_logit_bias_are_honoured(client, tiny_llm):
    kw = dict(max_tokens=16, temperature=0)
    for extra in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0},
                  {"logit_bias": {tok("q"): 30}}):
        out = client.completions.create(model="tiny", prompt="aaaa", extra_body=extra, **kw)
        params = {k: ({int(t): v for t, v in v.items()} if k == "logit_bias" else v) for k, v in extra.items()}
        want = tiny_llm.generate(["aaaa"], SamplingParams(**kw, **params))[0].text
        plain = tiny_llm.generate(["aaaa"], SamplingParams(**kw))[0].text
        assert out.choices[0].text == want != plain, extra
    biased = client.completions.create(model="tiny", prompt="aaaa", logit_bias={tok("q"): 100}, max_tokens=5)
    assert biased.choices[0].text == "qqqqq"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="a", logit_bias={"99999": 1})


# -- legacy completions ----------------------------------------------------------------------------

def test_prompt_lists_token_ids_and_echo(client):
    kw = dict(model="tiny", max_tokens=5, temperature=0)
    single = [client.completions.create(prompt=p, **kw).choices[0].text for p in ("ab", "cd", "ef")]
    many = client.completions.create(prompt=["ab", "cd", "ef"], **kw)
    assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == single
    assert many.usage.completion_tokens == 15
    ids = [ord(c) + 3 for c in "ab"]
    assert client.completions.create(prompt=ids, **kw).choices[0].text == single[0]
    lists = client.completions.create(prompt=[ids, [ord(c) + 3 for c in "cd"]], **kw)
    assert [c.text for c in lists.choices] == single[:2]
    echo = client.completions.create(prompt="ab", echo=True, **kw)
    assert echo.choices[0].text == "ab" + single[0]
    chunks = list(client.completions.create(prompt=["ab", "cd"], echo=True, stream=True, **kw))
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "ab" + single[0], 1: "cd" + single[1]}
    forked = client.completions.create(prompt=["ab", "cd"], n=2, seed=1, **{**kw, "temperature": 1})
    assert sorted(c.index for c in forked.choices) == [0, 1, 2, 3]


# -- no silent ignores, errors -------------------------------------------------------------------

_ASKING = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"}, "modalities": ["audio"],
           "prediction": {"type": "content", "content": "x"}, "store": True, "metadata": {"a": "b"},
           "reasoning_effort": "low", "web_search_options": {}, "service_tier": "flex", "min_tokens": 3,
           "stop_token_ids": [5], "include_stop_str_in_output": True, "skip_special_tokens": False,
           "spaces_between_special_tokens": False, "best_of": 2, "use_beam_search": True, "length_penalty": 2.0,
           "prompt_logprobs": 1, "add_generation_prompt": False, "continue_final_message": True,
           "chat_template": "x", "chat_template_kwargs": {"a": 1}, "documents": [{"a": "b"}], "priority": 1,
           "truncate_prompt_tokens": 5, "bad_words": ["x"], "allowed_token_ids": [5],
           "return_tokens_as_token_ids": True, "suffix": "x", "vllm_xargs": {"a": 1}, "kv_transfer_params": {},
           "return_hidden_states": True, "lora_path": "x", "verbosity": "low"}


def test_every_known_unsupported_field_is_refused_by_name(server):
    assert set(_ASKING) == set(UNSUPPORTED)
    with httpx.Client(base_url=server.url) as c:
        for field, value in _ASKING.items():
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2, field: value})
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
        benign = {f: UNSUPPORTED[f][1] for f in UNSUPPORTED if len(UNSUPPORTED[f]) > 1}
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 2, **benign, "an_unknown_field": 1, "user": "u1"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo with logprobs"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 1000, max_tokens=1500)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    for r in (httpx.post(server.url + "/v1/chat/completions", json={"messages": []}),
              httpx.post(server.url + "/v1/completions", json={"prompt": "x", "temperature": -1})):
        assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}


# -- cancellation -----------------------------------------------------------------------------------

def _idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["rudder_engine_requests"] == 0 and m["rudder_kv_blocks_free"] == m["rudder_kv_blocks_total"] \
                and m["rudder_requests_running"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not free the request: {m}")
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_request(server, stream):
    """Over real HTTP, streaming or not: the client leaves mid-request; the engine drops the
    request (KV blocks back, `cancelled` counted) before its end."""
    import socket
    import threading

    before = _idle(server)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": stream, "n": 4}  # four forks: slow enough to leave in the middle
    leave = threading.Event()

    def client():
        if not stream:  # the request is sent by hand; the socket closes with nothing read
            host, port = server.url.removeprefix("http://").split(":")
            data = json.dumps(body).encode()
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
                leave.wait(30)
            return
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()  # kept: dropping the iterator would close the connection now
                next(lines)
                leave.wait(30)
        # leaving the block closes the connection with the response unread

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["rudder_engine_requests"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    during = server.metrics()
    leave.set()
    t.join(30)
    assert during["rudder_kv_blocks_free"] < before["rudder_kv_blocks_total"]
    after = _idle(server, timeout=5)  # a step of the tiny model takes milliseconds: 5 s is margin
    assert after["rudder_cancelled_total"] == before["rudder_cancelled_total"] + 1
    assert after["rudder_tokens_total"] - before["rudder_tokens_total"] < 4 * 1500  # it stopped before its end


# -- streams and backtracking ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def rewind_id(server, tmp_path_factory):
    wasm = build_rewind(tmp_path_factory.mktemp("rewind"))
    with httpx.Client(base_url=server.url) as c:
        module_id = c.post("/v1/controllers", content=wasm).json()["module_id"]
        assert c.post("/v1/controllers/tags", json={"tag": "rewind", "module_id": module_id,
                                                    "max_backtrack": 2}).status_code == 200
    return module_id


def _stream_text(client, **kw) -> tuple[str, list]:
    chunks = list(chat(client, stream=True, **kw))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


def test_standard_streams_never_show_text_taken_back(client, rewind_id):
    """The rewind controller forces "Hello!" and takes "o!" back: held, never shown."""
    rewind = {"controller": "rewind", "controller_arg": "Hello!"}
    whole = chat(client, seed=3, extra_body={"rudder": rewind}).choices[0].message.content
    assert whole.startswith("Hell") and not whole.startswith("Hello!")
    text, chunks = _stream_text(client, seed=3, extra_body={"rudder": rewind})  # the tag declared 2
    assert text == whole
    shown = ""
    for ch in chunks:  # every prefix shown is a prefix of the final text
        shown += (ch.choices[0].delta.content or "") if ch.choices else ""
        assert whole.startswith(shown)
        assert "rudder_backtrack" not in ch.choices[0].model_extra if ch.choices else True
    by_id = {"controller": rewind_id, "controller_arg": "Hello!"}  # no tag, nothing declared: all held
    held_text, held_chunks = _stream_text(client, seed=3, extra_body={"rudder": by_id})
    assert held_text == whole
    contents = [ch.choices[0].delta.content for ch in held_chunks if ch.choices and ch.choices[0].delta.content]
    assert contents == [whole]  # one piece, at the end


def test_raw_backtrack_deltas_and_a_broken_declaration(client, rewind_id):
    rewind = {"controller": "rewind", "controller_arg": "Hello!"}
    chunks = list(chat(client, seed=3, stream=True, extra_body={"rudder": {**rewind, "stream_backtrack": True}}))
    text = ""
    backs = []
    for ch in chunks:
        if not ch.choices:
            continue
        back = (ch.choices[0].model_extra or {}).get("rudder_backtrack", 0)
        backs.append(back)
        text = text[: len(text) - back] + (ch.choices[0].delta.content or "")
    assert 2 in backs and text == chat(client, seed=3, extra_body={"rudder": rewind}).choices[0].message.content
    with pytest.raises(openai.APIError, match="max_backtrack"):  # declared 0, takes 2 back
        list(chat(client, seed=3, stream=True, extra_body={"rudder": {**rewind, "max_backtrack": 0}}))


def test_the_builtin_backtrack_controller_declares_its_word(client):
    kw = dict(seed=7, max_tokens=40, extra_body={"rudder": {"controller": "backtrack", "controller_arg": "e"}})
    whole = chat(client, **kw).choices[0].message.content
    text, _ = _stream_text(client, **kw)
    assert text == whole and "e" not in whole


# -- AICI clients ---------------------------------------------------------------------------------

def test_aici_protocol(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        force = next(t for t in c.get("/v1/controllers/tags").json()["tags"] if t["tag"] == "force")["module_id"]
        r = c.post("/v1/controllers/tags", json={"module_id": force, "tags": ["aici-a", "aici-b"]})
        assert r.status_code == 200
        listed = r.json()["tags"]
        assert [t["tag"] for t in listed] == ["aici-a", "aici-b"]
        assert all({"updated_at", "updated_by", "wasm_size", "compiled_size", "module_id"} <= set(t) for t in listed)
        assert all(isinstance(t["updated_at"], (int, float)) and t["compiled_size"] > 0 for t in listed)
        lines = [ln for ln in c.post("/v1/run", json={"controller": "choices", "controller_arg": ["yes", "no"],
                                                      "max_tokens": 10, "temperature": 0}).text.splitlines() if ln]
    # what AICI's client reads: "data: {" objects (initial-run, then runs with forks) and "data: [DONE]"
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: {") for ln in lines[:-1])
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["object"] == "initial-run" and events[0]["id"].startswith("run-")
    runs = events[1:]
    assert runs and all(e["object"] == "run" and "ff_tokens" in e["usage"] and "sampled_tokens" in e["usage"]
                        for e in runs)
    text = "".join(f["text"] for e in runs for f in e["forks"] if f["index"] == 0)
    assert text in ("yes", "no") and all(f["error"] == "" for e in runs for f in e["forks"])
    # AICI clients send a JSON controller_arg as an object: it reaches the controller as its text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/run", json={"controller": "json", "controller_arg": schema, "max_tokens": 40,
                                    "temperature": 0})
    assert r.status_code == 200, r.text
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    text = "".join(f["text"] for e in events[1:] for f in e["forks"] if f["index"] == 0)
    jsonschema.validate(json.loads(text), schema)


# -- observability --------------------------------------------------------------------------------

def test_histograms_labels_and_a_log_line_per_request(server, client, caplog):
    text = httpx.get(server.url + "/metrics").text
    before = server.metrics()
    with caplog.at_level(logging.INFO, logger="rudder.server"):
        chat(client, max_tokens=4, seed=1, user="someone")
        with pytest.raises(openai.BadRequestError):
            chat(client, extra_body={"guided_regex": "(ab"})
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if r.getMessage().startswith("request ")]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert any("status=ok" in ln and "completion_tokens=4" in ln and "error=-" in ln for ln in lines)
    assert any("status=refused" in ln and "controller=regex" in ln and "error=start" in ln for ln in lines)
    after = server.metrics()
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert f"# TYPE rudder_{h} histogram" in text
        assert after[f"rudder_{h}_count"] > before[f"rudder_{h}_count"], h
        assert after[f'rudder_{h}_bucket{{le="+Inf"}}'] == after[f"rudder_{h}_count"]
    assert after["rudder_itl_count" if False else "rudder_inter_token_latency_seconds_count"] >= \
        before["rudder_inter_token_latency_seconds_count"] + 3
    assert 0.0 <= after["rudder_kv_cache_usage_ratio"] <= 1.0
    assert all('model_name="tiny"' in ln for ln in text.splitlines() if ln and not ln.startswith("#"))


# -- the real model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_folder):
    with LiveServer(ServerConfig(model="smollm2", max_tokens=512)) as s:
        yield OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.model
def test_smollm2_calls_a_tool_the_client_parses(smol):
    out = smol.chat.completions.create(
        model="smollm2", max_tokens=80, temperature=0, tools=[{"type": "function", "function": WEATHER}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What's the weather in Paris, in Celsius?"}])
    [call] = out.choices[0].message.tool_calls
    args = _args_valid(call, WEATHER)
    assert args["city"] == "Paris" and args["unit"] == "C"


@pytest.mark.model
def test_smollm2_structured_dialects_agree(smol):
    """One schema through three dialects: the same greedy JSON, valid."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    messages = [{"role": "user", "content": "Invent a person and give their name and age as JSON."}]
    outs = [smol.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0, **kw)
            .choices[0].message.content for kw in (
                dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}),
                dict(extra_body={"guided_json": schema}),
                dict(extra_body={"structured_outputs": {"json": schema}}))]
    assert outs[0] == outs[1] == outs[2]
    jsonschema.validate(json.loads(outs[0]), schema)
