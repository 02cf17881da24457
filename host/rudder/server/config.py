"""The server's settings: what `rudder serve` flags set."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..paths import rudder_home
from ..reasoning import Reasoning
from .auth import KeyRing

if TYPE_CHECKING:
    from ..controller.limits import Limits


@dataclass
class ServerConfig:
    model: str = "smollm2"
    served_model_name: str | None = None  # the name clients use (default: `model`)
    restricted: bool = False           # no uploads, no tag changes: only what is registered
    max_concurrent: int = 16           # requests in the engine at once
    max_queue: int = 64                # requests waiting for a place; past that: 429
    max_tokens: int = 1024             # the most a request may ask for
    default_max_tokens: int = 256      # when a chat or /v1/run request does not say (completions: 16)
    max_upload_bytes: int = 32 << 20   # a .wasm upload (a Python component is ~18 MB)
    max_modules: int = 256             # uploaded modules kept (content-addressed), all tenants together
    max_loaded_modules: int = 64       # uploaded modules kept loaded in memory (an LRU; the rest stay on disk)
    controller_limits: dict = field(default_factory=dict)  # lowers the ABI defaults (`--limit`)
    engine_options: dict = field(default_factory=dict)     # passed to LLM (kv_cache_tokens, pipeline_stages...)
    api_keys: KeyRing = field(default_factory=KeyRing)     # none: no authentication (said at start-up)
    public_metrics: bool = False       # /metrics without a key even when keys are configured
    state_dir: str | Path | None = None  # the durable registry (default: $RUDDER_HOME/server)
    state_url: str | None = None       # or the registry (and keys) on PostgreSQL, shared by replicas anywhere
    tenant_max_concurrent: int | None = None  # one tenant's requests, running and queued
    tenant_max_modules: int | None = None     # modules one tenant may upload
    max_compiles: int = 2              # modules compiled at once (each in a worker process); the rest wait
    compile_wait_s: float = 60.0       # an upload waiting longer for a compile slot gets 503
    compile_memory_mb: int = 1024      # address space of one compile worker (a Python component needs ~600)
    reasoning: Reasoning | None = None  # --reasoning-parser: chat outputs think first (reasoning.py)

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir is not None else rudder_home() / "server"

    @property
    def state_where(self) -> str:
        """Where the registry lives, for logs (a URL without its password)."""
        if self.state_url is None:
            return str(self.state_path)
        from .postgres_store import redact

        return redact(self.state_url)
