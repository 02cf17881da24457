"""The server's settings: what `rudder serve` flags set."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    model: str = "smollm2"
    restricted: bool = False           # no uploads, no new tags: only the built-in controllers
    max_concurrent: int = 16           # requests in the engine at once
    max_queue: int = 64                # requests waiting for a place; past that: 429
    max_tokens: int = 1024             # the most a request may ask for
    default_max_tokens: int = 256      # when /v1/run does not say (OpenAI's default is 16)
    max_upload_bytes: int = 8 << 20    # a .wasm upload
    max_modules: int = 256             # uploaded modules kept (content-addressed)
    controller_limits: dict = field(default_factory=dict)  # lowers the ABI defaults (`--limit`)
    engine_options: dict = field(default_factory=dict)     # passed to LLM (kv_cache_tokens, pipeline_stages...)
