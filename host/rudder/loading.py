"""Loading a model and its tokenizer by name: "smollm2", "tiny" (random weights, for tests;
"tiny:N" with N layers), a .gguf file or a Hugging Face-style folder. Below the Python API
(llm.py), so the engine's draft models and the pipeline's stages can load models too."""

from __future__ import annotations

import torch

from .config import TINY_CONFIG, ModelConfig
from .model import build_model
from .tokenizer import Tokenizer

__all__ = ["load_model", "load_tokenizer", "load_config", "tiny_config"]


def tiny_config(spec: str) -> ModelConfig | None:
    """The config of "tiny" (the random-weight test model) or "tiny:N" (the same with N layers);
    None for any other spec."""
    if spec == "tiny":
        return TINY_CONFIG
    if isinstance(spec, str) and spec.startswith("tiny:") and spec[5:].isdigit() and int(spec[5:]) > 0:
        return TINY_CONFIG.replace(num_layers=int(spec[5:]))
    return None


def load_model(spec: str = "smollm2", device: str | torch.device = "cpu", dtype: str = "auto"):
    """(model, tokenizer) for a model spec, in weight precision `dtype` ("auto", "fp32", "bf16",
    "int8"; rudder/precision.py)."""
    cfg = tiny_config(spec)
    if cfg is not None:
        return build_model(cfg, None, device, dtype=dtype), Tokenizer.byte_level(cfg.vocab_size)
    from .weights import load_checkpoint

    cfg, state_dict, folder = load_checkpoint(spec)
    return build_model(cfg, state_dict, device, dtype=dtype), Tokenizer.from_folder(folder)


def load_tokenizer(spec: str) -> Tokenizer:
    cfg = tiny_config(spec)
    if cfg is not None:
        return Tokenizer.byte_level(cfg.vocab_size)
    from .weights import load_checkpoint

    return Tokenizer.from_folder(load_checkpoint(spec)[2])


def load_config(spec: str) -> ModelConfig:
    """A model's architecture without loading its weights."""
    cfg = tiny_config(spec)
    if cfg is not None:
        return cfg
    from .weights import load_checkpoint

    return load_checkpoint(spec, progress=False)[0]  # memory-mapped: no tensor is read
