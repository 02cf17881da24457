"""Start `rudder` CLI processes and local pipeline stages fast: fork them from a parent that has
already imported torch and rudder (about 1.4 s of CPU a process otherwise). The tests that start
the CLI many times (the SIGKILL durability loop, every hostile module through `rudder run`) use
it, and the suite's in-process pipelines fork their stages here (`forked_stages`); the others
start the CLI and stages the ordinary way (every CLI test, the stage-lifecycle tests marked
`spawned_stages`, stages under torchrun), so both paths stay covered.

A child is a real process: it runs `rudder.cli` (or `python -m MODULE`) from its `main`, with its
own argv, environment, working directory and output files, ends through the interpreter's normal
exit (its exit code or its signal is what the test sees), and is killed with a real signal.

The zygote never runs torch work (no OpenMP pool exists to be broken by fork) and never starts a
thread: it polls its control pipe and reaps its children in one loop. Protocol (JSON lines):
  parent -> zygote: {"args": [...], "env": {...}, "cwd": "...", "stdout": PATH, "stderr": PATH,
                     "module": NAME (optional: run `python -m NAME ARGS` instead of the CLI)}
  zygote -> parent: {"pid": N} for each request, in order; {"exited": N, "code": C} when a child
  ends (C < 0: killed by signal -C, as subprocess reports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the test side

class Child:
    """A forked CLI process, with the part of subprocess.Popen the tests use."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"rudder (pid {self.pid})", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._done.set()


class Zygote:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "host"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._pids: queue.Queue = queue.Queue()
        self._children: dict[int, Child] = {}
        self._early: dict[int, int] = {}  # exits reported before their Child was registered
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if self._pids.get(timeout=120) != "ready":
            raise RuntimeError("the zygote did not start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                self._pids.put("ready")
            elif "pid" in msg:
                self._pids.put(msg["pid"])
            else:
                with self._lock:
                    child = self._children.pop(msg["exited"], None)
                    if child is None:
                        self._early[msg["exited"]] = msg["code"]
                if child is not None:
                    child._ended(msg["code"])
        self._pids.put(None)  # the zygote is gone

    def spawn(self, args: list[str], env: dict, stdout: Path, stderr: Path, cwd: str | None = None,
              module: str | None = None) -> Child:
        with self._lock:
            self.proc.stdin.write(json.dumps({"args": args, "env": env, "cwd": cwd or os.getcwd(),
                                              "stdout": str(stdout), "stderr": str(stderr),
                                              "module": module}) + "\n")
            self.proc.stdin.flush()
        pid = self._pids.get(timeout=60)
        if pid is None:
            raise RuntimeError("the zygote died")
        child = Child(pid)
        with self._lock:
            if pid in self._early:
                child._ended(self._early.pop(pid))
            else:
                self._children[pid] = child
        return child

    def close(self) -> None:
        with self._lock:
            for pid in list(self._children):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote:
    """The session's zygote, started on first use (spawns are serialised; children run at once)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
            _ZYGOTE = Zygote()
            import atexit

            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def run_cli(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rudder ARGS` to completion, as subprocess.run(capture_output=True, text=True) returns it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        child = zygote().spawn(args, {**os.environ, **(env or {})}, out, err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(30)
            raise
        return subprocess.CompletedProcess(["rudder", *args], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def _spawn_stage(config: dict) -> Child:
    """rudder.pipeline.runner.launch_stage, forked: the stage writes where this process does."""
    me = os.getpid()
    return zygote().spawn([json.dumps(config)], dict(os.environ), Path(f"/proc/{me}/fd/1"), Path(f"/proc/{me}/fd/2"),
                          module="rudder.pipeline")


@contextlib.contextmanager
def forked_stages():
    """Local pipeline stages started in this block are forked from the zygote."""
    from rudder.pipeline import runner

    real, runner.launch_stage = runner.launch_stage, _spawn_stage
    try:
        yield real
    finally:
        runner.launch_stage = real


# ----------------------------------------------------------------------------- the zygote side

def _child(req: dict) -> None:
    """In the forked child: become `rudder ARGS` and never return to the zygote's loop."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    if req.get("module"):
        import runpy

        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        sys.exit(0)
    sys.argv = ["rudder", *req["args"]]
    from rudder.cli import app

    sys.exit(app())  # what the `rudder` console script does


def _serve() -> None:
    import rudder  # noqa: F401  (first: it sets the OpenMP environment before torch loads)
    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import rudder.cli  # noqa: F401
    import rudder.llm  # noqa: F401
    import rudder.pipeline.stage  # noqa: F401
    import rudder.server  # noqa: F401
    import rudder.server.app  # noqa: F401

    import gc

    gc.freeze()  # the imported objects never move again: a child's exit need not touch (and copy) them
    ctl_in = sys.stdin.fileno()
    report = os.fdopen(os.dup(1), "w", buffering=1)
    report.write(json.dumps({"ready": True}) + "\n")
    pending = b""
    live: set[int] = set()
    while True:
        ready, _, _ = select.select([ctl_in], [], [], 0.02)
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                report.write(json.dumps({"exited": pid, "code": code}) + "\n")
        if not ready:
            continue
        data = os.read(ctl_in, 1 << 16)
        if not data:
            break  # the tests are done
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                report.close()
                _child(req)  # a SystemExit from here ends this process through the normal exit
            live.add(pid)
            report.write(json.dumps({"pid": pid}) + "\n")
    deadline = time.monotonic() + 5
    while live and time.monotonic() < deadline:
        for pid in list(live):
            if os.waitpid(pid, os.WNOHANG)[0]:
                live.discard(pid)
        time.sleep(0.02)


if __name__ == "__main__":
    _serve()
