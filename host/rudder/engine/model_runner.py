"""Owns the model and the KV cache tensors; turns a scheduled step into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..model import AttentionMetadata, LlamaModel
from ..packed_linear import pack_linears
from .sampler import SampleOutput, Sampler
from .sequence import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: feed `num_tokens` pending tokens into `slots`."""

    seq: Sequence
    num_tokens: int
    slots: list[int]
    block_table: list[int]
    sample: bool  # the fed tokens reach the end of the sequence: its next-token logits are wanted
    logit_rows: int = 1  # logits of the last this many fed tokens (more than 1: speculative verification)


@dataclass
class StepArrays:
    """Everything a forward pass needs to know about a step, as a few int64 arrays (this is also
    what a pipeline stage receives: `rudder.pipeline`)."""

    counts: np.ndarray  # [B] tokens fed per sequence
    starts: np.ndarray  # [B] position of each sequence's first fed token (its num_cached)
    slot_mapping: np.ndarray  # [T] flat KV slot of each fed token
    tables: np.ndarray  # [B, blocks] block tables, zero-padded
    sample_rows: np.ndarray  # [R] flat row of each sampling sequence's last fed token
    input_ids: np.ndarray | None = None  # [T] (only the first stage needs them)

    @classmethod
    def of(cls, batch: list[ScheduledSeq]) -> "StepArrays":
        counts = np.array([e.num_tokens for e in batch], dtype=np.int64)
        starts = np.array([e.seq.num_cached for e in batch], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        num_table_blocks = int(max(len(e.block_table) for e in batch))
        input_ids = np.concatenate([e.seq.token_ids[s:s + n] for e, s, n in zip(batch, starts, counts)]).astype(np.int64)
        slot_mapping = np.concatenate([e.slots for e in batch]).astype(np.int64)
        tables = np.zeros((len(batch), num_table_blocks), dtype=np.int64)
        for b, e in enumerate(batch):
            tables[b, : len(e.block_table)] = e.block_table
        sample_rows = np.array([r for e, o, n in zip(batch, offsets, counts) if e.sample
                                for r in range(o + n - e.logit_rows, o + n)], dtype=np.int64)
        return cls(counts, starts, slot_mapping, tables, sample_rows, input_ids)

    def tensors(self, block_size: int, device) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, sample_rows) on `device`."""
        counts, starts, tables = self.counts, self.starts, self.tables
        B, T, Q = len(counts), int(counts.sum()), int(counts.max())
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        i = np.arange(Q)[None, :]
        valid = i < counts[:, None]  # [B, Q]
        query_pos = np.where(valid, starts[:, None] + i, 0)  # padded queries see key 0 only (no NaN rows)
        query_gather = np.where(valid, offsets[:, None] + i, T).reshape(-1)
        query_scatter = (np.arange(B)[:, None] * Q + i)[valid]
        key_pos = np.arange(tables.shape[1] * block_size)
        attn_mask = key_pos[None, None, None, :] <= query_pos[:, None, :, None]

        dev = device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slot_mapping).to(dev),
            query_gather=torch.from_numpy(query_gather).to(dev),
            query_scatter=torch.from_numpy(query_scatter).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            attn_mask=torch.from_numpy(attn_mask).to(dev),
            batch=B,
            max_query=Q,
        )
        input_ids = None if self.input_ids is None else torch.from_numpy(self.input_ids).to(dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, torch.from_numpy(self.sample_rows).to(dev)


class ModelRunner:
    multi_row_logits = True  # run() honours ScheduledSeq.logit_rows: speculative decoding can verify here

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg: ModelConfig = model.cfg
        self.model = pack_linears(model)  # the model runs here: its GEMMs get oneDNN-packed weights
        self.sampler = Sampler(cfg.vocab_size)
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        # The KV cache: [layer, K|V, block, position in block, kv head, head dim].
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=torch.float32, device=self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared blocks, queued by the block manager."""
        for src, dst in copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        return StepArrays.of(batch).tensors(self.block_size, self.device)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the batch; returns float32 logits [sum of logit_rows of entries with sample=True, vocab]."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_cache)
        return self.model.logits(hidden.index_select(0, sample_rows)).float()

    def sample(self, logits: torch.Tensor, rows: list[int], params: list, rngs: list, masks: list) -> SampleOutput:
        """Sample one token per entry of `rows` (rows of `logits`; forks share a row), each under
        its own params, generator and mask."""
        if rows != list(range(logits.shape[0])):  # forks share a row; some rows do not sample
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        return self.sampler.sample(logits, params, rngs, masks)

    def skip(self, logits: torch.Tensor) -> None:
        """The step's logits are not sampled (every row backtracked or failed): nothing to do here."""

    def close(self) -> None:
        pass
