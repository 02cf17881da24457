"""rudder: an LLM inference host steered by WebAssembly controllers."""

import os
import sys

# OpenMP threads that finish a parallel region spin before they sleep: libgomp's default is 300000
# turns (milliseconds). Pipeline stages on one machine take turns on its cores, and a stage whose
# workers still spin slows the next one down (B=1 decode over 2 stages: ~37 -> ~21 ms per token).
# libgomp reads this when torch is first imported, so it must be set before that (import rudder
# first); an explicit setting wins. SHORT_OMP_SPIN: whether this process's OpenMP threads yield soon.
SHORT_OMP_SPIN = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .engine import Completion, Delta, SamplingParams  # noqa: E402 (after the OpenMP setting)
from .llm import LLM, load_model  # noqa: E402

__all__ = ["LLM", "SamplingParams", "Completion", "Delta", "load_model"]
__version__ = "0.1.0"
