"""ModelRunner: the model and its KV cache in this process; turns a scheduled step into one
forward pass (the Runner protocol of engine/runner.py)."""

from __future__ import annotations

import torch

from .. import kernels
from ..model import LlamaModel, native_stack
from ..packed_linear import pack_linears
from .kv_cache import KVCache
from .runner import Capabilities
from .sampler import SampleOutput, Sampler, take_rows
from .step import ScheduledSeq, StepArrays

__all__ = ["ModelRunner"]


class ModelRunner:
    capabilities = Capabilities(verify_rows=True)

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        # build_model has prepared the linear layers for the model's precision; a model built
        # some other way gets its GEMMs packed here.
        self.model = pack_linears(model)
        self.sampler = Sampler(model.cfg.vocab_size)
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.kv_cache = KVCache(model.cfg, num_blocks, block_size, self.device,
                                dtype=getattr(model, "act_dtype", torch.float32))  # the activations' precision
        if (isinstance(model, LlamaModel) and self.kv_cache.dtype == torch.bfloat16 and kernels.available(self.device)
                and native_stack(model) is not None):
            self.capabilities = Capabilities(verify_rows=True, native_decoder=True)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv_cache.copy_blocks(copies)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], alone: bool = False, early: list | None = None) -> torch.Tensor:
        """Forward the batch; returns float32 logits [sum of logit_rows of entries with sample=True, vocab]."""
        input_ids, positions, meta, sample_rows = StepArrays.of(batch).tensors(self.block_size, self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_cache.tensor)
        if sample_rows.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, sample_rows)
        return self.model.logits(hidden).float()

    def logits(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return take_rows(logits, rows)

    def sample(self, logits: torch.Tensor, rows: list[int], params: list, rngs: list, masks: list,
               history: list | None = None) -> SampleOutput:
        """Sample one token per entry of `rows` (rows of `logits`; forks share a row), each under
        its own params, generator and mask (`history`: see Sampler.sample)."""
        if rows != list(range(logits.shape[0])):  # forks share a row; some rows do not sample
            logits = take_rows(logits, rows)
        return self.sampler.sample(logits, params, rngs, masks, history)

    def skip(self, logits: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass
