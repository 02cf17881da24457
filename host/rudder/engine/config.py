"""EngineConfig: the engine's sizes and limits, with the defaults the CLI, the server and the
Python API share (each exposes them as flags or keyword arguments of the same names)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    # KV cache size, in token positions (all sequences together). None: what `kv_cache_memory` of
    # the memory available at start holds (engine/kv_cache.py; the log says how many).
    kv_cache_tokens: int | None = None
    kv_cache_memory: float = 0.3   # that share of the available memory (ignored when kv_cache_tokens is set)
    block_size: int = 16           # KV positions per block (the unit of paging, copy-on-write and prefix caching)
    prefix_caching: bool = True    # reuse the KV blocks of prompts' common prefixes (engine/block_manager.py)
    max_batch_tokens: int = 512    # tokens fed per step (prompt chunks + decode tokens)
    # The time a step with decodes in it should stay near; prompts take what the decodes leave of
    # it (engine/scheduler.py). None: 1.75 times a step that decodes every sequence there is, measured.
    step_target_ms: float | None = None
    max_seqs: int = 64             # sequences running at once
    max_forks: int = 16            # live sequences per request
    controller_threads: int = 2    # threads running controllers while the model computes (0: inline)
    micro_batches: int = 1         # steps in flight at once (pipelines: one per stage pays off)
    draft_model: str = "int8"      # the draft of requests with speculative="draft" (engine/drafts.py)
    # Most threads for the model's native kernels. None: all of torch's, one fewer while
    # controllers keep a core busy (the fastest for one user). "shared": one fewer than torch's
    # always, where the native kernels run on two or more (a shared server's default: tenants'
    # controllers always have a core, so no request's speed depends on its neighbours'
    # controllers; benchmarks/tenants.py). An int: at most that many.
    model_threads: int | str | None = None

    def __post_init__(self):
        minimum = {"block_size": 1, "max_batch_tokens": 1, "max_seqs": 1, "max_forks": 1,
                   "controller_threads": 0, "micro_batches": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        k = self.kv_cache_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"kv_cache_tokens must be an integer >= 1 or None (from kv_cache_memory), got {k!r}")
        f = self.kv_cache_memory
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 0.95:
            raise ValueError(f"kv_cache_memory must be a share of the available memory in (0, 0.95], got {f!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        t = self.step_target_ms
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"step_target_ms must be a positive number of milliseconds or None, got {t!r}")
        m = self.model_threads
        if m is not None and m != "shared" and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"model_threads must be an integer >= 1, \"shared\" or None, got {m!r}")

    @property
    def num_blocks(self) -> int:
        if self.kv_cache_tokens is None:
            raise ValueError("kv_cache_tokens is not resolved yet (kv_cache.tokens_for_memory)")
        return max(1, self.kv_cache_tokens // self.block_size)

    @classmethod
    def of(cls, **options) -> "EngineConfig":
        """From keyword arguments; an unknown one is an error naming it (never silently dropped)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        if options.get("kv_cache_tokens") is not None and options.get("kv_cache_memory") is not None:
            raise ValueError("kv_cache_tokens and kv_cache_memory both size the KV cache: give one of them")
        return cls(**{k: v for k, v in options.items() if v is not None})

    def replace(self, **changes) -> "EngineConfig":
        return replace(self, **changes)
