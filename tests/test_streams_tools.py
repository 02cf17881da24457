"""The pieces behind the server's streams, without a server: HeldStream (what a standard client
may see of a stream whose controller backtracks) and ToolCallParser (tool calls read out of the
output, whole or in pieces), and the tool-call prompt and schemas."""

from __future__ import annotations

import json
import random

import pytest

from rudder.engine.output import BacktrackTooFar, Delta, HeldStream
from rudder.server.errors import APIError
from rudder.server.tools import ToolCallParser, ToolPlan, render_messages


def delta(text="", tokens=(), back_chars=0, back_tokens=0, finished=False, logprob=None):
    return Delta(0, 0, text, list(tokens), finished, "stop" if finished else None,
                 [logprob] if logprob else [], backtrack_chars=back_chars, backtrack_tokens=back_tokens)


def test_window_zero_releases_at_once():
    s = HeldStream(0)
    assert s.push(delta("ab", [1, 2])).text == "ab"
    assert s.push(delta("c", [3], finished=True)).text == "c"


def test_a_window_holds_the_last_tokens_until_enough_follow():
    s = HeldStream(2)
    assert s.push(delta("a", [1])).text == ""
    assert s.push(delta("b", [2])).text == ""
    assert s.push(delta("c", [3])).text == "a"          # two tokens follow "a"
    s.push(delta("", [], back_chars=2, back_tokens=2))  # "bc" taken back: never shown
    assert s.push(delta("X", [9])).text == ""
    assert s.push(delta("Y", [8])).text == ""
    last = s.push(delta("", [], finished=True))
    assert last.text == "XY" and last.token_ids == [9, 8]


def test_logprobs_travel_with_their_tokens():
    s = HeldStream(0)
    lp = {"token": 5, "logprob": -0.5, "top": []}
    piece = s.push(delta("hey", [5, 6, 7], logprob=lp))
    assert piece.logprobs == [lp, None, None]  # the sampled token, then forced ones


def test_a_backtrack_past_the_window_is_refused():
    s = HeldStream(1)
    s.push(delta("a", [1]))
    s.push(delta("b", [2]))  # "a" released
    with pytest.raises(BacktrackTooFar, match="max_backtrack"):
        s.push(delta("", [], back_chars=2, back_tokens=2))


def test_none_holds_everything_and_allows_any_backtrack():
    s = HeldStream(None)
    for ch in "hello":
        assert s.push(delta(ch, [ord(ch)])).text == ""
    s.push(delta("", [], back_chars=4, back_tokens=4))
    assert s.push(delta("ey", [1, 2], finished=True)).text == "hey"


def test_held_text_equals_the_final_text_under_random_backtracks():
    """A controller that keeps its declaration (never removes a token once `window` tokens have
    followed it) never makes a client see text that is later taken back."""
    rng = random.Random(0)
    for trial in range(300):
        window = rng.choice([0, 1, 2, 3, 5, None])
        s, shown, final = HeldStream(window), "", ""
        tokens: list[list] = []  # [text, most tokens that ever followed it]
        for _ in range(40):
            removable = [i for i in range(len(tokens)) if window is None or tokens[i][1] < window]
            if removable and rng.random() < 0.3 and len(tokens) - removable[0] > 0:
                first = rng.choice(removable)  # back to a token that may still be taken back
                if any(t[1] >= (window if window is not None else 10**9) for t in tokens[first:]):
                    continue
                gone = tokens[first:]
                del tokens[first:]
                chars = sum(len(t[0]) for t in gone)
                final = final[: len(final) - chars]
                shown += s.push(delta("", [], back_chars=chars, back_tokens=len(gone))).text
            else:
                t = rng.choice(["a", "bc", "d"])
                for i, old in enumerate(tokens):
                    old[1] = max(old[1], len(tokens) - i)
                tokens.append([t, 0])
                final += t
                shown += s.push(delta(t, [len(tokens)])).text
            assert final.startswith(shown), (trial, window)
        shown += s.push(delta("", [], finished=True)).text
        assert shown == final


def test_parser_reads_a_bare_call_in_pieces():
    text = '{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": "x\\"y"}}'
    for cut in range(1, len(text)):
        p = ToolCallParser("json")
        events = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        assert [e for e in events if e[0] == "call"][0][3] == "f"
        assert "".join(e[2] for e in events if e[0] == "args") == '{"a": [1, {"b": "}"}], "c": "x\\"y"}'
        assert p.tool_calls()[0]["function"]["arguments"] == '{"a": [1, {"b": "}"}], "c": "x\\"y"}'


def test_parser_tagged_text_and_parallel_calls():
    p = ToolCallParser("tagged")
    p.feed("Hello <tool_call> not a call")
    p.finish()
    assert p.content == "Hello <tool_call> not a call" and not p.calls
    p = ToolCallParser("tagged")
    text = ('<tool_call>\n{"name":"f", "arguments":{"x":1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    for ch in text:
        p.feed(ch)
    p.finish()
    calls = p.tool_calls()
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {}]
    assert p.content == "" and len({c["id"] for c in calls}) == 2


def test_plans_and_prompts():
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                                      "required": ["p"], "$defs": {"P": {"enum": [1, 2]}}}}
    named = ToolPlan.of([{"type": "function", "function": fn}], {"type": "function", "function": {"name": "f"}}, None)
    schema = json.loads(named.constraint.arg)
    assert schema["properties"]["name"] == {"const": "f"}
    assert schema["properties"]["arguments"]["properties"]["p"]["$ref"] == "#/properties/arguments/$defs/P"
    assert named.prompt_suffix == "<tool_call>\n" and named.mode == "json"
    auto = ToolPlan.of([{"type": "function", "function": fn}], None, False)
    assert auto.constraint.controller == "grammar" and "call*" not in auto.constraint.arg
    assert "%json " + named.constraint.arg in auto.constraint.arg   # the call schema of every mode
    assert "x-rudder-strict" not in named.constraint.arg
    strict = ToolPlan.of([{"type": "function", "function": {**fn, "strict": True}}], "auto", None)
    assert '"x-rudder-strict": true' in strict.constraint.arg
    assert ToolPlan.of([{"type": "function", "function": fn}], "none", None).constraint is None
    assert ToolPlan.of(None, None, None) is None
    with pytest.raises(APIError, match="tool_choice needs tools"):
        ToolPlan.of(None, "required", None)
    with pytest.raises(APIError, match="unique"):
        ToolPlan.of([{"type": "function", "function": fn}] * 2, "auto", None)
    msgs = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], auto)
    assert msgs[0]["content"].startswith("Be brief.") and "<tools>" in msgs[0]["content"]
    assert render_messages([{"role": "user", "content": "hi"}], ToolPlan.of(
        [{"type": "function", "function": fn}], "none", None)) == [{"role": "user", "content": "hi"}]
