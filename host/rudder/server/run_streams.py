"""/v1/run's two stream formats: rudder's events (a "step" per engine step, "trace" events, then
"done") and AICI's (an "initial-run" object, "run" objects, then [DONE]); and the run's final
choices, which the answer that is not streamed and the "done" event share."""

from __future__ import annotations

import contextlib
import time
import uuid

from ..engine.output import BacktrackTooFar, HeldStream
from .service import Service, sse

__all__ = ["choices", "rudder_events", "aici_events"]


def choices(result) -> list[dict]:
    return [{"branch": c.branch, "text": c.text, "finish_reason": c.finish_reason,
             **({"error": c.error} if c.error else {})} for c in result.completions]


def _delta(d) -> dict:
    out = {"branch": d.branch, "text": d.text, "backtrack": d.backtrack_chars, "token_ids": d.token_ids}
    if d.finished:
        out["finish_reason"] = d.finish_reason
        if d.error:
            out["error"] = d.error
    return out


async def rudder_events(svc: Service, jobs):
    """/v1/run's events: one per engine step ("step": each fork's delta, new log text), then
    "done" with every branch's final text, usage and timings (and the error, if it failed). A
    traced run also has a "trace" event per applied Branch, before the step that shows it."""
    async with contextlib.aclosing(svc.events(jobs)) as events:
        async for job, kind, *payload in events:
            if kind == "step":
                deltas, log_text, steps = payload
                for t in steps:
                    yield sse({"type": "trace", **t.as_dict(svc.tokenizer, mask=job.trace.masks)})
                event = {"type": "step", "deltas": [_delta(d) for d in deltas]}
                if log_text:
                    event["log"] = log_text
                yield sse(event)
            elif kind == "error":
                yield sse({"type": "error", **payload[0].body()})
            else:
                result = payload[0]
                event = {"type": "done", "choices": choices(result), "usage": result.usage_dict(),
                         "timings": result.timings_dict()}
                if result.error is not None:
                    event.update(result.error.body())
                yield sse(event)


async def aici_events(svc: Service, job):
    """AICI's /v1/run stream: an "initial-run" object, "run" objects whose forks carry new text
    (held back as for OpenAI clients: AICI's client cannot take text back), logs and errors,
    then [DONE]."""
    yield sse({"id": f"run-{uuid.uuid4()}", "object": "initial-run", "created": int(time.time()),
               "model": svc.config.served_name})
    held: dict[int, HeldStream] = {}

    def run_event(forks: list[dict]) -> str:
        u = job.request.usage if job.request is not None else None  # counters the engine thread adds to
        sampled, ff = (u.sampled_tokens, u.ff_tokens) if u is not None else (0, 0)
        return sse({"object": "run", "forks": forks,
                    "usage": {"sampled_tokens": sampled, "ff_tokens": ff + len(job.prompt),
                              "cost": 2 * sampled + ff + len(job.prompt)}})

    def failed(message: str, logs: str = "") -> str:
        return run_event([{"index": 0, "text": "", "error": message, "logs": logs, "storage": [],
                           "finish_reason": "error"}])

    async with contextlib.aclosing(svc.events([job])) as events:
        async for _, kind, *payload in events:
            if kind == "error":
                yield failed(str(payload[0]))
            elif kind == "done":
                if payload[0].error is not None:
                    yield failed(str(payload[0].error), payload[0].error.extra.get("log_tail", ""))
            else:
                deltas, log_text, _ = payload
                forks = []
                try:
                    for d in deltas:
                        piece = held.setdefault(d.branch, HeldStream(job.window)).push(d)
                        fork = {"index": d.branch, "text": piece.text, "error": d.error or "", "logs": "",
                                "storage": []}
                        if d.finished:
                            fork["finish_reason"] = d.finish_reason
                        forks.append(fork)
                except BacktrackTooFar as e:
                    yield failed(str(e))
                    break
                if forks:
                    forks[0]["logs"] = log_text
                    yield run_event(forks)
    yield sse("[DONE]")
