"""Per-request resource limits of a controller (docs/abi.md, "Limits").

The server owns the defaults; a request may only *lower* them (`capped`), so an untrusted
request can never buy itself more time, memory or forks than the operator allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

__all__ = ["Limits", "deadline_ticks"]


@dataclass(frozen=True)
class Limits:
    mid_process_ms: float = 25          # deadline of one rudder_mid_process call
    init_ms: float = 1000               # deadline of rudder_init and of rudder_start
    memory_bytes: int = 64 << 20        # linear memory; memory.grow returns -1 past it
    max_forks: int = 16                 # live sequences per request, and branches per result
    max_ff_tokens: int = 4096           # fast-forward tokens per result (all lists together)
    max_log_bytes: int = 64 << 10       # log bytes kept per request
    max_var_bytes: int = 1 << 20        # shared variables per request (keys + values)
    max_tokenize_bytes: int = 1 << 20   # text the `tokenize` import may take per request, in all
    # Progress budgets (engine/budget.py): a controller that never lets its request finish fails.
    max_steps_per_token: float = 4      # steps a sequence may take per output token it holds
    max_work_factor: float = 4          # tokens processed per token of prompt and output
    controller_ms_per_token: float = 50  # controllers' CPU time per token generated

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"limit {f.name} must be a non-negative number, got {value!r}")
            if f.type == "int" and not float(value).is_integer():
                raise ValueError(f"limit {f.name} must be an integer, got {value!r}")
        if self.max_forks < 1:
            raise ValueError("limit max_forks must be at least 1")

    def capped(self, requested: "Limits | dict | None") -> "Limits":
        """These limits lowered by `requested` (element-wise minimum); a request can lower a
        limit, never raise it. Unknown keys are an error, so typos don't pass silently."""
        if requested is None:
            return self
        if isinstance(requested, Limits):
            requested = {f.name: getattr(requested, f.name) for f in fields(requested)}
        if not isinstance(requested, dict):
            raise TypeError(f"limits must be a Limits or a dict, not {type(requested).__name__}")
        names = {f.name: f for f in fields(self)}
        unknown = sorted(set(requested) - set(names))
        if unknown:
            raise ValueError(f"unknown controller limit(s): {', '.join(unknown)} "
                             f"(known: {', '.join(names)})")
        lowered = {}
        for key, value in requested.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"limit {key} must be a non-negative number, got {value!r}")
            mine = getattr(self, key)
            new = min(mine, value)
            lowered[key] = int(new) if names[key].type == "int" else float(new)
        return replace(self, **lowered) if lowered else self


    def lowered(self, requested: dict | None) -> "Limits":
        """These limits lowered by an operator's `requested` (the CLI's `--limit`, a dict given as
        an LLM's or a ServerConfig's controller_limits). Unlike a request's (`capped`), a value
        above the current one is refused by name rather than taken as the current one: only a
        `Limits(...)` of the operator's own sets higher limits."""
        out = self.capped(requested)  # (unknown keys and bad values refused there)
        above = sorted(k for k, v in (requested or {}).items() if v is not None and v > getattr(self, k))
        if above:
            raise ValueError("controller limit(s) above the defaults: " + ", ".join(
                f"{k}={requested[k]:g} (default {getattr(self, k):g})" for k in above)
                + "; KEY=VALUE limits only lower them (in Python, pass rudder.controller.Limits(...) to raise)")
        return out


def deadline_ticks(ms: float, tick_ms: float) -> int:
    """Epoch ticks for a deadline of `ms`: the deadline is armed at an arbitrary point inside
    the current tick, so one tick more than ceil(ms / tick) guarantees at least `ms`."""
    return math.ceil(ms / tick_ms) + 1
