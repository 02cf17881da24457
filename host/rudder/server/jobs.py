"""A Job: one engine request seen from the event loop (an HTTP request may run several: one per
prompt of a legacy completion).

The engine thread posts events into the job's asyncio queue (thread-safely), which several jobs
of one HTTP request may share; the handler reads them. Events: `(job, "step", [Delta...], new
log text, [TraceStep...] completed since the last step)`, then `(job, "done", Result)` or
`(job, "error", APIError)`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..engine import Completion, SamplingParams, Usage
from ..engine.trace import ready
from .errors import APIError


@dataclass
class Result:
    """A finished request: each branch's completion, what it cost, and its error if it failed."""

    completions: list[Completion]
    prompt_tokens: int
    usage: Usage
    total_s: float
    log: str
    error: APIError | None = None

    def usage_dict(self) -> dict:
        u = self.usage
        out = {"prompt_tokens": self.prompt_tokens,
               "completion_tokens": sum(len(c.token_ids) for c in self.completions),
               "sampled_tokens": u.sampled_tokens, "ff_tokens": u.ff_tokens, "forks": u.forks}
        spec = self.completions[0].speculative if self.completions else None  # the request's, on each
        if spec is not None:
            out["speculative"] = spec
        return out

    def timings_dict(self) -> dict:
        u = self.usage
        return {"controller_ms": round(u.controller_s * 1000, 3), "forward_ms": round(u.forward_s * 1000, 3),
                "total_ms": round(self.total_s * 1000, 3)}


class Job:
    def __init__(self, loop: asyncio.AbstractEventLoop, prompt, params: SamplingParams, controller=None, *,
                 queue: asyncio.Queue | None = None, index: int = 0, arrived: float | None = None,
                 tenant: str = "anonymous", label: str = "", module_id: str | None = None):
        self.loop = loop
        self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self.index = index              # which prompt of its HTTP request
        self.prompt = prompt            # text or token ids
        self.params = params
        self.controller = controller    # a started Controller; the engine owns it once submitted
        self.request = None             # the engine's Request, set by the engine thread
        self.log_offset = 0             # how much of the controller's log was streamed
        self.arrived = arrived if arrived is not None else time.perf_counter()  # the HTTP request's arrival
        self.started = time.perf_counter()
        self.tenant = tenant
        self.label = label              # the controller as the request named it (for the log line)
        self.module_id = module_id      # the module it runs (registry use counts)
        self.window: int | None = 0     # tokens its controller may take back (None: unknown)
        self.last_tokens_at: float | None = None  # engine thread: when a step last gave it tokens
        self.finished = False           # a done/error event was posted
        self.outcome = "running"        # ok, error, cancelled (for the log line)
        self.result: Result | None = None  # set by Service.events from the "done" event
        self.error: APIError | None = None
        self.ended = False              # Service.end has released it
        self.trace = None               # the request's TraceOptions when it asked for trace events
        self.trace_offset = 0           # how many of its trace steps were posted

    def post(self, event: tuple) -> None:
        """From the engine thread: hand an event to the handler."""
        if event[0] != "step":
            self.finished = True
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self, *event))

    def new_log(self) -> str:
        """The controller log written since the last call (engine thread, between steps)."""
        ctx = getattr(self.controller, "request", None)
        if ctx is None or len(ctx.log) <= self.log_offset:
            return ""
        with ctx.lock:
            data = bytes(ctx.log[self.log_offset:])
        self.log_offset += len(data)
        return data.decode("utf-8", "replace")

    def new_trace(self) -> list:
        """The trace steps completed since the last call (engine thread, between steps)."""
        trace = self.request.trace
        if trace is None:
            return []
        end = ready(trace, self.trace_offset, self.request.seqs)
        steps, self.trace_offset = trace[self.trace_offset:end], end
        return steps

    def log_text(self) -> str:
        ctx = getattr(self.controller, "request", None)
        return ctx.log_text() if ctx is not None else ""
