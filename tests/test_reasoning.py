"""Reasoning (host/rudder/reasoning.py): free thinking up to `</think>`, then the constraint; the
thinking comes back apart (`Completion.reasoning`, `reasoning_content` over HTTP, streamed as
deltas), and a budget forces the end marker. SmolLM2 does not think by itself: the tiny random
model and budgets make it "think" here, and the `model` test forces SmolLM2's answer to end
its thinking by the budget."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st
from openai import OpenAI

from rudder import LLM, SamplingParams
from rudder.reasoning import Reasoning, ReasoningSplitter, split
from rudder.server import ServerConfig
from serve_util import LiveServer

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"]}
R = Reasoning()


@pytest.mark.parametrize("text, thinking, answer", [
    ("<think>a b</think>{}", "a b", "{}"),
    ("  <think>\nhm</think>\n\nyes", "\nhm", "\n\nyes"),
    ("no start marker</think>ok", "no start marker", "ok"),
    ("<think>still thinking", "still thinking", None),
    ("<thi", "<thi", None),
    ("a </thin", "a </thin", None),
    ("x</think>y</think>z", "x", "y</think>z"),
])
def test_split(text, thinking, answer):
    assert split(text, R) == (thinking, answer)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "t", "h", "i", "n", "k", ">", "/", " ", "a", "\n", "<think>", "</think>",
                                 "</", "ink>"]), max_size=30), st.data())
def test_streaming_splits_like_the_whole_text(pieces, data):
    """However the text arrives, the streamed parts add up to the whole split, and each part only
    grows (nothing shown is taken back)."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    s, thinking, answer = ReasoningSplitter(R), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        t, x = s.feed(text[a:b])
        thinking, answer = thinking + t, answer + x
    t, x = s.finish()
    whole = split(text, R)
    assert (thinking + t, (answer + x) if s.ended else None) == whole


def test_reasoning_options_are_checked():
    with pytest.raises(ValueError, match="unknown field 'stop'"):
        Reasoning.of({"stop": 1})
    with pytest.raises(ValueError, match="thinking_token_budget"):
        Reasoning(budget=-1)
    assert Reasoning.of(True) == R and Reasoning.of(None) is None


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as llm:
        yield llm


def test_the_budget_ends_the_thinking_and_the_constraint_follows(llm):
    budget = 6
    params = [SamplingParams(max_tokens=80, seed=s, json_schema=POINT, reasoning={"budget": budget}) for s in range(4)]
    for out in llm.generate(["go"] * 4, params):
        assert out.error is None and out.finish_reason == "stop"
        n_thinking = next(i for i in range(len(out.token_ids) + 1)
                          if "</think>" in llm.tokenizer.decode(out.token_ids[:i]))
        assert n_thinking <= budget + len(llm.tokenizer.encode("</think>"))   # the marker forced at the budget
        jsonschema.validate(json.loads(out.text), POINT)   # the answer: valid JSON, nothing else
        assert "</think>" not in out.reasoning


def test_no_constraint_and_no_budget_splits_only(llm):
    [plain] = llm.generate(["go"], SamplingParams(max_tokens=20, seed=3))
    [split_out] = llm.generate(["go"], SamplingParams(max_tokens=20, seed=3, reasoning=True))
    assert split_out.token_ids == plain.token_ids            # no controller: the same tokens
    assert (split_out.reasoning, split_out.text or None) == split(plain.text, R)


def test_streamed_thinking_and_answer_add_up(llm):
    params = SamplingParams(max_tokens=60, seed=5, regex="[a-c]{3,8}", reasoning={"budget": 5})
    [whole] = llm.generate(["go"], params)
    deltas = list(llm.stream("go", params))
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.text for d in deltas) == whole.text and deltas[-1].finished
    assert all(d.backtrack_chars == 0 for d in deltas)


def test_reasoning_with_a_controller_is_refused(llm):
    with pytest.raises(ValueError, match="reasoning works with the built-in structured output"):
        llm.generate(["go"], SamplingParams(reasoning=True), controller="fork", controller_arg="2")


@pytest.fixture(scope="module")
def server():
    with LiveServer(ServerConfig(model="tiny", max_tokens=500, reasoning=Reasoning())) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)


def test_chat_returns_reasoning_content_and_a_constrained_answer(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    for seed in range(3):
        out = chat(client, response_format=fmt, seed=seed, max_tokens=80, extra_body={"thinking_token_budget": 8})
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(msg.content), POINT)
        assert isinstance(msg.model_extra["reasoning_content"], str) and "</think>" not in msg.content


def test_reasoning_content_streams_as_deltas(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    kw = dict(response_format=fmt, seed=7, max_tokens=80, extra_body={"thinking_token_budget": 8})
    whole = chat(client, **kw).choices[0].message
    thinking = content = ""
    for chunk in chat(client, stream=True, **kw):
        delta = chunk.choices[0].delta
        thinking += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (thinking, content) == (whole.model_extra["reasoning_content"], whole.content)


def test_thinking_token_budget_is_refused_where_it_cannot_apply(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="thinking_token_budget applies to /v1/chat/completions"):
        client.completions.create(model="tiny", prompt="hi", extra_body={"thinking_token_budget": 3})
    with pytest.raises(openai.BadRequestError, match="n > 1 with thinking_token_budget"):
        chat(client, n=2, extra_body={"thinking_token_budget": 3})


def test_without_a_reasoning_parser_the_budget_is_a_400():
    import openai

    with LiveServer(ServerConfig(model="tiny")) as s:
        c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="needs a server started with --reasoning-parser"):
            chat(c, extra_body={"thinking_token_budget": 3})


@pytest.mark.model
def test_smollm2_thinks_within_the_budget_then_answers_in_json():
    """SmolLM2 writes whatever it writes for `budget` tokens; then `</think>` is forced and the
    answer is a valid document."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    with LLM("smollm2") as llm:
        params = [SamplingParams(max_tokens=80, seed=s, temperature=0.7, json_schema=schema,
                                 reasoning={"budget": 12}) for s in range(3)]
        for out in llm.generate(["Where is the Eiffel Tower?"] * 3, params, chat=True):
            assert out.error is None and out.finish_reason == "stop", out
            assert out.reasoning.strip()
            jsonschema.validate(json.loads(out.text), schema)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_a_named_or_required_tool_call_follows_the_thinking(client, tool_choice):
    for seed in range(3):
        out = chat(client, tools=[WEATHER, CLOCK], tool_choice=tool_choice, seed=seed, max_tokens=120,
                   parallel_tool_calls=False, extra_body={"thinking_token_budget": 6})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert isinstance(choice.message.model_extra["reasoning_content"], str)
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert len(choice.message.tool_calls) == 1
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
            assert args in ([{"zone": z} for z in ("UTC", "CET")] + [{"city": c} for c in ("Paris", "Oslo")])
