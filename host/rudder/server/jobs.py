"""A Job: one HTTP request's engine request, seen from the event loop.

The engine thread posts events into the job's asyncio queue (thread-safely); the HTTP handler
reads them. Events: ("step", [Delta...], new log text), then ("done", Result) or
("error", APIError)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..engine import Completion, SamplingParams, Usage
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
    def __init__(self, loop: asyncio.AbstractEventLoop, prompt, params: SamplingParams, controller=None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt = prompt            # text or token ids
        self.params = params
        self.controller = controller    # a started Controller; the engine owns it once submitted
        self.request = None             # the engine's Request, set by the engine thread
        self.log_offset = 0             # how much of the controller's log was streamed
        self.started = time.perf_counter()
        self.finished = False           # a done/error event was posted

    def post(self, event: tuple) -> None:
        """From the engine thread: hand an event to the handler."""
        if event[0] != "step":
            self.finished = True
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def new_log(self) -> str:
        """The controller log written since the last call (engine thread, between steps)."""
        ctx = getattr(self.controller, "request", None)
        if ctx is None or len(ctx.log) <= self.log_offset:
            return ""
        with ctx.lock:
            data = bytes(ctx.log[self.log_offset:])
        self.log_offset += len(data)
        return data.decode("utf-8", "replace")

    def log_text(self) -> str:
        ctx = getattr(self.controller, "request", None)
        return ctx.log_text() if ctx is not None else ""
