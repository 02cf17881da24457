"""The HTTP server (`rudder serve`): a controller registry, /v1/run with Server-Sent Events, and
OpenAI-compatible completions, over one engine stepped by one background thread.

Modules: config (ServerConfig), schemas (pydantic request models), errors (JSON errors),
registry (uploaded modules and tags), engine_loop (the thread that owns the Engine), jobs
(what a request streams back), admission (concurrency, queue, 429), metrics (Prometheus
text), openai_api (the OpenAI-shaped endpoints), app (routes and wiring).
"""

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
