"""What every generation endpoint shares: checking inputs against the model (its name, its
context), admission, starting the controller, submitting jobs to the engine thread, reading
their events until they end, and cancelling them the moment the client goes away (streaming or
not: `until_disconnect` watches the connection while a handler works)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import AsyncIterator

from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from ..controller import ControllerError
from ..engine import SamplingParams
from .admission import Admission
from .auth import ANONYMOUS, Principal
from .config import ServerConfig
from .dialects import Steer
from .engine_loop import EngineLoop
from .errors import APIError, controller_error
from .jobs import Job
from .metrics import Metrics
from .registry import Registry

log = logging.getLogger("rudder.server")


class ClientGone(Exception):
    """The client closed the connection while its request was being handled."""


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client goes away. After the body is read, the server's receive() only
    answers "http.disconnect" (when the client closes, or once the response is complete)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


class Service:
    def __init__(self, config: ServerConfig, llm, registry: Registry, metrics: Metrics, engine_loop: EngineLoop):
        self.config = config
        self.llm = llm
        self.registry = registry
        self.metrics = metrics
        self.engine_loop = engine_loop
        self.admission = Admission(config.max_concurrent, config.max_queue, config.tenant_max_concurrent)
        self.context = llm.engine.model_config.max_position
        self.tokenizer = llm.tokenizer

    # -- inputs --------------------------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return [self.config.served_name]

    def check_model(self, name: str | None) -> None:
        """An unknown model name is a 404, as vLLM answers (no name: the served model)."""
        if name and name not in self.model_names:
            raise APIError("not_found", f"the model {name!r} does not exist (this server serves "
                           f"{', '.join(map(repr, self.model_names))})", param="model", code="model_not_found")

    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as e:
                raise APIError("invalid_request", f"{param}: {e}", param=param) from None
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise APIError("invalid_request", f"{param}: token ids must be in [0, {self.tokenizer.vocab_size})",
                               param=param)
        if not ids:
            raise APIError("invalid_request", f"{param} is empty", param=param)
        return ids

    def chat_prompt(self, messages: list[dict], suffix: str = "") -> str:
        try:
            return self.tokenizer.apply_chat_template(messages) + suffix
        except Exception as e:  # a template's own error (e.g. roles it refuses): the user's input
            raise APIError("invalid_request", f"messages: the chat template refused them ({e})",
                           param="messages") from None

    def sampling(self, body, max_tokens: int | None, prompt_tokens: int, prompt_param: str = "prompt",
                 **extra) -> SamplingParams:
        """SamplingParams for a request, checked against this server and the model's context."""
        room = self.context - prompt_tokens
        if room < 1:
            raise APIError("invalid_request", f"the prompt has {prompt_tokens} tokens; the model's context is "
                           f"{self.context}", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif max_tokens > self.config.max_tokens:
            raise APIError("invalid_request", f"max_tokens {max_tokens} is over this server's limit "
                           f"({self.config.max_tokens})", param="max_tokens")
        elif max_tokens > room:
            raise APIError("invalid_request", f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                           f"is past the model's context ({self.context})", param="max_tokens",
                           code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        bias = None
        if body.logit_bias:
            try:
                bias = {int(k): v for k, v in body.logit_bias.items()}
            except ValueError:
                raise APIError("invalid_request", "logit_bias keys are token ids", param="logit_bias") from None
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                min_p=body.min_p, seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, logit_bias=bias, speculative=body.speculative,
                spec_k=body.spec_k, **extra).validate()
            return self.llm.check_params(params)
        except ValueError as e:
            raise APIError("invalid_request", str(e), param=_param_of(str(e))) from None

    # -- running -------------------------------------------------------------------------------

    async def until_disconnect(self, http: HTTPRequest, work):
        """Await `work` (a coroutine) unless the client goes first: then it is cancelled (its
        jobs with it) and ClientGone is raised."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(http))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise ClientGone()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()

    async def start(self, prompt_ids: list[int], params: SamplingParams, steer: Steer | None,
                    who: Principal = ANONYMOUS, *, queue: asyncio.Queue | None = None, index: int = 0,
                    arrived: float | None = None, trace=None) -> Job:
        """Wait for a place (or 429), start the controller (its rudder_start runs off the event
        loop) and hand the job to the engine thread. The job's `window` is how many tokens its
        controller may take back (None: unknown). `trace`: TraceOptions, for trace events."""
        arrived = arrived if arrived is not None else time.perf_counter()
        label = steer.controller if steer is not None else ""
        acquired = False
        try:
            resolved = None
            if steer is not None:
                resolved = self.registry.resolve_builtin(steer.controller)
                if resolved is None:  # a tag or module id: the store, maybe a first load
                    resolved = await asyncio.to_thread(self.registry.resolve, steer.controller)
            await self.admission.acquire(who.tenant)
            acquired = True
            ctl = await self._start_controller(resolved, steer, params.seed) if resolved is not None else None
            job = Job(asyncio.get_running_loop(), prompt_ids, params, ctl, queue=queue, index=index,
                      arrived=arrived, tenant=who.tenant, label=label,
                      module_id=resolved.module_id if resolved else None)
            job.trace = trace
            job.window = 0 if steer is None else (steer.max_backtrack if steer.max_backtrack is not None
                                                  else resolved.backtrack_for(steer.arg))
        except BaseException as e:
            if acquired:
                self.admission.release(who.tenant)
            if isinstance(e, APIError):  # refused before reaching the engine: logged all the same
                self._log_line("-", "refused", who.tenant, label, len(prompt_ids), 0,
                               e.extra.get("kind") or e.code or e.type, time.perf_counter() - arrived)
            raise
        if job.module_id is not None:
            self.registry.in_use[job.module_id] += 1
        self.engine_loop.submit(job)
        return job

    async def _start_controller(self, resolved, steer: Steer, seed: int | None):
        """runtime.start in a thread (`seed`: the request's, for a component's random numbers);
        if the handler is cancelled meanwhile (the client left), the controller it still makes
        is closed."""
        fut = asyncio.ensure_future(asyncio.to_thread(self.llm.runtime.start, resolved.module, steer.arg,
                                                      steer.limits, seed=seed))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.exception() is None and f.result().close())
            raise
        except ControllerError as e:
            self.metrics.failure(e.kind)
            raise controller_error(e, steer.controller, steer.param) from None
        except ValueError as e:  # bad limits
            raise APIError("invalid_request", str(e), param="controller_limits") from None

    async def start_all(self, specs: list[tuple[list[int], SamplingParams]], steer: Steer | None,
                        who: Principal, trace=None) -> list[Job]:
        """One job per prompt, sharing one event queue; all or none."""
        queue: asyncio.Queue = asyncio.Queue()
        arrived = time.perf_counter()
        jobs: list[Job] = []
        try:
            for i, (ids, params) in enumerate(specs):
                jobs.append(await self.start(ids, params, steer, who, queue=queue, index=i, arrived=arrived,
                                             trace=trace))
        except BaseException:
            self.end(jobs)
            raise
        return jobs

    async def events(self, jobs: list[Job]) -> AsyncIterator[tuple]:
        """(job, kind, ...) events of the jobs until each has ended ("done" or "error"). Leaving
        early (the client went away, or the response was closed) cancels what still runs: its KV
        blocks and controllers are freed before the next engine step."""
        pending = {id(j) for j in jobs}
        queue = jobs[0].queue
        try:
            while pending:
                event = await queue.get()
                job, kind = event[0], event[1]
                if kind == "done":
                    job.result = event[2]
                elif kind == "error":
                    job.error = event[2]
                yield event
                if kind != "step":
                    pending.discard(id(job))
        finally:
            self.end(jobs)

    def end(self, jobs: list[Job]) -> None:
        """Release what the jobs hold (cancelling unfinished ones); one log line each."""
        for job in jobs:
            if job.ended:
                continue
            job.ended = True
            if not job.finished:
                job.outcome = "cancelled"
                self.engine_loop.cancel(job)
            self.admission.release(job.tenant)
            if job.module_id is not None:
                self.registry.in_use[job.module_id] -= 1
                if self.registry.in_use[job.module_id] <= 0:
                    del self.registry.in_use[job.module_id]
            result = job.result
            error = job.error or (result.error if result is not None else None)
            prompt = result.prompt_tokens if result is not None else len(job.prompt)
            completion = result.usage_dict()["completion_tokens"] if result is not None else 0
            kind = (error.extra.get("kind") or error.type) if error is not None else ""
            self._log_line(getattr(job.request, "request_id", "-"), job.outcome, job.tenant, job.label, prompt,
                           completion, kind, time.perf_counter() - job.arrived)

    def _log_line(self, request_id, status, tenant, controller, prompt, completion, error_kind, seconds) -> None:
        log.info("request %s status=%s tenant=%s controller=%s prompt_tokens=%d completion_tokens=%d error=%s "
                 "seconds=%.3f", request_id, status, tenant, controller or "-", prompt, completion,
                 error_kind or "-", seconds)


_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams message begins with, if it begins with one."""
    word = message.split()[0].rstrip(":,") if message else ""
    return word if word in _FIELDS else None


def event_stream(svc: "Service", jobs: list, body) -> StreamingResponse:
    """An SSE response over `body` (an async generator reading the jobs' events). The jobs are
    also ended once the response is over, in case the generator never started (a client that
    left before the first byte): a place in the queue is never leaked."""
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(svc.end, jobs))


# Characters that end a line for str.splitlines - and so for httpx's and requests' iter_lines,
# which clients read event streams with - though not for SSE or JSON: escaped in an event, a
# token that decodes to one cannot cut the event in two.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    """One Server-Sent Event."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False)
        if "\x85" in data or "\u2028" in data or "\u2029" in data:
            data = data.translate(_LINE_ENDS)
    return f"data: {data}\n\n"
