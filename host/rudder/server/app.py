"""The FastAPI app: wiring (model, registry, engine thread), error handlers, and the native
endpoints (/v1/run, the controller registry, health, models, metrics). The OpenAI-compatible
endpoints are in openai_api.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import openai_api
from .config import ServerConfig
from .engine_loop import EngineLoop
from .errors import APIError
from .metrics import Metrics
from .registry import Registry
from .schemas import RunRequest, TagRequest
from .service import Service, sse

log = logging.getLogger("rudder.server")


def create_app(config: ServerConfig | None = None, llm=None) -> FastAPI:
    """The server's app. It loads `config.model` at start-up unless given a ready `llm`."""
    config = config or ServerConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        from ..controller.build import BUILTIN_CONTROLLERS
        from ..llm import LLM

        own = llm is None
        model = llm or await asyncio.to_thread(LLM, config.model, controller_limits=config.controller_limits or None,
                                               **config.engine_options)
        metrics = Metrics()
        registry = Registry(model.runtime, config.max_modules)
        await asyncio.to_thread(registry.add_builtins, BUILTIN_CONTROLLERS)
        engine_loop = EngineLoop(model.engine, metrics)
        engine_loop.start()
        app.state.service = Service(config, model, registry, metrics, engine_loop)
        try:
            yield
        finally:
            engine_loop.stop()
            if own:
                model.close()

    app = FastAPI(title="rudder", lifespan=lifespan, docs_url=None, redoc_url=None)
    _error_handlers(app)
    app.add_middleware(_CountRequests)
    _routes(app, config)
    openai_api.add_routes(app)
    return app


def service(request: Request) -> Service:
    return request.app.state.service


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: "
                             f"{err.get('msg', 'invalid')}" for err in e.errors()[:5])
        return JSONResponse(APIError("invalid_request", problems).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "invalid_request"}.get(e.status_code, "invalid_request")
        return JSONResponse({"error": {"type": kind, "message": str(e.detail)}}, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # logged here, never sent
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return JSONResponse(APIError("internal_error", "internal server error").body(), status_code=500)


class _CountRequests:
    """Counts responses by endpoint and status for /metrics (plain ASGI: it does not buffer or
    wrap streaming responses)."""

    def __init__(self, app):
        self.app = app
        self._paths: set[str] | None = None  # the app's routes (unknown paths count as "other")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            app = scope["app"]
            svc = getattr(app.state, "service", None)
            if self._paths is None:
                self._paths = {r.path for r in app.routes}
            if svc is not None:
                svc.metrics.request(scope["path"] if scope["path"] in self._paths else "other", status[0])


async def _read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError("payload_too_large", f"the module is {int(size)} bytes; this server takes at most {limit}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError("payload_too_large", f"the module is over {limit} bytes")
    except ClientDisconnect:
        raise APIError("invalid_request", "the client went away during the upload") from None
    return bytes(body)


def _routes(app: FastAPI, config: ServerConfig) -> None:
    @app.get("/healthz")
    async def healthz(request: Request):
        svc = service(request)
        return {"status": "ok" if svc.llm.engine.failure is None else "failed", "model": config.model,
                "running": svc.admission.active, "queued": svc.admission.waiting}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": config.model, "object": "model", "created": 0, "owned_by": "rudder"}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        svc = service(request)
        engine = svc.llm.engine
        gauges = {
            "requests_running": ("Requests admitted (in the engine or starting).", svc.admission.active),
            "queue_depth": ("Requests waiting for a place.", svc.admission.waiting),
            "engine_requests": ("Requests the engine holds.", len(engine.requests)),
            "kv_blocks_free": ("Free KV cache blocks.", engine.block_manager.num_free),
            "kv_blocks_total": ("KV cache blocks.", engine.block_manager.num_blocks),
            "controller_modules": ("Controller modules in the registry.", len(svc.registry.modules)),
        }
        return PlainTextResponse(svc.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/v1/controllers")
    async def upload(request: Request):
        svc = service(request)
        if config.restricted:
            raise APIError("forbidden", "uploads are disabled on this server (--restricted)")
        wasm = await _read_body(request, config.max_upload_bytes)
        if not wasm:
            raise APIError("invalid_request", "the body must be a .wasm module")
        info = await asyncio.to_thread(svc.registry.add, wasm)
        svc.metrics.uploads += 1
        return info

    @app.get("/v1/controllers")
    async def list_controllers(request: Request):
        return {"data": service(request).registry.describe()}

    @app.post("/v1/controllers/tags")
    async def add_tag(body: TagRequest, request: Request):
        if config.restricted:
            raise APIError("forbidden", "tags cannot be changed on this server (--restricted)")
        service(request).registry.tag(body.tag, body.module_id)
        return {"tag": body.tag, "module_id": body.module_id}

    @app.get("/v1/controllers/tags")
    async def tags(request: Request):
        reg = service(request).registry
        return {"tags": dict(sorted(reg.tags.items())), "builtin": sorted(reg.builtin)}

    @app.post("/v1/run")
    async def run(body: RunRequest, request: Request):
        svc = service(request)
        prompt = svc.prompt(body.prompt, body.messages)
        params = svc.sampling(body, body.max_tokens)
        job = await svc.start(prompt, params, body.controller, body.controller_arg, body.controller_limits)
        if not body.stream:
            result = await svc.result(job, request)
            return {"choices": _choices(result), "usage": result.usage_dict(), "timings": result.timings_dict(),
                    "log": result.log}
        return StreamingResponse(_run_stream(svc, job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def _choices(result) -> list[dict]:
    return [{"branch": c.branch, "text": c.text, "finish_reason": c.finish_reason,
             **({"error": c.error} if c.error else {})} for c in result.completions]


def _delta(d) -> dict:
    out = {"branch": d.branch, "text": d.text, "backtrack": d.backtrack_chars, "token_ids": d.token_ids}
    if d.finished:
        out["finish_reason"] = d.finish_reason
        if d.error:
            out["error"] = d.error
    return out


async def _run_stream(svc: Service, job, request: Request):
    """/v1/run's events: one per engine step ("step": each fork's delta, new log text), then
    "done" with every branch's final text, usage and timings (and the error, if it failed)."""
    async with contextlib.aclosing(svc.events(job, request)) as events:
        async for kind, *payload in events:
            if kind == "step":
                deltas, log_text = payload
                event = {"type": "step", "deltas": [_delta(d) for d in deltas]}
                if log_text:
                    event["log"] = log_text
                yield sse(event)
            elif kind == "error":
                yield sse({"type": "error", **payload[0].body()})
            else:
                result = payload[0]
                event = {"type": "done", "choices": _choices(result), "usage": result.usage_dict(),
                         "timings": result.timings_dict()}
                if result.error is not None:
                    event.update(result.error.body())
                yield sse(event)
