"""Load a checkpoint into a ModelConfig and an fp32 state dict.

Accepted specs:
- "smollm2": the bundled SmolLM2-135M-Instruct (fetched and converted on first use);
- a Hugging Face-style folder (config.json, *.safetensors, maybe sharded, tokenizer.json)
  of a Llama, SmolLM or Qwen2 model;
- a llama-architecture .gguf file, converted once into a cache folder named after its sha256.

Returned tensor names drop the `model.` prefix (`embed_tokens.weight`,
`layers.0.self_attn.q_proj.weight`, ..., `norm.weight`, and `lm_head.weight` only when the
head is not tied to the embeddings). Safetensors files are memory-mapped, so loading an
fp32 checkpoint costs milliseconds, not a copy of every weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rudder.config import ModelConfig
from rudder.errors import ModelLoadError
from rudder.fsutil import file_lock, sha256_file, write_json_atomic
from rudder.model import expected_shapes
from rudder.model_files import GGUF_SHA256, fetch_model, folder_is_complete, model_dir
from rudder.paths import models_dir

__all__ = ["ModelLoadError", "expected_shapes", "load_checkpoint", "load_config", "load_state_dict"]

# model_type -> architectures we accept; both run on the same decoder (Qwen2 adds q/k/v bias).
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def load_checkpoint(spec: str | os.PathLike, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """Resolve `spec` to a model folder and load it: `(config, state_dict, folder)`.

    `folder` also holds tokenizer.json / tokenizer_config.json for `Tokenizer.from_folder`.
    """
    text = os.fspath(spec)
    if text == "smollm2":
        folder = fetch_model(progress=progress)
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            folder = path
        elif path.is_file() and path.suffix.lower() == ".gguf":
            folder = gguf_cache_folder(path, progress=progress)
        elif path.exists():
            raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
        else:
            raise ModelLoadError(
                f"no such model {text!r}: expected 'smollm2', a Hugging Face model folder or a .gguf file"
            )
    config = load_config(folder)
    return config, load_state_dict(folder, config), folder


# --------------------------------------------------------------------------- config


def load_config(folder: Path) -> ModelConfig:
    """Read and vet `config.json`: refuse what our decoder would silently compute wrong."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json (not a Hugging Face model folder?)")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc

    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture model_type={model_type!r} in {path} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    archs = d.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
    if SUPPORTED_MODEL_TYPES[model_type] not in archs:
        raise ModelLoadError(f"unsupported architectures {archs} in {path}")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {d['hidden_act']!r} in {path}")
    if d.get("mlp_bias"):
        raise ModelLoadError(f"MLP biases (mlp_bias=true) are not supported ({path})")
    if model_type == "llama" and d.get("attention_bias"):
        # Llama's attention_bias also adds an o_proj bias, which the decoder does not have.
        raise ModelLoadError(f"Llama attention_bias=true is not supported ({path})")
    if d.get("use_sliding_window"):
        raise ModelLoadError(f"sliding-window attention is not supported ({path})")

    # transformers >= 5 writes RoPE settings under `rope_parameters`; older files use
    # `rope_theta` + `rope_scaling`. Only plain RoPE is supported either way.
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported ({path})")
    if "rope_theta" not in d and "rope_theta" in rope:
        d = {**d, "rope_theta": rope["rope_theta"]}
    try:
        return ModelConfig.from_hf_dict(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path} lacks or mangles a required field: {exc}") from exc


# --------------------------------------------------------------------------- tensors


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} lacks shard {missing[0]} listed in {index.name}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (other formats are not supported)")
    return files


def load_state_dict(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Memory-map the folder's safetensors and return checked fp32 tensors, no `model.` prefix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(folder)):
        try:
            tensors = load_file(path)  # mmap: pages are read lazily, on first use
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):  # a recomputable buffer in old checkpoints
                continue
            state[name] = t if t.dtype == torch.float32 else t.float()

    if cfg.tie_word_embeddings:
        # Some tied checkpoints store the head anyway; the decoder uses the embeddings.
        state.pop("lm_head.weight", None)
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in state]
    if missing:
        raise ModelLoadError(f"{folder}: {len(missing)} tensors missing, e.g. {missing[0]!r}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{folder}: {len(unexpected)} unexpected tensors, e.g. {unexpected[0]!r}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelLoadError(f"{folder}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {shape}")
    return state


# --------------------------------------------------------------------------- GGUF cache


def _gguf_sha256(path: Path) -> str:
    """sha256 of a GGUF, remembered per (path, size, mtime) so multi-GB files are hashed once."""
    index_path = models_dir() / "gguf-index.json"
    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns]
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    entry = index.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = sha256_file(path)
    index[key] = {"stamp": stamp, "sha256": digest}
    write_json_atomic(index_path, index)  # a lost race only costs a re-hash later
    return digest


def gguf_cache_folder(path: Path, progress: bool = True) -> Path:
    """Convert `path` (once) into `$RUDDER_HOME/models/gguf-<sha256 prefix>/` and return it."""
    from rudder.gguf_convert import convert_gguf

    digest = _gguf_sha256(path)
    if digest == GGUF_SHA256 and folder_is_complete(model_dir(), gguf_sha256=digest):
        return model_dir()  # the bundled model, already converted by fetch_model
    folder = models_dir() / f"gguf-{digest[:16]}"
    if folder_is_complete(folder, gguf_sha256=digest):
        return folder
    with file_lock(models_dir() / f".{folder.name}.lock"):
        if not folder_is_complete(folder, gguf_sha256=digest):
            convert_gguf(path, folder, progress=progress, marker_info={"gguf_sha256": digest})
    return folder
