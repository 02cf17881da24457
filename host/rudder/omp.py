"""OpenMP spinning, settled before torch loads (rudder/__init__.py imports this first).

OpenMP threads that finish a parallel region spin before they sleep: libgomp's default is 300000
turns (milliseconds). Pipeline stages on one machine take turns on its cores, and a stage whose
workers still spin slows the next one down (benchmarks/RESULTS.md, "Numbers the code's design rests on").
libgomp reads GOMP_SPINCOUNT when torch is first imported, so it must be set before that; an
explicit setting wins. SHORT_OMP_SPIN: whether this process's OpenMP threads yield soon."""

import os
import sys

SHORT_OMP_SPIN = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
