"""Uploads cannot exhaust the host: a module is checked by size before anything compiles it,
compiled in a worker process within a memory and a CPU-time limit, at most K at once; a real
`rudder serve --model tiny` takes compile bombs four at a time while a plain request streams.

The bombs (tests/compile_bombs.py) compiled in the serving process, as before, raised its RSS by
1.7 GB (300,000 empty functions, 19 s) and 2.3 GB (20,000 nested ifs): the bounds asserted here
(256 MiB over idle at the peak, 64 MiB after) are far below what the old code took.
"""

from __future__ import annotations

import concurrent.futures
import gc
import secrets
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from compile_bombs import controller, deep_nesting, empty_functions, huge_function, many_locals
from component_util import sdk
from rudder.cli import app
from rudder.controller import ControllerError, ControllerRuntime
from rudder.controller import compiler as compiler_module
from rudder.controller.compiler import CompileLimits, check_sizes
from rudder.controller.wasm_shape import read_sizes
from rudder.tokenizer import Tokenizer
from serve_util import ServeProcess, parse_metrics, sse_events

MiB = 1 << 20
PEAK_BOUND = 256 * MiB   # the server's RSS over idle while bombs compile (docs/server.md)
AFTER_BOUND = 64 * MiB   # ... and once they are done


def _runtime(**kw) -> ControllerRuntime:
    return ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False, max_instances=8, **kw)


def _runs(rt: ControllerRuntime, wasm: bytes) -> None:
    """The module loads, starts and answers a step."""
    ctl = rt.start(rt.load(wasm), b"")
    try:
        assert len(ctl.mid_process(0, 0, [1])) == 1
    finally:
        ctl.close()


def _no_worker(monkeypatch) -> None:
    """Any job given to a compile worker from now on fails the test."""
    def refuse(*a, **kw):
        raise AssertionError("a module was sent to a compile worker")
    monkeypatch.setattr(compiler_module._Worker, "run", refuse)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


# ------------------------------------------------------------------------------ cheap checks

def test_real_controllers_are_well_inside_the_compile_limits():
    """The Python and JavaScript components (12-18 MB) and every built-in controller pass the
    size checks with at least half of each limit to spare; the limits are not tuned to the edge."""
    from rudder.controller.build import BUILTIN_CONTROLLERS, builtin_controller

    limits = CompileLimits()
    modules = {"digits": sdk("py"), "js/digits": sdk("js")}  # the SDKs' test components (their digits case)
    modules.update({name: builtin_controller(name).read_bytes() for name in BUILTIN_CONTROLLERS})
    assert len(modules["digits"]) > 12 * MiB and len(modules["js/digits"]) > 10 * MiB
    for name, wasm in modules.items():
        sizes = check_sizes(wasm, limits)
        for key, value in sizes.as_dict().items():
            assert value <= getattr(limits, key) / 2, (name, key, value)
    py = read_sizes(modules["digits"])
    assert py.functions > 10_000 and py.function_bytes > 400_000  # CPython's core modules, all counted


BOMBS = {  # name: (module, the limit its refusal names)
    "functions": (lambda: empty_functions(300_000), "functions"),
    "locals per function": (lambda: many_locals(10, 20_000), "function_locals"),
    "locals in all": (lambda: many_locals(60, 9_000), "locals"),
    "a huge function": (lambda: huge_function(400_000), "function_bytes"),
    "code bytes": (lambda: controller([(3, b"\x00" + b"\x41\x01\x1a" * 300_000 + b"\x0b")] * 30), "code_bytes"),
    "data segments": (lambda: controller(data_segments=60_000), "data_segments"),
    "element segments": (lambda: controller(element_segments=20_000), "element_segments"),
    "a table": (lambda: controller(table=200_000), "table_elements"),
    "a memory": (lambda: controller(memory_pages=2_000), "memory_pages"),
}


@pytest.mark.parametrize("name", BOMBS)
def test_a_module_over_a_size_limit_is_refused_before_any_compile(name, monkeypatch):
    make, limit = BOMBS[name]
    wasm = make()
    _no_worker(monkeypatch)
    with _runtime() as rt:
        with pytest.raises(ControllerError) as e:
            rt.load(wasm)
        assert e.value.kind == "limit" and f"({limit})" in str(e.value) and "over the compile limit" in str(e.value)
        with pytest.raises(ControllerError, match=limit):  # remembered: no second look
            rt.load(wasm)


def test_the_memory_limit_follows_the_runtimes_memory_limit():
    """A memory minimum is refused against the runtime's own linear memory limit."""
    from rudder.controller import Limits

    with _runtime(limits=Limits(memory_bytes=4 * MiB)) as rt:
        with pytest.raises(ControllerError, match=r"at least 65 pages .* limit of 64 \(memory_pages\)"):
            rt.load(controller(memory_pages=65))
        _runs(rt, controller(memory_pages=64))


def test_a_trusted_module_has_no_compile_limits():
    with _runtime(compile_limits=CompileLimits.none()) as rt:
        _runs(rt, many_locals(10, 20_000))
        _runs(rt, controller(element_segments=20_000))


# ------------------------------------------------------------------------------ the worker

def test_a_compile_over_its_memory_limit_is_refused_and_the_host_does_not_grow():
    """20,000 nested ifs take Cranelift 2.3 GB: the worker dies at its limit, the host names it,
    and the host's own memory does not move. 8,000 (~0.45 GB in the worker) compile and run."""
    with _runtime() as rt:
        _runs(rt, controller(nonce="warm-up"))
        before = _rss()
        with pytest.raises(ControllerError) as e:
            rt.load(deep_nesting(20_000))
        assert e.value.kind == "limit"
        assert str(e.value) == "compiling the module needed more than 1024 MiB of memory (the compile's memory limit)"
        _runs(rt, deep_nesting(8_000))
        _runs(rt, empty_functions(40_000))
        assert _rss() - before < 100 * MiB
        assert (rt.compiler.running, rt.compiler.waiting) == (0, 0)


def test_a_compile_over_its_cpu_time_limit_is_refused():
    """49,000 functions of 4,096 locals take ~24 s of CPU: with a 1 s limit the worker is ended."""
    limits = CompileLimits(locals=None, cpu_seconds=1)
    with _runtime(compile_limits=limits) as rt:
        with pytest.raises(ControllerError) as e:
            rt.load(many_locals(49_000, 4_096))
    assert e.value.kind == "limit"
    assert str(e.value) == "compiling the module took more than 1 s of CPU time (the compile's CPU-time limit)"


def test_a_worker_starved_past_its_wall_clock_limit_is_ended(monkeypatch):
    """A worker that cannot finish in time (here: a wall-clock limit shorter than the compile) is
    killed and named; the next compile gets a new worker."""
    monkeypatch.setattr(compiler_module, "_WALL_FACTOR", 0)
    monkeypatch.setattr(compiler_module, "_WALL_SLACK_S", 0.3)
    with _runtime() as rt:
        with pytest.raises(ControllerError) as e:
            rt.load(empty_functions(40_000, secrets.token_hex(8)))  # seconds of compiling
        assert e.value.kind == "limit" and str(e.value) == \
            "compiling the module took more than 0.3 s (the compile's wall-clock limit)"
        monkeypatch.setattr(compiler_module, "_WALL_SLACK_S", 600)
        _runs(rt, controller(nonce=secrets.token_hex(8)))


def test_a_worker_is_reused_while_small_and_retired_once_it_grew():
    """Small compiles share one worker process; one whose compile took it past RETIRE_RSS exits,
    and with it the memory the compiler used."""
    pids = []
    real_run = compiler_module._Worker.run

    def run(worker, *a):
        pids.append(worker.proc.pid)
        return real_run(worker, *a)

    with _runtime() as rt, pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler_module._Worker, "run", run)
        for i in range(3):
            rt.load(controller(nonce=secrets.token_hex(8)))
        rt.load(empty_functions(40_000, secrets.token_hex(8)))  # ~250 MiB in the worker
        rt.load(controller(nonce=secrets.token_hex(8)))
    assert len(set(pids[:4])) == 1, pids
    assert pids[4] != pids[3] and not psutil.pid_exists(pids[3]), pids  # exited and reaped


def test_invalid_modules_keep_the_compilers_message():
    with _runtime() as rt:
        with pytest.raises(ControllerError, match=r"^invalid WebAssembly module: .*type mismatch") as e:
            rt.load(controller([(3, b"\x00\x6a\x0b")]))  # i32.add on an empty stack
        assert e.value.kind == "bad_module"


def test_compiled_code_is_stored_once_and_no_worker_file_is_left(tmp_path):
    """The worker's file becomes the cache file (renamed, not re-serialized); a module that
    fails its checks after compiling leaves nothing behind."""
    wasm = controller(nonce=secrets.token_hex(8))
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path, max_instances=8) as rt:
        module = rt.load(wasm)
        [cwasm] = tmp_path.glob(f"{module.sha256}.*.cwasm")
        assert cwasm.stat().st_size == module.compiled_size
        with pytest.raises(ControllerError, match="does not export rudder_init"):
            rt.load(controller(nonce="x").replace(b"rudder_init", b"rudder_xxxx"))
    gc.collect()
    assert list((tmp_path / "tmp").iterdir()) == []
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path, max_instances=8) as rt:
        rt.load(wasm)
        assert rt.cache.stats == {"memory_hits": 0, "disk_hits": 1, "compiled": 0}


# ------------------------------------------------------------------------------ the gate

def test_at_most_k_compiles_at_once_the_rest_wait_then_are_busy():
    """With one slot taken, a compile waits (the `waiting` gauge) and runs once it frees; one
    that waits longer than wait_s is refused as busy, and that is not remembered."""
    with _runtime() as rt:
        compiler = rt.compiler
        compiler.configure(max_compiles=1, wait_s=30)
        wasm, other = controller(nonce=secrets.token_hex(8)), controller(nonce=secrets.token_hex(8))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with compiler._slot():
                waiting = pool.submit(rt.load, wasm)
                while compiler.waiting == 0:
                    assert not waiting.done(), waiting.result()
                    time.sleep(0.01)
                assert (compiler.running, compiler.waiting) == (1, 1)
                compiler.configure(wait_s=0.2)
                with pytest.raises(ControllerError) as e:
                    rt.load(other)
                assert e.value.busy and e.value.kind == "limit" and "no compile slot freed within 0.2 s" in str(e.value)
                assert not waiting.done()
            assert waiting.result(timeout=120).sha256
        _runs(rt, other)  # the busy refusal was not remembered
        assert (compiler.running, compiler.waiting) == (0, 0)


# ------------------------------------------------------------------------------ the CLI

def test_rudder_run_applies_the_limits_unless_the_module_is_trusted(tmp_path):
    path = tmp_path / "locals.wasm"
    path.write_bytes(many_locals(10, 20_000))
    args = ["run", "--model", "tiny", "--controller", str(path), "--max-tokens", "3", "Hi"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1
    assert "limit: the module has a function with 20000 locals, over the compile limit of 10000 (function_locals)" \
        in refused.output and "Traceback" not in refused.output
    trusted = CliRunner().invoke(app, [*args, "--trust-module"])
    assert trusted.exit_code == 0, trusted.output


def test_serve_compile_flags_reach_the_server_config(monkeypatch):
    import uvicorn

    import rudder.server

    seen = {}
    monkeypatch.setattr(rudder.server, "create_app", lambda config, llm: seen.update(config=config))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--max-compiles", "3", "--compile-wait-s", "7.5",
                                      "--compile-memory-mb", "512"])
    assert result.exit_code == 0, result.output
    cfg = seen["config"]
    assert (cfg.max_compiles, cfg.compile_wait_s, cfg.compile_memory_mb) == (3, 7.5, 512)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--max-compiles", "0"])
    assert result.exit_code != 0 and "--max-compiles" in result.output


# ------------------------------------------------------------------------------ a real server

class _Sampler(threading.Thread):
    """The peak RSS of a process, sampled every 20 ms until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)


class _Streamer(threading.Thread):
    """Plain streaming completions, one after another, until stopped: the arrival time of every
    text chunk, and every stream's finish reason."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.chunks: list[float] = []
        self.finishes: list[str | None] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.halt.is_set():
                finish = None
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    for event in sse_events(r):
                        if event != "[DONE]":
                            self.chunks.append(time.monotonic())
                            finish = event["choices"][0]["finish_reason"] or finish
                self.finishes.append(finish)


def _upload(url: str, wasm: bytes) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/controllers", content=wasm, timeout=300)
    return r, time.monotonic() - t0


def test_compile_bombs_four_at_a_time_do_not_move_the_server():
    """Six bombs (new modules: nothing cached) uploaded four at a time to `rudder serve`: each
    gets its clear 413 naming the limit or is served; the server's RSS never rises more than
    PEAK_BOUND over idle and ends within AFTER_BOUND of it; a plain request streams throughout."""
    nonce = secrets.token_hex(8)
    bombs = {  # name: (module, the limit its 413 names, or None: served)
        "300,000 functions": (empty_functions(300_000, nonce), "(functions)"),
        "20,000 locals": (many_locals(10, 20_000, nonce), "(function_locals)"),
        "20,000 nested ifs": (deep_nesting(20_000, nonce), "the compile's memory limit"),
        "8,000 nested ifs": (deep_nesting(8_000, nonce), None),
        "a 900 KB function": (huge_function(300_000, nonce), None),
        "40,000 functions": (empty_functions(40_000, nonce), None),
    }
    with ServeProcess("--max-compiles", "2") as server, httpx.Client(base_url=server.url, timeout=120) as c:
        warm = c.post("/v1/controllers", content=controller(nonce=nonce)).json()["module_id"]
        assert c.post("/v1/run", json={"controller": warm, "prompt": "x", "max_tokens": 3, "stream": False}).is_success
        streamer = _Streamer(server.url)
        streamer.start()
        while len(streamer.finishes) < 2:  # the plain path warm too
            assert streamer.is_alive()
            time.sleep(0.05)
        proc = psutil.Process(server.proc.pid)
        idle = 0
        for _ in range(5):
            idle = max(idle, proc.memory_info().rss)
            time.sleep(0.05)
        sampler = _Sampler(server.proc.pid)
        sampler.start()
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = dict(zip(bombs, pool.map(lambda b: _upload(server.url, b[0]), bombs.values())))
        t1 = time.monotonic()
        for name, (r, _) in done.items():
            limit = bombs[name][1]
            if limit is None:
                assert r.status_code == 200, (name, r.text)
                run = c.post("/v1/run", json={"controller": r.json()["module_id"], "prompt": "x", "max_tokens": 3,
                                              "stream": False})
                assert run.status_code == 200, (name, run.text)
            else:
                assert r.status_code == 413, (name, r.text)
                err = r.json()["error"]
                assert err["type"] == "payload_too_large" and err["code"] == "compile_limit", (name, err)
                assert err["kind"] == "limit", (name, err)
                assert limit in err["message"], (name, err)
        streamer.halt.set()
        streamer.join(timeout=120)
        sampler.halt.set()
        sampler.join()
        time.sleep(0.5)
        after = proc.memory_info().rss
        metrics = parse_metrics(c.get("/metrics").text)
    during = [t for t in streamer.chunks if t0 <= t <= t1]
    print(f"\nidle RSS {idle / MiB:.0f} MiB, peak +{(sampler.peak - idle) / MiB:.0f} MiB, after "
          f"+{(after - idle) / MiB:.0f} MiB; uploads {t1 - t0:.1f} s, {len(during) / (t1 - t0):.1f} tokens/s "
          "streamed meanwhile; " + ", ".join(f"{n}: {r.status_code} in {s:.2f} s" for n, (r, s) in done.items()))
    assert sampler.peak - idle < PEAK_BOUND
    assert after - idle < AFTER_BOUND
    assert during and all(f == "length" for f in streamer.finishes), streamer.finishes
    assert metrics["rudder_compile_queue_depth"] == 0 and metrics["rudder_compiles_running"] == 0


def test_an_upload_that_waits_too_long_for_a_compile_slot_gets_503():
    """--max-compiles 1 --compile-wait-s 0: while one upload compiles, another is refused at
    once with 503 and Retry-After; it is accepted once the slot is free."""
    nonce = secrets.token_hex(8)
    slow, other = empty_functions(40_000, nonce), controller(nonce=nonce)
    with ServeProcess("--max-compiles", "1", "--compile-wait-s", "0", forked=True) as server, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_upload, server.url, slow)
        while parse_metrics(httpx.get(server.url + "/metrics").text)["rudder_compiles_running"] == 0:
            assert not first.done(), first.result()[0].text
            time.sleep(0.01)
        r, _ = _upload(server.url, other)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "unavailable" and err["code"] == "compile_busy" and "no compile slot" in err["message"]
        assert int(r.headers["retry-after"]) > 0
        assert first.result(timeout=120)[0].status_code == 200
        assert _upload(server.url, other)[0].status_code == 200
