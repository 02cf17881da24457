"""The web page: `GET /` serves a single-page app from `static/` (plain HTML, CSS and JavaScript
modules: no build step, nothing fetched from elsewhere), and `GET /v1/status` gives it what the
status panel shows and who the key belongs to. The page itself needs no key (it asks for one);
every call it makes goes to the API routes, which check the key as for any client."""

from __future__ import annotations

from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .auth import ANONYMOUS

STATIC = Path(__file__).with_name("static")


def add_routes(app: FastAPI) -> None:
    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/v1/status")
    async def status(request: Request):
        svc = request.app.state.service
        who = getattr(request.state, "principal", ANONYMOUS)
        engine, config = svc.llm.engine, svc.config
        bm = engine.block_manager
        return {
            "model": config.served_name, "dtype": str(svc.llm.dtype),
            "device": str(getattr(engine.runner, "device", "cpu")),  # a pipeline's runner has none of its own
            "threads": {"torch": torch.get_num_threads(), "model": engine.config.model_threads,
                        "controllers": engine.config.controller_threads},
            "context": svc.context, "vocab_size": svc.tokenizer.vocab_size,
            "kv": {"blocks_free": bm.num_free, "blocks_total": bm.num_blocks, "block_size": bm.block_size,
                   "usage": round(1 - bm.num_free / bm.num_blocks, 4) if bm.num_blocks else 0.0},
            "running": svc.admission.active, "queued": svc.admission.waiting,
            "tokens_per_second": round(svc.metrics.tokens_per_second(), 2),
            "tenant": who.tenant, "role": who.role, "keys": bool(config.api_keys), "restricted": config.restricted,
            "builtin": sorted(svc.registry.builtin),
        }
