"""Running controllers' `mid_process` calls off the engine thread, while the model computes.

Calls are split over a few worker threads (not one task per sequence): on a CPU host every
thread wake-up competes with torch's own threads. Wasm releases the GIL, so the guests really
run in parallel with the forward pass and with each other."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["ControllerCalls", "run_calls"]


def run_calls(calls) -> list:
    """Run mid_process calls `(key, controller, branch_idx, backtrack, tokens)` in order; each
    answer is (key, a Branch list or the exception raised, seconds taken)."""
    answers = []
    for key, controller, branch_idx, backtrack, tokens in calls:
        t0 = time.perf_counter()
        try:
            answer = controller.mid_process(branch_idx, backtrack, tokens)
        except Exception as e:  # noqa: BLE001  (the controller's failure is its request's, not ours)
            answer = e
        answers.append((key, answer, time.perf_counter() - t0))
    return answers


class ControllerCalls:
    def __init__(self, threads: int):
        self.threads = threads
        self.pool = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rudder-controller")
                     if threads > 0 else None)

    def submit(self, calls: list) -> list[Future]:
        """Futures of `run_calls` over `calls`, split over the threads (threads=0: run here, now)."""
        if not calls:
            return []
        if self.pool is None:
            done: Future = Future()
            done.set_result(run_calls(calls))
            return [done]
        n = min(self.threads, len(calls))
        return [self.pool.submit(run_calls, calls[i::n]) for i in range(n)]
