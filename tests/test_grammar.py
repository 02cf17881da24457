"""The `grammar` controller and the guest SDK's grammar engine (guest-sdk/rudder_grammar.c).

- grammar errors: one clear line with line:column, at request start;
- property: random sentences of several grammars (a small generator over the grammar text,
  bounded depth), tokenized, are followed token by token: every token is in the mask at its
  step, fast-forwards stay on the sentence, and the run ends exactly on it;
- agreement: masks equal llguidance's step by step (SmolLM2 vocabulary, special tokens aside);
- sampled outputs (SmolLM2, many seeds) are sentences by llguidance's matcher;
- the CLI end to end.
Everything runs in the product's sandbox (rudder.controller.ControllerRuntime);
tests/test_controllers.py checks that the mini host of tests/test_guest_sdk.py reads the
grammar controller's answers the same way. Tests that need SmolLM2's tokenizer files are
marked `model`.
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_controllers import allowed_ids, make_runtime, run_request, text_of  # noqa: E402
from test_guest_sdk import probe_module  # noqa: E402

from rudder.controller.build import builtin_controller  # noqa: E402
from rudder.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARITH = (REPO / "examples/grammars/arith.lark").read_text()
SQL = (REPO / "examples/grammars/sql.lark").read_text()
JSON = (REPO / "examples/grammars/json.lark").read_text()
# Ambiguous, left recursive, with an optional (nullable) part and lexemes that merge.
PARENS = """
start: s
s: s s | "(" s? ")" | WORD
WORD: /[a-z]+/
"""
# Nullable rules in a row, a terminal built from other terminals, an ignored comment.
LIST = """
start: "[" items "]"
items: item? ("," item?)*
item: KEY "=" VALUE | KEY
KEY: LETTER (LETTER | DIGIT)*
VALUE: DIGIT+ | "'" LETTER* "'"
LETTER: /[a-z]/
DIGIT: /[0-9]/
COMMENT: /#[^\\n]*\\n/
%ignore COMMENT
%ignore " "
"""

#: Samples for the generator, per grammar: a terminal name or an inline /regex/'s text -> strings
#: it matches.
SAMPLES = {
    "arith": {"NUMBER": ["0", "7", "42", "3.14", "100", "2.5"]},
    "sql": {"NAME": ["a", "id", "user_name", "t1", "price"], "NUMBER": ["0", "42", "7"],
            "STRING": ["'x'", "''", "'hello world'"], "OP": ["=", "<", ">=", "!=", "<="]},
    "json": {"STRING": ['""', '"a"', '"hello"', '"q\\"uote"', '"caf\u00e9"', '"line\\n"', '"\\u00e9"'],
             "NUMBER": ["0", "-1", "12.5", "3e10", "-0.25E-3", "7"]},
    "parens": {"WORD": ["a", "xy", "hello"]},
    "list": {"KEY": ["a", "k9", "name"], "VALUE": ["1", "42", "''", "'abc'"], "COMMENT": ["#note\n"]},
}

GRAMMARS = {"arith": ARITH, "sql": SQL, "json": JSON, "parens": PARENS, "list": LIST}


# ---------------------------------------------------------------------------- a random generator


def parse_lark(text: str):
    """The definitions of a grammar in our Lark subset: name -> expression tree, and whether it
    has %ignore. Trees: ("alt", [...]), ("seq", [...]), ("opt"|"star"|"plus", x), ("name", n),
    ("lit", s), ("re", r)."""
    defs, ignore, current = {}, False, None
    for line in text.split("\n"):
        line = re.sub(r"^\s*//.*", "", line)
        m = re.match(r"^[?!]?([A-Za-z_]\w*)\s*:(.*)", line)
        if m:
            current = m.group(1)
            defs[current] = m.group(2)
        elif line.startswith("%ignore"):
            ignore, current = True, None
        elif line.strip() and current:
            defs[current] += " " + line.strip()
    tok = re.compile(r'\s*("(?:[^"\\]|\\.)*"|/(?:[^/\\]|\\.)*/|[A-Za-z_]\w*|[|()\[\]?*+])')

    def parse(src):
        toks, at = [t for t in tok.findall(src)], [0]

        def peek():
            return toks[at[0]] if at[0] < len(toks) else None

        def alts():
            out = [seq()]
            while peek() == "|":
                at[0] += 1
                out.append(seq())
            return ("alt", out)

        def seq():
            items = []
            while peek() not in (None, "|", ")", "]"):
                t = toks[at[0]]
                at[0] += 1
                if t in "([":
                    x = alts()
                    at[0] += 1
                    x = ("opt", x) if t == "[" else x
                elif t.startswith('"'):
                    x = ("lit", ast.literal_eval(t))
                elif t.startswith("/"):
                    x = ("re", t[1:-1])
                else:
                    x = ("name", t)
                while peek() in ("?", "*", "+"):
                    x = ({"?": "opt", "*": "star", "+": "plus"}[toks[at[0]]], x)
                    at[0] += 1
                items.append(x)
            return ("seq", items)

        return alts()

    return {name: parse(src) for name, src in defs.items()}, ignore


def heights(defs) -> dict:
    """The least derivation depth of each rule (for bounding the generator)."""
    h = {n: float("inf") for n in defs}

    def of(x):
        k = x[0]
        if k == "alt":
            return min(of(a) for a in x[1])
        if k == "seq":
            return max([of(i) for i in x[1]], default=0)
        if k in ("opt", "star"):
            return 0
        if k == "plus":
            return of(x[1])
        if k == "name" and x[1][0].islower():
            return h[x[1]] + 1
        return 0

    for _ in range(len(defs) + 2):
        for n, x in defs.items():
            if n[0].islower():
                h[n] = min(h[n], of(x))
    return h, of


def generate(name: str, rng: random.Random, max_depth: int = 6) -> str:
    text, samples = GRAMMARS[name], SAMPLES[name]
    defs, ignore = parse_lark(text)
    _, of = heights(defs)
    lexemes: list[str] = []

    def gen(x, depth):
        k = x[0]
        deep = depth > max_depth
        if k == "alt":
            options = x[1] if not deep else sorted(x[1], key=of)[:1]
            gen(rng.choice(options), depth)
        elif k == "seq":
            for i in x[1]:
                gen(i, depth)
        elif k == "opt":
            if not deep and rng.random() < 0.5:
                gen(x[1], depth)
        elif k in ("star", "plus"):
            for _ in range((k == "plus") + (0 if deep else rng.randrange(3))):
                gen(x[1], depth)
        elif k == "lit":
            lexemes.append(x[1])
        elif k == "re":
            lexemes.append(rng.choice(samples[x[1]]))
        elif x[1][0].islower():
            gen(defs[x[1]], depth + 1)
        elif x[1] in samples:
            lexemes.append(rng.choice(samples[x[1]]))
        else:
            gen(defs[x[1]], depth)

    gen(defs["start"], 0)
    out = lexemes[0] if lexemes else ""
    for lx in lexemes[1:]:
        glue = (x := out[-1:] + lx[:1]).isalnum() or "_" in x
        out += (" " if glue or rng.random() < 0.4 else "") if ignore else ""
        out += lx
    return out


# ---------------------------------------------------------------------------- helpers


def follow_text(target: bytes, tok: Tokenizer):
    """A picker that steers the run to exactly `target`: the target's own tokens while the run
    is on them, else the tokens of what is left (after a fast-forward); EOS at the end."""
    ids = tok.encode(target.decode())

    def pick(allowed, seq):
        done = text_of(tok, seq.generated)
        assert target.startswith(done), (done, target)
        if done == target:
            t = tok.eos_token_id
        elif seq.generated == ids[: len(seq.generated)]:
            t = ids[len(seq.generated)]
        else:
            t = tok.encode(target[len(done):].decode())[0]
        assert t in allowed, (tok.token_bytes[t], done, target)
        return t

    return pick


@pytest.fixture(scope="module")
def smol_tok(smollm2_folder) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder)


@pytest.fixture(scope="module")
def rt():
    """The product's sandbox for any tokenizer (made on demand, one per tokenizer)."""
    made = {}

    def get(tok):
        if id(tok) not in made:
            made[id(tok)] = make_runtime("real", tok)
        return made[id(tok)]

    yield get
    for r in made.values():
        if hasattr(r, "close"):
            r.close()


# ---------------------------------------------------------------------------- errors

BAD = [
    ("", "the grammar is empty"),
    ("// nothing\n", "the grammar is empty"),
    ('expr: "x"\n', "no 'start' rule"),
    ('start: a\n', "1:8: undefined rule 'a'"),
    ('start: "x" B\n', "1:12: undefined terminal 'B'"),
    ('start: "x"\nunused: "y"\n', "2:1: rule is not reachable from start: 'unused'"),
    ('start: "x"\nT: "y"\n', "2:1: terminal is never used: 'T'"),
    ('start: "x" start\n', "rule can never finish"),
    ('start: ("x"\n', "2:1: expected ')'"),
    ('start: "x\n', "1:8: unterminated string"),
    ('start: /x\n', "unterminated regex"),
    ('start: "x"i\n', "1:11: flags after a string or regex are not supported"),
    ('start: "x" ; "y"\n', "1:12: unexpected character ';'"),
    ('start: "x"\n\x01\n', "2:1: unexpected character"),
    ('start: "x"\nstart: "y"\n', "2:1: defined twice: 'start'"),
    ('start: T\nT: /a*/\n', "2:1: terminal matches the empty string: 'T'"),
    ('start: T\nT: "a" T\n', "terminal refers to itself: 'T'"),
    ('start: T\nT: "a" r\nr: "b"\n', "a terminal cannot use the rule 'r'"),
    ('start: /a(/\n', "in a terminal:"),
    ('%import common.NUMBER\nstart: NUMBER\n', "1:1: unsupported directive (only %ignore is) '%import'"),
    ('start.2: "x"\n', "priorities are not supported"),
    ("start: " + "(" * 200 + '"x"' + ")" * 200 + "\n", "1:72: groups nested too deeply"),
    ("start: T0\n" + "".join(f"T{i}: T{i + 1}\n" for i in range(300)) + 'T300: "x"\n', "terminals nested too deeply"),
    ('start: "x" |\n  "y" "z" :\n', "2:11: expected a name"),
    # %json: the JSON engine's own message, at the element's line:column
    ('start: "x"\n  %json {"type": "nope"}\n', '2:3: %json: unknown type in "type" at #'),
    ('start: %json {"minimum": "a"}\n', '1:8: %json: must be a number: "minimum" at #'),
    ('start: %json "x"\n', "1:8: expected a JSON Schema object after %json"),
    ('start: %json {"type": "object"\n', "1:8: unterminated %json schema"),
    ('start: T\nT: "a" %json {}\n', "2:8: %json cannot be part of a terminal"),
    ('start: "a"\n%ignore %json {}\n', "%ignore takes a terminal name"),
    # a value and another lexeme that may begin alike at one point: refused, both named
    ('start: %json {"type": "object"} | "{}"\n',
     "1:8: %json may begin where \"{}\" may too, and both can begin with '{'"),
    ('start: a\na: %json {"type": "integer"} | %json {"type": "number"}\n',
     "2:4: %json may begin where the %json at 2:32 may too, and both can begin with '-'"),
    ('start: "a" %json {"type": "string"}\n%ignore /["x]/\n', "1:12: %json may begin where /[\"x]/ may too"),
    ('start: NAME %json {} | WORD "{"\nNAME: /[a-z]+/\nWORD: /[a-c]+/\n', "1:13: %json may begin where \"{\" may too"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_bad_grammars_fail_at_start_with_a_clear_message(rt, text, message):
    tok = Tokenizer.byte_level(512)
    r = rt(tok)
    with pytest.raises(Exception) as info:
        r.start(r.load(builtin_controller("grammar")), text)
    full = f"{info.value}\n{getattr(info.value, 'log_tail', '')}"
    assert "grammar: " + message in full or message in full, full


def test_example_grammars_compile_and_lark_prefixes_are_accepted(rt):
    """The example grammars, Lark's `?rule`, `!rule`, `-> alias` and `//` comments, and a chain
    of 40 terminals (nested, under the limit) are accepted, and each grammar then allows exactly
    what it should: its first tokens, and the whole of its sentences."""
    tok = Tokenizer.byte_level(512)
    r = rt(tok)
    mod = r.load(builtin_controller("grammar"))
    prompt = [1, *tok.encode("go")]
    # The bytes a sentence can start with (ignored text is only allowed between lexemes,
    # docs/grammar.md); SQL's only start is the keyword and the list's its "[": they are
    # fast-forwarded, all of it: with one byte per token no longer token could merge the last
    # one with what follows (docs/constraints.md; test_forced_text_is_fast_forwarded holds one
    # back).
    first = {"arith": set(b"0123456789(-"), "json": set(b'{["-0123456789tfn'),
             "parens": set(b"(abcdefghijklmnopqrstuvwxyz")}
    forced = {"sql": "SELECT", "list": "["}
    for name, text in GRAMMARS.items():
        ctl = r.start(mod, text)
        [b] = ctl.mid_process(0, 0, prompt)
        if name in forced:
            assert b.mask is None and b.ff == [tok.encode(forced[name])]
        else:
            got = {tok.token_bytes[t][0] for t in allowed_ids(b.mask, tok.vocab_size)}
            assert got == first[name], (name, bytes(sorted(got ^ first[name])))
        ctl.close()
    prefixes = '?start: x -> alias\n!x: "a"\n    | "b" // comment\n'
    outs = {text_of(tok, s.generated) for pick in (allowed_ids_min, allowed_ids_max)
            for s in run_request(r, mod, prefixes, prompt, pick)}
    assert outs == {b"a", b"b"}   # both alternatives, and nothing of the comment or the alias
    chain = "start: T0\n" + "".join(f"T{i}: T{i + 1}\n" for i in range(40)) + 'T40: "x"\n'
    [s] = run_request(r, mod, chain, prompt, allowed_ids_min)
    assert text_of(tok, s.generated) == b"x" and s.finish in ("stop", "eos")


def allowed_ids_min(allowed, seq):
    return allowed.min()


def allowed_ids_max(allowed, seq):
    return allowed.max()


# ---------------------------------------------------------------------------- properties


def check_sentences(r, tok, name, n, seed=0):
    mod = r.load(builtin_controller("grammar"))
    rng = random.Random(seed)
    prompt = [tok.bos_token_id if tok.bos_token_id is not None else 1, *tok.encode("go")]
    seen = set()
    for _ in range(n):
        target = generate(name, rng).encode()
        seen.add(target)
        [s] = run_request(r, mod, GRAMMARS[name], prompt, follow_text(target, tok), max_tokens=400)
        assert text_of(tok, s.generated) == target, s.ctl.log_text()
        assert s.finish in ("eos", "stop")
    assert len(seen) > n // 3   # the generator does vary


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_random_sentences_are_followed_token_by_token_tiny_vocab(rt, name):
    check_sentences(rt(Tokenizer.byte_level(512)), Tokenizer.byte_level(512), name, 6)


@pytest.mark.model
@pytest.mark.parametrize("name", list(GRAMMARS))
def test_random_sentences_are_followed_token_by_token_smollm2(rt, smol_tok, name):
    check_sentences(rt(smol_tok), smol_tok, name, 12, seed=1)


def test_not_a_sentence_fails_clearly(rt):
    tok = Tokenizer.byte_level(512)
    r = rt(tok)
    ctl = r.start(r.load(builtin_controller("grammar")), ARITH)
    ctl.mid_process(0, 0, [1, *tok.encode("go")])
    with pytest.raises(Exception) as info:
        ctl.mid_process(0, 0, tok.encode("1+)"))
    full = f"{info.value}\n{getattr(info.value, 'log_tail', '')}"
    assert "does not continue a sentence" in full


def test_backtrack_restores_the_parse(rt):
    tok = Tokenizer.byte_level(512)
    r = rt(tok)
    ctl = r.start(r.load(builtin_controller("grammar")), ARITH)
    vocab = tok.vocab_size

    def allowed(branches):
        return {tok.token_bytes[t] for t in allowed_ids(branches[0].mask, vocab)}

    first = allowed(ctl.mid_process(0, 0, [1, *tok.encode("go")]))
    after_1 = allowed(ctl.mid_process(0, 0, tok.encode("1")))
    assert b")" not in after_1 and b"+" in after_1
    after_paren = allowed(ctl.mid_process(0, 0, tok.encode("+(2")))
    assert b")" in after_paren
    again = allowed(ctl.mid_process(0, 4, []))   # back to the start
    assert again == first
    assert allowed(ctl.mid_process(0, 0, tok.encode("1"))) == after_1


@pytest.mark.model
def test_forced_text_is_fast_forwarded(rt, smol_tok):
    """Bytes that no alternative escapes are appended without sampling, canonically tokenized;
    the last token waits when a longer token starting with it could follow (it could merge
    with the free text after it), not at the end."""
    r = rt(smol_tok)
    mod = r.load(builtin_controller("grammar"))
    grammar = 'start: "The answer is: " WORD " (final answer)"\nWORD: /[a-z]+/\n'
    ctl = r.start(mod, grammar)
    [b] = ctl.mid_process(0, 0, [1, *smol_tok.encode("go")])
    assert b.mask is None and b.ff[0] == smol_tok.encode("The answer is: ")[:-1]
    [b] = ctl.mid_process(0, 0, b.ff[0])
    assert b.mask is not None   # the last forced token " " could merge with the word: " yes"
    [b] = ctl.mid_process(0, 0, smol_tok.encode(" yes"))
    assert b.mask is not None   # the word may go on
    [b] = ctl.mid_process(0, 0, smol_tok.encode(" ("))
    assert b.mask is None and text_of(smol_tok, b.ff[0]) == b"final answer)"   # to the end
    assert ctl.mid_process(0, 0, b.ff[0]) == []   # complete, nothing can extend it: stop
    # SmolLM2 splits digits from what precedes them: no token " 4" exists, so before a number
    # the " " cannot merge with anything and all of the forced text comes at once.
    ctl = r.start(mod, 'start: "The answer is: " NUMBER\nNUMBER: /[0-9]+/\n')
    [b] = ctl.mid_process(0, 0, [1, *smol_tok.encode("go")])
    assert b.mask is None and b.ff[0] == smol_tok.encode("The answer is: ")


@pytest.mark.model
def test_few_choices_get_ff_lists(rt, smol_tok):
    """Few allowed tokens: each one after which bytes are forced carries the forced tokens."""
    r = rt(smol_tok)
    ctl = r.start(r.load(builtin_controller("grammar")), 'start: "yes, definitely" | "no, never"\n')
    [b] = ctl.mid_process(0, 0, [1, *smol_tok.encode("go")])
    assert b.mask is not None and b.ff
    for lst in b.ff:
        assert (b.mask[lst[0] >> 5] >> (lst[0] & 31)) & 1
        assert text_of(smol_tok, lst) in (b"yes, definitely", b"no, never")   # they finish it
    [s] = run_request(r, r.load(builtin_controller("grammar")), 'start: "yes, definitely" | "no, never"\n',
                      [1, *smol_tok.encode("go")], lambda allowed, seq: allowed[0])
    assert text_of(smol_tok, s.generated) in (b"yes, definitely", b"no, never") and s.steps == 2


# ---------------------------------------------------------------------------- agreement with llguidance

PROBE = r"""
#include "rudder.h"
#include "rudder_grammar.h"
/* Follows the appended tokens (and backtracks) and answers the full mask at every step (no
 * fast-forward). */
static rudder_grammar *g;
static rudder_gm_pos saved[4096];
static uint32_t n_gen;
int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    g = rudder_gm_new(arg, len, err, sizeof err);
    if (!g) { rudder_logf("%s\n", err); return 1; }
    saved[0] = rudder_gm_save(g);
    return 0;
}
void controller_step(const rudder_step *step, rudder_out *out) {
    n_gen = step->backtrack > n_gen ? 0 : n_gen - step->backtrack;
    rudder_gm_restore(g, saved[n_gen]);
    for (uint32_t i = 0; step->index > 0 && i < step->n_tokens && n_gen < 4095; i++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(step->tokens[i], &len);
        if (!rudder_gm_push(g, b, len)) { rudder_out_fail(out, "rejected"); return; }
        saved[++n_gen] = rudder_gm_save(g);
    }
    uint32_t *mask = rudder_out_mask(out);
    uint32_t n = rudder_gm_fill_mask(g, mask);
    if (rudder_gm_accepting(g)) { rudder_mask_set(mask, rudder_eos_token()); n++; }
    if (n) rudder_out_sample(out, mask);
}
"""


@pytest.fixture(scope="module")
def llg_tokenizer(smollm2_folder):
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(smollm2_folder / "tokenizer.json"))
    return llguidance.hf.from_tokenizer(hf, n_vocab=49152, eos_token=2)


def llg_matcher(lt, grammar: str):
    import llguidance

    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    return m


def llg_allowed(m, vocab: int) -> set[int]:
    bits = np.frombuffer(bytes(m.compute_bitmask()), dtype=np.uint8)
    return set(np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab]).tolist())


AGREEMENT_DOCS = {
    "arith": ["1 + 2*(3-4.5)", "((7))/-8", "12.75 * 3 - 1"],
    "json": ['{"a": [1, 2.5, true], "b": {"c": null}}', '[ "x" , -3e2, {} ]'],
    "sql": ["SELECT a, COUNT(*) FROM t WHERE a >= 3 AND (b = 'x' OR c < 2) ORDER BY a DESC LIMIT 10;"],
    "parens": ["(ab(c)d)x(y)()", "hello(world)"],
    "list": ["[a=1, b9 ,c='x',,#note\n d]", "[]"],
}


@pytest.mark.model
@pytest.mark.parametrize("name", list(AGREEMENT_DOCS))
def test_masks_agree_with_llguidance_step_by_step(smol_tok, llg_tokenizer, tmp_path, name):
    r = make_runtime("real", smol_tok)
    mod = r.load(probe_module(tmp_path, PROBE))
    special = set(smol_tok.special_token_ids)
    vocab = smol_tok.vocab_size
    compared = forced = 0
    for doc in AGREEMENT_DOCS[name]:
        ctl = r.start(mod, GRAMMARS[name])
        m = llg_matcher(llg_tokenizer, GRAMMARS[name])
        ids = smol_tok.encode(doc)
        branches = ctl.mid_process(0, 0, [1])
        for step, t in enumerate([*ids, None]):
            ours = set(allowed_ids(branches[0].mask, vocab).tolist()) - special if branches else set()
            theirs = llg_allowed(m, vocab) - special
            diff = sorted(ours ^ theirs)[:20]
            if m.compute_ff_bytes():
                # bytes are forced: llguidance keeps only the tokens of their canonical
                # tokenization (our controller fast-forwards those bytes instead)
                assert theirs <= ours, (doc, step, diff)
                forced += 1
            else:
                assert ours == theirs, (doc, step, diff, [smol_tok.token_bytes[x] for x in diff])
                compared += 1
            if t is None:
                assert m.is_accepting() and branches and (branches[0].mask[0] >> 2) & 1   # EOS both
                break
            assert m.consume_token(t)
            branches = ctl.mid_process(0, 0, [t])
        ctl.close()
    assert compared > 2 * forced


# ---------------------------------------------------------------------------- with the model


@pytest.fixture(scope="module")
def smol_llm():
    from rudder.llm import LLM

    llm = LLM("smollm2")
    yield llm
    llm.close()


@pytest.mark.model
@pytest.mark.parametrize("name,question", [
    ("arith", "Write an arithmetic expression that equals 10."),
    ("json", "Describe a cat as a JSON object."),
    ("sql", "Write a SQL query listing the names of users older than 30."),
])
def test_sampled_outputs_are_sentences(smol_llm, llg_tokenizer, name, question):
    from rudder.engine import SamplingParams

    n = 16  # (the JSON grammar's outputs finish within 100 tokens for about one seed in five)
    params = [SamplingParams(max_tokens=100, temperature=0.7, seed=seed) for seed in range(n)]
    outs = smol_llm.generate([question] * n, params, chat=True, controller="grammar", controller_arg=GRAMMARS[name])
    finished = 0
    for c in outs:
        assert c.finish_reason in ("stop", "eos", "length"), (c.finish_reason, c.error)
        m = llg_matcher(llg_tokenizer, GRAMMARS[name])
        ids = [t for t in c.token_ids if t != 2]
        assert m.consume_tokens(ids), (c.text, m.get_error())   # always a prefix of a sentence
        if c.finish_reason != "length":
            finished += 1
            assert m.is_accepting(), c.text
    assert finished >= 2   # (the small model may ramble past max_tokens; what it wrote is still checked)


@pytest.mark.model
def test_cli_runs_the_grammar_controller_and_reports_bad_grammars(tmp_path, smollm2_folder, llg_tokenizer):
    env = {"PYTHONPATH": str(REPO / "host")}
    import os

    env = {**os.environ, **env}
    cmd = [sys.executable, "-m", "rudder.cli", "run", "--controller", "grammar",
           "--arg", f"@{REPO / 'examples/grammars/arith.lark'}", "--chat", "--max-tokens", "40",
           "--seed", "3", "What is 2 plus 3? Answer with an arithmetic expression."]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip()
    m = llg_matcher(llg_tokenizer, ARITH)
    assert text and m.consume_tokens(llg_tokenizer.tokenize_str(text)) and m.is_accepting(), text
    bad = tmp_path / "bad.lark"
    bad.write_text('start: expr\nexpr: "x" | y\n')
    cmd[cmd.index("--arg") + 1] = f"@{bad}"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "2:13: undefined rule 'y'" in out.stderr, out.stderr


# ---------------------------------------------------------------------------- %json

TOOL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1}}}}}
BOOLS = {"type": "array", "items": {"type": "boolean"}}
KEYS = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}},
                                         "b": {"type": "string"}}, "additionalProperties": False}


def js(schema: dict, **options) -> str:
    """A `%json` element of `schema` (with our root options, e.g. x-rudder-whitespace)."""
    return "%json " + json.dumps({**schema, **{f"x-rudder-{k}": v for k, v in options.items()}})


#: name -> (grammar, sentences): a value as the whole start, in a sequence with literals, in
#: alternatives, repeated (a token can end one value and begin the next: `","`), beside a
#: terminal that begins differently, values that end only where the next byte cannot extend them
#: (numbers); then ignored text around values and flexible whitespace inside them.
JSON_GRAMMARS = {
    "whole": (f"start: {js(TOOL)}\n",
              ['{"name":"get_weather","arguments":{"city":"Paris","days":12}}',
               '{"name":"get_weather","arguments":{"city":"}]{x"}}']),
    "sequence": (f'start: "<call>" {js(TOOL)} NL "done"\nNL: /\\n+/\n',
                 ['<call>{"name":"get_weather","arguments":{"city":"Oslo"}}\n\ndone']),
    "alternatives": (f"start: TEXT | call\ncall: {js(BOOLS)}\nTEXT: /[^\\[][a-z ]*/\n",
                     ["[true,false]", "[]", "hello world"]),
    "repeated": (f'start: "[" ({js({"type": "string"})} ",")* ({js(KEYS)} ";")* "]"\n',
                 ['["a",", b","x}y",{"a":[1,2.5,-3e2]};{};]', "[]"]),
    "competing": (f'start: WORD {js({"type": "integer"})} WORD\nWORD: /[a-z]+/\n', ["abc12de", "x7y", "ab-3c"]),
    "numbers": (f'start: ({js({"enum": [1, 12, "x", True]})} ".")+ {js({"type": "null"})}\n',
                ['12.1."x".true.null', "1.null"]),
}
#: Not compared with llguidance (see test_json_masks_agree_with_llguidance_step_by_step).
JSON_OTHERS = {
    "multiline": ((REPO / "examples/grammars/tool_call.lark").read_text(),
                  ["It is sunny.", '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
                   '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}\n</tool_call>']),
    "ignored": (f'start: WORD {js({"type": "integer"})} WORD\nWORD: /[a-z]+/\n%ignore " "\n',
                ["abc 12 de", "x7y", "ab -3c"]),
    "flexible": (f'start: "<c>" {js(KEYS, whitespace="flexible")} "</c>" ({js(BOOLS, whitespace="flexible")} "\\n")*\n',
                 ['<c>{ "a" : [1, 2], "b": "x" }</c>[ true ]\n[]\n', "<c>{}</c>"]),
}


def follow_sentences(r, tok, grammars):
    mod = r.load(builtin_controller("grammar"))
    prompt = [tok.bos_token_id if tok.bos_token_id is not None else 1, *tok.encode("go")]
    for name, (grammar, docs) in grammars.items():
        for doc in docs:
            target = doc.encode()
            [s] = run_request(r, mod, grammar, prompt, follow_text(target, tok), max_tokens=400)
            assert text_of(tok, s.generated) == target, (name, s.ctl.log_text())
            assert s.finish in ("eos", "stop")


def test_json_values_are_followed_token_by_token_tiny_vocab(rt):
    """Sentences with %json values are followed byte by byte: every token is in its step's mask,
    fast-forwards (inside values too) stay on the sentence, and the run ends exactly on it."""
    tok = Tokenizer.byte_level(512)
    follow_sentences(rt(tok), tok, {**JSON_GRAMMARS, **JSON_OTHERS})


@pytest.mark.model
def test_json_values_are_followed_token_by_token_smollm2(rt, smol_tok):
    """The same with SmolLM2's tokens, which cross value boundaries (`"},`, `"]`, `}\n`)."""
    follow_sentences(rt(smol_tok), smol_tok, {**JSON_GRAMMARS, **JSON_OTHERS})


def test_json_value_whitespace_and_fast_forward_options(rt):
    """A %json value has no whitespace around it (flexible whitespace is inside it only, and
    `%ignore` does not apply inside it); x-rudder-ff false turns fast-forward off inside it."""
    tok = Tokenizer.byte_level(512)
    r = rt(tok)
    mod = r.load(builtin_controller("grammar"))
    prompt = [1, *tok.encode("go")]

    def first_bytes(grammar, text):
        """The bytes that may come after `text` (a forced one alone), or the first answer."""
        ctl = r.start(mod, grammar)
        [b] = ctl.mid_process(0, 0, prompt)
        if not text:
            return b
        while text:
            if b.mask is None:   # fast-forwarded: follow it
                done = text_of(tok, b.ff[0])
                if not done.startswith(text):
                    assert text.startswith(done), (text, done)
                [b] = ctl.mid_process(0, 0, b.ff[0])
            else:
                done = text
                [b] = ctl.mid_process(0, 0, tok.encode(text.decode()))
            if len(done) > len(text):
                return {done[len(text):len(text) + 1]}
            text = text[len(done):]
        ctl.close()
        if b.mask is None:
            return {text_of(tok, b.ff[0])[:1]}
        return {tok.token_bytes[t][:1] for t in allowed_ids(b.mask, tok.vocab_size)}

    flexible = f'start: "<a>" {js(KEYS, whitespace="flexible")} "</a>"\n'
    assert first_bytes(flexible, b"<a>") == {b"{"}   # no whitespace before the value
    assert b" " in first_bytes(flexible, b"<a>{")   # inside: the engine's flexible whitespace
    assert first_bytes(flexible, b"<a>{}") == {b"<"}   # none after it either
    compact = f'start: "<a>" {js(KEYS)} "</a>"\n%ignore " "\n'
    assert first_bytes(compact, b"<a>{") == {b'"', b"}"}   # %ignore does not reach inside
    assert first_bytes(compact, b"<a>") == {b"{", b" "}   # between lexemes it does
    assert first_bytes(compact, b"<a> {} ") == {b"<", b" "}
    # the tool's object is forced up to its first free byte, unless the element says no
    b = first_bytes(f'start: "<a>" {js(TOOL)}\n', b"")
    assert b.mask is None and text_of(tok, b.ff[0]) == b'<a>{"name":"get_weather","arguments":{"city":"'
    b = first_bytes(f'start: "<a>" {js(TOOL, ff=False)}\n', b"")
    assert b.mask is None and text_of(tok, b.ff[0]) == b"<a>"
    assert first_bytes(f'start: "<a>" {js(TOOL, ff=False)}\n', b"<a>") == {b"{"}


def check_backtracks(r, tok, tmp_path, n_moves=60):
    mod = r.load(probe_module(tmp_path, PROBE))
    grammar, docs = JSON_GRAMMARS["repeated"]
    ids = tok.encode(docs[0])
    rng = random.Random(5)

    def mask_of(branches):
        return tuple(allowed_ids(branches[0].mask, tok.vocab_size).tolist()) if branches else ()

    ctl = r.start(mod, grammar)
    start = mask_of(ctl.mid_process(0, 0, [1]))
    at = 0
    for _ in range(n_moves):
        if at == len(ids) or (at and rng.random() < 0.3):
            back = rng.randint(1, at)
            at -= back
            got = mask_of(ctl.mid_process(0, back, []))
        else:
            n = min(rng.randint(1, 4), len(ids) - at)
            got = mask_of(ctl.mid_process(0, 0, ids[at:at + n]))
            at += n
        fresh = r.start(mod, grammar)
        want = mask_of(fresh.mid_process(0, 0, [1]))
        if at:
            want = mask_of(fresh.mid_process(0, 0, ids[:at]))
        fresh.close()
        assert got == want, (at, tok.decode(ids[:at]))
    assert mask_of(ctl.mid_process(0, at, [])) == start
    ctl.close()


def test_json_positions_survive_backtracks_exactly(rt, tmp_path):
    """Positions inside %json values are checkpoints: after random backtracks (into the current
    value, into an earlier value of the same element, before any value) the mask at every step
    equals the mask of a fresh parse fed the same tokens."""
    tok = Tokenizer.byte_level(512)
    check_backtracks(rt(tok), tok, tmp_path)


@pytest.mark.model
def test_json_positions_survive_backtracks_exactly_smollm2(rt, smol_tok, tmp_path):
    check_backtracks(rt(smol_tok), smol_tok, tmp_path, n_moves=30)


@pytest.mark.model
def test_json_fast_forward_inside_values(rt, smol_tok):
    """Bytes a value forces are fast-forwarded, across the value's edges: the literal before it
    and the start of the object; after the last free byte, its end and the literal after it."""
    r = rt(smol_tok)
    mod = r.load(builtin_controller("grammar"))
    ctl = r.start(mod, f'start: "<tool_call>\\n" {js(TOOL)} "\\n</tool_call>"\n')
    [b] = ctl.mid_process(0, 0, [1, *smol_tok.encode("go")])
    assert b.mask is None
    forced = text_of(smol_tok, b.ff[0])
    assert b'<tool_call>\n{"name":"get_weather","arguments":{"city":"'.startswith(forced) and len(forced) > 40
    [b] = ctl.mid_process(0, 0, b.ff[0])
    while b.mask is None:   # (a token held back, then the rest)
        [b] = ctl.mid_process(0, 0, b.ff[0])
    [b] = ctl.mid_process(0, 0, smol_tok.encode('Paris"'))
    allowed = {smol_tok.token_bytes[t] for t in allowed_ids(b.mask, smol_tok.vocab_size)}
    assert b"}" in allowed and b"," in allowed and b'"' not in allowed
    [b] = ctl.mid_process(0, 0, smol_tok.encode("}"))
    assert b.mask is None and text_of(smol_tok, b.ff[0]) == b"}\n</tool_call>"   # to the end
    assert ctl.mid_process(0, 0, b.ff[0]) == []


EXACT_PROBE = r"""
#include "rudder.h"
#include "rudder_grammar.h"
/* Follows the appended tokens and answers the full mask, after checking it against the plain
 * definition: token t is allowed when pushing its bytes succeeds (each tried, then undone). */
static rudder_grammar *g;
static rudder_gm_pos saved[4096];
static uint32_t n_gen;
int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    g = rudder_gm_new(arg, len, err, sizeof err);
    if (!g) { rudder_logf("%s\n", err); return 1; }
    saved[0] = rudder_gm_save(g);
    return 0;
}
void controller_step(const rudder_step *step, rudder_out *out) {
    n_gen = step->backtrack > n_gen ? 0 : n_gen - step->backtrack;
    rudder_gm_restore(g, saved[n_gen]);
    for (uint32_t i = 0; step->index > 0 && i < step->n_tokens && n_gen < 4095; i++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(step->tokens[i], &len);
        if (!rudder_gm_push(g, b, len)) { rudder_out_fail(out, "rejected"); return; }
        saved[++n_gen] = rudder_gm_save(g);
    }
    uint32_t *mask = rudder_out_mask(out);
    uint32_t n = rudder_gm_fill_mask(g, mask);
    for (uint32_t t = 0; t < rudder_vocab_size(); t++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(t, &len);
        if (!b || !len) continue;
        rudder_gm_pos here = rudder_gm_save(g);
        bool ok = rudder_gm_push(g, b, len);
        if (ok) rudder_gm_restore(g, here);
        if (ok != rudder_mask_test(mask, t)) {
            rudder_logf("token %u (%.*s): mask %d, push %d\n", t, (int)len, (const char *)b, !ok, ok);
            rudder_out_fail(out, "mask differs");
            return;
        }
    }
    if (rudder_gm_accepting(g)) { rudder_mask_set(mask, rudder_eos_token()); n++; }
    if (n) rudder_out_sample(out, mask);
}
"""


def json_bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE whose merged tokens cross the edges of JSON values: they end one and go
    on with the grammar (`"},`, `}\n`), begin one after a literal (`<c>{`), or both (`},{"`)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from rudder.tokenizer import byte_to_unicode

    b2u = byte_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({ch: 3 + b for b, ch in b2u.items()})
    merges = []
    for w in ['"},', '"}}', '},{"', '"]', '"];', '}\n', '}\n\n', '}</', '<c>{', '<call>{"', '12,', '1.', '.1', '"x".',
              'true.', 'e.', '",', '","', '":', '{"a', '{}', '[]\n', ']\n[', 'abc', 'de', '7y', ' -', 'l', '{"name']:
        u = "".join(b2u[b] for b in w.encode())
        cur = u[0]
        for ch in u[1:]:
            if cur + ch not in vocab:
                vocab[cur + ch] = len(vocab)
                merges.append((cur, ch))
            cur += ch
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in specials])
    return Tokenizer(hf, eos_token_id=2, bos_token_id=1, vocab_size=len(vocab))


def check_exact(tok, tmp_path, grammars):
    from rudder.controller import ControllerRuntime, Limits

    # The probe pushes every token of the vocabulary at each step: a runtime whose step deadline
    # allows it (a request's limits can only lower the runtime's).
    with ControllerRuntime(tok, Limits(mid_process_ms=60_000), max_instances=64) as r:
        mod = r.load(probe_module(tmp_path, EXACT_PROBE))
        for name, (grammar, docs) in grammars.items():
            for doc in docs:
                ctl = r.start(mod, grammar)
                ctl.mid_process(0, 0, [1])
                for t in tok.encode(doc):
                    ctl.mid_process(0, 0, [t])
                ctl.close()


def test_json_masks_equal_what_pushing_each_token_allows(tmp_path):
    """The mask at every step is exactly the set of tokens whose bytes the parse takes (each
    pushed, then undone), with tokens that end a value and go on after it, begin one after a
    literal, or both."""
    tok = json_bpe_tokenizer()
    check_exact(tok, tmp_path, {**JSON_GRAMMARS, **JSON_OTHERS})


@pytest.mark.model
def test_json_masks_equal_what_pushing_each_token_allows_smollm2(smol_tok, tmp_path):
    check_exact(smol_tok, tmp_path,
                {k: JSON_GRAMMARS[k] for k in ("sequence", "repeated")} | {"ignored": JSON_OTHERS["ignored"]})


DEL = 0x7F


@pytest.mark.model
@pytest.mark.parametrize("name", list(JSON_GRAMMARS))
def test_json_masks_agree_with_llguidance_step_by_step(smol_tok, llg_tokenizer, tmp_path, name):
    """%json masks equal llguidance's (its JSON made compact to match ours), token by token.
    Set aside: tokens holding DEL (0x7f), which JSON allows unescaped in strings (RFC 8259) and
    llguidance's string lexeme does not; `\\/` and `\\u` escapes, which our JSON engine allows
    in strings and llguidance's does not; and %ignore: llguidance does not skip ignored text right
    before a value (ours does, a %json value is a lexeme like any other), so no grammar here has
    any."""
    r = make_runtime("real", smol_tok)
    mod = r.load(probe_module(tmp_path, PROBE))
    skip = set(smol_tok.special_token_ids) | {t for t, b in enumerate(smol_tok.token_bytes) if DEL in b}
    vocab = smol_tok.vocab_size
    grammar, docs = JSON_GRAMMARS[name]
    theirs_grammar = re.sub(r'"x-rudder-[a-z]+": [^,}]+', "", grammar).replace(
        "%json {", '%json {"x-guidance": {"whitespace_flexible": false}, ').replace(", }", "}")
    compared = forced = 0
    for doc in docs:
        ctl = r.start(mod, grammar)
        m = llg_matcher(llg_tokenizer, theirs_grammar)
        ids = smol_tok.encode(doc)
        branches = ctl.mid_process(0, 0, [1])
        for step, t in enumerate([*ids, None]):
            ours = set(allowed_ids(branches[0].mask, vocab).tolist()) - skip if branches else set()
            theirs = llg_allowed(m, vocab) - skip
            diff = sorted(ours ^ theirs)[:20]
            if m.compute_ff_bytes():
                assert theirs <= ours, (doc, step, diff)   # (see test_masks_agree_with_llguidance_step_by_step)
                forced += 1
            else:
                assert ours == theirs, (doc, step, diff, [smol_tok.token_bytes[x] for x in diff])
                compared += 1
            if t is None:
                assert m.is_accepting() and branches and (branches[0].mask[0] >> 2) & 1   # EOS both
                break
            assert m.consume_token(t)
            branches = ctl.mid_process(0, 0, [t])
        ctl.close()
    assert compared >= 5   # (forced steps are many here: the tool's object is mostly fixed)
