"""The serving engine: sequences, paged KV bookkeeping, scheduler, model runner, sampler, loop."""

from .block_manager import BlockManager, KVCacheFull
from .llm_engine import Engine, Request, RunnerFailure
from .output import Completion, Delta, Usage
from .sampler import Sampler
from .sequence import SamplingParams, Sequence

__all__ = ["BlockManager", "KVCacheFull", "Completion", "Delta", "Engine", "Request", "RunnerFailure", "Sampler",
           "SamplingParams", "Sequence", "Usage"]
