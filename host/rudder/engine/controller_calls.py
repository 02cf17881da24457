"""Running controllers' `mid_process` calls off the engine thread, while the model computes.

A few worker threads take calls from one queue, so a slow controller holds up one worker, not
the calls queued behind it; each call has its own Future, so the engine can go on without a
call that is late (engine/llm_engine.py) and take its answer at a later step. Wasm releases
the GIL, so guests really run in parallel with the forward pass and with each other.

The workers run at a lower CPU priority (nice +10) than the engine's and torch's threads: on a
busy host the forward pass, which every request shares, comes first, and a tenant's controller
gets what is left. Deadlines count a controller's own CPU time (native/deadline.c), so waiting
for a core is never held against it, and the wall-clock cap that ends a starved call leaves room
for that priority (controller/store.py). Each answer carries the CPU time the call took.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future

from ..controller.store import WORKER_NICE  # (the calls' wall-clock cap is sized for it)

__all__ = ["ControllerCalls", "run_call", "WORKER_NICE"]


def run_call(controller, branch_idx: int, backtrack: int, tokens) -> tuple[object, float]:
    """(a Branch list or the exception raised, CPU seconds taken) of one mid_process call."""
    t0 = time.thread_time()
    try:
        answer = controller.mid_process(branch_idx, backtrack, tokens)
    except Exception as e:  # noqa: BLE001  (the controller's failure is its request's, not ours)
        # Without its traceback, nor those of the exceptions it was raised from: their frames
        # would keep the failed instance (and its memory) alive in a reference cycle until
        # the garbage collector runs.
        answer = e.with_traceback(None)
        e.__context__ = e.__cause__ = None
    return answer, time.thread_time() - t0


class ControllerCalls:
    def __init__(self, threads: int):
        self.threads = threads
        self.cpu_s = 0.0  # CPU seconds the workers' calls took, all together (demand())
        self._cpu_lock = threading.Lock()
        self._mark: tuple[float, float] | None = None  # (time, cpu_s) at the last demand()
        self._demand = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list = []
        self._workers = [threading.Thread(target=self._work, name=f"rudder-controller-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def submit(self, calls: list, hold: bool = False, inline: bool = False) -> dict[object, Future]:
        """Start calls `(key, controller, branch_idx, backtrack, tokens)`; a Future per key,
        whose result is (answer, CPU seconds). With no threads, or `inline`, the calls run here,
        now. `hold`: the workers get them only at `start_held()` (the engine starts them when its
        forward pass enters native code)."""
        futures = {}
        for key, *call in calls:
            future: Future = Future()
            if inline or not self.threads:
                future.set_result(run_call(*call))
            elif hold:
                self._held.append((future, call))
            else:
                self._queue.put((future, call))
            futures[key] = future
        return futures

    def demand(self) -> float:
        """How many cores the calls kept busy lately: CPU seconds per second since the last
        call of this, as a running average (the engine asks once per step)."""
        now = time.perf_counter()
        with self._cpu_lock:
            cpu = self.cpu_s
        if self._mark is not None and now > self._mark[0]:
            self._demand = 0.7 * self._demand + 0.3 * (cpu - self._mark[1]) / (now - self._mark[0])
        self._mark = (now, cpu)
        return self._demand

    def start_held(self) -> None:
        """Hand the held calls to the workers."""
        held, self._held = self._held, []
        for item in held:
            self._queue.put(item)

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
            pass
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, call = item
            result = run_call(*call)
            with self._cpu_lock:
                self.cpu_s += result[1]
            future.set_result(result)

    def close(self) -> None:
        self.start_held()
        for _ in self._workers:
            self._queue.put(None)
