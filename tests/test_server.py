"""The HTTP server, driven over real HTTP on loopback (httpx and the `openai` client).

Server mechanics use the tiny random-weight model (fast); tests marked `model` use SmolLM2."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import time

import httpx
import jsonschema
import pytest
import wasmtime

from rudder.controller import Limits
from rudder.controller.build import build_controller, builtin_controller
from rudder.server import ServerConfig
from serve_util import REWIND_C, LiveServer, apply_deltas, sse_events
from controller_wat import controller_wat

HANG_WAT = controller_wat(mid='(call $log (i32.const 0x200) (i32.const 8)) (loop $l (br $l)) (i32.const 0)',
                          extra='(data (i32.const 0x200) "hanging\\n")')


@pytest.fixture(scope="module")
def server():
    cfg = ServerConfig(model="tiny", max_tokens=2000, max_concurrent=8, max_queue=8, max_upload_bytes=1 << 20,
                       controller_limits=Limits(mid_process_ms=50))  # (a dict only lowers the defaults)
    with LiveServer(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def rewind_wasm(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("rewind")
    (d / "rewind.c").write_text(REWIND_C)
    return build_controller([d / "rewind.c"], d / "rewind.wasm").read_bytes()


def tag_map(c) -> dict[str, str]:
    """GET /v1/controllers/tags as {tag: module_id}."""
    return {t["tag"]: t["module_id"] for t in c.get("/v1/controllers/tags").json()["tags"]}


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- registry -----------------------------------------------------------------------------------

def test_health_models_and_builtin_tags(server):
    with server.client() as c:
        assert c.get("/healthz").json()["status"] == "ok"
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
        tags = c.get("/v1/controllers/tags").json()
        by_name = tag_map(c)
    for name in ("choices", "fork", "force", "backtrack", "json", "regex", "grammar"):
        assert name in tags["builtin"]
        assert by_name[name] == hashlib.sha256(builtin_controller(name).read_bytes()).hexdigest()


def test_upload_tag_and_run(server, rewind_wasm):
    with server.client() as c:
        r = c.post("/v1/controllers", content=rewind_wasm, headers={"content-type": "application/wasm"})
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["module_id"] == hashlib.sha256(rewind_wasm).hexdigest()
        assert info["wasm_size"] == len(rewind_wasm) and info["compiled_size"] > 0 and info["time_ms"] >= 0
        again = c.post("/v1/controllers", content=rewind_wasm).json()
        assert again["module_id"] == info["module_id"]  # content-addressed: one module

        assert c.post("/v1/controllers/tags", json={"tag": "rewind", "module_id": info["module_id"]}).status_code == 200
        assert tag_map(c)["rewind"] == info["module_id"]
        listed = {m["module_id"]: m for m in c.get("/v1/controllers").json()["data"]}
        assert "rewind" in listed[info["module_id"]]["tags"]

        by_tag = c.post("/v1/run", json={"controller": "rewind", "controller_arg": "Hello!", "prompt": "x",
                                         "stream": False, "seed": 3, "max_tokens": 50}).json()
        by_id = c.post("/v1/run", json={"controller": info["module_id"], "controller_arg": "Hello!", "prompt": "x",
                                        "stream": False, "seed": 3, "max_tokens": 50}).json()
    assert by_tag["choices"] == by_id["choices"]
    [choice] = by_tag["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"].startswith("Hell")  # "Hello!" forced, "o!" taken back, then sampled on
    assert by_tag["usage"]["ff_tokens"] == 6 and by_tag["usage"]["sampled_tokens"] >= 1
    assert "rewind: taking 2 tokens back" in by_tag["log"]
    assert by_tag["timings"]["controller_ms"] > 0 and by_tag["timings"]["forward_ms"] > 0


def test_upload_errors(server):
    with server.client() as c:
        bad = c.post("/v1/controllers", content=b"\0asm\x01\0\0\0garbage")
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["type"] == "controller_error" and err["kind"] == "bad_module" and err["message"]
        big = c.post("/v1/controllers", content=b"\0" * ((1 << 20) + 1))
        assert big.status_code == 413 and big.json()["error"]["type"] == "payload_too_large"
        assert c.post("/v1/controllers/tags", json={"tag": "x", "module_id": "0" * 64}).status_code == 404
        force_id = tag_map(c)["force"]
        assert c.post("/v1/controllers/tags", json={"tag": "fork", "module_id": force_id}).status_code == 403


def test_request_errors_are_json(server):
    with server.client() as c:
        cases = [
            (c.post("/v1/run", json={"prompt": "x", "max_tokens": 0}), 400, "invalid_request"),
            (c.post("/v1/run", json={"prompt": "x", "max_tokens": 5000}), 400, "invalid_request"),
            (c.post("/v1/run", json={"max_tokens": 5, "aici": False}), 400, "invalid_request"),
            (c.post("/v1/run", content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_request"),
            (c.post("/v1/run", json={"prompt": "x", "controller": "nope"}), 404, "not_found"),
            (c.post("/v1/run", json={"prompt": "x", "controller": "fork", "controller_limits": {"bogus": 1}}),
             400, "invalid_request"),
            (c.get("/v1/nothing"), 404, "not_found"),
        ]
    for r, status, kind in cases:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["error"]["type"] == kind and body["error"]["message"]
        assert "Traceback" not in r.text


def test_controller_start_error_carries_log_tail(server):
    with server.client() as c:
        r = c.post("/v1/run", json={"prompt": "x", "controller": "fork", "controller_arg": "many"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "controller_error" and err["kind"] == "start"
    assert "the argument must be a number" in err["log_tail"]


def test_request_limits_only_lower_the_servers(server):
    with server.client() as c:
        lowered = c.post("/v1/run", json={"prompt": "x", "controller": "fork", "controller_arg": "3",
                                          "controller_limits": {"max_forks": 2}})
        hang = c.post("/v1/controllers", content=bytes(wasmtime.wat2wasm(HANG_WAT))).json()["module_id"]
        t0 = time.monotonic()
        raised = c.post("/v1/run", json={"prompt": "x", "controller": hang, "stream": False,
                                         "controller_limits": {"mid_process_ms": 60000}})
        elapsed = time.monotonic() - t0
    assert lowered.status_code == 400 and "max_forks 2" in lowered.json()["error"]["log_tail"]
    # asking for a 60 s step gets the server's 50 ms
    assert raised.status_code == 400 and raised.json()["error"]["kind"] == "timeout" and elapsed < 10


# -- streaming ----------------------------------------------------------------------------------

def test_sse_stream_with_backtrack(server, rewind_wasm):
    with server.client() as c:
        module_id = c.post("/v1/controllers", content=rewind_wasm).json()["module_id"]
        texts: dict[int, str] = {}
        events = []
        with c.stream("POST", "/v1/run", json={"controller": module_id, "controller_arg": "Hello!",
                                               "prompt": "x", "seed": 1, "max_tokens": 50}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for event in sse_events(r):
                events.append(event)
                if event["type"] == "step":
                    apply_deltas(texts, event["deltas"])
    steps, done = events[:-1], events[-1]
    assert all(e["type"] == "step" for e in steps) and done["type"] == "done"
    assert any(d["backtrack"] == 2 for e in steps for d in e["deltas"])   # "o!" taken back
    assert any("rewind:" in e.get("log", "") for e in steps)
    assert texts[0] == done["choices"][0]["text"]
    assert done["usage"]["ff_tokens"] == 6
    assert done["usage"]["completion_tokens"] == len(
        [t for e in steps for d in e["deltas"] for t in d["token_ids"]]) - 2  # 2 taken back


def test_fork_controller_returns_several_choices(server):
    with server.client() as c:
        done = [e for e in sse_events(c.post("/v1/run", json={"prompt": "x", "controller": "fork",
                                                                 "controller_arg": "3", "max_tokens": 6, "seed": 2}))]
    assert done[-1]["type"] == "done"
    choices = done[-1]["choices"]
    assert sorted(ch["branch"] for ch in choices) == [0, 1, 2]
    assert done[-1]["usage"]["forks"] == 2

    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                         max_tokens=5, seed=4)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens > 0  # 3 choices of 5 tokens


def test_openai_client_streams_and_extension(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    forced = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=20, extra_body={"rudder": {"controller": "force",
                                                                                  "controller_arg": "Ahoy"}})
    assert forced.choices[0].message.content == "Ahoy" and forced.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=7, seed=5, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    whole = client.completions.create(model="tiny", prompt="abc", max_tokens=7, seed=5)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 7

    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"rudder": {"controller": "no-such-tag"}})
    assert "no-such-tag" in str(e.value)


# -- hostile controllers, limits, disconnects -------------------------------------------------------

def test_hostile_controller_fails_alone(server):
    wasm = bytes(wasmtime.wat2wasm(HANG_WAT))
    with server.client() as c:
        hang = c.post("/v1/controllers", content=wasm).json()["module_id"]

    def bad():
        with server.client() as c:
            return c.post("/v1/run", json={"prompt": "x", "controller": hang, "stream": False, "max_tokens": 10})

    def bad_stream():
        with server.client() as c:
            return list(sse_events(c.post("/v1/run", json={"prompt": "x", "controller": hang, "max_tokens": 10})))

    def good():
        with server.client() as c:
            return c.post("/v1/run", json={"prompt": "hello", "controller": "fork", "controller_arg": "2",
                                           "stream": False, "max_tokens": 30, "seed": 1})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        f_bad, f_stream, f_good = pool.submit(bad), pool.submit(bad_stream), pool.submit(good)
        r_bad, events, r_good = f_bad.result(), f_stream.result(), f_good.result()

    assert r_bad.status_code == 400
    err = r_bad.json()["error"]
    assert err["type"] == "controller_error" and err["kind"] == "timeout"
    assert "hanging" in err["log_tail"]
    assert events[-1]["type"] == "done" and events[-1]["error"]["kind"] == "timeout"
    assert events[-1]["choices"][0]["finish_reason"] == "error"

    assert r_good.status_code == 200
    assert [ch["finish_reason"] for ch in r_good.json()["choices"]] == ["length", "length"]
    assert server.metrics()['rudder_failures_total{kind="timeout"}'] >= 2


def test_disconnect_frees_kv_blocks_and_request(server):
    before = server.metrics()
    total = before["rudder_kv_blocks_total"]
    assert wait_for(lambda: server.metrics()["rudder_kv_blocks_free"] == total)
    with server.client() as c:
        with c.stream("POST", "/v1/run", json={"prompt": "a long prompt " * 20, "controller": "fork",
                                               "controller_arg": "2", "max_tokens": 1700, "seed": 7,
                                               "ignore_eos": True}) as r:
            events = sse_events(r)
            seen = [next(events) for _ in range(3)]
            during = server.metrics()
        # the connection is closed here, mid-stream
    assert all(e["type"] == "step" for e in seen)
    assert during["rudder_engine_requests"] == 1 and during["rudder_kv_blocks_free"] < total
    assert wait_for(lambda: server.metrics()["rudder_cancelled_total"] == before["rudder_cancelled_total"] + 1)
    after = server.metrics()
    assert after["rudder_kv_blocks_free"] == total
    assert after["rudder_engine_requests"] == 0 and after["rudder_requests_running"] == 0


def test_queue_full_is_429_and_restricted_mode():
    cfg = ServerConfig(model="tiny", restricted=True, max_concurrent=1, max_queue=0, max_tokens=2000)
    with LiveServer(cfg) as s, s.client() as c:
        assert c.post("/v1/controllers", content=b"\0asm").json()["error"]["type"] == "forbidden"
        with c.stream("POST", "/v1/run", json={"prompt": "x", "controller": "fork", "controller_arg": "1",
                                               "max_tokens": 2000, "ignore_eos": True}) as r:
            events = sse_events(r)
            assert next(events)["type"] == "step"  # it runs
            busy = httpx.post(s.url + "/v1/run", json={"prompt": "y", "max_tokens": 3})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "too_many_requests"
        assert busy.headers["retry-after"] == "1"
        assert wait_for(lambda: s.metrics()["rudder_requests_running"] == 0)
        assert c.post("/v1/run", json={"prompt": "y", "max_tokens": 3, "stream": False}).status_code == 200


# -- the real model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_server(smollm2_folder):
    with LiveServer(ServerConfig(model="smollm2", max_tokens=512)) as s:
        yield s


@pytest.mark.model
def test_openai_stream_matches_whole_response(smol_server):
    from openai import OpenAI

    client = OpenAI(base_url=smol_server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                                 stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole.choices[0].message.content
    assert len(streamed.split()) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.model
def test_json_schema_chat_completion_validates(smol_server):
    from openai import OpenAI

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    client = OpenAI(base_url=smol_server.url + "/v1", api_key="unused")
    out = client.chat.completions.create(
        model="smollm2", max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, schema)


def test_regex_extension_maps_onto_the_regex_controller(server):
    from openai import OpenAI

    assert "regex" in httpx.get(server.url + "/v1/controllers/tags").json()["builtin"]
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a number"}],
                                             max_tokens=8, seed=seed, extra_body={"rudder": {"regex": "[0-9]+"}})
        assert re.fullmatch("[0-9]+", out.choices[0].message.content), out.choices[0].message.content


def test_speculative_run_reports_its_stats_and_matches_plain(server):
    body = {"prompt": "a b c a b c a b c a b", "max_tokens": 24, "temperature": 0, "stream": False}
    with server.client() as c:
        plain = c.post("/v1/run", json=body).json()
        spec = c.post("/v1/run", json={**body, "speculative": "lookup", "spec_k": 4}).json()
        bad = c.post("/v1/run", json={**body, "speculative": "oracle"})
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    stats = spec["usage"]["speculative"]
    assert stats["target_forwards"] >= 1 and stats["drafted"] >= stats["accepted"] >= 0
    assert "speculative" not in plain["usage"]
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request"


def test_pipeline_server_answers_as_one_process_and_a_dead_stage_fails_cleanly():
    """`rudder serve --pipeline-stages 2`: the same text as one process over HTTP; killing a
    stage ends the stream in flight with an engine error, and the server then says so."""
    import os
    import signal

    from rudder import LLM, SamplingParams

    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": False}
    want = LLM("tiny:4").generate(["hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    cfg = ServerConfig(model="tiny:4", max_tokens=2000, engine_options={"pipeline_stages": 2})
    with LiveServer(cfg) as s, s.client() as c:
        runner = s.app.state.service.llm.engine.runner
        assert runner.num_stages == 2
        r = c.post("/v1/run", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        with c.stream("POST", "/v1/run", json={**body, "max_tokens": 2000, "stream": True}) as stream:
            events = sse_events(stream)
            assert next(events)["type"] == "step"
            os.kill(runner.children[0].pid, signal.SIGKILL)
            last = [e for e in events if e != "[DONE]"][-1]
        assert last["type"] == "done" and last["error"]["type"] == "engine_error"
        assert "stage 1" in last["error"]["message"] and "killed by signal 9" in last["error"]["message"]
        assert c.get("/healthz").json()["status"] == "failed"
        refused = c.post("/v1/run", json=body)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_error"
    assert runner.children[0].poll() is not None


def test_serve_with_a_bad_layout_or_model_is_one_line():
    from typer.testing import CliRunner

    from rudder.cli import app

    for args in (["-m", "tiny:4", "--pipeline-stages", "3,2"], ["-m", "no-such-model"]):
        result = CliRunner().invoke(app, ["serve", "--port", "0", *args])
        assert result.exit_code == 1 and "error:" in result.output and "Traceback" not in result.output, args


def test_text_with_unicode_line_ends_streams_one_event_per_line(server):
    """U+0085, U+2028 and U+2029 end a line for str.splitlines, and so for httpx's and requests'
    iter_lines, which clients read event streams with (not for SSE or JSON): a stream escapes
    them, so each event is one line there and the text comes back whole."""
    text = "a\x85b\u2028c\u2029d"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True,
                "rudder": {"controller": "force", "controller_arg": text}}) as r:
            events = list(sse_events(r))  # json.loads fails on half an event
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == text
        with c.stream("POST", "/v1/run", json={"controller": "force", "controller_arg": text, "prompt": "x",
                                                "max_tokens": 20}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines), lines
