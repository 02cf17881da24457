"""A pipeline stage's share of the decoder: a contiguous run of layers, plus the embeddings on
the first stage and the final norm and LM head on the last (which also needs the embeddings when
they are tied to the head). Same arithmetic as `LlamaModel`, in the same precision, so results match
it bit for bit. Activations cross between stages in fp32 (what the transport carries), which holds a
bf16 activation exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..loading import tiny_config
from ..model import (AttentionMetadata, DecoderLayer, RMSNorm, embedding, fuse_projections, materialize,
                     random_weights, rope_tables, run_layers, set_precision)
from ..precision import resolve
from .partition import StageSpec


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageSpec):
        super().__init__()
        self.cfg = cfg  # the whole model's config
        self.stage = stage
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(stage.num_layers))
        needs_embed = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size) if needs_embed else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                        if stage.is_last and not cfg.tie_word_embeddings else None)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.precision, self.act_dtype = "fp32", torch.float32  # set_precision changes them

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """x: token ids [T] on the first stage, else the previous stage's hidden states [T, hidden]
        (fp32). kv_cache holds this stage's layers only. Returns hidden states: normalised on the
        last stage, in fp32 on the others (for the next stage)."""
        # A copy either way: the layers update the residual stream in place.
        x = self.embed_tokens(x) if self.stage.is_first else x.to(self.act_dtype, copy=True)
        x = run_layers(self, x, positions, meta, kv_cache)
        return self.norm(x) if self.stage.is_last else x.float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of normalised hidden states."""
        if self.lm_head is None:
            return F.linear(hidden.to(self.embed_tokens.weight.dtype), self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def stage_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, stage: StageSpec) -> dict[str, torch.Tensor]:
    """The stage's tensors out of a whole checkpoint (HF or fused names), layers renumbered from 0."""
    out = {}
    for name, tensor in state_dict.items():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            if int(index) in stage.layers:
                out[f"layers.{int(index) - stage.first_layer}.{rest}"] = tensor
        else:
            out[name] = tensor
    return fuse_projections(out, cfg.replace(num_layers=stage.num_layers))


def build_stage_model(spec: str, stage: StageSpec, device: str | torch.device = "cpu",
                      dtype: str = "auto") -> StageModel:
    """The stage of model `spec` ("tiny", "smollm2", a folder or a .gguf), loaded from the same
    checkpoint every stage reads (memory-mapped: a stage touches only its own tensors), in
    precision `dtype` (the default matches `rudder.loading.load_model`'s)."""
    cfg = tiny_config(spec)
    if cfg is not None:
        full = random_weights(cfg)
    else:
        from ..weights import load_checkpoint

        cfg, full, _ = load_checkpoint(spec, progress=False)
    with torch.device("meta"):
        model = StageModel(cfg, stage)
    model = materialize(model, device)
    model.rope_cos, model.rope_sin = rope_tables(cfg, torch.device(device))
    weights = stage_state_dict(full, cfg, stage)
    expected = set(model.state_dict())
    missing = expected - weights.keys()
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of stage {stage.index}, e.g. {sorted(missing)[:3]}")
    model.load_state_dict({k: weights[k].to(device=device, dtype=torch.float32) for k in expected}, strict=True,
                          assign=True)
    return set_precision(model.eval().requires_grad_(False), resolve(dtype, device))
