"""rudder: an LLM inference host steered by WebAssembly controllers."""

from .engine import Completion, Delta, SamplingParams
from .llm import LLM, load_model

__all__ = ["LLM", "SamplingParams", "Completion", "Delta", "load_model"]
__version__ = "0.1.0"
