"""A scheduled step, as the model sees it: which sequences feed which tokens into which KV slots
(`ScheduledSeq`), and the same flattened into a few integer arrays (`StepArrays`) - what a forward
pass needs, and what a pipeline stage receives over the wire."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..model import AttentionMetadata
from .sequence import Sequence

__all__ = ["ScheduledSeq", "StepArrays"]


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
        counts = [e.num_tokens for e in batch]
        starts = [e.seq.num_cached for e in batch]
        width = max(len(e.block_table) for e in batch)
        input_ids = [t for e, s, n in zip(batch, starts, counts) for t in e.seq.token_ids[s:s + n]]
        tables = [e.block_table + [0] * (width - len(e.block_table)) for e in batch]
        ends = itertools.accumulate(counts)
        sample_rows = [r for e, end in zip(batch, ends) if e.sample for r in range(end - e.logit_rows, end)]
        arr = np.array
        return cls(arr(counts, np.int64), arr(starts, np.int64), arr([x for e in batch for x in e.slots], np.int64),
                   arr(tables, np.int64), arr(sample_rows, np.int64), arr(input_ids, np.int64))

    def tensors(self, block_size: int, device) -> tuple[torch.Tensor | None, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, sample_rows) on `device`."""
        counts, starts, tables = self.counts, self.starts, self.tables
        B, T = len(counts), len(self.slot_mapping)
        key_pos = np.arange(tables.shape[1] * block_size)
        if T == B:  # one new token per sequence (decode): no padding, query i is row i
            Q, positions = 1, starts
            query_gather = query_scatter = np.arange(B)
            attn_mask = (key_pos[None, :] <= starts[:, None])[:, None, None, :]
        else:
            Q = int(counts.max())
            offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
            positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
            i = np.arange(Q)[None, :]
            valid = i < counts[:, None]  # [B, Q]
            query_pos = np.where(valid, starts[:, None] + i, 0)  # padded queries see key 0 only (no NaN rows)
            query_gather = np.where(valid, offsets[:, None] + i, T).reshape(-1)
            query_scatter = (np.arange(B)[:, None] * Q + i)[valid]
            attn_mask = key_pos[None, None, None, :] <= query_pos[:, None, :, None]

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return t if t.device == device else t.to(device)

        gather = put(query_gather)
        scatter = gather if query_scatter is query_gather else put(query_scatter)
        meta = AttentionMetadata(slot_mapping=put(self.slot_mapping), query_gather=gather, query_scatter=scatter,
                                 block_tables=put(tables), attn_mask=put(attn_mask), batch=B, max_query=Q)
        input_ids = None if self.input_ids is None else put(self.input_ids)
        return input_ids, put(positions), meta, put(self.sample_rows)
