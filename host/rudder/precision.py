"""Weight precision, a model option: `auto`, `fp32`, `bf16` or `int8` (docs/performance.md).

- `fp32`: weights and activations in float32 (the reference; what transformers computes).
- `bf16`: weights, activations and the KV cache in bfloat16, arithmetic accumulated in fp32;
  the LM head's logits come out in fp32. Half the weight bytes per token.
- `int8`: linear layers (the LM head included) hold int8 weights with a scale per output
  channel, widened to bf16 as they are read; activations and the KV cache in bf16. A quarter of
  fp32's weight bytes, half of bf16's.
- `auto`: bf16 where the device computes it natively (a CPU with avx512_bf16 or AMX and the
  native kernels built, a CUDA GPU with bf16), else fp32.

Decoding with a given precision is deterministic and a row's result never depends on its batch,
so greedy output is the same whatever else runs; two engines agree token for token when they
use the same precision.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import kernels

__all__ = ["PRECISIONS", "check_name", "resolve", "activation_dtype", "cpu_has_bf16", "cpu_flags"]

PRECISIONS = ("auto", "fp32", "bf16", "int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[-1].split())


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic: AVX-512 BF16 or AMX (x86), or the BF16 extension (Arm)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def check_name(dtype: str | None) -> str:
    """The precision's canonical name ("auto", "fp32", "bf16", "int8"; None is "auto"; "float32",
    "bfloat16" and "qint8" are accepted too); a ValueError naming the choices otherwise."""
    name = "auto" if dtype is None else str(dtype).lower()
    name = {"float32": "fp32", "bfloat16": "bf16", "qint8": "int8"}.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(PRECISIONS)}")
    return name


def resolve(dtype: str | None, device: torch.device | str = "cpu") -> str:
    """The concrete precision ("fp32", "bf16" or "int8") for a requested one on `device`."""
    name = check_name(dtype)
    if name != "auto":
        return name
    dev = torch.device(device)
    if dev.type == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    # Without the native kernels (no zig), bf16 would run on oneDNN, whose rows depend on their batch.
    return "bf16" if dev.type == "cpu" and cpu_has_bf16() and kernels.available(dev) else "fp32"


def activation_dtype(precision: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype of the activations and of the KV cache under a (resolved) precision."""
    return torch.float32 if precision == "fp32" else torch.bfloat16
