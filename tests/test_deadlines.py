"""Deadlines count a controller's CPU time, not the time its thread waited for a core.

A legal controller that computes for a tenth of its budget per step keeps running when the
machine is so busy that each of its calls takes more than its budget of wall time; a runaway one
still ends at its budget (its CPU time) or at the wall-clock cap when it is starved; and
time spent in an import (the tokenizer, which lets go of the GIL) counts against the call.
Needs the native library (deadlines fall back to wall time without it). Every case runs for
both controller shapes (tests/shapes.py): the deadline is the store's, whatever runs in it.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time

import pytest

from controller_wat import busy_wat, controller_wat
from rudder import native
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.store import WORKER_NICE, wall_cap_ms
from rudder.tokenizer import Tokenizer
from shapes import SHAPES

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
both = pytest.mark.parametrize("shape", SHAPES, ids=str)


@pytest.fixture(scope="module")
def rt():
    assert native.library() is not None, native.unavailable_reason  # the CPU-time deadline lives there
    runtime = ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False)
    yield runtime
    runtime.close()


def _cpu_of_one_call(ctl) -> float:
    t0 = time.thread_time()
    ctl.mid_process(0, 0, [1])
    return time.thread_time() - t0


def _calibrated(rt, shape, target_s: float):
    """A busy controller whose step costs about `target_s` of CPU here."""
    module = rt.load(shape.wasm(busy_wat()))
    n = 200_000
    while True:
        ctl = rt.start(module, struct.pack("<I", n))  # its steps stay far below the default deadline
        cpu = min(_cpu_of_one_call(ctl) for _ in range(3))
        ctl.close()
        if cpu >= target_s / 4:
            return module, max(1, int(n * target_s / cpu))
        n *= 4


class _Contention:
    """This process and `k` CPU-burning processes on one core: our threads get ~1/(k+1) of it."""

    def __init__(self, k: int):
        self.k = k

    def __enter__(self):
        self.before = os.sched_getaffinity(0)
        core = min(self.before)
        os.sched_setaffinity(0, {core})
        # a burner dies with this process (PR_SET_PDEATHSIG), so a test run killed meanwhile (its
        # time limit, ^C) leaves no process spinning on the core
        burn = (f"import ctypes, os, signal\nctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
                f"if os.getppid() != {os.getpid()}: os._exit(0)\n"
                f"os.sched_setaffinity(0, {{{core}}})\nwhile True: pass")
        self.burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(self.k)]
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        for p in self.burners:
            p.kill()
            p.wait()
        os.sched_setaffinity(0, self.before)


@both
def test_a_legal_controller_survives_a_busy_machine(rt, shape):
    """~2.5 ms of CPU a step under a 25 ms budget, on a core shared with 12 burners: a step takes
    more than its budget of wall time (a wall-clock deadline would kill it), and the wall-clock
    cap (825 ms, a slowdown of 330) stays far away even when the rest of the machine is busy too."""
    module, n = _calibrated(rt, shape, 0.0025)
    ctl = rt.start(module, struct.pack("<I", n))
    walls = []
    with _Contention(12):
        for _ in range(12):
            t0 = time.perf_counter()
            ctl.mid_process(0, 0, [1])  # a wall-clock deadline would kill it here
            walls.append(time.perf_counter() - t0)
    ctl.close()
    assert max(walls) > 0.025, walls  # the contention was real: some steps took longer than the budget


def _on_a_worker(fn):
    """fn() on a new thread at the controller workers' priority (engine/controller_calls.py),
    on this thread's cores; its result, or the exception it raised."""
    out = []

    def run():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001  (handed to the test)
            out.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out[0]


def test_the_wall_cap_leaves_a_worker_room_beside_three_busy_threads():
    """The kernel weighs a thread ~1.25x less per nice level (1024 at nice 0, 110 at +10): a
    controller worker beside three busy threads of normal priority gets 110 / (110 + 3 * 1024) of
    its core, and a call that needs its whole budget must still fit under the cap. (The former
    cap, 4 x + 100 ms, fit three busy threads of the worker's own priority only.)"""
    weight = 1024 / 1.25 ** WORKER_NICE
    share = weight / (weight + 3 * 1024)
    for ms in (1, 25, 250):
        assert wall_cap_ms(ms) >= ms / share + 100, (ms, wall_cap_ms(ms), ms / share + 100)


@both
def test_a_legal_controller_on_a_worker_survives_busy_neighbours(rt, shape):
    """10 ms of CPU a step under the default 25 ms budget, on a controller worker (nice +10)
    whose core three ordinary busy processes share: its steps take several times their budget
    of wall time (115-250 ms here; the cap the workers once had, 4 x 25 + 100 ms, ended 14 of 15
    such steps beside two busy processes), and none is ended."""
    module, n = _calibrated(rt, shape, 0.010)
    ctl = rt.start(module, struct.pack("<I", n))

    def steps():
        walls = []
        for _ in range(6):
            t0 = time.perf_counter()
            ctl.mid_process(0, 0, [1])
            walls.append(time.perf_counter() - t0)
        return walls

    with _Contention(3):
        walls = _on_a_worker(steps)
    ctl.close()
    assert isinstance(walls, list), walls  # (else the ControllerError that ended a step)
    assert max(walls) > 2 * 0.025, walls  # the contention was real


@both
def test_a_runaway_ends_at_its_cpu_budget_even_when_busy(rt, shape):
    loop = controller_wat(mid="(loop $l (br $l)) (i32.const 0)")
    ctl = rt.start(rt.load(shape.wasm(loop)), "", {"mid_process_ms": 20})
    with _Contention(1):
        t0, c0 = time.perf_counter(), time.thread_time()
        with pytest.raises(ControllerError) as e:
            ctl.mid_process(0, 0, [1])
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert e.value.kind == "timeout" and "20 ms of CPU time" in str(e.value)
    # it got its whole budget of CPU (less at most one tick: the time before the first tick is
    # counted as wall time, too much for a thread that waited meanwhile: native/deadline.c)...
    assert 0.020 - rt.tick_ms / 1000 <= cpu, cpu
    assert wall < wall_cap_ms(20) / 1000 + 1.0  # ...and no more than the wall cap (margin for a loaded host)


@both
def test_a_starved_call_ends_at_the_wall_cap(rt, shape):
    """A runaway on a controller worker (nice +10) with 8 burners on its core gets ~1.3 % of it:
    its 50 ms of CPU would take ~3.8 s of wall time, past the cap of 1.55 s, so the cap ends it
    first."""
    loop = controller_wat(mid="(loop $l (br $l)) (i32.const 0)")
    runtime = ControllerRuntime(Tokenizer.byte_level(512), Limits(mid_process_ms=50), cache_dir=False)
    ctl = runtime.start(runtime.load(shape.wasm(loop)), "")

    def call():
        t0 = time.perf_counter()
        try:
            ctl.mid_process(0, 0, [1])
        except ControllerError as e:
            return e, time.perf_counter() - t0
        return None, time.perf_counter() - t0

    with _Contention(8):
        e, wall = _on_a_worker(call)
    assert isinstance(e, ControllerError) and e.kind == "timeout", e
    if "wall-clock cap" in str(e):
        assert wall >= wall_cap_ms(50) / 1000
    else:  # the scheduler gave it more than its share: then its CPU budget ended it
        assert "50 ms of CPU time" in str(e)
    runtime.close()


TOKENIZE_LOOP = controller_wat(
    start="(drop (call $arg_read (i32.const 0x1000) (i32.const 16384))) (i32.const 0)",
    mid_locals="(local $i i32)",
    mid="""(loop $l
             (drop (call $tokenize (i32.const 0x1000) (i32.const 16384) (i32.const 0x8000) (i32.const 0)))
             (local.set $i (i32.add (local.get $i) (i32.const 1)))
             (br_if $l (i32.lt_u (local.get $i) (i32.const 1000))))
           (i32.const 0x100)""")


@both
def test_tokenize_in_a_loop_is_charged_and_budgeted(shape):
    """A step that tokenizes 16 KiB again and again: each call's time counts against the step
    (the tokenizer works on the guest's thread, without the GIL), and the request's tokenize
    budget ends it with kind `limit` when that comes first."""
    # a request can only lower the runtime's limits: the second controller's 1 s comes from here
    with ControllerRuntime(Tokenizer.byte_level(512), Limits(mid_process_ms=1000), cache_dir=False) as runtime:
        module = runtime.load(shape.wasm(TOKENIZE_LOOP))
        digits = b"7" * 16384
        ctl = runtime.start(module, digits, {"mid_process_ms": 25})
        t0 = time.perf_counter()
        with pytest.raises(ControllerError) as e:
            ctl.mid_process(0, 0, [1])
        elapsed = time.perf_counter() - t0
        assert e.value.kind in ("timeout", "limit"), e.value
        assert elapsed < 5, elapsed  # a behaviour bound: 1000 calls x 16 KiB would take far longer
        small = runtime.start(module, digits, {"max_tokenize_bytes": 40000})
        assert small.limits.mid_process_ms == 1000
        with pytest.raises(ControllerError) as e:
            small.mid_process(0, 0, [1])
        assert e.value.kind == "limit" and "tokenize budget of 40000 bytes" in str(e.value)


@both
def test_one_tokenize_call_is_capped_in_a_step(rt, shape):
    wat = controller_wat(mid="(drop (call $tokenize (i32.const 0x1000) (i32.const 20000) (i32.const 0) (i32.const 0)))"
                             " (i32.const 0x100)")
    ctl = rt.start(rt.load(shape.wasm(wat)), "")
    with pytest.raises(ControllerError) as e:
        ctl.mid_process(0, 0, [1])
    assert e.value.kind == "limit" and "16384 bytes one call may tokenize in a step" in str(e.value)


def test_limits_take_the_tokenize_budget():
    assert Limits().max_tokenize_bytes == 1 << 20
    assert Limits().capped({"max_tokenize_bytes": 10}).max_tokenize_bytes == 10
