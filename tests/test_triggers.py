"""The `triggers` controller (controllers/triggers.c): free text until a trigger string, then a
constraint (JSON Schema, regex or grammar) until its text is complete, then an end string and
free text again (or the end of the output). Driven in the product's sandbox
(rudder.controller.ControllerRuntime) by scripted texts on the byte-level and the small BPE test
tokenizers; the last test runs SmolLM2 (`model`).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.build import builtin_controller
from rudder.tokenizer import Tokenizer
from test_guest_sdk import tiny_bpe_tokenizer

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
TOOL = {"triggers": [{"begin": "<call>", "json": POINT, "end": "</call>"}]}


@pytest.fixture(scope="module", params=["byte", "bpe"])
def tok(request):
    return Tokenizer.byte_level(512) if request.param == "byte" else tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def rt(tok):
    runtime = ControllerRuntime(tok, Limits(mid_process_ms=2000, init_ms=5000))
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def module(rt):
    return rt.load(builtin_controller("triggers"))


def allowed(mask, t: int) -> bool:
    return bool((int(mask[t >> 5]) >> (t & 31)) & 1)


class Walk:
    """Writes `text` as a model would: the next token of its canonical tokenization at a
    sampling step (it must be allowed), forced tokens where the controller forces them (they
    must be the text's). Records what each step was: "free" (no mask), "mask", "list" (a
    sampled token and the forced tokens of its ff list) or "ff"."""

    def __init__(self, rt, module, tok, arg, text: str):
        self.tok, self.data = tok, text.encode()
        self.ctl = rt.start(module, json.dumps(arg) if not isinstance(arg, str) else arg)
        self.kinds: list[tuple[str, bytes]] = []   # (kind, the bytes appended)
        self.stopped = False

    def run(self):
        tok, data = self.tok, self.data
        branches = self.ctl.mid_process(0, 0, [tok.bos_token_id, *tok.encode("go")])
        pos = 0
        while pos < len(data):
            if not branches:
                self.stopped = True
                return self
            [b] = branches
            if b.mask is None and b.ff:
                append, kind = list(b.ff[0]), "ff"
            else:
                t = tok.encode(data[pos:].decode(errors="ignore"))[0]
                if b.mask is not None:
                    assert allowed(b.mask, t), f"{tok.token_bytes[t]!r} refused after {data[:pos]!r}"
                append = next((list(lst) for lst in b.ff if lst[0] == t), [t]) if b.mask is not None else [t]
                kind = "free" if b.mask is None else "list" if len(append) > 1 else "mask"
            got = b"".join(tok.token_bytes[x] for x in append)
            assert data[pos:].startswith(got), (data[:pos], got)
            self.kinds.append((kind, got))
            pos += len(got)
            branches = self.ctl.mid_process(0, 0, append)
        self.stopped = not branches
        self.last = branches
        return self

    def kind_at(self, text: bytes) -> set[str]:
        """The kinds of the steps whose bytes overlap where `text` first occurs."""
        at = self.data.index(text)
        out, pos = set(), 0
        for kind, got in self.kinds:
            if pos < at + len(text) and pos + len(got) > at:
                out.add(kind)
            pos += len(got)
        return out


def test_free_then_constrained_then_free_again(rt, module, tok):
    text = 'I call <call>{"x":12,"y":-3}</call> and then <call>{"x":1,"y":2}</call> done'
    w = Walk(rt, module, tok, TOOL, text).run()
    assert w.kind_at(b"I call") == {"free"}                 # no mask before the trigger
    assert w.kind_at(b"12") == {"mask"}                     # the model writes the values, masked
    assert w.kind_at(b',"y":') == {"list"}                  # the schema forces the key
    assert w.kind_at(b"</call>") == {"ff"}                  # the end string is forced
    assert w.kind_at(b" and then") == {"free"}              # free again
    assert w.kind_at(b'"x":1,') <= {"mask", "list", "ff"}   # the trigger fires a second time
    assert w.kind_at(b" done") == {"free"} and not w.stopped


def test_the_constraint_refuses_what_breaks_it(rt, module, tok):
    with pytest.raises(AssertionError, match="refused"):
        Walk(rt, module, tok, TOOL, 'ok <call>{"x":"no"}').run()


def test_stop_ends_the_output_after_the_segment(rt, module, tok):
    arg = {"triggers": [{"begin": "Answer: ", "regex": "(yes|no)", "stop": True}]}
    w = Walk(rt, module, tok, arg, "I thought about it. Answer: no").run()
    assert w.stopped and w.kind_at(b"I thought") == {"free"}
    # with an end string, the end string first, then the stop; where the number may go on, the
    # end string's first token is offered beside its digits (and its list carries the rest)
    arg = {"triggers": [{"begin": "[", "regex": "[0-9]+", "end": "]!", "stop": True}]}
    w = Walk(rt, module, tok, arg, "It is [42]!").run()
    assert w.stopped and w.kind_at(b"]!") == {"list"}
    arg = {"triggers": [{"begin": "[", "regex": "[0-9]{2}", "end": "]!", "stop": True}]}
    w = Walk(rt, module, tok, arg, "It is [42]!").run()
    assert w.stopped and w.kind_at(b"]!") == {"ff"}   # complete, nothing can follow: forced


def test_a_grammar_segment_and_the_end_offered_where_it_may_end(rt, module, tok):
    """A constraint that is complete but could go on (a number): the end string's first token is
    allowed beside its continuations, and carries the rest of the end string as an ff list."""
    arg = {"triggers": [{"begin": "=", "grammar": 'start: NUM\nNUM: /[0-9]+/\n', "end": ";"}]}
    w = Walk(rt, module, tok, arg, "a=12; b=345; c").run()
    assert w.kind_at(b"12") == {"mask"} and w.kind_at(b" b") == {"free"}
    assert w.kind_at(b";") == {"mask"}   # (sampled: the end string is one token)


def test_a_trigger_that_spans_tokens_and_text_after_it_in_the_same_token(rt, module):
    """On the BPE tokenizer: the trigger "o w" ends inside the token " world" ("Hello", " world");
    the rest of that token ("orld") is the constrained text's beginning."""
    tok = tiny_bpe_tokenizer()
    r = ControllerRuntime(tok, Limits(mid_process_ms=2000, init_ms=5000))
    m = r.load(builtin_controller("triggers"))
    arg = {"triggers": [{"begin": "o w", "regex": "orld[!?]", "stop": True}]}
    w = Walk(r, m, tok, arg, "Hello world!").run()
    assert w.stopped and w.kind_at(b"!") == {"mask"}
    r.close()


def test_a_token_past_its_trigger_with_refused_text_is_taken_back(rt, module):
    """"Paris" is one token; with the trigger "Pa" its "ris" does not begin a number: the token
    is taken back and "Pa" written instead, and the number follows."""
    tok = tiny_bpe_tokenizer()
    r = ControllerRuntime(tok, Limits(mid_process_ms=2000, init_ms=5000))
    ctl = r.start(r.load(builtin_controller("triggers")), json.dumps({"triggers": [{"begin": "Pa", "regex": "[0-9]+"}]}))
    [b] = ctl.mid_process(0, 0, [tok.bos_token_id])
    assert b.mask is None and not b.ff   # free text
    [paris] = tok.encode("Paris")
    [b] = ctl.mid_process(0, 0, [paris])
    assert b.backtrack == 1 and b.mask is None
    assert b"".join(tok.token_bytes[t] for t in b.ff[0]) == b"Pa"
    [b] = ctl.mid_process(0, 1, b.ff[0])
    assert b.mask is not None
    digits = {tok.token_bytes[t] for t in np.flatnonzero(np.unpackbits(b.mask.view(np.uint8), bitorder="little"))}
    assert digits == {bytes([c]) for c in b"0123456789"}
    r.close()


def test_backtrack_into_an_earlier_segment(rt, module, tok):
    """Two segments of the same trigger; taking tokens back into the first one gives the same
    answer as the first time there."""
    arg = {"triggers": [{"begin": "<", "regex": "[a-z]+", "end": ">"}]}
    text = "x <ab> y <cd> z"
    first = Walk(rt, module, tok, arg, text).run()
    ids = [t for _, got in first.kinds for t in tok.encode(got.decode())]
    ctl = rt.start(module, json.dumps(arg))
    ctl.mid_process(0, 0, [tok.bos_token_id, *tok.encode("go")])
    upto = tok.encode("x <a")
    want = [b.mask.copy() for b in [ctl.mid_process(0, 0, upto)[0]]][0]
    ctl.mid_process(0, 0, tok.encode("b> y <cd"))
    [b] = ctl.mid_process(0, len(tok.encode("b> y <cd")), [])   # back to after "x <a"
    assert np.array_equal(b.mask, want) and len(ids) > 5


def no_eos_mask(b, tok) -> bool:
    """A mask that allows every token with text: no EOS, no other special token (they could end
    the output too)."""
    bits = np.unpackbits(b.mask.view(np.uint8), bitorder="little")[:tok.vocab_size]
    text = np.array([t not in tok.special_token_ids and len(tok.token_bytes[t]) > 0 for t in range(tok.vocab_size)])
    return bool(np.array_equal(bits.astype(bool), text)) and not bits[tok.eos_token_id]


def test_reasoning_then_a_start_constraint(rt, module, tok):
    """Free thinking until the end string, then the start constraint from the byte after it; while
    thinking, EOS is refused (an answer must come)."""
    arg = {"reasoning": {"end": "</think>"}, "start": {"json": POINT, "stop": True}}
    w = Walk(rt, module, tok, arg, '<think>x is 1, and y is 2</think>{"x":1,"y":2}').run()
    assert w.kind_at(b"and y is") == {"mask"}    # thinking: every token but EOS
    assert w.kind_at(b'"y":') <= {"list", "ff"} and w.stopped
    ctl = rt.start(module, json.dumps(arg))
    [b] = ctl.mid_process(0, 0, [tok.bos_token_id])
    assert no_eos_mask(b, tok)
    # a triggers trigger in the thinking does not fire: only the end string counts
    arg = {"reasoning": {"end": "</think>"}, "triggers": [{"begin": "<", "regex": "[0-9]+", "end": ">"}]}
    w = Walk(rt, module, tok, arg, "<think>a<b</think> then <12> and").run()
    assert w.kind_at(b"a<b") == {"free"} and w.kind_at(b"12") == {"mask"} and w.kind_at(b" and") == {"free"}


def test_the_reasoning_budget_forces_the_end_string(rt, module, tok):
    """Once `budget` tokens are generated, the rest of the end string is fast-forwarded (also when
    part of it is written), and the constraint follows."""
    budget = 4
    arg = {"reasoning": {"end": "</think>", "budget": budget}, "start": {"regex": "[0-9]+!", "stop": True}}
    head = "".join(tok.token_bytes[t].decode() for t in tok.encode("hmm, let me think a lot")[:budget])
    w = Walk(rt, module, tok, arg, head + "</think>42!").run()
    assert w.kind_at(b"</think>") == {"ff"} and w.stopped
    assert sum(len(got) for kind, got in w.kinds[:budget]) == len(head.encode())
    # "ab</" then the budget: only "think>" is forced (on the byte-level tokenizer, one byte a token)
    ids = tok.encode("ab</th")[:budget]
    part = b"".join(tok.token_bytes[t] for t in ids).decode()
    written = next(k for k in range(len("</think>"), -1, -1) if part.endswith("</think>"[:k]))
    assert written >= 1 or len(tok.token_bytes) > 512
    w = Walk(rt, module, tok, arg, part + "</think>"[written:] + "7!").run()
    assert w.kinds[budget] == ("ff", "</think>"[written:].encode()) and w.stopped


def test_at_least_one_refuses_eos_until_a_trigger_fired(rt, module, tok):
    arg = {"triggers": [{"begin": "<", "regex": "[0-9]+", "end": ">"}], "at_least_one": True}
    ctl = rt.start(module, json.dumps(arg))
    [b] = ctl.mid_process(0, 0, [tok.bos_token_id])
    assert no_eos_mask(b, tok)
    [b] = ctl.mid_process(0, 0, tok.encode("see <12>"))
    assert b.mask is None   # a trigger fired: free again, EOS allowed


def test_a_start_constraint_then_free_text_with_triggers(rt, module, tok):
    arg = {"start": {"regex": "[0-9]+", "end": ":"}, "triggers": [{"begin": "<", "regex": "[a-z]+", "end": ">"}]}
    w = Walk(rt, module, tok, arg, "42: then <ab> ok").run()
    assert w.kind_at(b"42") == {"mask"} and w.kind_at(b" then") == {"free"} and w.kind_at(b"ab") == {"mask"}
    ctl = rt.start(module, json.dumps(arg))
    [b] = ctl.mid_process(0, 0, [tok.bos_token_id])
    assert b.mask is not None and not allowed(b.mask, tok.eos_token_id)


@pytest.mark.parametrize("arg,message", [
    ("[", "triggers: the argument is not valid JSON"),
    ('{"triggers": []}', "with 1 to 16 triggers"),
    ('{"triggers": [{"json": {}}]}', '"begin": a string'),
    ('{"triggers": [{"begin": "x"}]}', 'exactly one of "json", "regex", "grammar"'),
    ('{"triggers": [{"begin": "x", "regex": "(a"}]}', "trigger 0: regex: pattern 0 at byte"),
    ('{"triggers": [{"begin": "x", "json": {"type": "strin"}}]}', 'trigger 0: json: unknown type in "type"'),
    ('{"triggers": [{"begin": "x", "grammar": "start: y"}]}', "trigger 0: grammar: "),
    ('{"triggers": [{"begin": "x", "regex": "a", "stop": 1}]}', '"stop" must be true or false'),
    ('{"triggers": [{"begin": "x", "regex": "a", "stopp": true}]}', 'unknown key "stopp" in trigger 0'),
    ('{"triggers": [{"begin": "x", "regex": "a"}], "at_least": true}', 'unknown key "at_least" in the argument'),
    ('{"start": {"begin": "x", "regex": "a"}}', 'unknown key "begin" in "start"'),
    ('{"start": {"regex": "(a"}}', '"start": regex: pattern 0'),
    ('{"reasoning": {"end": ""}}', '"reasoning" needs "end"'),
    ('{"reasoning": {"end": "</think>", "budget": -1}}', '"budget" must be a whole number'),
    ('{"reasoning": {"end": "</think>", "budget": 2}, "at_least_one": true}', '"at_least_one" needs triggers'),
])
def test_bad_arguments_fail_at_start(rt, module, arg, message):
    with pytest.raises(ControllerError) as info:
        rt.start(module, arg)
    assert info.value.kind == "start" and message in f"{info.value}\n{info.value.log_tail}"


@pytest.mark.model
def test_smollm2_writes_a_sentence_then_json_after_the_trigger():
    """Think, then answer in JSON: the text before the trigger is the model's own, the text after
    it a JSON document valid against the schema (then the output ends)."""
    from rudder import LLM, SamplingParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    arg = json.dumps({"triggers": [{"begin": ".", "json": schema, "stop": True}]})
    prompt = "Where is the Eiffel Tower? Answer with one sentence, then a JSON object with its city and country."
    llm = LLM("smollm2")
    params = [SamplingParams(max_tokens=160, seed=s, temperature=0.7) for s in range(4)]
    outs = llm.generate([prompt] * len(params), params, chat=True, controller="triggers", controller_arg=arg)
    done = 0
    for out in outs:
        assert out.error is None, out.error
        if out.finish_reason == "length":
            continue
        sentence, _, doc = out.text.partition(".")
        assert len(sentence.split()) >= 3, out.text    # free text first
        jsonschema.validate(json.loads(doc), schema)   # then valid JSON
        done += 1
    assert done >= 2, [o.text for o in outs]
