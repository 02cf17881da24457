"""The serving engine: requests and sequences, paged KV bookkeeping, scheduler, Branch semantics,
runners, sampler, and the loop that drives them (llm_engine.Engine)."""

from .block_manager import BlockManager, KVCacheFull
from .branching import InvalidBranch
from .config import EngineConfig
from .cursor import Controller
from .llm_engine import Engine
from .output import Completion, Delta, Usage
from .runner import Capabilities, Runner, RunnerFailure
from .sampler import Sampler
from .sequence import Request, SamplingParams, Sequence

__all__ = ["BlockManager", "Capabilities", "Completion", "Controller", "Delta", "Engine", "EngineConfig",
           "InvalidBranch", "KVCacheFull", "Request", "Runner", "RunnerFailure", "Sampler", "SamplingParams",
           "Sequence", "Usage"]
