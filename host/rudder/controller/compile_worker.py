"""The compile worker: compiles untrusted modules and components in a process of its own.

Run as a script by path (`python -I compile_worker.py`), never imported through the `rudder`
package when it runs: it needs only the standard library and wasmtime, so it starts in a few
tens of milliseconds instead of importing the host. The host imports it for the engine settings
below, which the serving engines and the worker share (serialized code only loads into an engine
of the same settings).

A worker takes jobs one after another, until its host closes its stdin or retires it. A job is
one JSON line on stdin (`settings`, `component`, `memory_bytes`, `cpu_seconds`, `out`, `size`),
then `size` bytes of wasm. Before it reads the wasm, the worker limits itself for this job:
address space (RLIMIT_AS) and CPU time from now (RLIMIT_CPU). It writes the serialized code to
`out` and one JSON line to stdout: {"size": n} or {"error": text}, with `peak_rss` (its high-water
mark, by which the host retires a worker that grew). When a limit ends it, the kernel or the
allocator kills it and the host names the limit. It never runs what it compiles.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["CONTROLLER_ENGINE", "COMPONENT_ENGINE", "make_config"]

# The controllers' engine (runtime.py adds its pooling allocator, which does not change code):
# epoch deadlines; one private 32-bit memory, so no threads, memory64, multi-memory, GC;
# no exceptions or stack switching; SIMD on, relaxed SIMD deterministic (seeded runs repeat).
CONTROLLER_ENGINE = {
    "epoch_interruption": True, "cranelift_opt_level": "speed", "wasm_threads": False, "shared_memory": False,
    "wasm_memory64": False, "wasm_multi_memory": False, "wasm_gc": False, "wasm_function_references": False,
    "wasm_custom_page_sizes": False, "wasm_exceptions": False, "wasm_stack_switching": False,
    "wasm_relaxed_simd_deterministic": True,
}
# Components (Python, JavaScript): epoch deadlines, no threads or shared memory, deterministic
# relaxed SIMD; the rest of wasmtime's defaults (their core modules use several memories).
COMPONENT_ENGINE = {
    "epoch_interruption": True, "cranelift_opt_level": "speed", "wasm_threads": False, "shared_memory": False,
    "wasm_memory64": False, "wasm_relaxed_simd_deterministic": True,
}

NICE = 10  # the worker yields the cores to decoding: a compile may wait, a token should not


def make_config(settings: dict):
    import wasmtime

    cfg = wasmtime.Config()
    for name, value in settings.items():
        setattr(cfg, name, value)
    return cfg


def _settle() -> None:
    """Once per worker: no core files, a lower scheduling priority."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        os.nice(NICE)
    except OSError:
        pass  # a priority we may not lower further is no reason to refuse compiles


def _limit(memory_bytes: int | None, cpu_seconds: float | None) -> None:
    """This job's limits, as soft limits (the hard ones stay unlimited, so that the next job may
    have others): past RLIMIT_AS an allocation fails (the compiler aborts), past RLIMIT_CPU the
    kernel sends SIGXCPU, which ends the process."""
    import resource

    unlimited = resource.RLIM_INFINITY
    resource.setrlimit(resource.RLIMIT_AS, (unlimited if memory_bytes is None else memory_bytes, unlimited))
    if cpu_seconds is None:
        resource.setrlimit(resource.RLIMIT_CPU, (unlimited, unlimited))
    else:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used = usage.ru_utime + usage.ru_stime
        resource.setrlimit(resource.RLIMIT_CPU, (int(used + cpu_seconds + 0.999), unlimited))


def _peak_rss() -> int:
    """This process's RSS high-water mark (not getrusage's: that one keeps, across exec, the RSS
    of the host process it was forked from)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # elsewhere: an upper bound


def _compile(job: dict, wasm: bytes) -> dict:
    import wasmtime

    cfg = make_config(job["settings"])
    cfg.parallel_compilation = False  # one core per compile: the host bounds compiles at once
    engine = wasmtime.Engine(cfg)
    try:
        if job["component"]:
            from wasmtime import component

            compiled = component.Component(engine, wasm)
        else:
            compiled = wasmtime.Module(engine, wasm)
    except wasmtime.WasmtimeError as e:
        return {"error": str(e)}
    blob = compiled.serialize()
    with open(job["out"], "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())  # the host renames it into the cache: never a name for missing data
    return {"size": len(blob)}


def main() -> int:
    import wasmtime  # noqa: F401 - imported while idle, not on a job's time

    _settle()
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return 0  # the host closed the pipe (or went away)
        job = json.loads(line)
        _limit(job["memory_bytes"], job["cpu_seconds"])
        try:
            wasm = stdin.read(job["size"])
            if len(wasm) != job["size"]:
                return 0  # the host went away mid-job
            result = _compile(job, wasm)
        except MemoryError:  # said, then gone: the rest of this job's input is never read
            sys.stdout.write(json.dumps({"out_of_memory": True}) + "\n")
            return 1
        result["peak_rss"] = _peak_rss()
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
