"""Structured output without controller names: SamplingParams(json_schema=, regex=, choice=,
grammar=) through LLM (the tiny model: the constraint, not the text, is the point), GBNF grammars
translated to Lark with their meaning kept, and LLM.chat."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rudder import LLM, SamplingParams
from rudder.gbnf import GBNFError, to_lark
from rudder.structured import ConstraintError, json_schema, whitespace_of


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as model:
        yield model


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
          "required": ["ok", "n"]}


def test_each_structured_field_constrains_the_output(llm):
    seeds = range(4)
    for seed in seeds:
        out = llm.generate("x", SamplingParams(json_schema=SCHEMA, max_tokens=40, seed=seed))[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        out = llm.generate("x", SamplingParams(regex="[a-c]{2,4}-[0-9]", max_tokens=10, seed=seed))[0]
        assert re.fullmatch("[a-c]{2,4}-[0-9]", out.text), out.text
        out = llm.generate("x", SamplingParams(choice=["red", "green", "blue"], max_tokens=10, seed=seed))[0]
        assert out.text in ("red", "green", "blue")
        out = llm.generate("x", SamplingParams(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]/\n',
                                               max_tokens=30, seed=seed))[0]
        assert out.finish_reason == "stop" and re.fullmatch(r"\([0-9](,[0-9])*\)", out.text), out.text


def test_gbnf_grammar_keeps_its_meaning(llm):
    # "ab" "c" vs "a" "bc" would lex differently in Lark with maximal munch; one-character
    # terminals keep GBNF's own language.
    gbnf = r'''
        root ::= greeting " " name{1,2} "!"   # comment
        greeting ::= "hi" | "hey" | "h"
        name ::= [A-Z] [a-z]*
        unused-rule ::= "never"
    '''
    lark = to_lark(gbnf)
    assert "unused" not in lark and lark.startswith("start:")
    for seed in range(4):
        out = llm.generate("x", SamplingParams(grammar=gbnf, max_tokens=25, seed=seed))[0]
        if out.finish_reason == "stop":
            assert re.fullmatch(r"(hi|hey|h) ([A-Z][a-z]*){1,2}!", out.text), out.text
        else:  # a long name: still a prefix of the language
            assert re.fullmatch(r"(hi|hey|h) [A-Z][A-Za-z]*", out.text), out.text


def test_gbnf_errors_are_clear():
    for bad, words in [("root ::= foo", "not defined"), ("x ::= \"a\"", "root"), ("root ::= (\"a\"", "')'"),
                       ("root ::= \"a\" (?= \"b\")", "unexpected"), ("root ::= \"\\q\"", "escape")]:
        with pytest.raises(GBNFError, match=re.escape(words)):
            to_lark(bad)


def test_conflicts_and_bad_values_name_the_field(llm):
    with pytest.raises(ValueError, match="json_schema and regex"):
        llm.generate("x", SamplingParams(json_schema={}, regex="a"))
    with pytest.raises(ValueError, match="regex and controller"):
        llm.generate("x", SamplingParams(regex="a"), controller="fork")
    with pytest.raises(ValueError, match="choice"):
        llm.generate("x", SamplingParams(choice=[]))
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.generate("x", SamplingParams(json_schema="{nope"))
    with pytest.raises(ValueError, match="logit_bias: token id 100000"):
        llm.generate("x", SamplingParams(logit_bias={100000: 1}))
    with pytest.raises(ConstraintError, match="whitespace_pattern"):
        whitespace_of("[ ]+", None, "structured_outputs")


def test_json_schema_options():
    arg = json.loads(json_schema({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}},
                                 whitespace="flexible", no_additional_properties=True).arg)
    assert arg["x-rudder-whitespace"] == "flexible"
    assert arg["additionalProperties"] is False and arg["properties"]["a"]["additionalProperties"] is False


def test_chat_and_stream_take_structured_params(llm):
    out = llm.chat([{"role": "user", "content": "pick"}], SamplingParams(choice=["yes", "no"], seed=1))
    assert out.text in ("yes", "no")
    both = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                    SamplingParams(regex="[0-9]{3}", seed=2))
    assert len(both) == 2 and all(re.fullmatch("[0-9]{3}", c.text) for c in both)
    text = "".join(d.text for d in llm.stream("x", SamplingParams(regex="z{5}", max_tokens=10)))
    assert text == "zzzzz"
    with pytest.raises(ValueError, match="messages"):
        llm.chat("just a string")


def test_cli_structured_flags_version_and_a_bad_device(tmp_path):
    from typer.testing import CliRunner

    from rudder import __version__
    from rudder.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).output.strip() == f"rudder {__version__}"
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    out = runner.invoke(app, ["generate", "-m", "tiny", "--json-schema", f"@{schema}", "--seed", "1", "x"])
    assert out.exit_code == 0, out.output
    jsonschema.validate(json.loads(out.stdout.strip()), SCHEMA)
    out = runner.invoke(app, ["generate", "-m", "tiny", "--choice", "up", "--choice", "down", "x"])
    assert out.exit_code == 0 and out.stdout.strip() in ("up", "down")
    for args, words in [(["--device", "nowhere"], "not a torch device"), (["--device", "cuda:7"], "--device cuda:7"),
                        (["--regex", "a", "--choice", "b"], "give one of"), (["--json-schema", "@missing.json"],
                                                                           "no such file")]:
        out = runner.invoke(app, ["generate", "-m", "tiny", *args, "x"])
        assert out.exit_code == 1 and words in out.output and "Traceback" not in out.output, (args, out.output)
        assert len(out.output.strip().splitlines()) == 1
