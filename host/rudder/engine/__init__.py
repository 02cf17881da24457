"""The serving engine: requests and sequences, paged KV bookkeeping, scheduler, Branch semantics,
runners, sampler, and the loop that drives them (llm_engine.Engine). Names load on first use
(PEP 562), so that `rudder.engine.config` alone does not import torch."""

import importlib

__all__ = ["BlockManager", "Capabilities", "Completion", "Controller", "Delta", "Engine", "EngineConfig",
           "InvalidBranch", "KVCacheFull", "Request", "Runner", "RunnerFailure", "Sampler", "SamplingParams",
           "Sequence", "Usage"]

_WHERE = {"BlockManager": ".block_manager", "KVCacheFull": ".block_manager", "InvalidBranch": ".branching",
          "EngineConfig": ".config", "Controller": ".cursor", "Engine": ".llm_engine", "Completion": ".output",
          "Delta": ".output", "Usage": ".output", "Capabilities": ".runner", "Runner": ".runner",
          "RunnerFailure": ".runner", "Sampler": ".sampler", "Request": ".sequence", "SamplingParams": ".sequence",
          "Sequence": ".sequence"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module 'rudder.engine' has no attribute {name!r}")
