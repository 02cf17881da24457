"""A pipeline stage's share of the decoder: a contiguous run of layers, plus the embeddings on
the first stage and the final norm and LM head on the last (which also needs the embeddings when
they are tied to the head). Same arithmetic as `LlamaModel`, so results match it bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..loading import tiny_config
from ..packed_linear import pack_linears
from ..model import AttentionMetadata, DecoderLayer, RMSNorm, build_model, fuse_projections, rope_tables
from .partition import StageSpec


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageSpec):
        super().__init__()
        self.cfg = cfg  # the whole model's config
        self.stage = stage
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(stage.num_layers))
        needs_embed = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if needs_embed else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                        if stage.is_last and not cfg.tie_word_embeddings else None)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """x: token ids [T] on the first stage, else the previous stage's hidden states [T, hidden].
        kv_cache holds this stage's layers only. Returns hidden states (normalised on the last)."""
        if self.stage.is_first:
            x = self.embed_tokens(x)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
        return self.norm(x) if self.stage.is_last else x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)


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


def build_stage_model(spec: str, stage: StageSpec, device: str | torch.device = "cpu") -> StageModel:
    """The stage of model `spec` ("tiny", "smollm2", a folder or a .gguf), loaded from the same
    checkpoint every stage reads (memory-mapped: a stage touches only its own tensors)."""
    cfg = tiny_config(spec)
    if cfg is not None:
        full = build_model(cfg, None, "cpu").state_dict()
    else:
        from ..weights import load_checkpoint

        cfg, full, _ = load_checkpoint(spec, progress=False)
    with torch.device("meta"):
        model = StageModel(cfg, stage)
    model = model.to_empty(device=device)
    model.rope_cos, model.rope_sin = rope_tables(cfg, torch.device(device))
    weights = stage_state_dict(full, cfg, stage)
    expected = set(model.state_dict())
    missing = expected - weights.keys()
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of stage {stage.index}, e.g. {sorted(missing)[:3]}")
    model.load_state_dict({k: weights[k].to(device=device, dtype=torch.float32) for k in expected}, strict=True,
                          assign=True)
    return pack_linears(model.eval().requires_grad_(False))
