"""Token healing (rudder/healing.py, docs/constraints.md): the prompt's last token(s) are taken back
and the output writes their bytes again first, in tokens of the model's choice, through the same
backtrack and mask as every controller answer; alone (the `heal` controller) and composed with the
built-in constraints (json, regex, choices, grammar: the guest SDK's token layer).

Three levels: the built-in controllers in the sandbox, driven token by token by pickers (every
healing mask checked token by token); the tiny random model through LLM and over HTTP, with a
byte-level BPE whose merges make prompts worth healing; and SmolLM2 (`model`), where healing
changes the output for the better."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_util import LiveServer, sse_events  # noqa: E402
from test_controllers import allowed_ids, fails_with, pickers  # noqa: E402

from rudder import LLM, SamplingParams  # noqa: E402
from rudder.branch import Branch  # noqa: E402
from rudder.controller.build import builtin_controller  # noqa: E402
from rudder.healing import Healing, plan, tell  # noqa: E402
from rudder.tokenizer import Tokenizer, byte_to_unicode  # noqa: E402

# Merges that make the tokens " Paris", " lazy" (but no " laz": "over the laz" is " la" + "z"),
# " dog", "://", "https", " {" and '{"'.
MERGES = [(" ", "P"), (" P", "a"), ("r", "i"), ("ri", "s"), (" Pa", "ris"), (" ", "l"), (" l", "a"), ("z", "y"),
          (" la", "zy"), (" ", "d"), (" d", "o"), (" do", "g"), (":", "/"), (":/", "/"), ("h", "t"), ("ht", "t"),
          ("htt", "p"), ("http", "s"), (" ", "{"), ("{", '"'), ("P", "a"), ("Pa", "ris")]

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
REGEX = r"(Paris|Rome)( is [a-z]{1,8})?"
CHOICES = ["Paris", "Rome", " Paris"]
GRAMMAR = 'start: CITY "!"\nCITY: "Paris" | "Rome"\n'
# (controller, argument, check of the text after the healed part of a finished output)
CONSTRAINTS = [
    ("heal", "", lambda text: True),
    ("json", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text) is not None),
    ("choices", json.dumps(CHOICES), lambda text: text in CHOICES),
    ("grammar", GRAMMAR, lambda text: text in ("Paris!", "Rome!")),
]
PROMPTS = ["The capital is ", "over the laz", "Go to https:", "It is Pa"]


def healing_tokenizer(vocab_size: int = 512, extra=()) -> Tokenizer:
    """A byte-level BPE (ids 0-2 special, 3-258 the bytes, then MERGES and `extra`, pairs of str or
    bytes), padded to the tiny model's vocabulary."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    b2u = byte_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in b2u.items()})
    merges = []
    for a, b in [*MERGES, *extra]:
        ua, ub = ("".join(b2u[x] for x in (s if isinstance(s, bytes) else s.encode())) for s in (a, b))
        merges.append((ua, ub))
        vocab[ua + ub] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(tok, eos_token_id=2, bos_token_id=1, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return healing_tokenizer()


def pieces(tok: Tokenizer, text: str) -> list[bytes]:
    return [tok.token_bytes[i] for i in tok.encode(text)]


# ---------------------------------------------------------------------------- what to take back

def test_plan_takes_back_what_a_longer_token_could_write(tok):
    assert pieces(tok, "over the laz")[-2:] == [b" la", b"z"]
    assert plan(tok, tok.encode("The capital is ")) == Healing(1, " ")   # " " begins " Paris"
    assert plan(tok, tok.encode("over the laz")) == Healing(2, " laz")   # " la" + "z" begin " lazy"
    assert plan(tok, tok.encode("Go to https:")) == Healing(1, ":")      # ":" begins "://"
    assert plan(tok, tok.encode("It is Pa")) == Healing(1, " Pa")        # " Pa" begins " Paris"


def test_plan_takes_back_nothing_that_would_not_help(tok):
    assert plan(tok, tok.encode("The end.")) is None        # no token begins with "."
    assert plan(tok, tok.encode("Pa")) is None               # never the whole prompt
    assert plan(tok, [*tok.encode("Hi "), 2]) is None        # never a special token
    assert plan(tok, [*tok.encode("a"), 2, *tok.encode(" ")]) == Healing(1, " ")  # ... nor past one


def test_plan_takes_back_whole_characters_only():
    # "é" is two byte tokens here, and a token begins with its second byte: taking that byte back
    # alone would split the character, and no token begins with the whole of it.
    tok = healing_tokenizer(extra=[(b"\xa9", b"x")])
    assert pieces(tok, "café")[-2:] == [b"\xc3", b"\xa9"]
    assert plan(tok, tok.encode("café")) is None
    whole = healing_tokenizer(extra=[(b"\xc3", b"\xa9"), ("é", "s")])  # "é" is one token, "és" another
    assert plan(whole, whole.encode("café")) == Healing(1, "é")


# ---------------------------------------------------------------------------- in the sandbox

@pytest.fixture(scope="module")
def rt(tok):
    from rudder.controller import ControllerRuntime, Limits

    runtime = ControllerRuntime(tok, Limits())
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def modules(rt):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = rt.load(builtin_controller(name))
        return cache[name]

    return get


def drive(rt, module, arg: str, prompt: list[int], heal: int, pick, max_tokens: int = 24):
    """One sequence under a controller told to heal `heal` prompt tokens, played as the engine
    would (backtrack, masked sampling with ff lists, fast-forward). Returns the generated tokens
    (from where the backtrack left the prompt), each step's Branch (its mask as the allowed ids) and
    the output before it."""
    vocab, eos = rt.tokenizer.vocab_size, rt.tokenizer.eos_token_id
    ctl = rt.start(module, arg)
    tell(ctl, Healing(heal, ""))
    tokens, n_prompt, backtrack, appended, steps = list(prompt), len(prompt), 0, list(prompt), []
    try:
        for _ in range(4 * max_tokens):
            branches = ctl.mid_process(0, backtrack, appended)
            if not branches:
                break
            [b] = branches
            tokens = tokens[: len(tokens) - b.backtrack]
            n_prompt = min(n_prompt, len(tokens))
            allowed = None if b.mask is None else allowed_ids(b.mask, vocab)  # (the mask lives until the next call)
            steps.append((Branch(b.backtrack, allowed, b.ff), list(tokens[n_prompt:])))
            if b.mask is None and b.ff:
                appended = list(b.ff[0])
            else:
                t = int(pick(allowed_ids(b.mask, vocab), None))
                appended = next((list(lst) for lst in b.ff if lst[0] == t), [t])
            tokens += appended
            backtrack = b.backtrack
            if eos in appended or len(tokens) - n_prompt >= max_tokens:
                break
    finally:
        ctl.close()
    return [t for t in tokens[n_prompt:] if t != eos], steps


def text_bytes(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes[i] for i in ids)


@pytest.mark.parametrize("name,arg,valid", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_healing_mask_writes_the_taken_back_bytes_again(tok, rt, modules, name, arg, valid, prompt):
    ids = tok.encode(prompt)
    healing = plan(tok, ids)
    healed = text_bytes(tok, ids[-healing.tokens:])
    for pick in pickers(6):
        generated, steps = drive(rt, modules(name), arg, ids, healing.tokens, pick)
        first, _ = steps[0]
        assert first.backtrack == healing.tokens and first.mask is not None
        for branch, before in steps:
            written = text_bytes(tok, before)
            if len(written) >= len(healed):
                assert branch.backtrack == 0 and not (name == "heal" and branch.mask is not None)
                continue
            rest = healed[len(written):]
            allowed = branch.mask
            assert tok.eos_token_id not in allowed
            spelled = [tok.token_bytes[t] for t in allowed]
            assert all(b.startswith(rest) or rest.startswith(b) for b in spelled), (rest, spelled)
            if any(b.startswith(rest) for b in spelled):  # tokens that write all of it, when there are
                assert all(b.startswith(rest) for b in spelled)
        out = text_bytes(tok, generated)
        assert out.startswith(healed), (out, healed)
        if len(generated) < 24:  # it ended: what follows the healed text is the constraint's
            assert valid(out[len(healed):].decode("utf-8", "replace")), out


@pytest.mark.parametrize("name,arg,valid", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_nothing_to_heal_is_the_plain_controller(tok, rt, modules, name, arg, valid):
    ids = tok.encode("The capital is ")
    for pick in pickers(3):
        plain, plain_steps = drive(rt, modules(name), arg, ids, 0, pick)
        assert plain_steps[0][0].backtrack == 0
        if name == "heal":
            assert all(b.mask is None and not b.ff for b, _ in plain_steps)


def test_a_token_that_does_not_write_the_healed_text_fails_the_request(tok, rt, modules):
    ctl = rt.start(modules("regex"), REGEX)
    ids = tok.encode("The capital is ")
    tell(ctl, Healing(1, " "))
    [b] = ctl.mid_process(0, 0, ids)
    assert b.backtrack == 1
    with fails_with("(Paris) after 0 generated tokens does not continue the match"):
        ctl.mid_process(0, 1, tok.encode("Paris"))  # no space: the host ignored the mask
    ctl.close()


# ---------------------------------------------------------------------------- the tiny model

@pytest.fixture(scope="module")
def llm(tok):
    llm = LLM("tiny")
    llm.tokenizer = llm.engine.tokenizer = tok  # the tiny model, with merges worth healing (same 512 ids)
    yield llm
    llm.close()


GREEDY = SamplingParams(max_tokens=12, temperature=0, token_healing=True)


def first_bytes(tok, out, n: int) -> bytes:
    return text_bytes(tok, out.token_ids)[:n]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_healing_alone_on_the_tiny_model(llm, tok, prompt):
    healing = plan(tok, tok.encode(prompt))
    for seed in (None, 1, 2, 3):
        params = SamplingParams(max_tokens=12, temperature=0 if seed is None else 1.0, seed=seed, token_healing=True,
                                ignore_eos=True)
        [out] = llm.generate([prompt], params, trace=True)
        assert out.error is None and out.finish_reason == "length"
        full = text_bytes(tok, out.token_ids)
        assert full.startswith(healing.text.encode())
        assert out.text == full[len(healing.text.encode()):].decode("utf-8", "replace")
        assert out.trace[0].backtrack == healing.tokens
        assert len(out.token_ids) == 12 and out.prompt_tokens == len(tok.encode(prompt))
        streamed = "".join(d.text for d in llm.stream(prompt, params))
        assert streamed == out.text


@pytest.mark.parametrize("name,arg,valid", CONSTRAINTS[1:], ids=[c[0] for c in CONSTRAINTS[1:]])
@pytest.mark.parametrize("prompt", ["The capital is ", "It is Pa"])
def test_healing_composes_with_each_constraint_on_the_tiny_model(llm, tok, name, arg, valid, prompt):
    field = {"json": "json_schema", "regex": "regex", "choices": "choice", "grammar": "grammar"}[name]
    value = {"json": SCHEMA, "regex": REGEX, "choices": CHOICES, "grammar": GRAMMAR}[name]
    healing = plan(tok, tok.encode(prompt))
    for seed in (1, 2, 3, 4):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, token_healing=True, **{field: value})
        [out] = llm.generate([prompt], params, trace=True)
        assert out.error is None and out.finish_reason == "stop", out.error
        assert text_bytes(tok, out.token_ids).startswith(healing.text.encode())
        assert out.trace[0].backtrack == healing.tokens
        assert valid(out.text), out.text


def test_greedy_output_is_the_plain_one_when_nothing_is_taken_back(llm, tok):
    assert plan(tok, tok.encode("The end.")) is None
    for extra in ({}, {"regex": "[a-z ]{4,30}\\."}, {"choice": CHOICES}):
        plain = llm.generate(["The end."], SamplingParams(max_tokens=12, temperature=0, **extra))[0]
        healed = llm.generate(["The end."], SamplingParams(max_tokens=12, temperature=0, token_healing=True,
                                                           **extra))[0]
        assert healed.token_ids == plain.token_ids and healed.text == plain.text


def test_stop_strings_look_after_the_healed_text(llm, tok):
    # " la" + "z" come back as " lazy": the stop string "la" is in the healed text, not the output.
    [plain] = llm.generate(["over the laz"], SamplingParams(max_tokens=12, temperature=0, token_healing=True))
    [stopped] = llm.generate(["over the laz"], SamplingParams(max_tokens=12, temperature=0, token_healing=True,
                                                              stop=["la"]))
    assert plain.text.startswith("y")  # " lazy": the healed " laz" is not shown
    assert stopped.text == plain.text.split("la")[0]
    assert first_bytes(tok, stopped, 4) == b" laz"


def test_healing_refuses_what_it_cannot_do(llm, tmp_path):
    with pytest.raises(ValueError, match="token_healing: a chat prompt"):
        llm.generate(["Hi "], GREEDY, chat=True)
    with pytest.raises(ValueError, match="token_healing: a chat prompt"):
        llm.chat([{"role": "user", "content": "Hi "}], GREEDY)
    with pytest.raises(ValueError, match="token_healing: logprobs"):
        llm.generate(["Hi "], SamplingParams(token_healing=True, logprobs=1))
    with pytest.raises(ValueError, match="token_healing: .*'fork' does not heal"):
        llm.generate(["Hi "], GREEDY, controller="fork", controller_arg="2")
    with pytest.raises(ValueError, match="token_healing: .*a controller module does not heal"):
        llm.generate(["Hi "], GREEDY, controller=b"\0asm")
    with pytest.raises(ValueError, match="token_healing: .*reasoning does not heal"):  # (the `triggers` controller)
        llm.generate(["Hi "], SamplingParams(token_healing=True, reasoning={"budget": 4}))


def test_a_started_controller_that_does_not_heal_fails_its_request(llm, tok):
    ctl = llm.start_controller("force", "xyz")
    [out] = llm.generate(["The capital is "], GREEDY, controllers=[ctl])
    assert out.finish_reason == "error" and "token healing: the first answer must take back" in out.error


@pytest.mark.parametrize("spec", ["lookup", "draft"])
def test_speculative_decoding_heals_exactly(llm, tok, spec):
    cases = [("over the laz", {}), ("It is Pa", {"regex": REGEX}), ("The capital is ", {"json_schema": SCHEMA})]
    for prompt, extra in cases:
        params = dict(max_tokens=20, temperature=0, token_healing=True, **extra)
        [plain] = llm.generate([prompt], SamplingParams(**params))
        [fast] = llm.generate([prompt], SamplingParams(**params, speculative=spec))
        assert fast.error is None and (fast.token_ids, fast.text) == (plain.token_ids, plain.text)


def test_the_taken_back_tokens_are_not_computed(llm, tok, monkeypatch):
    """The first answer needs no logits: once it is in, the prompt is prefilled without the tokens
    it takes back, and its sample comes from that prefill (had it come after the prefill, the
    taken-back positions would be dropped and one re-fed: the same tokens, one forward more)."""
    import rudder.engine.llm_engine as engine_module

    fed, run = [], llm.engine.runner.run

    def counting(batch, *args):
        fed.append(sum(e.num_tokens for e in batch))
        return run(batch, *args)

    monkeypatch.setattr(llm.engine.runner, "run", counting)
    monkeypatch.setattr(engine_module, "FIRST_ANSWER_WAIT", 60.0)  # (it waits for the answer, not this long)
    params = SamplingParams(max_tokens=3, temperature=0, token_healing=True, ignore_eos=True)
    [out] = llm.generate(["over the laz"], params)
    assert fed == [len(tok.encode("over the laz")) - 2, 1, 1]
    monkeypatch.setattr(engine_module, "FIRST_ANSWER_WAIT", 0.0)
    [again] = llm.generate(["over the laz"], params)
    assert again.token_ids == out.token_ids


def test_cli_token_healing():
    from zygote import run_cli  # `rudder` processes forked from one that imported torch already

    def rudder(*args):
        return run_cli([*args, "--model", "tiny", "--max-tokens", "6", "--temperature", "0"], timeout=60)

    plain, healed = rudder("generate", "Hello "), rudder("generate", "Hello ", "--token-healing")
    assert healed.returncode == 0 and healed.stdout == plain.stdout  # one token per byte: nothing to heal
    refused = rudder("run", "--controller", "fork", "--arg", "2", "--token-healing", "Hello ")
    assert refused.returncode == 1 and "token_healing:" in refused.stderr and "'fork' does not heal" in refused.stderr
    chat = rudder("generate", "--chat", "--token-healing", "Hello ")
    assert chat.returncode == 1 and "token_healing: a chat prompt" in chat.stderr


# ---------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server(llm):
    from rudder.server import ServerConfig

    with LiveServer(ServerConfig(model="tiny"), llm=llm) as s:
        yield s


def test_completions_heal_streamed_and_not(server, llm, tok):
    [want] = llm.generate(["The capital is "], SamplingParams(max_tokens=10, temperature=0, token_healing=True))
    body = {"prompt": "The capital is ", "max_tokens": 10, "temperature": 0, "token_healing": True}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == want.text
        usage = out["usage"]  # every token generated, the healing one too; the prompt as sent
        assert usage["completion_tokens"] == 10 and usage["prompt_tokens"] == len(tok.encode(body["prompt"]))
        echoed = c.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
        assert echoed == "The capital is " + want.text
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [e for e in sse_events(s) if e != "[DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events) == want.text
        raw = {**body, "stream": True, "rudder": {"stream_backtrack": True}}
        with c.stream("POST", "/v1/completions", json=raw) as s:
            events = [e for e in sse_events(s) if e != "[DONE]"]
        assert all(e["choices"][0].get("rudder_backtrack_tokens", 0) == 0 for e in events)  # none of the output
        assert "".join(e["choices"][0]["text"] for e in events) == want.text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_heal_with_a_constraint(server, tok, stream):
    body = {"prompt": "It is Pa", "max_tokens": 20, "temperature": 1.0, "seed": 3, "token_healing": True,
            "structured_outputs": {"regex": REGEX}, "stream": stream}
    with server.client() as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as s:
                text = "".join(e["choices"][0]["text"] for e in sse_events(s) if e != "[DONE]")
        else:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
    assert re.fullmatch(REGEX, text), text  # the constraint is on what follows the prompt as sent


@pytest.mark.parametrize("extra,words", [
    ({"n": 2}, "n > 1"),
    ({"logprobs": 1}, "logprobs"),
    ({"rudder": {"controller": "fork", "controller_arg": "2"}}, "rudder.controller ('fork') does not heal"),
])
def test_completions_refuse_what_healing_cannot_do(server, extra, words):
    body = {"prompt": "The capital is ", "max_tokens": 4, "token_healing": True, **extra}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "token_healing" and words in error["message"], error


def test_chat_and_run_refuse_token_healing(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "token_healing": True}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing", r.text
        r = c.post("/v1/run", json={**body, "controller": "fork", "controller_arg": "2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing", r.text


# ---------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smol(smollm2_folder):
    from rudder.controller import Limits

    return LLM("smollm2", controller_limits=Limits(mid_process_ms=2000, init_ms=10000))  # a loaded 2-core machine


# A prompt that ends mid-word or with a space, and what a good continuation completes it into.
BETTER = [
    ("The capital of France is ", "The capital of France is Paris"),
    ("The quick brown fox jumps over the la", "over the lazy dog"),
    ("The Eiffel Tow", "The Eiffel Tower"),
]


@pytest.mark.model
@pytest.mark.parametrize("prompt,good", BETTER, ids=[p for p, _ in BETTER])
def test_smollm2_healing_completes_the_prompt_the_way_the_model_would_have(smol, prompt, good):
    params = SamplingParams(max_tokens=8, temperature=0)
    [plain] = smol.generate([prompt], params)
    [healed] = smol.generate([prompt], SamplingParams(max_tokens=8, temperature=0, token_healing=True), trace=True)
    assert good in prompt + healed.text, healed.text
    assert good not in prompt + plain.text, plain.text  # before: the prompt's last token steered it off
    first = smol.tokenizer.token_bytes[healed.token_ids[0]]
    healing = plan(smol.tokenizer, smol.tokenizer.encode(prompt))
    assert first.startswith(healing.text.encode()) and len(first) > len(healing.text.encode())  # one token across


@pytest.mark.model
def test_smollm2_url_heals_into_one_token(smol):
    prompt = '{"url": "https:'
    healing = plan(smol.tokenizer, smol.tokenizer.encode(prompt))
    assert healing == Healing(1, ":")
    [out] = smol.generate([prompt], SamplingParams(max_tokens=12, temperature=0, token_healing=True))
    assert smol.tokenizer.token_bytes[out.token_ids[0]] == b"://"
    assert re.match(r"//[a-z0-9.-]+\.[a-z]{2,}", out.text), out.text


@pytest.mark.model
@pytest.mark.parametrize("field,value,valid", [
    ("json_schema", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                     "required": ["city"], "additionalProperties": False},
     lambda t: isinstance(json.loads(t)["city"], str)),
    ("regex", r"[A-Z][a-z]+\.", lambda t: re.fullmatch(r"[A-Z][a-z]+\.", t)),
    ("choice", ["Paris", "London", "Berlin"], lambda t: t in ("Paris", "London", "Berlin")),
    ("grammar", 'start: WORD "."\nWORD: /[A-Z][a-z]+/\n', lambda t: re.fullmatch(r"[A-Z][a-z]+\.", t)),
], ids=["json_schema", "regex", "choice", "grammar"])
def test_smollm2_healing_composes_with_constraints(smol, field, value, valid):
    prompt = "The capital of France is "
    [out] = smol.generate([prompt], SamplingParams(max_tokens=20, temperature=0, token_healing=True,
                                                   **{field: value}), trace=True)
    assert out.error is None and valid(out.text), out.text
    first = out.trace[0]
    assert first.backtrack == 1
    assert smol.tokenizer.token_bytes[out.token_ids[0]].startswith(b" ")
