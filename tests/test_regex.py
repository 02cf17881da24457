"""The regex engine (guest-sdk/rudder_regex.c) and the `regex` controller (controllers/regex.c).

The engine is checked against Python's `re` through a small probe controller that runs it on
queries passed in its argument (any tokenizer will do). The controller is driven through the
real sandbox with the SmolLM2 tokenizer, token by token as a sampler would, and end to end on
the models; its masks are compared with llguidance's.
"""

from __future__ import annotations

import re

import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.build import build_controller, builtin_controller
from rudder.tokenizer import Tokenizer

BENCH_REGEX = r"[A-Z][a-z]{2,10} [0-9]{1,4}(, [A-Z][a-z]+)*\."
# A step takes well under 5 ms (benchmarks/masks.py), but this machine's cores are shared: a
# wall-clock deadline of 25 ms can pass while a step waits for a core. Tests allow more.
SLACK = Limits(mid_process_ms=500, init_ms=10_000)
SEP, SUB = b"\x1e", b"\x1f"   # the probe's record and field separators

PROBE_C = r"""
/* rx_probe: runs the regex engine on the queries in its argument and logs the answers. */
#include "rudder.h"
#include "rudder_regex.h"

/* Records separated by 0x1e: P<regex> and L<literal> (the patterns, first), then queries:
 * Q<bytes> (pushed from the start of all patterns), S<subset>\x1f<bytes> (a subset start),
 * E<text> (log rudder_rx_escape's output). Every payload is hex-encoded, so that it may hold
 * any byte, the separators included. */
static uint32_t nibble(char c) { return c <= '9' ? (uint32_t)(c - '0') : (uint32_t)(c - 'a' + 10); }

static const char *unhex(const char *s, uint32_t n, uint32_t *len) {
    char *out = rudder_xalloc(n / 2 + 1);   /* kept: patterns point into it */
    for (uint32_t k = 0; k + 1 < n; k += 2)
        out[k / 2] = (char)(nibble(s[k]) << 4 | nibble(s[k + 1]));
    out[n / 2] = 0;
    *len = n / 2;
    return out;
}

static void words(const char *name, const uint32_t *w, uint32_t n) {
    rudder_logf(" %s=", name);
    for (uint32_t i = 0; i < n; i++)
        rudder_logf("%x,", w[i]);
}

int controller_start(const char *arg, uint32_t len) {
    static rudder_rx_pattern pats[256];
    uint32_t n = 0, i = 0;
    char err[200];
    rudder_rx *rx = NULL;
    while (i <= len) {
        uint32_t j = i;
        while (j < len && arg[j] != 0x1e)
            j++;
        char kind = i < len ? arg[i] : 0;
        const char *text = arg + i + 1;
        uint32_t tlen = j > i ? j - i - 1 : 0, subset = 0;
        if (kind == 'S') {
            uint32_t k = 0;
            while (text[k] != 0x1f)
                subset = subset * 10 + (uint32_t)(text[k++] - '0');
            text += k + 1, tlen -= k + 1;
        }
        text = unhex(text, tlen, &tlen);
        if (kind == 'P' || kind == 'L') {
            pats[n++] = (rudder_rx_pattern){.text = text, .len = tlen, .literal = kind == 'L'};
        } else if (!rx && !(rx = rudder_rx_new(pats, n, err, sizeof err))) {
            rudder_logf("ERR %s\n", err);
            return 0;
        }
        if (kind == 'E') {   /* E<text>: log the text escaped, as a pattern */
            char buf[512];
            uint32_t n_esc = rudder_rx_escape(text, tlen, buf, sizeof buf);
            rudder_log_bytes(buf, n_esc < sizeof buf ? n_esc : sizeof buf);
            rudder_log("\n");
        }
        if (kind == 'Q' || kind == 'S') {
            uint32_t state = rudder_rx_start(rx, kind == 'S' ? &subset : NULL);
            state = rudder_rx_push_bytes(rx, state, (const uint8_t *)text, tlen);
            if (state == RUDDER_DEAD) {
                rudder_log("dead\n");
            } else {
                uint32_t w = (rudder_rx_n_patterns(rx) + 31) / 32;
                rudder_logf("acc=%d ext=%d forced=%d", (int)rudder_rx_accepted(rx, state),
                            (int)rudder_rx_can_extend(rx, state), (int)rudder_rx_forced_byte(rx, state));
                words("set", rudder_rx_accept_set(rx, state), w);
                words("alive", rudder_rx_alive_set(rx, state), w);
                rudder_logf(" accepting=%d tokens=%u\n", (int)rudder_rx_accepting(rx, state),
                            rudder_mask_count(rudder_rx_mask(rx, state)));
            }
        }
        i = j + 1;
    }
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { (void)step, (void)out; }
"""


def parse_probe_line(line: str) -> dict | None:
    if line == "dead":
        return None
    out = {}
    for field in line.split():
        key, value = field.split("=")
        out[key] = int("".join(reversed([f"{int(w, 16):08x}" for w in value.rstrip(",").split(",")])), 16) \
            if key in ("set", "alive") else int(value)
    return out


@pytest.fixture(scope="module")
def byte_rt():
    rt = ControllerRuntime(Tokenizer.byte_level(512), SLACK, max_instances=16)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def probe(byte_rt, tmp_path_factory):
    """probe(patterns, queries) -> one answer per query (None: dead), or the compile error.
    A pattern is a str (regex) or bytes (literal); a query is bytes or (subset bits, bytes)."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "rx_probe.c").write_text(PROBE_C)
    module = byte_rt.load(build_controller([folder / "rx_probe.c"], folder / "rx_probe.wasm", debug=True))

    def run(patterns, queries):
        recs = [b"L" + p.hex().encode() if isinstance(p, bytes) else b"P" + p.encode().hex().encode() for p in patterns]
        for q in queries:
            recs.append(b"S" + str(q[0]).encode() + SUB + q[1].hex().encode() if isinstance(q, tuple)
                        else b"Q" + q.hex().encode())
        ctl = byte_rt.start(module, SEP.join(recs) + (SEP if not queries else b""))
        log = ctl.log_text()
        ctl.close()
        if log.startswith("ERR "):
            return log[4:].strip()
        lines = log.splitlines()
        assert len(lines) == len(queries), log
        return [parse_probe_line(line) for line in lines]

    run.module = module
    return run


# -- the engine against Python's re -------------------------------------------------------------

ATOMS = ["a", "b", "é", "日", ".", "[ab]", "[^a]", "[a-é]", r"\d", r"\w", r"\s", r"\S", r"[^\w]", "x", " ",
         r"\n", r"[\x00-\x7f]", r"\.", "[-a]", r"[日-本]", r"\u00e9", "(?:)", "😀", r"[\x7f-\u0800]",
         r"[\U0000fff0-\U00010010]", r"[\ud000-\ufffd]", r"[\U0010fff0-\U0010ffff]", r"[\]\-^]"]
# (classes stay small: hypothesis is slow to draw from a class of a million code points)
QUANTIFIERS = ["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?", "{,2}"]


def _extend(children):
    return st.one_of(
        st.tuples(children, children).map("".join),
        st.tuples(children, children).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        st.tuples(children, children).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(children, st.sampled_from(QUANTIFIERS)).map(lambda t: f"(?:{t[0]}){t[1]}"),
    )


patterns = st.recursive(st.sampled_from(ATOMS), _extend, max_leaves=10)
texts = st.text(alphabet="abé日本x 1_\n.-😀\x7fࠀ\ud7ff\ue000]^", max_size=10)


# derandomize: the same 200 examples on every run. A random seed once drew a pattern for which
# hypothesis's from_regex spent over ten minutes producing matches (a CI run hung here); a fixed
# set keeps the suite's time bounded and a failure reproducible.
@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(patterns, st.data())
def test_engine_agrees_with_python_re(probe, pattern, data):
    """Whole-match on the UTF-8 bytes, for matching and random strings; every prefix of a match
    is alive, and a state extends exactly when it is not a finished match."""
    compiled = re.compile(pattern, re.ASCII)   # our \d \w \s are ASCII
    matching = data.draw(st.lists(st.from_regex(compiled, fullmatch=True).filter(lambda s: len(s) < 40),
                                  max_size=3))
    others = data.draw(st.lists(texts, max_size=4))
    queries = [t.encode() for t in matching + others]
    prefixes = [q[:i] for q in queries[:len(matching)] for i in range(len(q))]
    answers = probe([pattern], queries + prefixes)
    for q, a in zip(queries, answers):
        expect = compiled.fullmatch(q.decode()) is not None
        assert (a is not None and a["acc"] == 0) == expect, (pattern, q)
        assert a is None or a["accepting"] == (a["acc"] == 0)
    assert all(a is not None for a in answers[len(queries):]), "a prefix of a match is dead"


def test_control_bytes_are_ordinary_input(probe):
    """0x1e and 0x1f (the probe's own separators, which hypothesis once drew) are plain bytes."""
    one, two, _ = probe([".", "\x1e+"], [b"\x1e", b"\x1f", b"\x1e\x1e"])
    assert one["set"] == 0b11 and two["set"] == 0b01
    assert probe([".", "\x1e+"], [b"\x1e\x1e"])[0]["set"] == 0b10


def test_multi_pattern_accept_and_alive_sets(probe):
    pats = ["if", "[a-z]+", "[0-9]+", b"else", b"a.b", "[a-z]+[0-9]"]
    regexes = [re.compile(p if isinstance(p, str) else re.escape(p.decode())) for p in pats]
    words = ["", "i", "if", "ifx", "el", "else", "elsex", "12", "1a", "a.b", "a.", "axb", "ab1", "ab1x", "?"]
    answers = probe(pats, [w.encode() for w in words])
    for w, a in zip(words, answers):
        accepted = [i for i, r in enumerate(regexes) if r.fullmatch(w)]
        if a is None:
            assert not accepted and w in ("1a", "ab1x", "?"), w
            continue
        assert a["set"] == sum(1 << i for i in accepted), w
        assert a["acc"] == (accepted[0] if accepted else -1)
        assert a["alive"] & a["set"] == a["set"]
    by_word = dict(zip(words, answers))
    assert by_word["el"]["alive"] == 0b101010        # [a-z]+, the literal else, [a-z]+[0-9]
    assert by_word[""]["alive"] == 0b111111
    assert by_word["a."]["alive"] == 0b10000         # only the literal a.b
    assert by_word["ab1"]["ext"] == 0 and by_word["ab1"]["set"] == 0b100000


def test_multi_pattern_alive_set_names_every_live_pattern(probe):
    pats = ["if", "[a-z]+", "[0-9]+", b"else"]
    [el] = probe(pats, [b"el"])
    assert el["alive"] == 0b1010   # [a-z]+ (accepting) and the literal else (not yet)


def test_subset_starts(probe):
    pats = ["if", "[a-z]+", "[0-9]+"]
    a = probe(pats, [(0b001, b"if"), (0b010, b"if"), (0b100, b"if"), (0b100, b"42"), (0, b"")])
    assert a[0]["set"] == 0b001 and a[0]["ext"] == 0
    assert a[1]["set"] == 0b010 and a[1]["ext"] == 1
    assert a[2] is None and a[3]["set"] == 0b100
    assert a[4] is None   # the empty subset is dead


def test_many_patterns_use_several_bitset_words(probe):
    pats = [f"w{i}" for i in range(40)] + ["w[0-9]+"]
    a = probe(pats, [b"w3", b"w39", b"w", b"w123"])
    assert a[0]["set"] == (1 << 3) | (1 << 40)
    assert a[1]["set"] == (1 << 39) | (1 << 40)
    assert a[2]["alive"] == (1 << 41) - 1 and a[2]["acc"] == -1
    assert a[3]["set"] == 1 << 40 and a[3]["acc"] == 40


def test_forced_bytes(probe):
    a = probe(["hello (world|there)é"], [b"", b"hello ", b"hello w", "hello worldé".encode(), b"hello world\xc3"])
    assert a[0]["forced"] == ord("h")
    assert a[1]["forced"] == -1
    assert a[2]["forced"] == ord("o")
    assert a[3]["forced"] == -1 and a[3]["acc"] == 0 and a[3]["ext"] == 0
    assert a[4]["forced"] == 0xa9   # the second byte of é
    [b] = probe(["ab?"], [b"a"])
    assert b["forced"] == -1 and b["acc"] == 0   # accepting: nothing is forced


def test_masks_count_the_tokens_that_keep_the_match_alive(probe):
    tok = Tokenizer.byte_level(512)   # the probe's tokenizer
    [a] = probe(["[0-9]{2}x"], [b""])
    expected = sum(1 for i, b in enumerate(tok.token_bytes)
                   if i not in tok.special_token_ids and re.fullmatch(rb"[0-9]{1,2}|[0-9]{2}x", b))
    assert a["tokens"] == expected


BAD_PATTERNS = {
    "(a": "missing ')'",
    "a)": "unbalanced ')'",
    "*a": "nothing to repeat",
    "a{3,2}": "m < n",
    r"(a)\1": "backreferences are not supported",
    "(?=a)b": "lookaround is not supported",
    "(?i)a": "not supported",
    "a**": "multiple repeat",
    "a*+": "possessive quantifiers are not supported",
    "[a": "unterminated character class",
    "[z-a]": "bad character range",
    "a\\": "trailing backslash",
    r"\b": "not supported",
    r"\q": "unknown escape",
    r"\x4": "2 hex digits",
    "a{10001}": "over 10000",
    "(?:(?:a{100}){100}){100}": "too large",
    "a^b": "only supported at the very start and end",
}


@pytest.mark.parametrize("pattern", sorted(BAD_PATTERNS))
def test_compile_errors_are_clear(probe, pattern):
    msg = probe([pattern], [])
    assert isinstance(msg, str) and BAD_PATTERNS[pattern] in msg, msg
    assert msg.startswith("pattern 0 at byte ")


def test_escaped_text_matches_itself_only(probe, byte_rt):
    text = "a.b*c+?(x)[y]{2}|^$\\-\n\t é日"
    ctl = byte_rt.start(probe.module, b"P" + b"x".hex().encode() + SEP + b"E" + text.encode().hex().encode())
    escaped = ctl.log_text()[:-1]
    ctl.close()
    assert re.fullmatch(escaped, text) and not re.fullmatch(escaped, text.replace(".", "x"))
    a = probe([escaped], [text.encode(), text.replace(".", "x").encode()])
    assert a[0]["acc"] == 0 and a[1] is None


def test_anchors_and_lazy_quantifiers_are_accepted(probe):
    a = probe(["^a+?b$"], [b"aab", b"b"])
    assert a[0]["acc"] == 0 and a[1] is None
    assert isinstance(probe(["ok", "(b"], []), str) and "pattern 1" in probe(["ok", "(b"], [])


def test_a_large_counted_repetition_compiles_and_matches(probe):
    a = probe(["[a-z]{500,1000}"], [b"a" * 499, b"a" * 500, b"a" * 1000, b"a" * 1001])
    assert a[0]["acc"] == -1 and a[1]["acc"] == 0 and a[2]["acc"] == 0 and a[2]["ext"] == 0 and a[3] is None


# -- the controller, driven through the sandbox with the SmolLM2 tokenizer -------------------

@pytest.fixture(scope="module")
def smol_rt(smollm2_tokenizer):
    rt = ControllerRuntime(smollm2_tokenizer, SLACK, max_instances=32)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def regex_module(smol_rt):
    return smol_rt.load(builtin_controller("regex"))


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def walk(rt, module, tok, pattern: str, text: str, limits=None) -> list[list[int]]:
    """Feed `text` to the controller as a sampler would: each next token of its tokenization
    must be allowed; fast-forwards must be a prefix of the rest (the walk then continues with
    the rest's own tokenization). At the end EOS must be allowed, or the controller stops.
    Returns the tokens appended at each step."""
    data, pos, pending, steps = text.encode(), 0, None, []
    eos = tok.eos_token_id
    ctl = rt.start(module, pattern, limits)
    try:
        branches = ctl.mid_process(0, 0, [1])
        while True:
            if not branches:
                assert pos == len(data), f"stopped early at byte {pos} of {data!r}"
                return steps
            [b] = branches
            if b.mask is None:
                [appended] = b.ff
            else:
                if pos == len(data):
                    assert allowed(b.mask, eos), "EOS not allowed after a complete match"
                    return steps
                assert not allowed(b.mask, eos), f"EOS allowed after {data[:pos]!r}"
                if not pending:
                    pending = tok.encode(data[pos:].decode())
                t = pending.pop(0)
                assert allowed(b.mask, t), f"token {tok.token_bytes[t]!r} refused after {data[:pos]!r}"
                appended = next((list(lst) for lst in b.ff if lst[0] == t), [t])
            got = b"".join(tok.token_bytes[i] for i in appended)
            assert data.startswith(got, pos), f"appended {got!r} is not {data[pos:]!r}"
            if len(appended) > 1 or b.mask is None:
                pending = None   # the rest is re-tokenized: it begins on a whole character
            pos += len(got)
            steps.append(appended)
            branches = ctl.mid_process(0, 0, appended)
    finally:
        ctl.close()


WALK_REGEXES = [
    BENCH_REGEX,
    r"(yes|no|maybe), because [a-z ]{3,30}\.",
    r"[a-z]{3,8}@[a-z]{3,8}\.(com|org|net)",
    r"\d{3}-\d{3}-\d{4}",
    r"(café|naïve|日本語|Ελλάδα) [a-zé]{1,10}!",
    r'\{"name": "[A-Za-z ]{1,20}", "age": [0-9]{1,3}\}',
    r"(The answer is (yes|no)\. )+Thank you for asking, have a nice day!",
]


@pytest.mark.model
@pytest.mark.parametrize("ff", [True, False], ids=["ff", "no-ff"])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_token_of_a_valid_text_is_allowed(smol_rt, regex_module, smollm2_tokenizer, ff, data):
    tok = smollm2_tokenizer
    pattern = data.draw(st.sampled_from(WALK_REGEXES))
    # ASCII: our \d \w \s are ASCII classes (Python's default would be Unicode)
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True).filter(lambda s: len(s) < 200))
    if tok.decode(tok.encode(text)) != text:
        return   # the tokenizer cannot write this text (a byte without a token)
    walk(smol_rt, regex_module, tok, pattern, text, None if ff else Limits(max_ff_tokens=0))


@pytest.mark.model
def test_forced_literals_are_fast_forwarded(smol_rt, regex_module, smollm2_tokenizer):
    tok = smollm2_tokenizer
    pattern = r"The answer is (yes|no)\. Thank you for asking, have a nice day!"
    text = "The answer is no. Thank you for asking, have a nice day!"
    steps = walk(smol_rt, regex_module, tok, pattern, text)
    text_of = lambda ids: b"".join(tok.token_bytes[i] for i in ids).decode()  # noqa: E731
    # "The answer is" is forced (" " could merge with yes/no: it is held back) ...
    assert text_of(steps[0]) == "The answer is"
    # ... then the model writes " no"/" yes" (or " n", " y"), and the rest comes in one go:
    # after "no" the bytes up to the end are forced and end the match, so all are appended.
    assert any(len(s) > 5 and text_of(s).endswith("have a nice day!") for s in steps)
    assert sum(len(s) for s in steps) - len(steps) >= 10
    # without a fast-forward budget the same text is sampled token by token
    slow = walk(smol_rt, regex_module, tok, pattern, text, Limits(max_ff_tokens=0))
    assert all(len(s) == 1 for s in slow) and len(slow) > len(steps)


@pytest.mark.model
def test_ff_lists_attach_the_forced_continuation_to_the_token(smol_rt, regex_module, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ctl = smol_rt.start(regex_module, r"(alpha|beta)-(one|two)")
    try:
        [b] = ctl.mid_process(0, 0, [1])
        assert b.mask is not None
        lists = {tuple(lst) for lst in b.ff}
        text_of = lambda ids: b"".join(tok.token_bytes[i] for i in ids)  # noqa: E731
        # "al" forces "pha" and then "-" is forced too: a list starting with a token "al..."
        assert any(text_of(lst).startswith(b"al") and len(lst) > 1 for lst in lists), \
            [text_of(lst) for lst in lists]
        for lst in lists:   # every list spells a prefix of a match and starts with an allowed token
            assert allowed(b.mask, lst[0])
            assert re.fullmatch(rb"(alpha|beta)-(one|two)", text_of(lst) + b"one") or \
                re.match(rb"(alpha|beta)(-(o(ne?)?|t(wo?)?)?)?$", text_of(lst))
    finally:
        ctl.close()


@pytest.mark.model
def test_backtrack_rewinds_the_state(smol_rt, regex_module, smollm2_tokenizer):
    tok = smollm2_tokenizer
    pattern = r"(cat|dog)s? (sleep|run)s?\."
    enc = lambda s: tok.encode(s)  # noqa: E731

    def masks_after(ids):
        ctl = smol_rt.start(regex_module, pattern, Limits(max_ff_tokens=0))
        branches = ctl.mid_process(0, 0, [1])
        for t in ids:
            branches = ctl.mid_process(0, 0, [t])
        mask = branches[0].mask.copy()
        ctl.close()
        return mask

    ctl = smol_rt.start(regex_module, pattern, Limits(max_ff_tokens=0))
    try:
        ctl.mid_process(0, 0, [1])
        first = enc("cats sleep")
        for t in first:
            [b] = ctl.mid_process(0, 0, [t])
        assert np.array_equal(b.mask, masks_after(first))
        # take " sleep" back and write " run" instead: the state is the one after "cats"
        n_back = len(enc(" sleep"))
        [b] = ctl.mid_process(0, n_back, [])
        assert np.array_equal(b.mask, masks_after(enc("cats")))
        for t in enc(" run"):
            [b] = ctl.mid_process(0, 0, [t])
        assert np.array_equal(b.mask, masks_after(enc("cats run")))
        # backtrack everything generated and append in one call
        [b] = ctl.mid_process(0, len(enc("cats run")), enc("dog"))
        assert np.array_equal(b.mask, masks_after(enc("dog")))
        with pytest.raises(ControllerError) as exc:
            ctl.mid_process(0, 0, enc(" fly"))
        assert "does not continue the match" in exc.value.log_tail
    finally:
        ctl.close()


@pytest.mark.model
def test_a_token_outside_the_constraint_fails_clearly(smol_rt, regex_module, smollm2_tokenizer):
    ctl = smol_rt.start(regex_module, r"[0-9]+")
    ctl.mid_process(0, 0, [1])
    [x] = smollm2_tokenizer.encode("x")
    with pytest.raises(ControllerError) as exc:
        ctl.mid_process(0, 0, [x])
    assert f"token {x} (x) after 0 generated tokens does not continue the match" in exc.value.log_tail
    ctl.close()


@pytest.mark.model
def test_a_complete_match_stops(smol_rt, regex_module, smollm2_tokenizer):
    ctl = smol_rt.start(regex_module, r"(yes|no)")
    ctl.mid_process(0, 0, [1])
    assert ctl.mid_process(0, 0, smollm2_tokenizer.encode("yes")) == []
    ctl.close()


def test_a_bad_pattern_fails_the_start_with_its_message(byte_rt):
    module = byte_rt.load(builtin_controller("regex"))
    with pytest.raises(ControllerError) as exc:
        byte_rt.start(module, "[a-z")
    assert "regex: pattern 0 at byte 0: an unterminated character class" in exc.value.log_tail


# -- masks against llguidance's -------------------------------------------------------------------

BENCH_DOCS = ["Hello 42.", "Paris 2024, London, Berlin.", "Abcdefghijk 9, Zed.", "Nice 1000, Rome, Oslo, Kyoto."]


@pytest.mark.model
@pytest.mark.parametrize("doc", BENCH_DOCS)
def test_masks_agree_with_llguidance(smol_rt, regex_module, smollm2_tokenizer, smollm2_folder, doc):
    """Step by step, the allowed sets are identical apart from special tokens (not text: EOS is
    compared alone). Both decide on a token's bytes only, so tokens with identical bytes are
    allowed or refused together; on these documents no other difference shows up."""
    tok = smollm2_tokenizer
    eos = tok.eos_token_id
    ll_tok = llguidance.LLTokenizer(str(smollm2_folder / "tokenizer.json"), eos_token=eos)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_regex(BENCH_REGEX))
    assert not matcher.is_error(), matcher.get_error()
    special = np.zeros(tok.vocab_size, dtype=bool)
    special[list(tok.special_token_ids)] = True
    vocab = tok.vocab_size

    def bits(words) -> np.ndarray:   # our mask (uint32 words) or llguidance's (bytes)
        raw = np.frombuffer(words, dtype=np.uint8) if isinstance(words, bytes) else np.asarray(words).view(np.uint8)
        return np.unpackbits(raw, bitorder="little")[:vocab].astype(bool)

    ctl = smol_rt.start(regex_module, BENCH_REGEX, Limits(max_ff_tokens=0))
    try:
        branches = ctl.mid_process(0, 0, [1])
        ids = tok.encode(doc)
        for t in ids:
            [b] = branches
            ours, theirs = bits(b.mask), bits(matcher.compute_bitmask())
            diff = np.flatnonzero((ours != theirs) & ~special)
            assert diff.size == 0, [(int(d), tok.token_bytes[d], bool(ours[d])) for d in diff[:10]]
            # Special tokens are not text: EOS alone is compared (neither allows it mid-document).
            assert not ours[eos] and not theirs[eos]
            assert matcher.consume_token(t)
            branches = ctl.mid_process(0, 0, [t])
        # The documents end with "." that nothing may follow: we stop, llguidance allows only EOS.
        assert branches == []
        theirs = bits(matcher.compute_bitmask())
        assert matcher.is_accepting() and theirs[eos] and not (theirs & ~special).any()
    finally:
        ctl.close()


# -- generation under the constraint ----------------------------------------------------------------

GEN_REGEXES = {
    "city": (r"[A-Z][a-z]{2,10} [0-9]{1,4}(, [A-Z][a-z]{1,10}){0,3}\.", "Name a city and a year."),
    "phone": (r"\d{3}-\d{3}-\d{4}", "Give me a phone number."),
    "answer": (r"(yes|no|maybe), because [a-z ]{5,40}\.", "Is the sea salty?"),
    "email": (r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", "Write an email address."),
    "unicode": (r"(café|naïve|日本語) [a-zé]{1,10}!", "Say something."),
}


def check_completions(completions, pattern, tok):
    for c in completions:
        assert c.error is None and c.finish_reason != "length", (c.finish_reason, c.error, c.text)
        text = b"".join(tok.token_bytes[t] for t in c.token_ids if t not in tok.special_token_ids)
        # Characters, not bytes: a bytes pattern would count `é` in [a-zé]{1,10} as two.
        assert re.fullmatch(pattern, text.decode("utf-8")), text


@pytest.fixture(scope="module")
def smol_llm():
    from rudder import LLM

    return LLM("smollm2", kv_cache_tokens=8192, block_size=16, controller_limits=SLACK)


@pytest.mark.model
@pytest.mark.parametrize("name", sorted(GEN_REGEXES))
def test_smollm2_outputs_match(smol_llm, name):
    from rudder import SamplingParams

    pattern, prompt = GEN_REGEXES[name]
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s) for s in range(6)]
    completions = smol_llm.generate([prompt] * len(params), params, chat=True, controller="regex",
                                    controller_arg=pattern)
    check_completions(completions, pattern, smol_llm.tokenizer)


@pytest.mark.model
def test_a_random_model_with_the_smollm2_vocabulary_matches_every_time(smollm2_tokenizer):
    """The tiny random model samples all over the vocabulary: many seeds, quickly."""
    from rudder import SamplingParams
    from rudder.config import TINY_CONFIG
    from rudder.engine import Engine
    from rudder.model import build_model

    tok = smollm2_tokenizer
    model = build_model(TINY_CONFIG.replace(vocab_size=tok.vocab_size), None, "cpu")
    engine = Engine(model, tok, kv_cache_tokens=16384, block_size=16)
    rt = ControllerRuntime(tok, SLACK, max_instances=64)
    module = rt.load(builtin_controller("regex"))
    try:
        for pattern, _ in GEN_REGEXES.values():
            requests = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=120, temperature=1.0, seed=s),
                                           rt.start(module, pattern)) for s in range(12)]
            while not all(r.finished for r in requests):
                engine.step()
            completions = [engine.completions(r)[0] for r in requests]
            for r in requests:
                engine.forget(r)
            check_completions(completions, pattern, tok)
    finally:
        rt.close()


# -- the CLI -----------------------------------------------------------------------------------------

@pytest.mark.model
def test_rudder_run_with_a_regex():
    from rudder.cli import app

    pattern = r"(Monday|Tuesday|Friday) at [0-9]{1,2}(am|pm)"
    result = CliRunner().invoke(app, ["run", "--controller", "regex", "--arg", pattern, "--chat", "--seed", "3",
                                      "When shall we meet?"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(pattern, result.stdout.rstrip("\n")), result.stdout


@pytest.mark.model
def test_rudder_run_with_a_bad_regex_is_one_clear_error():
    from rudder.cli import app

    result = CliRunner().invoke(app, ["run", "--controller", "regex", "--arg", "(unclosed", "--chat", "hi"])
    assert result.exit_code != 0
    assert "missing ')'" in result.stderr and "Traceback" not in result.output + result.stderr


def test_a_dfa_past_its_state_limit_fails_clearly(probe):
    """(a|b)*a(a|b){20} needs a DFA state per window of 21 bytes: a long random text exceeds the
    limit, and the request fails with the engine's message instead of exhausting memory."""
    import random

    rng = random.Random(0)
    text = bytes(rng.choice(b"ab") for _ in range(260_000))
    with pytest.raises(ControllerError) as exc:
        probe(["(a|b)*a(a|b){20}"], [text])
    assert "the DFA grew past 200000 states" in exc.value.log_tail
