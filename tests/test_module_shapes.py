"""No module shape can take the host down.

Every shape of tests/wasm_shapes.py (and a few hundred random ones) is loaded, started and
stepped by the real ControllerRuntime in a child process, so that a shape that aborts the
process (as v128 did, inside wasmtime-py's type reflection) fails this test instead of killing
pytest. Each must run or fail with its own ControllerError kind. Then `rudder run` is run on a
shape from each stage a module can fail at: it must always end with its own exit code, never by a
signal.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import wasmtime

from controller_wat import wasm_of
from zygote import run_cli
from wasm_shapes import SHAPES, random_shape

HERE = Path(__file__).resolve().parent
RUDDER = Path(sys.executable).with_name("rudder")

# The child: read {name: wasm hex} on stdin, print one JSON line per module as it goes
# (so a crash names the module it died on).
PROBE = r"""
import json, sys
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.tokenizer import Tokenizer

rt = ControllerRuntime(Tokenizer.byte_level(512), limits=Limits(init_ms=500), cache_dir=False)
for name, hexed in json.load(sys.stdin).items():
    print(json.dumps({"name": name, "status": "loading"}), flush=True)
    try:
        ctl = rt.start(rt.load(bytes.fromhex(hexed)), "")
        ctl.mid_process(0, 0, [1, 2, 3])
        ctl.close()
        outcome = "ok"
    except ControllerError as e:
        outcome = e.kind
        assert "\n" not in str(e), str(e)
    print(json.dumps({"name": name, "status": outcome}), flush=True)
rt.close()
"""


def _probe(modules: dict[str, bytes]) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    done = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps({k: v.hex() for k, v in modules.items()}),
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outcomes = {d["name"]: d["status"] for d in lines}
    last = lines[-1]["name"] if lines else None
    assert done.returncode == 0, (f"the host died (exit {done.returncode}) on module {last!r}: "
                                  f"{done.stderr.strip()[-600:]}")
    return outcomes


def _compilable(wat: str) -> bytes | None:
    try:
        return wasm_of(wat)
    except Exception:  # noqa: BLE001  (a random shape the text parser itself refuses)
        return None


def test_every_shape_runs_or_fails_with_its_kind():
    outcomes = _probe({name: wasm_of(wat) for name, (wat, _) in SHAPES.items()})
    wrong = {name: outcomes.get(name) for name, (_, allowed) in SHAPES.items() if outcomes.get(name) not in allowed}
    assert not wrong, wrong
    # The ones that matter most, exactly:
    assert outcomes["v128_exported_global"] == "bad_module"
    assert outcomes["v128_import_param"] == "bad_import"
    assert outcomes["v128_private_global"] == "ok"


def test_random_shapes_never_kill_the_host():
    rng = random.Random(1234)
    modules = {}
    for i in range(300):
        wasm = _compilable(random_shape(rng))
        if wasm is not None:
            modules[f"random{i}"] = wasm
    assert len(modules) > 150  # the generator mostly makes parseable modules
    outcomes = _probe(modules)
    assert set(outcomes.values()) <= {"ok", "bad_module", "bad_import", "trap", "loading"} - {"loading"}, outcomes
    assert len(outcomes) == len(modules)
    assert {"ok", "bad_module", "bad_import"} <= set(outcomes.values())  # the mix exercised every path


def test_shape_checks_survive_the_disk_cache(tmp_path):
    """A refused module is refused again by a second runtime that shares the compile cache."""
    from rudder.controller import ControllerError, ControllerRuntime
    from rudder.tokenizer import Tokenizer

    wasm = wasm_of(SHAPES["v128_exported_global"][0])
    for _ in range(2):
        with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path) as rt:
            with pytest.raises(ControllerError) as e:
                rt.load(wasm)
            assert e.value.kind == "bad_module" and "v128" in str(e.value)


# One shape from each stage a module can fail at, each leaving other wasmtime objects behind for
# the interpreter's exit: refused from its bytes before compiling (start function), by the compiler
# (memory64 is off), by the byte-level shape check after compiling (v128), by the import and export
# checks through wasmtime's types (an imported global, a second memory), at instantiation (data
# and element segments out of bounds, a memory over the limit), and while running (a table that
# grows without end). Every shape's kind is checked in-process above.
STAGES = ["start_function", "memory64", "v128_export_param", "imported_global", "exported_second_memory",
          "data_segment_out_of_bounds", "elem_segment_out_of_bounds", "huge_initial_memory", "table_grow_bomb"]


def test_cli_always_exits_with_its_own_code(tmp_path):
    """`rudder run` on a module failing at each stage: a one-line error naming the kind, exit
    status 1, never a signal (SIGSEGV at exit used to follow an instantiation trap). The runs fork
    from the tests' zygote (tests/zygote.py): each is a process that ends through the interpreter's
    normal exit, as `rudder` does."""
    paths = {}
    for name in STAGES:
        paths[name] = tmp_path / f"{name}.wasm"
        paths[name].write_bytes(wasm_of(SHAPES[name][0]))

    def run(name):
        return name, run_cli(["run", "--model", "tiny", "--controller", str(paths[name]), "--max-tokens", "2",
                              "--temperature", "0", "hi"], timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(run, STAGES))
    signalled = {n: r.returncode for n, r in results.items() if r.returncode < 0}
    assert not signalled, f"ended by a signal: {signalled}"
    for name, done in results.items():
        allowed = SHAPES[name][1]
        if done.returncode == 0:
            assert "ok" in allowed, f"{name}: ran, but it should fail with one of {allowed}"
            continue
        assert done.returncode == 1, (name, done.returncode, done.stderr)
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("error: "), (name, done.stderr)
        assert any(f"{kind}:" in line for kind in allowed), (name, line)


def test_wasmtime_still_aborts_on_v128_reflection():
    """Why wasm_shape exists: if wasmtime-py ever learns to describe v128, this test tells us the
    byte-level check could go (it runs the reflection in a child, which dies by SIGABRT today)."""
    code = ("import wasmtime; m = wasmtime.Module(wasmtime.Engine(), wasmtime.wat2wasm("
            "'(module (func (export \"f\") (param v128)))')); print(m.exports[0].type.params)")
    no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731 (no core file in the tree)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=no_core)
    assert done.returncode != 0 and "v128" in done.stderr
    assert wasmtime is not None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_process_survives_every_upload(tmp_path):
    """A real `rudder serve` process: every shape is uploaded (and run, where it is accepted);
    each answer is a 200, or a 400 or 413 naming the kind, and the process is alive and healthy after."""
    import httpx

    port = _free_port()
    env = dict(os.environ, RUDDER_HOME=os.environ.get("RUDDER_HOME", str(tmp_path)))
    log = open(tmp_path / "server.log", "w+")  # a file: a pipe nobody reads would block the server when full
    server = subprocess.Popen([str(RUDDER), "serve", "--model", "tiny", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(600):
                try:
                    if c.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert server.poll() is None, open(log.name).read()
                time.sleep(0.1)
            for name, (wat, allowed) in SHAPES.items():
                r = c.post("/v1/controllers", content=bytes(wasm_of(wat)), headers={"content-type": "application/wasm"})
                assert server.poll() is None, f"the server died on {name}: {open(log.name).read()[-800:]}"
                if r.status_code in (400, 413):  # 413: over a compile limit (kind `limit`)
                    kind = r.json()["error"]["kind"]
                else:
                    assert r.status_code == 200, (name, r.status_code, r.text)
                    run = c.post("/v1/run", json={"controller": r.json()["module_id"], "prompt": "hi", "max_tokens": 2,
                                                  "stream": False, "temperature": 0})
                    body = run.json()
                    kind = body["error"]["kind"] if run.status_code != 200 else "ok"
                assert kind in allowed or (kind == "ok" and "ok" in allowed), (name, kind, allowed)
            assert c.get("/healthz").json()["status"] == "ok"
    finally:
        server.terminate()
        server.wait(timeout=30)
