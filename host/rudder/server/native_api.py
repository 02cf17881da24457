"""The native endpoints: health, models, metrics, the controller registry and /v1/run (the request;
its two stream formats are run_streams.py). The OpenAI-compatible endpoints are openai_api.py."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.requests import ClientDisconnect

from .auth import ANONYMOUS, Principal
from .config import ServerConfig
from .dialects import Steer
from .errors import APIError
from .run_streams import aici_events, rudder_events
from .run_streams import choices as run_choices
from .schemas import RunRequest, TagRequest
from .service import Service, event_stream
from .store import StoreUnavailable

__all__ = ["add_routes", "service", "principal"]


def service(request: Request) -> Service:
    return request.app.state.service


def principal(request: Request) -> Principal:
    return getattr(request.state, "principal", ANONYMOUS)


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


def add_routes(app: FastAPI, config: ServerConfig) -> None:
    """The native endpoints on `app`."""
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
        return event_stream(svc, jobs, aici_events(svc, jobs[0]))
    if not body.stream:
        async with contextlib.aclosing(svc.events(jobs)) as events:
            async for _, kind, *payload in events:
                if kind == "error":
                    raise payload[0]
        result = jobs[0].result
        if result.error is not None:
            raise result.error
        choices = run_choices(result)
        if trace is not None:
            for choice, c in zip(choices, result.completions):
                choice["trace"] = [t.as_dict(svc.tokenizer, mask=trace.masks) for t in c.trace]
        return {"choices": choices, "usage": result.usage_dict(), "timings": result.timings_dict(),
                "log": result.log}
    return event_stream(svc, jobs, rudder_events(svc, jobs))
