"""Compiling untrusted modules in a bounded place: cheap size checks, then a worker process
with a memory and a CPU-time limit, at most `max_compiles` at once.

Why: Cranelift's memory and time grow with what a module asks for, and some shapes cost far more
than their size (thousands of nested blocks take gigabytes; a few hundred thousand empty
functions take seconds and gigabytes). Compiled in the serving process, a module like that
raises its memory for good and slows every request. So:

1. `check_sizes` refuses, from the bytes alone (wasm_shape.read_sizes), a module over a compile
   limit (docs/abi.md, "Compile limits") before anything is compiled;
2. the compile itself runs in a worker process (compile_worker.py) that limits its own address
   space and CPU time before it reads the module and writes the serialized code to a file,
   which the host loads. Workers are reused while they stay small (a fresh interpreter costs
   more than a small module's compile) and retired once one compile took them past
   RETIRE_RSS, so whatever a big compile used goes back to the system;
3. a gate lets at most `max_compiles` compiles run at once; the others wait, up to `wait_s`,
   then fail as busy (the server answers 503 with Retry-After).

A refusal is a ControllerError of kind `limit` that names the limit; waiting too long is one
with `busy` set (a shared resource, not the module's fault).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .errors import ControllerError
from .wasm_shape import CodeSizes, read_sizes

__all__ = ["CompileLimits", "Compiler", "check_sizes", "DEFAULT_MAX_COMPILES", "DEFAULT_WAIT_S"]

WORKER = Path(__file__).with_name("compile_worker.py")
DEFAULT_MAX_COMPILES = 2
DEFAULT_WAIT_S = 60.0
# A worker that cannot use its CPU time (it runs niced behind decoding) is still ended, at
# _WALL_FACTOR times its CPU limit plus _WALL_SLACK_S seconds of wall-clock time.
_WALL_FACTOR, _WALL_SLACK_S = 10, 60
RETIRE_RSS = 192 << 20  # a worker whose peak memory passed this is not reused (an idle one: ~30 MiB)
_IDLE_WORKERS = 2       # idle workers kept for the next compiles, per process


@dataclass(frozen=True)
class CompileLimits:
    """What compiling one module (or component) may ask for; None: no limit. The defaults hold
    the Python and JavaScript components (12-18 MB: 13,400 functions, 9.2 MB of code, a 427 KB
    function, 52,000 locals, 10,000 data segments, tables of 7,700, memories of 198 pages) with
    room to spare. `memory_bytes` and `cpu_seconds` bound the compile worker itself."""

    functions: int | None = 50_000
    code_bytes: int | None = 24 << 20
    function_bytes: int | None = 1 << 20
    function_locals: int | None = 10_000
    locals: int | None = 500_000
    data_segments: int | None = 50_000
    element_segments: int | None = 10_000
    table_elements: int | None = 100_000
    memory_pages: int | None = 1024  # the runtime sets its memory limit (64 MiB by default)
    memory_bytes: int | None = 1 << 30
    cpu_seconds: float | None = 120.0

    @classmethod
    def none(cls) -> "CompileLimits":
        """No limits at all: for a trusted local module (`rudder run --trust-module`)."""
        return cls(**{f.name: None for f in fields(cls)})

    def replace(self, **changes) -> "CompileLimits":
        return replace(self, **changes)


_WHAT = {  # limit -> how a refusal words the module's size
    "functions": "defines {} functions",
    "code_bytes": "has {} bytes of code",
    "function_bytes": "has a function of {} bytes",
    "function_locals": "has a function with {} locals",
    "locals": "declares {} locals in all",
    "data_segments": "has {} data segments",
    "element_segments": "has {} element segments",
    "table_elements": "has a table of at least {} elements",
    "memory_pages": "has a memory of at least {} pages (64 KiB each)",
}


def check_sizes(wasm: bytes, limits: CompileLimits) -> CodeSizes:
    """The module's sizes; ControllerError `limit` naming the first one over its limit."""
    sizes = read_sizes(wasm, limits.functions)
    for name, words in _WHAT.items():
        limit, value = getattr(limits, name), getattr(sizes, name)
        if limit is not None and value > limit:
            raise ControllerError("limit", f"the module {words.format(value)}, over the compile limit of {limit} "
                                  f"({name})")
    return sizes


class Compiler:
    """Compiles modules and components in worker processes, within `limits`, at most
    `max_compiles` at once; a compile that finds no slot within `wait_s` seconds is refused as
    busy. `waiting` and `running` are what /metrics shows. Shared by a runtime's module and
    component caches, so the bound holds for both."""

    def __init__(self, limits: CompileLimits | None = None, max_compiles: int = DEFAULT_MAX_COMPILES,
                 wait_s: float = DEFAULT_WAIT_S):
        self.limits = limits or CompileLimits()
        self.max_compiles = max_compiles
        self.wait_s = wait_s
        self.waiting = 0
        self.running = 0
        self._cond = threading.Condition()
        _workers.warm()  # the first compile need not wait for an interpreter to start

    def configure(self, *, max_compiles: int | None = None, wait_s: float | None = None, **limits) -> None:
        """Change the gate (`max_compiles`, `wait_s`) and any limit of CompileLimits by name."""
        if max_compiles is not None:
            if max_compiles < 1:
                raise ValueError(f"max_compiles must be at least 1, got {max_compiles}")
            with self._cond:
                self.max_compiles = max_compiles
                self._cond.notify_all()
        if wait_s is not None:
            self.wait_s = wait_s
        if limits:
            self.limits = self.limits.replace(**limits)

    def compile(self, wasm: bytes, settings: dict, component: bool, out_dir: Path | None) -> tuple[Path, int]:
        """Check `wasm`'s sizes, then compile it in a worker with engine `settings`; returns the
        file (in `out_dir`, else the system's temporary folder) holding the serialized code,
        and its size. Raises ControllerError: `limit` (a compile limit; `busy` when no slot
        freed in time) or `bad_module` (the compiler's own error)."""
        limits = self.limits
        check_sizes(wasm, limits)
        with self._slot():
            return self._run(wasm, settings, component, out_dir, limits)

    @contextlib.contextmanager
    def _slot(self):
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            self.waiting += 1
            try:
                while self.running >= self.max_compiles:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ControllerError("limit", f"no compile slot freed within {self.wait_s:g} s "
                                              f"({self.running} compiling, {self.waiting} waiting)", busy=True)
                    self._cond.wait(left)
                self.running += 1
            finally:
                self.waiting -= 1
        try:
            yield
        finally:
            with self._cond:
                self.running -= 1
                self._cond.notify()

    def _run(self, wasm: bytes, settings: dict, component: bool, out_dir: Path | None,
             limits: CompileLimits) -> tuple[Path, int]:
        what = "component" if component else "module"
        fd, name = tempfile.mkstemp(prefix="compile-", suffix=".tmp", dir=out_dir)
        os.close(fd)
        out = Path(name)
        job = json.dumps({"settings": settings, "component": component, "memory_bytes": limits.memory_bytes,
                          "cpu_seconds": limits.cpu_seconds, "out": str(out), "size": len(wasm)}).encode() + b"\n"
        wall = None if limits.cpu_seconds is None else _WALL_FACTOR * limits.cpu_seconds + _WALL_SLACK_S
        try:
            worker = _workers.take()
            try:
                line = worker.run(job, wasm, wall)
            except subprocess.TimeoutExpired:
                worker.kill()
                raise ControllerError("limit", f"compiling the {what} took more than {wall:g} s "
                                      "(the compile's wall-clock limit)") from None
            except BaseException:
                worker.kill()
                raise
            result = _result(line)
            if "size" in result or "error" in result:  # done, the worker fit: it may take another job
                _workers.give_back(worker, result.get("peak_rss", RETIRE_RSS))
                if "size" in result:
                    return out, int(result["size"])
                raise _failure(what, 0, result, "", limits)
            raise _failure(what, worker.ended(), result, worker.stderr_tail(), limits)
        except BaseException:
            out.unlink(missing_ok=True)
            raise


class _Worker:
    """One compile worker process (compile_worker.py) and its pipes; its stderr goes to a file,
    read when it dies."""

    def __init__(self):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr)

    def run(self, job: bytes, wasm: bytes, timeout: float | None) -> bytes:
        """Send one job; its result line, or b"" if the worker died (TimeoutExpired past `timeout`)."""
        self.stderr.seek(0)
        self.stderr.truncate()
        try:
            self.proc.stdin.write(job)
            self.proc.stdin.write(wasm)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died, or gave up before reading it all: what it said, if anything, is on stdout
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        return self.proc.stdout.readline()

    def ended(self) -> int:
        """The exit status of a worker that died (negative: the signal that ended it)."""
        self.kill()
        return self.proc.returncode

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4096:].decode("utf-8", "replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """An idle worker exits at the end of its input."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.stderr.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class _Workers:
    """Idle workers of this process, shared by every Compiler (jobs carry their own settings and
    limits). A process forked from this one starts with none: the pipes are its parent's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._pid = os.getpid()

    def take(self) -> _Worker:
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker()

    def warm(self) -> None:
        """Start a worker now, unless one is idle: it imports wasmtime while nothing waits for it."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            if not self._idle:
                self._idle.append(_Worker())

    def give_back(self, worker: _Worker, peak_rss: int) -> None:
        with self._lock:
            if peak_rss < RETIRE_RSS and len(self._idle) < _IDLE_WORKERS and self._pid == os.getpid():
                self._idle.append(worker)
                return
        worker.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


_workers = _Workers()
atexit.register(_workers.close)


def _result(line: bytes) -> dict:
    try:
        result = json.loads(line)
    except ValueError:
        return {}
    return result if isinstance(result, dict) else {}


_OUT_OF_MEMORY = ("memory allocation of", "Cannot allocate memory", "out of memory", "os error 12")


def _failure(what: str, returncode: int, result: dict, stderr: str, limits: CompileLimits) -> ControllerError:
    """The error for a compile that did not produce code: the compiler's own message, or the
    limit that ended the worker."""
    error = result.get("error", "")
    memory_out = result.get("out_of_memory") or any(s in stderr or s in error for s in _OUT_OF_MEMORY)
    if memory_out and limits.memory_bytes is not None:
        return ControllerError("limit", f"compiling the {what} needed more than {limits.memory_bytes >> 20} MiB of "
                               "memory (the compile's memory limit)")
    if returncode == -signal.SIGXCPU and limits.cpu_seconds is not None:
        return ControllerError("limit", f"compiling the {what} took more than {limits.cpu_seconds:g} s of CPU time "
                               "(the compile's CPU-time limit)")
    if error:
        return ControllerError("bad_module", f"invalid WebAssembly {what}: {innermost(error)}")
    how = f"exit status {returncode}"
    if returncode < 0:
        try:
            how = f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"signal {-returncode}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return ControllerError("bad_module", f"the compiler failed on the {what} ({how})"
                           + (f": {lines[-1][:300]}" if lines else ""))


def innermost(text: str) -> str:
    """wasmtime's error chain ends with the precise cause; it numbers the causes ("1: ...")."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith("Caused by")
             and ln.strip() not in ("failed to parse WebAssembly module",)]
    detail = lines[-1] if lines else "unknown error"
    head, sep, rest = detail.partition(": ")
    return rest if sep and head.isdigit() else detail
