"""The FastAPI app: its wiring (model, durable registry, engine thread, keys), its middleware and
its error handlers. The endpoints: native_api.py (/v1/run, the controller registry, health,
models, metrics), openai_api.py (OpenAI-compatible), web.py (the page)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from . import native_api, openai_api, web
from .auth import AuthMiddleware
from .config import ServerConfig
from .engine_loop import EngineLoop
from .errors import APIError
from .metrics import Metrics
from .registry import Registry
from .service import ClientGone, Service
from .store import LocalStore, RegistryStore

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
    native_api.add_routes(app, config)
    openai_api.add_routes(app)
    web.add_routes(app)
    return app


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


def open_store(config: ServerConfig) -> RegistryStore:
    """The store a ServerConfig names: PostgreSQL for `state_url` (its API keys joining
    `config.api_keys`), else files + SQLite in the state directory."""
    if config.state_url is None:
        return LocalStore(config.state_path)
    try:
        from .postgres_store import PostgresStore
    except ImportError as e:
        raise ValueError(f"--state-url needs psycopg ({e}): pip install 'rudder[postgres]'") from None
    store = PostgresStore(config.state_url)
    try:
        store.watch_keys(config.api_keys.use_stored)
    except BaseException:
        store.close()
        raise
    return store
