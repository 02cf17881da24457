"""rudder: an LLM inference host steered by WebAssembly controllers."""

from .omp import SHORT_OMP_SPIN  # first: it must run before torch is imported  # noqa: F401, I001

from .engine import Completion, Delta, EngineConfig, SamplingParams  # noqa: E402
from .llm import LLM  # noqa: E402
from .loading import load_model  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "Completion", "Delta", "load_model"]
__version__ = "0.1.0"
