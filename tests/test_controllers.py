"""The built-in controllers (controllers/*.c), driven step by step by a fake "model".

`run_request` plays the engine's part of docs/abi.md for one request: it applies every
Branch (backtrack, masked sampling with ff lists, fast-forward, forks) with a pluggable
sampler instead of logits, and records what each sequence looked like after every step.
Every behaviour test runs in the product's sandbox (rudder.controller.ControllerRuntime).
`test_the_mini_host_agrees_with_the_sandbox` also runs every built-in controller in
MiniRuntime (tests/test_guest_sdk.py), a second, independent reading of the ABI's host side,
and requires the same Branch records, step by step, and the same logs.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Callable

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_guest_sdk import MiniRuntime, tiny_bpe_tokenizer  # noqa: E402

from rudder.branch import Branch  # noqa: E402

from rudder.controller.build import builtin_controller  # noqa: E402
from rudder.tokenizer import Tokenizer  # noqa: E402

Picker = Callable[[np.ndarray, "Seq"], int]


@dataclass
class Seq:
    ctl: object
    tokens: list[int]
    n_prompt: int
    branch_idx: int = 0
    backtrack: int = 0
    appended: list[int] = field(default_factory=list)
    finish: str | None = None
    #: the sequence after each step's backtrack, before anything was appended
    history: list[list[int]] = field(default_factory=list)
    steps: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]


def allowed_ids(mask: np.ndarray | None, vocab: int) -> np.ndarray:
    if mask is None:
        return np.arange(vocab)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def check_branches(branches: list[Branch], seq_len: int, vocab: int, max_forks: int = 16, max_ff: int = 4096):
    """Every rule of docs/abi.md a host enforces on a result."""
    assert len(branches) <= max_forks
    assert sum(len(lst) for b in branches for lst in b.ff) <= max_ff
    words = (vocab + 31) // 32
    for b in branches:
        assert 0 <= b.backtrack <= seq_len
        if b.mask is None:
            assert len(b.ff) <= 1, "no mask and several ff lists"
            if b.ff and not b.ff[0]:
                assert b.backtrack > 0, "empty fast-forward without backtrack"
            appends = b.ff[0] if b.ff else [0]
        else:
            assert b.mask.shape == (words,)
            bits = np.unpackbits(b.mask.view(np.uint8), bitorder="little")
            assert not bits[vocab:].any(), "mask bits past the vocabulary"
            assert bits.any(), "mask allows nothing"
            assert all(b.ff), "empty ff list under a mask"
            appends = [0]
        assert b.backtrack < seq_len or appends, "the sequence would become empty"
        assert all(0 <= t < vocab for lst in b.ff for t in lst)


def make_runtime(kind: str, tok: Tokenizer, max_forks: int = 16, backtrack_allowed: bool = True):
    if kind == "mini":
        return MiniRuntime(tok, max_forks=max_forks, backtrack_allowed=backtrack_allowed)
    from rudder.controller import ControllerRuntime, Limits

    return ControllerRuntime(tok, Limits(max_forks=max_forks), max_instances=64,
                             backtrack_allowed=backtrack_allowed)


def limits_of(rt) -> tuple[int, int]:
    if isinstance(rt, MiniRuntime):
        return rt.max_forks, rt.max_ff
    return rt.limits.max_forks, rt.limits.max_ff_tokens


@contextmanager
def fails_with(text: str):
    """A controller failure whose message or log (either runtime) contains `text`."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the two runtimes raise different classes
        full = f"{exc}\n{getattr(exc, 'log_tail', '')}"
        assert text in full, full
    else:
        raise AssertionError(f"no failure (expected {text!r})")


def run_request(rt, module, arg, prompt: list[int], pick: Picker, max_steps: int = 200,
                max_tokens: int = 1000, on_step: Callable | None = None) -> list[Seq]:
    """Run one request to its end; `on_step(seq, branches)` sees every answer."""
    vocab, eos = rt.tokenizer.vocab_size, rt.tokenizer.eos_token_id
    max_forks, max_ff = limits_of(rt)
    first = Seq(rt.start(module, arg), list(prompt), len(prompt), appended=list(prompt))
    seqs, live = [first], [first]
    for _ in range(max_steps):
        if not live:
            break
        next_live = []
        for s in live:
            branches = s.ctl.mid_process(s.branch_idx, s.backtrack, s.appended)
            s.steps += 1
            if on_step is not None:
                on_step(s, branches)
            check_branches(branches, len(s.tokens), vocab, max_forks, max_ff)
            if not branches:
                s.finish = "stop"
                s.ctl.close()
                continue
            group = [s] + [Seq(s.ctl.fork(), list(s.tokens), s.n_prompt, steps=s.steps) for _ in branches[1:]]
            seqs += group[1:]
            for i, (seq, b) in enumerate(zip(group, branches)):
                seq.branch_idx = i if len(branches) > 1 else 0
                seq.tokens = seq.tokens[: len(seq.tokens) - b.backtrack]
                seq.history.append(list(seq.tokens))
                if b.mask is None and b.ff:
                    appended = list(b.ff[0])
                else:
                    t = int(pick(allowed_ids(b.mask, vocab), seq))
                    assert b.mask is None or (b.mask[t >> 5] >> (t & 31)) & 1
                    appended = next((list(lst) for lst in b.ff if lst[0] == t), [t])
                seq.tokens += appended
                seq.backtrack, seq.appended = b.backtrack, appended
                if eos in appended:
                    seq.finish = "eos"
                elif len(seq.generated) >= max_tokens:
                    seq.finish = "length"
                else:
                    next_live.append(seq)
                    continue
                seq.ctl.close()
        live = next_live
    for s in live:
        s.ctl.close()
    return seqs


def text_of(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes[i] for i in ids if i not in tok.special_token_ids)


def lowest(allowed, seq):
    return allowed.min()


def highest(allowed, seq):
    return allowed.max()


def seeded(seed: int) -> Picker:
    rng = random.Random(seed)
    return lambda allowed, seq: allowed[rng.randrange(len(allowed))]


def pickers(n: int = 8) -> list[Picker]:
    return [lowest, highest, *(seeded(i) for i in range(n))]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["byte", "bpe"])
def tok(request) -> Tokenizer:
    return Tokenizer.byte_level(512) if request.param == "byte" else tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def rt(tok):
    runtime = make_runtime("real", tok)
    yield runtime
    if hasattr(runtime, "close"):
        runtime.close()


@pytest.fixture(scope="module")
def modules(rt) -> dict:
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = rt.load(builtin_controller(name))
        return cache[name]

    return get


def prompt_of(tok: Tokenizer) -> list[int]:
    return [tok.bos_token_id, *tok.encode("user\nSay something.")]


# ---------------------------------------------------------------------------- force


@pytest.mark.parametrize("text", ["Hello world", "café 😀 ok", "x", " very very long " * 20])
def test_force_appends_exactly_the_tokens(rt, modules, tok, text):
    prompt = prompt_of(tok)
    [s] = run_request(rt, modules("force"), text, prompt, lowest)
    assert s.tokens == prompt + tok.encode(text)
    assert s.finish == "stop" and s.steps == 2
    assert f"-> {len(tok.encode(text))} tokens" in s.ctl.log_text()


def test_force_empty_text_stops_at_once(rt, modules, tok):
    [s] = run_request(rt, modules("force"), "", prompt_of(tok), lowest)
    assert s.generated == [] and s.finish == "stop" and s.steps == 1


# ---------------------------------------------------------------------------- choices

CHOICE_SETS = [
    ["yes", "no"],
    [" Paris", "Paris", "Pa", "Par"],
    ["a", "ab", "abc", "abd"],
    ["café", "cafe", "ca", "😀", "😁"],
    ["only one choice here"],
    ["Hello world", "Hello there", "Goodbye"],
    ["", "x"],
]


@pytest.mark.parametrize("choices", CHOICE_SETS, ids=lambda c: "|".join(c))
def test_choices_ends_with_exactly_one_choice(rt, modules, tok, choices):
    import json

    arg = json.dumps(choices)
    targets = {c.encode() for c in choices}
    for pick in pickers(10):
        [s] = run_request(rt, modules("choices"), arg, prompt_of(tok), pick)
        out = text_of(tok, s.generated)
        assert out in targets, (out, s.ctl.log_text())
        assert s.finish in ("stop", "eos")
        for h in s.history:  # always on the way to some choice
            done = text_of(tok, h[s.n_prompt:])
            assert any(t.startswith(done) for t in targets)


def test_choices_fast_forwards_the_rest_of_a_unique_choice(rt, modules, tok):
    [s] = run_request(rt, modules("choices"), '["Hello world", "Goodbye"]', prompt_of(tok), lowest)
    assert text_of(tok, s.generated) == b"Goodbye"
    assert s.steps == 2  # sample "G" (or a longer token) with its ff list (the rest of the choice), stop
    [s] = run_request(rt, modules("choices"), '["only"]', prompt_of(tok), lowest)
    assert s.generated == tok.encode("only") and s.steps == 2


def test_choices_allows_eos_after_a_complete_choice(rt, modules, tok):
    eos = tok.eos_token_id

    def prefer_eos(allowed, seq):
        return eos if eos in allowed else allowed.min()

    [s] = run_request(rt, modules("choices"), '["a", "ab"]', prompt_of(tok), prefer_eos)
    assert s.finish == "eos" and text_of(tok, s.generated) == b"a"


@pytest.mark.parametrize("arg", ["", "yes", "[]", '["a", 1]', '["unterminated]', '["a"], ["b"]'])
def test_choices_rejects_bad_arguments(rt, modules, arg):
    with fails_with("choices: the argument must be a non-empty JSON array"):
        rt.start(modules("choices"), arg)


def test_choices_unicode_escapes(rt, modules, tok):
    [s] = run_request(rt, modules("choices"), '["caf\\u00e9", "\\ud83d\\ude00"]', prompt_of(tok), highest)
    assert text_of(tok, s.generated) in ("café".encode(), "😀".encode())


# ---------------------------------------------------------------------------- uppercase


@pytest.mark.parametrize("arg,n", [("", 40), ("13", 13)])
def test_uppercase_every_fourth_byte(rt, modules, tok, arg, n):
    for pick in pickers(6):
        [s] = run_request(rt, modules("uppercase"), arg, prompt_of(tok), pick)
        out = text_of(tok, s.generated)
        assert s.finish == "stop" and len(s.generated) == n
        assert all(65 <= out[i] <= 90 for i in range(0, len(out), 4)), out
        assert tok.eos_token_id not in s.generated


def test_uppercase_bad_argument(rt, modules):
    with fails_with("uppercase: the argument must be a number"):
        rt.start(modules("uppercase"), "many")


# ---------------------------------------------------------------------------- fork


@pytest.mark.parametrize("arg,n", [("", 3), ("5", 5), ("1", 1)])
def test_fork_yields_n_sequences(rt, modules, tok, arg, n):
    seqs = run_request(rt, modules("fork"), arg, prompt_of(tok), seeded(7), max_tokens=6)
    assert len(seqs) == n
    assert all(s.finish == "length" or s.finish == "eos" for s in seqs)
    if n > 1:
        firsts = [s.generated[0] for s in seqs]
        assert len(set(firsts)) > 1  # the forks sampled on their own
        log = seqs[0].ctl.log_text()  # the request's log, shared by all forks
        for i in range(n):
            assert f"fork: this is fork {i} of {n}" in log


def test_fork_limits(tok):
    few = make_runtime("real", tok, max_forks=2)
    with fails_with("cannot fork into 3 sequences (forks allowed, max_forks 2)"):
        few.start(few.load(builtin_controller("fork")), "3")
    no_forks = make_runtime("real", tok, max_forks=1)
    module = no_forks.load(builtin_controller("fork"))
    with fails_with("forks not allowed"):
        no_forks.start(module, "2")
    assert len(run_request(no_forks, module, "1", prompt_of(tok), lowest, max_tokens=3)) == 1
    with fails_with("must be a number"):
        no_forks.start(module, "-1")
    for runtime in (few, no_forks):
        getattr(runtime, "close", lambda: None)()


# ---------------------------------------------------------------------------- backtrack


def adversary(tok: Tokenizer, target: bytes, seed: int = 0) -> Picker:
    """Writes `target` over and over with the longest allowed token that fits, else any."""
    rng = random.Random(seed)
    table = tok.token_bytes

    def pick(allowed, seq):
        done = len(text_of(tok, seq.generated))
        want = (target * 50)[done:]
        fits = [t for t in allowed if table[t] and t not in tok.special_token_ids and want.startswith(table[t])]
        if fits:
            return max(fits, key=lambda t: len(table[t]))
        return allowed[rng.randrange(len(allowed))]

    return pick


@pytest.mark.parametrize("word", ["", " very", "ery v", "v"])
def test_backtrack_removes_the_banned_word(rt, modules, tok, word):
    banned = (word or " very").encode()
    for seed in range(3):
        pick = adversary(tok, b"It is a very very nice day" if seed != 2 else b" very", seed)
        [s] = run_request(rt, modules("backtrack"), word, prompt_of(tok), pick, max_tokens=60, max_steps=2000)
        assert s.finish in ("length", "stop")  # stop: it gave up after 100 backtracks
        for h in s.history:  # after every answer of the controller
            assert banned not in text_of(tok, h[s.n_prompt:])
        assert "backtrack: " in s.ctl.log_text() and "banning token" in s.ctl.log_text()
    # free sampling without the word: no backtrack at all
    [s] = run_request(rt, modules("backtrack"), "zzzz", prompt_of(tok), lowest, max_tokens=20)
    assert "backtrack:" not in s.ctl.log_text() and len(s.generated) == 20


def test_backtrack_needs_permission(tok):
    rt = make_runtime("real", tok, backtrack_allowed=False)
    with fails_with("does not allow backtracking"):
        rt.start(rt.load(builtin_controller("backtrack")))
    getattr(rt, "close", lambda: None)()


def test_force_rejects_invalid_utf8(rt, modules):
    with fails_with("force: the text is not valid UTF-8"):
        rt.start(modules("force"), b"abc\xff")


def test_choices_with_invalid_utf8_still_works(rt, modules, tok):
    """Arguments are bytes; a choice that is not UTF-8 cannot be tokenized, so the mask leads."""
    for pick in pickers(3):
        [s] = run_request(rt, modules("choices"), b'["\xff\xfeab", "x"]', prompt_of(tok), pick)
        assert text_of(tok, s.generated) in (b"\xff\xfeab", b"x")


# ---------------------------------------------------------------------------- all


@pytest.mark.parametrize("name,arg", [("force", "abc"), ("choices", '["x", "yz"]'), ("uppercase", "9"),
                                      ("fork", "4"), ("backtrack", " very")])
def test_deterministic(rt, modules, tok, name, arg):
    def once():
        seqs = run_request(rt, modules(name), arg, prompt_of(tok), seeded(3), max_tokens=30)
        return [(s.tokens, s.finish, s.history) for s in seqs], seqs[0].ctl.log_text()

    assert once() == once()


STATE_PROBE = r"""
#include "rudder.h"
/* Heap state made in init (past the first pages of memory) and in a step must survive the
 * host's post-init snapshot and a fork. */
static uint8_t *init_block, *step_block;
#define INIT_BYTES (3u << 20)
#define STEP_BYTES (2u << 20)

static bool intact(const uint8_t *p, uint32_t n, uint8_t salt) {
    for (uint32_t i = 0; i < n; i += 4093)
        if (p[i] != (uint8_t)(i * 7 + salt))
            return false;
    return p[n - 1] == (uint8_t)((n - 1) * 7 + salt);
}

static void fill(uint8_t *p, uint32_t n, uint8_t salt) {
    for (uint32_t i = 0; i < n; i += 4093)
        p[i] = (uint8_t)(i * 7 + salt);
    p[n - 1] = (uint8_t)((n - 1) * 7 + salt);
}

int controller_init(void) {
    init_block = rudder_xalloc(INIT_BYTES);
    fill(init_block, INIT_BYTES, 1);
    return 0;
}

int controller_start(const char *arg, uint32_t len) {
    (void)arg, (void)len;
    if (!intact(init_block, INIT_BYTES, 1)) {
        rudder_log("state: the init state was lost\n");
        return 1;
    }
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (!intact(init_block, INIT_BYTES, 1) || (step->index > 0 && !intact(step_block, STEP_BYTES, 2))) {
        rudder_out_fail(out, "state: memory was lost");
        return;
    }
    if (step->index == 0) {
        step_block = rudder_xalloc(STEP_BYTES);
        fill(step_block, STEP_BYTES, 2);
        rudder_out_sample(out, NULL);
        rudder_out_sample(out, NULL);
        return;
    }
    if (step->index < 3)
        rudder_out_sample(out, NULL);
}
"""


def state_probe_wasm(folder: Path) -> Path:
    from rudder.controller.build import build_controller

    src = folder / "state.c"
    src.write_text(STATE_PROBE)
    return build_controller([src], folder / "state.wasm")


def test_state_survives_snapshot_and_fork(tmp_path):
    """Memory the guest grows during init or a step is part of its state (docs/abi.md)."""
    tok = Tokenizer.byte_level(512)
    rt = make_runtime("real", tok)
    module = rt.load(state_probe_wasm(tmp_path))
    for _ in range(2):  # the second request starts from the same snapshot
        seqs = run_request(rt, module, "", prompt_of(tok), lowest)
        assert len(seqs) == 2 and all(s.finish == "stop" and len(s.generated) == 3 for s in seqs)
    getattr(rt, "close", lambda: None)()


# ---------------------------------------------------------------------------- two readings of the ABI

AGREEMENT_CASES = [
    ("force", "Hello world, café 😀"), ("choices", '["yes", "no", "Paris", " Paris"]'), ("uppercase", "17"),
    ("fork", "3"), ("backtrack", " very"), ("regex", "[A-Z][a-z]{1,6}( [0-9]{1,3})?"),
    ("json", '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yes"]}}, '
             '"required": ["a", "b"]}'),
    ("grammar", 'start: "(" WORD ")" | WORD\nWORD: /[a-z]+/\n'),
    ("triggers", '{"triggers": [{"begin": "<", "regex": "[0-9]+", "end": ">"}, {"begin": "{", "json": {"enum": ["a", 1]}}]}'),
    ("state", ""),
]


def _record(tok: Tokenizer, steps: list):
    """An on_step that keeps each answer as plain data (masks as allowed-token lists)."""
    vocab = tok.vocab_size

    def on_step(seq, branches):
        steps.append([(b.backtrack, None if b.mask is None else allowed_ids(b.mask, vocab).tolist(),
                       [list(lst) for lst in b.ff]) for b in branches])

    return on_step


@pytest.mark.parametrize("name,arg", AGREEMENT_CASES, ids=[n for n, _ in AGREEMENT_CASES])
def test_the_mini_host_agrees_with_the_sandbox(tok, name, arg, tmp_path):
    """The product's sandbox and MiniRuntime, two independent readings of docs/abi.md, give
    the same Branch records at every step, the same sequences and the same log, for every
    built-in controller (and a guest whose state lives in memory grown in init and in a step)
    under the same sampler."""
    wasm = state_probe_wasm(tmp_path) if name == "state" else builtin_controller(name)
    runs = {}
    for kind in ("real", "mini"):
        rt = make_runtime(kind, tok)
        module = rt.load(wasm)
        steps: list = []
        pick = adversary(tok, b"It is a very very nice day") if name == "backtrack" else \
            adversary(tok, b"Try <12> or {1, <7>", 5) if name == "triggers" else seeded(11)
        seqs = run_request(rt, module, arg, prompt_of(tok), pick, max_tokens=40, max_steps=400,
                           on_step=_record(tok, steps))
        runs[kind] = (steps, [(s.tokens, s.finish, s.history) for s in seqs], seqs[0].ctl.log_text())
        getattr(rt, "close", lambda: None)()
    assert runs["real"][0] == runs["mini"][0]   # every Branch record
    assert runs["real"][1:] == runs["mini"][1:]   # the sequences and the log
    assert len(runs["real"][0]) >= 2   # not vacuous: several steps


def test_a_builtin_controllers_build_key_follows_its_sources(tmp_path, monkeypatch):
    """The build key (which names the cached module) is kept between requests while the sources'
    modification times and sizes stay, and changes when a source or an SDK file changes: an edit
    must never run a stale module."""
    from rudder.controller import build

    sdk = tmp_path / "sdk"
    sdk.mkdir()
    header, source = sdk / "lib.h", tmp_path / "ctl.c"
    header.write_text("int f(void);\n")
    source.write_text("int main(void) { return 0; }\n")
    monkeypatch.setattr(build, "SDK_DIR", sdk)
    first = build._build_key(source, False)
    reads = []
    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")
        assert build._build_key(source, False) == first and not reads  # unchanged: not hashed again
    header.write_text("int g(void);\n")  # same size, new content (and modification time)
    os.utime(header, ns=(header.stat().st_atime_ns, header.stat().st_mtime_ns + 1_000_000))
    second = build._build_key(source, False)
    assert second != first
    source.write_text("int main(void) { return 1 + 0; }\n")
    assert build._build_key(source, False) not in (first, second)
    assert build._build_key(source, True) != build._build_key(source, False)
