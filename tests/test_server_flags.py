"""`rudder serve` as users start it: a real subprocess on a free port, its flags checked by
their effect over HTTP (--restricted, --max-concurrent, --max-queue, --max-tokens,
--max-upload-mb, --limit), the flags' mapping onto ServerConfig, and bad flags as one-line
errors. The tiny random-weight model: offline, no SmolLM2."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from controller_wat import GOOD_WAT, controller_wat, wasm_of
from rudder.cli import app
from serve_util import sse_events

HANG_WAT = controller_wat(mid='(call $log (i32.const 0x200) (i32.const 8)) (loop $l (br $l)) (i32.const 0)',
                          extra='(data (i32.const 0x200) "hanging\\n")')
_LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


class Serve:
    """`python -m rudder.cli serve --model tiny --port 0 FLAGS` in a subprocess; `.url` once it
    listens. Stopped with SIGINT (Ctrl+C), as a user would."""

    def __init__(self, *flags: str, model: str = "tiny"):
        self.cmd = [sys.executable, "-m", "rudder.cli", "serve", "--model", model, "--port", "0", *flags]
        self.lines: list[str] = []
        self.url = None

    def __enter__(self) -> "Serve":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=os.environ.copy())
        listening = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = _LISTENING.search(line)
                if m:
                    self.url = m.group(1)
                    listening.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 300
        while not listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                raise AssertionError("rudder serve did not start:\n" + "".join(self.lines))
        return self

    def _stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=10)
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.returncode = self._stop()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)


def error_of(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == kind, body
    return body


def wait_for(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_serve_restricted_queue_tokens_and_limit_flags():
    """--restricted: no uploads, no tag changes, built-in controllers run. --max-concurrent 1
    --max-queue 1: one runs, one waits (then runs), the next is 429. --max-tokens 2000: the most
    a request may ask (below the tiny model's 2048-token context, so the flag, not the context,
    refuses 2001). --limit max_forks=2: a request's controller cannot fork into 3."""
    flags = ["--restricted", "--max-concurrent", "1", "--max-queue", "1", "--max-tokens", "2000",
             "--limit", "max_forks=2"]
    # 12 layers: the long request below runs for ~20 s (its 2000 tokens), far longer than the
    # checks made while it runs; it is cancelled once they are done.
    with Serve(*flags, model="tiny:12") as s, s.client() as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert c.get("/healthz").json()["status"] == "ok"
        tags = c.get("/v1/controllers/tags").json()
        assert {"force", "fork", "json", "regex"} <= set(tags["builtin"])
        # the tags are a list of objects (AICI's shape), the built-ins among them
        by_name = {t["tag"]: t for t in tags["tags"]}
        assert set(tags["builtin"]) <= set(by_name) and all(by_name[b]["builtin"] for b in tags["builtin"])
        force_id = by_name["force"]["module_id"]
        assert re.fullmatch("[0-9a-f]{64}", force_id)
        upload = error_of(c.post("/v1/controllers", content=bytes(wasm_of(GOOD_WAT))), 403, "forbidden")
        assert "--restricted" in upload["message"] and upload["code"] == "restricted"
        retag = error_of(c.post("/v1/controllers/tags", json={"tag": "mine", "module_id": force_id}), 403, "forbidden")
        assert "--restricted" in retag["message"] and retag["code"] == "restricted"
        assert c.get("/v1/controllers/tags").json() == tags   # nothing changed
        forced = c.post("/v1/run", json={"prompt": "x", "controller": "force", "controller_arg": "ok", "stream": False})
        assert forced.status_code == 200 and forced.json()["choices"][0]["text"] == "ok"

        too_many = error_of(c.post("/v1/run", json={"prompt": "x", "max_tokens": 2001}), 400, "invalid_request")
        assert too_many["message"] == "max_tokens 2001 is over this server's limit (2000)"
        assert too_many["param"] == "max_tokens"
        forks = error_of(c.post("/v1/run", json={"prompt": "x", "controller": "fork", "controller_arg": "3"}),
                         400, "controller_error")
        assert forks["kind"] == "start" and "max_forks 2" in forks["log_tail"]
        two = c.post("/v1/run", json={"prompt": "x", "controller": "fork", "controller_arg": "2", "max_tokens": 3,
                                      "stream": False})
        assert two.status_code == 200 and len(two.json()["choices"]) == 2

        with c.stream("POST", "/v1/run", json={"prompt": "a", "max_tokens": 2000, "ignore_eos": True}) as running:
            assert running.status_code == 200
            events = sse_events(running)   # (kept: dropping the generator would close the stream)
            assert next(events)["type"] == "step"
            waiting = pool.submit(lambda: httpx.post(s.url + "/v1/run", timeout=120, json={
                "prompt": "b", "max_tokens": 3, "stream": False, "ignore_eos": True}))
            assert wait_for(lambda: c.get("/healthz").json()["queued"] == 1)
            error_of(c.post("/v1/run", json={"prompt": "c", "max_tokens": 3}), 429, "too_many_requests")
            assert not waiting.done()
        r = waiting.result(timeout=60)   # the long one was cancelled: the waiting one ran
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert s.returncode == 0, "".join(s.lines)   # Ctrl+C: a clean exit
    assert "Traceback" not in "".join(s.lines)


def test_serve_upload_size_and_controller_limit_flags():
    """--max-upload-mb: a larger module is 413 (declared or streamed without a length), a
    smaller one is taken. --limit mid_process_ms=10: a request asking for more gets 10 ms."""
    from test_hostile import _padded

    limit = int(0.05 * (1 << 20))
    small = _padded(bytes(wasm_of(GOOD_WAT)), limit)
    big = _padded(bytes(wasm_of(GOOD_WAT.replace("0xABCD", "0xABCE"))), limit + 1)
    with Serve("--max-upload-mb", "0.05", "--limit", "mid_process_ms=10") as s, s.client() as c:
        assert "at most 52428" in error_of(c.post("/v1/controllers", content=big), 413, "payload_too_large")["message"]
        streamed = c.post("/v1/controllers", content=iter([big[:40_000], big[40_000:]]))   # chunked: no length
        assert "transfer-encoding" in {k.lower() for k in streamed.request.headers}
        error_of(streamed, 413, "payload_too_large")
        taken = c.post("/v1/controllers", content=small)
        assert taken.status_code == 200 and taken.json()["wasm_size"] == limit
        hang = c.post("/v1/controllers", content=bytes(wasm_of(HANG_WAT)))
        assert hang.status_code == 200, hang.text
        t0 = time.monotonic()
        r = c.post("/v1/run", json={"prompt": "x", "controller": hang.json()["module_id"], "stream": False,
                                    "controller_limits": {"mid_process_ms": 60_000}})
        err = error_of(r, 400, "controller_error")
        assert err["kind"] == "timeout" and "deadline of 10 ms" in err["message"] and "hanging" in err["log_tail"]
        assert time.monotonic() - t0 < 50   # not the 60 s asked for (a generous bound: a loaded machine)
    assert s.returncode == 0, "".join(s.lines)


def test_serve_maps_its_flags_onto_the_server_config(monkeypatch):
    """Every flag lands in ServerConfig (and the engine options) as documented; uvicorn gets
    the host and port."""
    import uvicorn

    import rudder.server

    seen = {}
    real_create_app = rudder.server.create_app
    monkeypatch.setattr(rudder.server, "create_app", lambda config, llm: seen.update(config=config, llm=llm)
                        or real_create_app(config, llm))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(uvicorn=kw))
    result = CliRunner().invoke(app, [
        "serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "1234", "--restricted", "--max-concurrent", "3",
        "--max-queue", "5", "--max-tokens", "77", "--max-upload-mb", "0.5", "--limit", "mid_process_ms=10",
        "--limit", "max_forks=4", "--kv-cache-tokens", "512", "--dtype", "int8", "--model-threads", "all",
        "--no-prefix-caching", "--step-target-ms", "150"])
    assert result.exit_code == 0, result.output
    cfg = seen["config"]
    assert (cfg.model, cfg.restricted, cfg.max_concurrent, cfg.max_queue) == ("tiny", True, 3, 5)
    assert (cfg.max_tokens, cfg.default_max_tokens, cfg.max_upload_bytes) == (77, 77, 512 << 10)
    assert cfg.controller_limits == {"mid_process_ms": 10, "max_forks": 4}
    assert cfg.engine_options["kv_cache_tokens"] == 512 and cfg.engine_options["dtype"] == "int8"
    assert cfg.engine_options["model_threads"] is None
    assert seen["llm"].engine.config.prefix_caching is False and seen["llm"].engine.config.step_target_ms == 150
    assert seen["llm"].dtype == "int8" and seen["llm"].model.precision == "int8"
    assert seen["llm"].runtime.limits.mid_process_ms == 10 and seen["llm"].runtime.limits.max_forks == 4
    assert seen["uvicorn"]["host"] == "0.0.0.0" and seen["uvicorn"]["port"] == 1234
    defaults = CliRunner().invoke(app, ["serve", "--model", "tiny"])
    assert defaults.exit_code == 0, defaults.output
    cfg = seen["config"]
    assert (cfg.restricted, cfg.max_concurrent, cfg.max_queue, cfg.max_tokens, cfg.default_max_tokens) == \
        (False, 16, 64, 1024, 256)
    assert cfg.max_upload_bytes == 32 << 20 and cfg.controller_limits == {} and cfg.engine_options["dtype"] == "auto"
    assert cfg.engine_options["model_threads"] == "shared"  # a core kept for tenants' controllers
    engine = seen["llm"].engine.config  # the KV cache sized from the machine's memory, prefixes cached
    assert engine.kv_cache_tokens > 0 and engine.prefix_caching and engine.step_target_ms is None
    assert seen["uvicorn"]["host"] == "127.0.0.1" and seen["uvicorn"]["port"] == 8000


@pytest.mark.parametrize("flags,message", [
    (["--limit", "max_forks"], "expected KEY=NUMBER"),
    (["--limit", "mid_process_msec=5"], "unknown controller limit"),
    (["--limit", "max_forks=-1"], "max_forks"),
    (["--limit", "mid_process_ms=250"], "mid_process_ms=250 (default 25); KEY=VALUE limits only lower them"),
    (["--max-upload-mb", "0"], "--max-upload-mb"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--dtype", "fp16"], "--dtype 'fp16': expected auto, fp32, bf16 or int8"),
    (["--model-threads", "0"], "--model-threads takes shared, all or a number of threads >= 1, got '0'"),
    (["--kv-cache-memory", "2"], "--kv-cache-memory"),
    (["--kv-cache-tokens", "512", "--kv-cache-memory", "0.2"], "kv_cache_tokens and kv_cache_memory both size"),
])
def test_serve_bad_flags_are_one_line_errors(flags, message):
    """A bad flag fails before any model loads (the model named does not exist), in one line."""
    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model", "--port", "0", *flags])
    assert result.exit_code != 0
    out = result.output
    assert message in out and "Traceback" not in out and "no such model" not in out, out
