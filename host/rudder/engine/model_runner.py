"""Owns the model and the KV cache tensors; turns a scheduled step into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..model import AttentionMetadata, LlamaModel
from .sequence import Sequence


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: feed `num_tokens` pending tokens into `slots`."""

    seq: Sequence
    num_tokens: int
    slots: list[int]
    block_table: list[int]
    sample: bool  # the fed tokens reach the end of the sequence: its next-token logits are wanted


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg: ModelConfig = model.cfg
        self.model = model
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
        bs = self.block_size
        counts = np.array([e.num_tokens for e in batch], dtype=np.int64)
        starts = np.array([e.seq.num_cached for e in batch], dtype=np.int64)
        B, T, Q = len(batch), int(counts.sum()), int(counts.max())
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        num_table_blocks = int(max(len(e.block_table) for e in batch))

        input_ids = np.concatenate([e.seq.token_ids[s:s + n] for e, s, n in zip(batch, starts, counts)]).astype(np.int64)
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        slot_mapping = np.concatenate([e.slots for e in batch]).astype(np.int64)
        tables = np.zeros((B, num_table_blocks), dtype=np.int64)
        for b, e in enumerate(batch):
            tables[b, : len(e.block_table)] = e.block_table

        i = np.arange(Q)[None, :]
        valid = i < counts[:, None]  # [B, Q]
        query_pos = np.where(valid, starts[:, None] + i, 0)  # padded queries see key 0 only (no NaN rows)
        query_gather = np.where(valid, offsets[:, None] + i, T).reshape(-1)
        query_scatter = (np.arange(B)[:, None] * Q + i)[valid]
        key_pos = np.arange(num_table_blocks * bs)
        attn_mask = key_pos[None, None, None, :] <= query_pos[:, None, :, None]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_gather=torch.from_numpy(query_gather).to(dev),
            query_scatter=torch.from_numpy(query_scatter).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            attn_mask=torch.from_numpy(attn_mask).to(dev),
            batch=B,
            max_query=Q,
        )
        sample_rows = torch.from_numpy(np.array([o + n - 1 for e, o, n in zip(batch, offsets, counts) if e.sample],
                                                dtype=np.int64)).to(dev)
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta, sample_rows

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the batch; returns float32 logits [number of entries with sample=True, vocab]."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_cache)
        return self.model.logits(hidden.index_select(0, sample_rows)).float()
