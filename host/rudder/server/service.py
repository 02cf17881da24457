"""What every generation endpoint shares: admission, starting the controller, submitting the
job to the engine thread, and reading its events until it ends, or cancelling it when the
client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest

from ..controller import ControllerError
from ..engine import SamplingParams
from .admission import Admission
from .config import ServerConfig
from .engine_loop import EngineLoop
from .errors import APIError, controller_error
from .jobs import Job, Result
from .metrics import Metrics
from .registry import Registry

_DISCONNECT_POLL_S = 1.0  # how often a waiting handler checks that its client is still there


class Service:
    def __init__(self, config: ServerConfig, llm, registry: Registry, metrics: Metrics, engine_loop: EngineLoop):
        self.config = config
        self.llm = llm
        self.registry = registry
        self.metrics = metrics
        self.engine_loop = engine_loop
        self.admission = Admission(config.max_concurrent, config.max_queue)

    # -- inputs --------------------------------------------------------------------------------

    def sampling(self, body, max_tokens: int | None) -> SamplingParams:
        max_tokens = max_tokens or self.config.default_max_tokens
        if max_tokens > self.config.max_tokens:
            raise APIError("invalid_request", f"max_tokens {max_tokens} is over this server's limit "
                           f"({self.config.max_tokens})")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, seed=body.seed, stop=stop,
                                  ignore_eos=getattr(body, "ignore_eos", False), speculative=body.speculative,
                                  spec_k=body.spec_k).validate()
        except ValueError as e:
            raise APIError("invalid_request", str(e)) from None

    def prompt(self, prompt: str | None, messages) -> str:
        if (prompt is None) == (messages is None):
            raise APIError("invalid_request", "give either prompt or messages")
        if messages is None:
            return prompt
        return self.llm.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages])

    # -- running -------------------------------------------------------------------------------

    async def start(self, prompt: str, params: SamplingParams, controller: str | None = None, arg: str = "",
                    limits: dict | None = None) -> Job:
        """Wait for a place (or 429), start the controller (its rudder_start runs here, off the
        event loop) and hand the job to the engine thread."""
        module = self.registry.resolve(controller) if controller is not None else None
        await self.admission.acquire()
        try:
            ctl = None
            if module is not None:
                try:
                    ctl = await asyncio.to_thread(self.llm.runtime.start, module, arg, limits)
                except ControllerError as e:
                    self.metrics.failure(e.kind)
                    raise controller_error(e) from None
                except ValueError as e:  # bad limits
                    raise APIError("invalid_request", str(e)) from None
            job = Job(asyncio.get_running_loop(), prompt, params, ctl)
            self.engine_loop.submit(job)
            return job
        except BaseException:
            self.admission.release()
            raise

    async def events(self, job: Job, http: HTTPRequest) -> AsyncIterator[tuple]:
        """The job's events until "done" or "error". Leaving early (the client went away, or
        the response was closed) cancels the request: its KV blocks and controllers are freed."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                yield event
                if event[0] != "step":
                    return
        finally:
            if not job.finished:
                self.engine_loop.cancel(job)
            self.admission.release()

    async def result(self, job: Job, http: HTTPRequest) -> Result:
        """Run a job to its end (non-streaming); its error, if any, is raised."""
        async with contextlib.aclosing(self.events(job, http)) as events:
            async for event in events:
                if event[0] == "error":
                    raise event[1]
                if event[0] == "done":
                    if event[1].error is not None:
                        raise event[1].error
                    return event[1]
        raise APIError("invalid_request", "the client disconnected")  # nobody reads this


def sse(data: dict | str) -> str:
    """One Server-Sent Event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
