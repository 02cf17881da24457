"""The FastAPI app: wiring (model, durable registry, engine thread, keys), error handlers, and the
native endpoints (/v1/run, the controller registry, health, models, metrics). The OpenAI-compatible
endpoints are in openai_api.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from ..engine.output import BacktrackTooFar, HeldStream
from . import openai_api, web
from .auth import ANONYMOUS, AuthMiddleware, Principal
from .config import ServerConfig
from .dialects import Steer
from .engine_loop import EngineLoop
from .errors import APIError
from .metrics import Metrics
from .registry import Registry
from .schemas import RunRequest, TagRequest
from .service import ClientGone, Service, event_stream, sse
from .store import StoreUnavailable, open_store

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
        metrics = Metrics(config.served_name)
        model.runtime.compiler.configure(max_compiles=config.max_compiles, wait_s=config.compile_wait_s,
                                         memory_bytes=config.compile_memory_mb << 20)
        store = await asyncio.to_thread(open_store, config)  # with --state-url, the database's keys join config's
        registry = Registry(model.runtime, store, config.max_modules, config.tenant_max_modules,
                            config.max_loaded_modules)
        await asyncio.to_thread(registry.add_builtins, BUILTIN_CONTROLLERS)
        engine_loop = EngineLoop(model.engine, metrics)
        engine_loop.start()
        app.state.service = Service(config, model, registry, metrics, engine_loop)
        if not config.api_keys:
            log.warning("no API keys: any client that can reach this server may run requests, upload controllers "
                        "and change tags (--api-key, --api-keys-file or RUDDER_API_KEY to require keys)")
        else:
            log.info("%d API key(s): /v1 routes%s need one", len(config.api_keys),
                     "" if config.public_metrics else " and /metrics")
        log.info("registry state in %s", config.state_where)
        try:
            yield
        finally:
            engine_loop.stop()
            store.close()
            if own:
                model.close()

    app = FastAPI(title="rudder", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    app.add_middleware(AuthMiddleware, keys=config.api_keys, public_metrics=config.public_metrics)
    app.add_middleware(_CountRequests)  # outermost: 401s are counted too
    _routes(app, config)
    openai_api.add_routes(app)
    web.add_routes(app)
    return app


def service(request: Request) -> Service:
    return request.app.state.service


def principal(request: Request) -> Principal:
    return getattr(request.state, "principal", ANONYMOUS)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        def where(err) -> str:
            return ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems = "; ".join(f"{where(err)}: {err.get('msg', 'invalid')}" for err in errors[:5])
        param = where(errors[0]) if errors else None
        return JSONResponse(APIError("invalid_request", problems, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "invalid_request"}.get(e.status_code, "invalid_request")
        return JSONResponse(APIError(kind, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # logged here, never sent
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return JSONResponse(APIError("internal_error", "internal server error").body(), status_code=500)


class _CountRequests:
    """Counts responses by endpoint and status for /metrics (plain ASGI: it does not buffer or
    wrap streaming responses)."""

    def __init__(self, app):
        self.app = app

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
            if svc is not None:
                route = next((r.path for r in app.routes if r.matches(scope)[0] == Match.FULL), "other")
                svc.metrics.request(route, status[0])


def _module_count(svc: Service) -> float:
    try:
        return len(svc.registry.builtin) + svc.registry.store.count_modules()
    except StoreUnavailable:  # a scrape during a database outage still answers
        return float("nan")


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
    def writable() -> None:
        if config.restricted:
            raise APIError("forbidden", "the registry cannot be changed on this server (--restricted)",
                           code="restricted")

    @app.get("/healthz")
    async def healthz(request: Request):
        svc = service(request)
        return {"status": "ok" if svc.llm.engine.failure is None else "failed", "model": config.served_name,
                "running": svc.admission.active, "queued": svc.admission.waiting}

    @app.get("/v1/models")
    async def models(request: Request):
        svc = service(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rudder",
                                            "max_model_len": svc.context} for name in svc.model_names]}

    @app.get("/metrics")
    async def metrics(request: Request):
        svc = service(request)
        engine = svc.llm.engine
        bm = engine.block_manager
        gauges = {
            "requests_running": ("Requests admitted (in the engine or starting).", svc.admission.active),
            "queue_depth": ("Requests waiting for a place.", svc.admission.waiting),
            "engine_requests": ("Requests the engine holds.", len(engine.requests)),
            "kv_blocks_free": ("Free KV cache blocks.", bm.num_free),
            "kv_blocks_total": ("KV cache blocks.", bm.num_blocks),
            "kv_cache_usage_ratio": ("Share of the KV cache in use (0-1).",
                                     round(1 - bm.num_free / bm.num_blocks, 6) if bm.num_blocks else 0.0),
            "controller_modules": ("Controller modules in the registry (built-in and uploaded; NaN while its "
                                   "database is away).", _module_count(svc)),
        }
        runtime, compiler = svc.llm.runtime.stats(), svc.llm.runtime.compiler
        gauges.update({
            "compile_queue_depth": ("Module compiles waiting for a compile slot.", compiler.waiting),
            "compiles_running": ("Module compiles running (each in a worker process).", compiler.running),
            "guest_memory_bytes": ("Linear memory of all live controller instances.", runtime["guest_memory_bytes"]),
            "guest_memory_budget_bytes": ("The server's budget for that memory.", runtime["guest_memory_budget"]),
            "snapshot_bytes": ("Post-init snapshots kept for loaded modules.", runtime["snapshot_bytes"]),
            "snapshot_budget_bytes": ("The budget for those snapshots.", runtime["snapshot_budget"]),
        })
        return PlainTextResponse(svc.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    # -- the registry ---------------------------------------------------------------------------

    @app.post("/v1/controllers")
    async def upload(request: Request):
        svc = service(request)
        writable()
        wasm = await _read_body(request, config.max_upload_bytes)
        if not wasm:
            raise APIError("invalid_request", "the body must be a .wasm module")
        info = await asyncio.to_thread(svc.registry.add, wasm, principal(request))
        svc.metrics.uploads += 1
        return info

    @app.get("/v1/controllers")
    async def list_controllers(request: Request):
        return {"data": await asyncio.to_thread(service(request).registry.describe)}

    @app.delete("/v1/controllers/{module_id}")
    async def remove_module(module_id: str, request: Request):
        writable()
        await asyncio.to_thread(service(request).registry.remove_module, module_id, principal(request))
        return {"module_id": module_id, "deleted": True}

    @app.post("/v1/controllers/prune")
    async def prune(request: Request):
        writable()
        removed = await asyncio.to_thread(service(request).registry.prune, principal(request))
        return {"deleted": removed}

    @app.post("/v1/controllers/tags")
    async def add_tag(body: TagRequest, request: Request):
        writable()
        try:
            names = body.names()
        except ValueError as e:
            raise APIError("invalid_request", str(e), param="tag") from None
        reg, who = service(request).registry, principal(request)

        def tag_all() -> list[dict]:
            return [reg.tag(name, body.module_id, who, body.max_backtrack) for name in names]

        views = await asyncio.to_thread(tag_all)
        out = {"tags": views}
        if len(views) == 1:
            out.update(tag=views[0]["tag"], module_id=views[0]["module_id"], owner=views[0]["owner"])
        return out

    @app.get("/v1/controllers/tags")
    async def tags(request: Request):
        reg = service(request).registry
        return {"tags": await asyncio.to_thread(reg.tags), "builtin": sorted(reg.builtin)}

    @app.delete("/v1/controllers/tags/{tag}")
    async def delete_tag(tag: str, request: Request):
        writable()
        await asyncio.to_thread(service(request).registry.untag, tag, principal(request))
        return {"tag": tag, "deleted": True}

    # -- running a controller -------------------------------------------------------------------

    @app.post("/v1/run")
    async def run(body: RunRequest, request: Request):
        svc = service(request)
        return await svc.until_disconnect(request, _run(svc, body, request))


async def _run(svc: Service, body: RunRequest, request: Request):
    aici = body.aici if body.aici is not None else (body.prompt is None and body.messages is None)
    if body.prompt is not None and body.messages is not None:
        raise APIError("invalid_request", "give either prompt or messages", param="prompt")
    if body.messages is not None:
        ids = svc.encode(svc.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages]), "messages")
    elif body.prompt is not None:
        ids = svc.encode(body.prompt)
    elif aici:  # AICI's requests have no prompt: the controller writes it (fast-forward)
        start = svc.tokenizer.bos_token_id if svc.tokenizer.bos_token_id is not None else svc.tokenizer.eos_token_id
        ids = [start]
    else:
        raise APIError("invalid_request", "give either prompt or messages", param="prompt")
    params = svc.sampling(body, body.max_tokens, len(ids))
    steer = None
    if body.controller is not None:
        steer = Steer(body.controller, body.arg, body.controller_limits, body.max_backtrack, "controller")
    elif body.controller_limits is not None or body.max_backtrack is not None:
        raise APIError("invalid_request", "controller_limits and max_backtrack go with a controller",
                       param="controller")
    if aici and not body.stream:
        raise APIError("invalid_request", "AICI runs are streamed (aici needs stream: true)", param="stream")
    trace = body.trace_options
    if trace is not None and (steer is None or aici):
        raise APIError("invalid_request", "trace needs a controller (it lists the Branches a controller gave)"
                       if steer is None else "trace events come in rudder's stream, not AICI's (aici: false)",
                       param="trace")
    jobs = await svc.start_all([(ids, params)], steer, principal(request), trace)
    if aici:
        return event_stream(svc, jobs, _aici_stream(svc, jobs[0]))
    if not body.stream:
        async with contextlib.aclosing(svc.events(jobs)) as events:
            async for _, kind, *payload in events:
                if kind == "error":
                    raise payload[0]
        result = jobs[0].result
        if result.error is not None:
            raise result.error
        choices = _choices(result)
        if trace is not None:
            for choice, c in zip(choices, result.completions):
                choice["trace"] = [t.as_dict(svc.tokenizer, mask=trace.masks) for t in c.trace]
        return {"choices": choices, "usage": result.usage_dict(), "timings": result.timings_dict(),
                "log": result.log}
    return event_stream(svc, jobs, _run_stream(svc, jobs))


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


async def _run_stream(svc: Service, jobs):
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
                event = {"type": "done", "choices": _choices(result), "usage": result.usage_dict(),
                         "timings": result.timings_dict()}
                if result.error is not None:
                    event.update(result.error.body())
                yield sse(event)


async def _aici_stream(svc: Service, job):
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
