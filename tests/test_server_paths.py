"""Server paths users touch that tests/test_server.py does not: admission queueing, a full
registry, restricted mode's tags, `stop` and `messages` on /v1/run, the OpenAI endpoints'
constraint rules and their streamed backtracks, and the 500 handler.

Real HTTP on loopback (uvicorn in a thread, tests/serve_util.py) over the tiny random-weight
model: no SmolLM2, offline. The `rudder serve` command line itself is in test_server_flags.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import time

import httpx
import jsonschema
import pytest

from controller_wat import GOOD_WAT, wasm_of
from rudder.controller.build import BUILTIN_CONTROLLERS, build_controller
from rudder.server import ServerConfig
from serve_util import LiveServer, apply_deltas, sse_events

# Forces the argument's tokens, then takes the last two back and samples on to 8 tokens: a
# stream with a visible backtrack.
REWIND_C = r'''
#include "rudder.h"
static uint32_t *forced, n_forced;
int controller_start(const char *arg, uint32_t len) {
    forced = rudder_tokenize(arg, len, &n_forced);
    return forced && n_forced >= 2 ? 0 : 1;
}
void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index == 0) {
        rudder_out_ff(out, forced, n_forced);
        return;
    }
    if (step->index == 1) {
        rudder_out_sample(out, NULL)->backtrack = 2;
        return;
    }
    if (step->n_seq - step->n_prompt < 8)
        rudder_out_sample(out, NULL);
}
'''

# "A request that runs": its 2000 tokens (within the tiny model's 2048-token context: a prompt
# plus max_tokens past it is a 400) take ~20 s with 12 layers, far longer than the checks made
# meanwhile; the tests cancel it once they are done.
LONG = {"max_tokens": 2000, "ignore_eos": True}
SLOW_TINY = "tiny:12"


@pytest.fixture(scope="module")
def server():
    with LiveServer(ServerConfig(model="tiny", max_tokens=5000, max_concurrent=4, max_queue=4)) as s:
        yield s


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def rewind_id(server, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("rewind")
    (d / "rewind.c").write_text(REWIND_C)
    wasm = build_controller([d / "rewind.c"], d / "rewind.wasm").read_bytes()
    r = httpx.post(server.url + "/v1/controllers", content=wasm)
    assert r.status_code == 200, r.text
    return r.json()["module_id"]


def wait_for(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == kind, body
    return body["message"]


def run(c: httpx.Client, **body) -> dict:
    r = c.post("/v1/run", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- admission -----------------------------------------------------------------------------------

def test_a_queued_request_waits_then_runs():
    """max_concurrent 1, max_queue 2: while one request runs, two more wait (and say so in
    /healthz and /metrics), a fourth is refused with 429 at once; when the running one ends,
    the waiting ones run, in order."""
    cfg = ServerConfig(model=SLOW_TINY, max_concurrent=1, max_queue=2, max_tokens=5000)
    # The order the server finished them in, from its one line per finished request (told apart
    # by their prompts' lengths): client-side clocks are read after the response, by threads
    # that may wait for a core, and once put c before b by 0.3 ms.
    finished = []
    handler = logging.Handler()
    handler.emit = lambda record: finished.append(record.getMessage())
    server_log = logging.getLogger("rudder.server")
    level = server_log.level
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    with LiveServer(cfg) as s, s.client() as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        def short(prompt):
            with s.client() as own:
                return own.post("/v1/run", json={"prompt": prompt, "max_tokens": 3, "stream": False,
                                                 "ignore_eos": True})

        with c.stream("POST", "/v1/run", json={"prompt": "a", **LONG}) as running:
            assert running.status_code == 200
            events = sse_events(running)
            assert next(events)["type"] == "step"
            first = pool.submit(short, "b")  # (one token)
            assert wait_for(lambda: c.get("/healthz").json()["queued"] == 1)
            second = pool.submit(short, "c c c c c")  # (more)
            assert wait_for(lambda: c.get("/healthz").json()["queued"] == 2)
            health = c.get("/healthz").json()
            assert (health["running"], health["queued"]) == (1, 2)
            assert s.metrics()["rudder_queue_depth"] == 2
            message = error_of(httpx.post(s.url + "/v1/run", json={"prompt": "d", "max_tokens": 3}), 429,
                               "too_many_requests")
            assert "1 running, 2 queued" in message
            assert not first.done() and not second.done()   # they wait while the first runs
        # the stream is closed: the long request is cancelled and the queue moves
        for f in (first, second):
            r = f.result(timeout=60)
            assert r.status_code == 200, r.text
            [choice] = r.json()["choices"]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 3
        server_log.removeHandler(handler)
        server_log.setLevel(level)
        lengths = [int(m.split("prompt_tokens=")[1].split()[0]) for m in finished if "completion_tokens=3 " in m]
        assert len(lengths) == 2 and lengths[0] < lengths[1]  # b ran (and ended) before c
        assert wait_for(lambda: (c.get("/healthz").json()["running"], c.get("/healthz").json()["queued"]) == (0, 0))


# -- registry --------------------------------------------------------------------------------------

def test_a_full_registry_refuses_new_modules_with_413():
    """The registry keeps at most max_modules uploaded modules (`--max-modules`: the built-in
    ones, in memory, do not count): a new one past that is 413; the same bytes again are the
    same module, not a new one."""
    cfg = ServerConfig(model="tiny", max_modules=2)
    one, two, three = (bytes(wasm_of(GOOD_WAT.replace("0xABCD", m))) for m in ("0x1111", "0x2222", "0x3333"))
    with LiveServer(cfg) as s, s.client() as c:
        assert set(c.get("/v1/controllers/tags").json()["builtin"]) == set(BUILTIN_CONTROLLERS)
        first = c.post("/v1/controllers", content=one)
        assert first.status_code == 200, first.text
        second = c.post("/v1/controllers", content=two)
        assert second.status_code == 200, second.text
        full = c.post("/v1/controllers", content=three)
        assert error_of(full, 413, "payload_too_large") == f"the registry is full ({cfg.max_modules} modules)"
        assert full.json()["error"]["code"] == "registry_full"
        again = c.post("/v1/controllers", content=one)
        assert again.status_code == 200 and again.json()["module_id"] == first.json()["module_id"]
        listed = c.get("/v1/controllers").json()["data"]
        uploaded = {m["module_id"] for m in listed if not m["builtin"]}
        assert uploaded == {first.json()["module_id"], second.json()["module_id"]}
        assert len(listed) == len(BUILTIN_CONTROLLERS) + cfg.max_modules
        # the module that got in runs
        out = run(c, prompt="x", controller=first.json()["module_id"], controller_arg="m", max_tokens=2)
        assert out["choices"][0]["finish_reason"] in ("length", "stop")


def test_restricted_mode_refuses_uploads_and_tag_changes():
    """--restricted: the registry is read-only (no uploads, no tag changes or deletions, each a
    403 with code "restricted"); the built-in controllers still run."""
    restricted = "the registry cannot be changed on this server (--restricted)"
    with LiveServer(ServerConfig(model="tiny", restricted=True)) as s, s.client() as c:
        tags = c.get("/v1/controllers/tags").json()
        force_id = next(t["module_id"] for t in tags["tags"] if t["tag"] == "force")
        refusals = [c.post("/v1/controllers", content=bytes(wasm_of(GOOD_WAT))),
                    c.post("/v1/controllers/tags", json={"tag": "mine", "module_id": force_id}),
                    c.post("/v1/controllers/tags", json={"tags": ["mine", "yours"], "module_id": force_id}),
                    c.delete("/v1/controllers/tags/mine"),
                    c.delete(f"/v1/controllers/{force_id}"),
                    c.post("/v1/controllers/prune")]
        for r in refusals:
            assert error_of(r, 403, "forbidden") == restricted, r.request.url
            assert r.json()["error"]["code"] == "restricted"
        assert c.get("/v1/controllers/tags").json() == tags   # nothing changed
        out = run(c, prompt="x", controller="force", controller_arg="built-in ones still run")
        assert out["choices"][0]["text"] == "built-in ones still run"


# -- /v1/run -----------------------------------------------------------------------------------

def test_stop_strings_over_http(server, openai_client):
    """`stop` (a string or a list) cuts the text before the first stop string, sampled or
    fast-forwarded, with finish_reason "stop"; /v1/completions does the same."""
    with server.client() as c:
        forced = run(c, prompt="x", controller="force", controller_arg="Hello, world. Bye", stop=["Bye", "world"])
        assert forced["choices"][0] == {"branch": 0, "text": "Hello, ", "finish_reason": "stop"}
        body = {"prompt": "hello there", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        whole = run(c, **body)["choices"][0]["text"]
        assert len(whole) > 12
        stop = whole[8:11]
        want = whole[: whole.find(stop)]
        cut = run(c, **body, stop=stop)["choices"][0]
        assert cut == {"branch": 0, "text": want, "finish_reason": "stop"}
        streamed: dict[int, str] = {}
        with c.stream("POST", "/v1/run", json={**body, "stop": [stop]}) as r:
            events = list(sse_events(r))
        for e in events[:-1]:
            apply_deltas(streamed, e["deltas"])
        assert streamed[0] == want and events[-1]["choices"][0]["finish_reason"] == "stop"
    out = openai_client.completions.create(model="tiny", prompt="hello there", max_tokens=40, temperature=0,
                                           stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"


def test_run_with_messages_is_the_chat_template(server):
    """/v1/run with `messages` is the same request as the prompt the chat template makes of them
    (streamed or not); exactly one of prompt and messages."""
    from rudder.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tok = Tokenizer.byte_level(512)   # the tiny model's
    prompt = tok.apply_chat_template(messages)
    assert "Be brief." in prompt and "Hi there" in prompt
    body = {"max_tokens": 12, "seed": 5, "temperature": 0.9}
    with server.client() as c:
        by_messages = run(c, messages=messages, **body)
        by_prompt = run(c, prompt=prompt, **body)
        assert by_messages["choices"] == by_prompt["choices"]
        assert by_messages["usage"]["prompt_tokens"] == len(tok.encode(prompt)) == by_prompt["usage"]["prompt_tokens"]
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
        assert run(c, messages=[messages[0], *parts], **body)["choices"] == by_messages["choices"]
        streamed: dict[int, str] = {}
        with c.stream("POST", "/v1/run", json={"messages": messages, **body}) as r:
            for e in sse_events(r):
                if e["type"] == "step":
                    apply_deltas(streamed, e["deltas"])
        assert streamed[0] == by_messages["choices"][0]["text"]
        both = c.post("/v1/run", json={"prompt": "x", "messages": messages})
        assert error_of(both, 400, "invalid_request") == "give either prompt or messages"
        assert error_of(c.post("/v1/run", json={"messages": [{"content": "no role"}]}), 400, "invalid_request")


# -- OpenAI endpoints: constraints -------------------------------------------------------------

CHAT = [{"role": "user", "content": "Answer."}]
# closed: an absent additionalProperties allows extra keys, which random weights never end
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok"],
          "additionalProperties": False}
GRAMMAR = 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/\n'


def _native(server, controller: str, arg: str, seed: int, max_tokens: int) -> dict:
    with server.client() as c:
        return run(c, messages=CHAT, controller=controller, controller_arg=arg, seed=seed, max_tokens=max_tokens)


@pytest.mark.parametrize("constraint,controller,arg", [
    ({"response_format": {"type": "json_object"}}, "json", json.dumps({"type": "object"})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json",
     json.dumps(SCHEMA)),
    ({"rudder": {"grammar": GRAMMAR}}, "grammar", GRAMMAR),
    ({"rudder": {"regex": "[A-Z][a-z]{2,5}"}}, "regex", "[A-Z][a-z]{2,5}"),
    ({"rudder": {"controller": "force", "controller_arg": "Ahoy"}}, "force", "Ahoy"),
], ids=["json_object", "json_schema", "grammar", "regex", "controller"])
def test_openai_constraints_map_onto_the_builtin_controllers(server, constraint, controller, arg):
    """Each constraint of a chat completion is the named built-in controller with that
    argument: the same seed gives the very text /v1/run gives with it. At least three seeds,
    more (up to 10) until an output finished within max_tokens and could be checked whole (the
    random model's JSON objects often run past 60 tokens)."""
    checked = 0
    for seed in range(10):
        if seed >= 3 and checked:
            break
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": CHAT, "max_tokens": 60, "seed": seed, **constraint})
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        native = _native(server, controller, arg, seed, 60)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (native["text"], native["finish_reason"])
        text = choice["message"]["content"]
        if choice["finish_reason"] == "length":
            continue
        checked += 1
        if controller == "json":
            value = json.loads(text)
            if "json_schema" in constraint.get("response_format", {}):
                jsonschema.validate(value, SCHEMA)
            else:   # json_object: any JSON object (not any JSON value)
                assert isinstance(value, dict), text
        elif controller == "grammar":
            assert re.fullmatch("yes|no|[0-9]{1,3}", text), text
        elif controller == "regex":
            assert re.fullmatch("[A-Z][a-z]{2,5}", text), text
        else:
            assert text == "Ahoy"
    assert checked >= 1   # not vacuous: some outputs finished


def test_openai_constraint_rules(server, openai_client):
    """One constraint at a time (two are a 400 naming both, `param` the second); n > 1 only
    without one; a json_schema needs its schema. Each refusal is a 400 the OpenAI client raises.
    A completion's list of prompts is one request per prompt (choice index = prompt index)."""
    import openai

    url = server.url + "/v1/chat/completions"
    two = [({"response_format": {"type": "json_object"}, "rudder": {"regex": "a+"}}, "response_format", "rudder.regex"),
           ({"rudder": {"regex": "a+", "grammar": GRAMMAR}}, "rudder.regex", "rudder.grammar"),
           ({"rudder": {"grammar": GRAMMAR, "controller": "force", "controller_arg": "x"}}, "rudder.grammar",
            "rudder.controller")]
    for body, first, second in two:
        r = httpx.post(url, json={"messages": CHAT, **body})
        assert error_of(r, 400, "invalid_request") == f"{first} and {second} both constrain the output: give one"
        assert r.json()["error"]["param"] == second
    for body, field in [({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"rudder": {"regex": "a+"}}, "rudder.regex")]:
        r = httpx.post(url, json={"messages": CHAT, "n": 2, **body})
        message = error_of(r, 400, "invalid_request")
        assert "n > 1 works without a constraint only" in message and f"{field} is one" in message
        assert r.json()["error"]["param"] == "n"
    schemaless = {"type": "json_schema", "json_schema": {"name": "x"}}
    r = httpx.post(url, json={"messages": CHAT, "response_format": schemaless})
    assert "needs json_schema.schema" in error_of(r, 400, "invalid_request")
    assert r.json()["error"]["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="both constrain the output"):
        openai_client.chat.completions.create(model="tiny", messages=CHAT, response_format={"type": "json_object"},
                                              extra_body={"rudder": {"regex": "a+"}})
    [single] = openai_client.completions.create(model="tiny", prompt=["one"], max_tokens=3, seed=1).choices
    [plain] = openai_client.completions.create(model="tiny", prompt="one", max_tokens=3, seed=1).choices
    assert single.text == plain.text
    alone = [openai_client.completions.create(model="tiny", prompt=p, max_tokens=3, seed=1) for p in ("one", "two")]
    both = openai_client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=3, seed=1)
    assert [(ch.index, ch.text) for ch in both.choices] == [(0, alone[0].choices[0].text),
                                                           (1, alone[1].choices[0].text)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # n > 1 without a constraint: n choices (the fork controller), each sampled on its own
    out = openai_client.completions.create(model="tiny", prompt="x", n=3, max_tokens=6, seed=2)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2] and len({ch.text for ch in out.choices}) > 1


def _stream_text(url: str, body: dict, chat: bool) -> tuple[str, list[str], list[int], list]:
    """Stream `body`; returns the text a client applying `rudder_backtrack` ends with, the text
    it showed after each chunk, the backtracks it applied and the raw chunks."""
    text, shown, backtracks, chunks = "", [], [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for chunk in sse_events(r):
            chunks.append(chunk)
            if chunk == "[DONE]":
                break
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                if choice.get("rudder_backtrack"):
                    backtracks.append(choice["rudder_backtrack"])
                    text = text[: len(text) - choice["rudder_backtrack"]]
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                shown.append(text)
    assert chunks[-1] == "[DONE]"
    return text, shown, backtracks, chunks


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_openai_streams_carry_rudder_backtrack(server, rewind_id, endpoint):
    """A controller that takes text back ("Hello!", then "o!" taken back): by default the
    stream holds text back until it can no longer be taken back (the rewind module declared no
    backtrack depth: held until it ends), so a standard client never sees "o!" and no chunk
    carries `rudder_backtrack`. With `rudder.stream_backtrack: true` the raw deltas come, the
    backtrack as `rudder_backtrack` (characters to delete first) on the streamed choice; applying
    it gives the non-streamed text either way."""
    chat = endpoint == "chat"
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    steer = {"controller": rewind_id, "controller_arg": "Hello!"}
    body = {"model": "tiny", "max_tokens": 50, "seed": 3, **({"messages": CHAT} if chat else {"prompt": "x"}),
            "rudder": steer}
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    whole_text = whole["message"]["content"] if chat else whole["text"]
    assert whole_text.startswith("Hell") and not whole_text.startswith("Hello!") and whole["finish_reason"] == "stop"

    # the default: held back, never a backtrack, every text shown a prefix of the final one
    text, shown, backtracks, chunks = _stream_text(url, body, chat)
    assert text == whole_text and backtracks == []
    assert all(whole_text.startswith(t) for t in shown), shown
    assert not any("rudder_backtrack" in choice for ch in chunks[:-1] for choice in ch["choices"])

    # the opt-in: the raw deltas, "Hello!" shown and then "o!" taken back, once
    raw = {**body, "rudder": {**steer, "stream_backtrack": True}}
    text, shown, backtracks, chunks = _stream_text(url, raw, chat)
    assert backtracks == [2]
    assert any(t.startswith("Hello!") for t in shown), shown
    assert text == whole_text
    marked = [choice for ch in chunks[:-1] for choice in ch["choices"] if "rudder_backtrack" in choice]
    assert [(c["rudder_backtrack"], c["rudder_backtrack_tokens"]) for c in marked] == [(2, 2)]
    plain = [ch for ch in chunks[:-1] for choice in ch["choices"] if "rudder_backtrack" not in choice]
    assert plain   # the other chunks carry no such field


# -- the 500 handler ---------------------------------------------------------------------------

def test_an_unexpected_error_is_a_plain_500(server, caplog):
    """A bug in a handler is logged with its traceback and answered with a JSON 500 that tells
    the client nothing of it; the server keeps serving."""
    registry = server.app.state.service.registry

    def broken():
        raise RuntimeError("secret internal detail")

    before = server.metrics().get('rudder_requests_total{endpoint="/v1/controllers",status="500"}', 0)
    with caplog.at_level(logging.ERROR, logger="rudder.server"):
        registry.describe = broken
        try:
            r = httpx.get(server.url + "/v1/controllers")
        finally:
            del registry.describe
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "internal_error", "param": None,
                                  "code": None}}
    assert "secret" not in r.text and "Traceback" not in r.text
    logged = [rec for rec in caplog.records if rec.name == "rudder.server" and rec.exc_info]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])
    assert server.metrics()['rudder_requests_total{endpoint="/v1/controllers",status="500"}'] == before + 1
    assert httpx.get(server.url + "/v1/controllers").status_code == 200
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
