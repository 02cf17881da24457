"""rudder: an LLM inference host steered by WebAssembly controllers.

The names below load on first use (PEP 562): `import rudder` alone, or the CLI's `--help`,
`--version`, `build` and a controller that fails its checks, never import torch."""

from .omp import SHORT_OMP_SPIN  # first: it must run before torch is imported  # noqa: F401

import importlib  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "Completion", "Delta", "load_model"]
__version__ = "0.1.0"

_WHERE = {"LLM": ".llm", "SamplingParams": ".engine.sequence", "EngineConfig": ".engine.config",
          "Completion": ".engine.output", "Delta": ".engine.output", "load_model": ".loading"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module 'rudder' has no attribute {name!r}")
