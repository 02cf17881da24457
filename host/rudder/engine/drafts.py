"""Draft sources for speculative decoding (engine/speculative.py): where proposed tokens come from.

- `PromptLookup`: the continuation of the latest earlier occurrence of the sequence's last n
  tokens (prompt and output alike). Free to compute; strong when the output copies the prompt
  (extraction, JSON, code edits).
- `DraftModel`: a smaller or faster model with the same vocabulary, with its own paged KV cache
  that follows each sequence (rewound to the common prefix, then fed what it has not seen).
  `build_draft_model` makes one: a copy of the target in a cheaper weight precision ("int8",
  "bf16"), the target's first N layers, or any local checkpoint with the same vocabulary.

The controller's own fast-forward tokens are the third source; they need no code here.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..packed_linear import make_linear, prepare_linears
from ..precision import activation_dtype
from .block_manager import BlockManager, KVCacheFull
from .model_runner import ModelRunner
from .step import ScheduledSeq


class PromptLookup:
    """n-gram match against the sequence itself: the longest suffix of 1..`max_ngram` tokens
    that occurred before; its most recent occurrence's continuation is the proposal. A match of
    one token is weak evidence (in free text it is mostly a common word), so its proposal is at
    most `one_token_match` tokens; longer matches propose up to k. After the controller's
    fast-forward (`after_forced`) a one-token match is none: it is the controller's own text
    recurring (a JSON key's closing `":"`), and what followed it last time - the previous
    key's value - is no guess of the next value (on the extraction benchmark such drafts were
    never accepted past the key)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, one_token_match: int = 2):
        self.max_ngram, self.min_ngram, self.one_token_match = max_ngram, min_ngram, one_token_match

    def continuation(self, tokens: list[int], k: int, after_forced: bool = False) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        size = len(arr)
        shortest = max(self.min_ngram, 2) if after_forced else self.min_ngram
        for n in range(min(self.max_ngram, size - 1), shortest - 1, -1):
            suffix = arr[size - n:]
            hits = np.flatnonzero(arr[: size - n] == suffix[0])  # starts whose continuation exists
            for j in range(1, n):
                if not hits.size:
                    break
                hits = hits[arr[hits + j] == suffix[j]]
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start: start + (k if n > 1 else min(k, self.one_token_match))].tolist()
        return []


class DraftModel:
    """A draft model with its own KV cache, keyed by sequence id."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.bm = BlockManager(num_blocks, block_size)
        self.cached: dict[int, list[int]] = {}  # tokens whose keys/values the draft cache holds
        self.fed = 0  # the most tokens one sequence fed in the last call (1-2 when it keeps up)

    def logits(self, jobs: list[tuple[int, list[int]]]) -> list[torch.Tensor | None]:
        """Next-token logits after each job's tokens (one forward for all); None for a job that
        no longer fits the draft cache (it drafts nothing this step)."""
        batch, rows = [], []
        for key, tokens in jobs:
            entry = self._schedule(key, tokens)
            rows.append(None if entry is None else len(batch))
            if entry is not None:
                batch.append(entry)
        self.fed = max((e.num_tokens for e in batch), default=0)
        if not batch:
            return [None] * len(jobs)
        self.runner.copy_blocks(self.bm.take_copies())
        logits = self.runner.run(batch)
        return [None if r is None else logits[r] for r in rows]

    def _schedule(self, key: int, tokens: list[int]) -> ScheduledSeq | None:
        cached = self.cached.get(key)
        if cached is None:
            cached = self.cached[key] = []
            self.bm.add(key)
        n = min(len(cached), len(tokens) - 1)  # feed at least the last token
        if cached[:n] != tokens[:n]:  # rewound (a rejected draft, a backtrack): keep the common prefix
            n = int(np.flatnonzero(np.asarray(cached[:n]) != np.asarray(tokens[:n]))[0])
        if n < len(cached):
            self.bm.pop(key, len(cached) - n)
            del cached[n:]
        try:
            slots = self.bm.append(key, len(tokens) - n)
        except KVCacheFull:
            self.drop(key)
            return None
        view = SimpleNamespace(token_ids=tokens, num_cached=n)
        cached.extend(tokens[n:])
        return ScheduledSeq(view, len(tokens) - n, slots, self.bm.tables[key], True)

    def drop(self, key: int) -> None:
        """Forget a sequence: its tokens and its blocks of the draft cache."""
        if self.cached.pop(key, None) is not None:
            self.bm.free(key)

    def calibrate(self, read: int = 64, steps: int = 3) -> tuple[float, float] | None:
        """(seconds per token read in one go, seconds per one-token step), timed on a throwaway
        sequence: what drafting will cost is known before a request pays for finding out
        (None if the cache has no room for it)."""
        key, tokens = -1, list(range(1, read + 1))
        try:
            t0 = time.perf_counter()
            if self.logits([(key, tokens)])[0] is None:
                return None
            per_read = (time.perf_counter() - t0) / read
            times = []
            for i in range(steps):
                tokens.append(1 + i)
                t0 = time.perf_counter()
                if self.logits([(key, tokens)])[0] is None:
                    return None
                times.append(time.perf_counter() - t0)
            return per_read, sorted(times)[len(times) // 2]
        finally:
            self.drop(key)


def _truncated(target, num_layers: int):
    """A LlamaModel made of the target's own first `num_layers` layers, embeddings, norm, head and
    RoPE tables (nothing copied)."""
    from ..model import LlamaModel

    with torch.device("meta"):
        draft = LlamaModel(target.cfg.replace(num_layers=num_layers))
    draft.embed_tokens, draft.norm, draft.lm_head = target.embed_tokens, target.norm, target.lm_head
    draft.layers = nn.ModuleList(target.layers[:num_layers])
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    draft.precision, draft.act_dtype = target.precision, target.act_dtype
    return draft.eval().requires_grad_(False)


def _cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` itself when its weight has `dtype`, else a copy that has it."""
    if module.weight.dtype == dtype:
        return module
    out = copy.deepcopy(module)
    out.weight.data = out.weight.data.to(dtype)
    return out


def _in_precision(target, precision: str):
    """A copy of the target in another weight precision (rudder/precision.py): its layers
    converted from the target's weights, an LM head of its own in that precision; embeddings,
    final norm and RoPE tables shared when their dtype is the same."""
    from ..model import LlamaModel, RMSNorm

    device = target.rope_cos.device
    act = activation_dtype(precision, device)
    with torch.device("meta"):
        draft = LlamaModel(target.cfg)
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    draft.embed_tokens, draft.norm = _cast(target.embed_tokens, act), _cast(target.norm, act)
    draft.layers = copy.deepcopy(target.layers)
    for module in draft.layers.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = module.weight.data.to(act)
    prepare_linears(draft.layers, precision, convert=True)
    head = target.lm_head.weight if target.lm_head is not None else target.embed_tokens.weight
    draft.lm_head = make_linear(head.float(), None, precision, device, head=True)
    draft.precision, draft.act_dtype = precision, act
    return draft.eval().requires_grad_(False)


def build_draft_model(spec, target):
    """The draft for `spec`: "int8" or "bf16" (the target in that weight precision), "layers:N"
    (the target's first N layers, no copy), a loaded model, or a model spec for
    `rudder.loading.load_model` (a local checkpoint); its vocabulary must be the target's."""
    from ..model import LlamaModel

    if spec in ("int8", "bf16") or (isinstance(spec, str) and spec.startswith("layers:")):
        if not isinstance(target, LlamaModel):
            raise ValueError(f"the draft model {spec!r} is built from the whole target model, which this "
                             f"process does not hold (a pipeline's coordinator holds stage 0 only); give "
                             f"a draft checkpoint of its own, or use speculative='lookup'")
    if spec in ("int8", "bf16"):
        draft = _in_precision(target, spec)
    elif isinstance(spec, str) and spec.startswith("layers:"):
        n = spec[7:]
        if not n.isdigit() or not 0 < int(n) <= target.cfg.num_layers:
            raise ValueError(f"draft model {spec!r}: N must be in 1..{target.cfg.num_layers}")
        draft = _truncated(target, int(n))
    elif isinstance(spec, str):
        from ..loading import load_model

        draft = load_model(spec, target.embed_tokens.weight.device, dtype=getattr(target, "precision", "auto"))[0]
    else:
        draft = spec
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) is not the target's "
                         f"({target.cfg.vocab_size})")
    return draft
