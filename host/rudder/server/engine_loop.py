"""The one thread that owns the Engine: it takes submitted and cancelled jobs from a queue
between steps (so a cancel takes effect before the next step), steps the engine while anything
runs, and posts each step's deltas to the jobs' asyncio queues. It also times what the latency
histograms record (queue time, first token, gaps between tokens). Nothing else touches the
engine (reads of counters for /metrics aside)."""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..controller import ControllerError
from ..engine import Engine, RunnerFailure
from .errors import APIError, controller_error, from_finish
from .jobs import Job, Result
from .metrics import Metrics

log = logging.getLogger("rudder.server")
_IDLE_WAIT_S = 0.5


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}  # by engine request id
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rudder-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)

    # -- from the event loop (thread-safe) ----------------------------------------------------

    def submit(self, job: Job) -> None:
        self._commands.put(("add", job))

    def cancel(self, job: Job) -> None:
        self._commands.put(("cancel", job))

    @property
    def running(self) -> int:
        return len(self._jobs)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._take_commands(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                deltas = self.engine.step()
            except Exception:  # a bug, not a user's input: fail what runs, keep serving
                log.exception("engine step failed")
                self._fail_all(APIError("internal_error", "the engine failed while stepping this request"))
                continue
            self._dispatch(deltas)
        self._fail_all(APIError("engine_error", "the server is shutting down"))

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, job = cmd
            if kind == "add":
                self._add(job)
            elif kind == "cancel":
                self._cancel(job)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: Job) -> None:
        try:
            req = self.engine.add_request(job.prompt, job.params, job.controller,  # closes it on refusal
                                          trace=job.trace is not None)
        except (ValueError, RunnerFailure, ControllerError) as e:
            if isinstance(e, ControllerError):  # its kind and log reach the client, as everywhere else
                error = controller_error(e)
                self.metrics.failure(e.kind)
            else:
                error = APIError("engine_error" if isinstance(e, RunnerFailure) else "invalid_request", str(e))
                self.metrics.failure(error.type)
            job.outcome = "error"
            job.post(("error", error))
            return
        job.request = req
        self._jobs[req.request_id] = job
        self.metrics.queue.observe(time.perf_counter() - job.arrived)

    def _cancel(self, job: Job) -> None:
        req = job.request
        if req is None or self._jobs.pop(req.request_id, None) is None:
            return  # never added, or already finished
        self.engine.cancel(req.request_id)  # frees its KV blocks and closes its controllers
        self.engine.forget(req)
        self.metrics.cancelled += 1
        job.outcome = "cancelled"

    def _dispatch(self, deltas) -> None:
        by_job: dict[int, list] = {}
        tokens = 0
        for d in deltas:
            by_job.setdefault(d.request_id, []).append(d)
            tokens += len(d.token_ids)
        self.metrics.add_tokens(tokens)
        now = time.perf_counter()
        for request_id, ds in by_job.items():
            job = self._jobs.get(request_id)
            if job is None:
                continue
            if any(d.token_ids for d in ds):
                if job.last_tokens_at is None:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    self.metrics.itl.observe(now - job.last_tokens_at)
                job.last_tokens_at = now
            job.post(("step", ds, job.new_log(), job.new_trace()))
            if job.request.finished:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        req = job.request
        del self._jobs[req.request_id]
        completions = self.engine.completions(req)
        self.engine.forget(req)
        log_text = job.log_text()
        error = None
        message = req.error or next((c.error for c in completions if c.finish_reason == "error"), None)
        if message is not None:
            error = from_finish(message, log_text[-2048:])
            self.metrics.failure(error.extra.get("kind", error.type))
        result = Result(completions, len(req.prompt_ids), req.usage, time.perf_counter() - job.started, log_text, error)
        self.metrics.finished(result)
        self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        job.outcome = "error" if error is not None else "ok"
        job.post(("done", result))

    def _fail_all(self, error: APIError) -> None:
        for job in list(self._jobs.values()):
            self._cancel(job)
            job.outcome = "error"
            job.post(("error", error))
        while True:  # jobs never added (stopping): their controllers are still ours to close
            try:
                kind, job = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if job.controller is not None:
                    job.controller.close()
                job.outcome = "error"
                job.post(("error", error))
