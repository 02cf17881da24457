"""Draft sources for speculative decoding (engine/speculative.py): where proposed tokens come from.

- `PromptLookup`: the continuation of the latest earlier occurrence of the sequence's last n
  tokens (prompt and output alike). Free to compute; strong when the output copies the prompt
  (extraction, JSON, code edits).
- `DraftModel`: a smaller or faster model with the same vocabulary, with its own paged KV cache
  that follows each sequence (rewound to the common prefix, then fed what it has not seen).
  `build_draft_model` makes one: an int8 (dynamically quantized) copy of the target, the target's
  first N layers, or any local checkpoint with the same vocabulary.

The controller's own fast-forward tokens are the third source; they need no code here.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..packed_linear import unpack_linears
from .block_manager import BlockManager, KVCacheFull
from .model_runner import ModelRunner
from .step import ScheduledSeq


class PromptLookup:
    """n-gram match against the sequence itself: the longest suffix of 1..`max_ngram` tokens
    that occurred before; its most recent occurrence's continuation is the proposal."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        size = len(arr)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = arr[size - n:]
            hits = np.flatnonzero(arr[: size - n] == suffix[0])  # starts whose continuation exists
            for j in range(1, n):
                if not hits.size:
                    break
                hits = hits[arr[hits + j] == suffix[j]]
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start: start + k].tolist()
        return []


class DraftModel:
    """A draft model with its own KV cache, keyed by sequence id."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.bm = BlockManager(num_blocks, block_size)
        self.cached: dict[int, list[int]] = {}  # tokens whose keys/values the draft cache holds

    def logits(self, jobs: list[tuple[int, list[int]]]) -> list[torch.Tensor | None]:
        """Next-token logits after each job's tokens (one forward for all); None for a job that
        no longer fits the draft cache (it drafts nothing this step)."""
        batch, rows = [], []
        for key, tokens in jobs:
            entry = self._schedule(key, tokens)
            rows.append(None if entry is None else len(batch))
            if entry is not None:
                batch.append(entry)
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
            self.release(key)
            return None
        view = SimpleNamespace(token_ids=tokens, num_cached=n)
        cached.extend(tokens[n:])
        return ScheduledSeq(view, len(tokens) - n, slots, self.bm.tables[key], True)

    def release(self, key: int) -> None:
        if self.cached.pop(key, None) is not None:
            self.bm.free(key)


class _QuantizedLM(nn.Module):
    """A LlamaModel whose Linear layers and (tied) LM head run in int8 (dynamic quantization)."""

    def __init__(self, base):
        super().__init__()
        unpack_linears(base)  # quantize_dynamic swaps nn.Linear modules only
        head = nn.Linear(base.cfg.hidden_size, base.cfg.vocab_size, bias=False)
        tied = base.embed_tokens if base.lm_head is None else base.lm_head
        head.weight = nn.Parameter(tied.weight.detach().clone(), requires_grad=False)
        base.lm_head = None  # the quantized head below replaces it
        with warnings.catch_warnings():  # torch marks its eager int8 path deprecated; it still runs fastest here
            warnings.simplefilter("ignore")
            # In place: `base` owns deep copies of the layers, and shares the embeddings unquantized.
            self.base = torch.ao.quantization.quantize_dynamic(base, {nn.Linear}, dtype=torch.qint8, inplace=True)
            self.head = torch.ao.quantization.quantize_dynamic(nn.Sequential(head), {nn.Linear}, dtype=torch.qint8,
                                                               inplace=True)
        self.cfg, self.embed_tokens = base.cfg, base.embed_tokens

    def forward(self, *args):
        return self.base(*args)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def _shared_copy(target, num_layers: int | None = None):
    """A LlamaModel sharing the target's embeddings, norm and RoPE tables; its layers are deep
    copies (for quantization), or the target's own first `num_layers` (truncation)."""
    from ..model import LlamaModel

    cfg = target.cfg if num_layers is None else target.cfg.replace(num_layers=num_layers)
    with torch.device("meta"):
        draft = LlamaModel(cfg)
    draft.embed_tokens, draft.norm, draft.lm_head = target.embed_tokens, target.norm, target.lm_head
    layers = target.layers if num_layers is None else target.layers[:num_layers]
    draft.layers = copy.deepcopy(layers) if num_layers is None else nn.ModuleList(layers)
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft.eval().requires_grad_(False)


def build_draft_model(spec, target):
    """The draft for `spec`: "int8" (the target, dynamically quantized), "layers:N" (the
    target's first N layers, no copy), a loaded model, or a model spec for `rudder.loading.load_model`
    (a local checkpoint); its vocabulary must be the target's."""
    from ..model import LlamaModel

    if spec == "int8" or (isinstance(spec, str) and spec.startswith("layers:")):
        if not isinstance(target, LlamaModel):
            raise ValueError(f"the draft model {spec!r} is built from the whole target model, which this "
                             f"process does not hold (a pipeline's coordinator holds stage 0 only); give "
                             f"a draft checkpoint of its own, or use speculative='lookup'")
    if spec == "int8":
        draft = _QuantizedLM(_shared_copy(target))
    elif isinstance(spec, str) and spec.startswith("layers:"):
        n = spec[7:]
        if not n.isdigit() or not 0 < int(n) <= target.cfg.num_layers:
            raise ValueError(f"draft model {spec!r}: N must be in 1..{target.cfg.num_layers}")
        draft = _shared_copy(target, int(n))
    elif isinstance(spec, str):
        from ..loading import load_model

        draft = load_model(spec, target.embed_tokens.weight.device)[0]
    else:
        draft = spec
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) is not the target's "
                         f"({target.cfg.vocab_size})")
    return draft
