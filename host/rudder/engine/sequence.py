"""A request, the sequences it runs as, and how each picks its tokens (SamplingParams)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

import numpy as np

from .output import Usage

if TYPE_CHECKING:
    from .cursor import ControllerCursor
    from .output import TextOutput


@dataclass
class SamplingParams:
    """How to pick each token. temperature 0 = greedy; top_k 0 / top_p 1 = no truncation."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the sampled token's plus the top n
    speculative: str | None = None  # None, "lookup" or "draft": speculative decoding (docs/speculative.md)
    spec_k: int = 8  # the most draft tokens per target forward (adapted below it)

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.speculative not in (None, "lookup", "draft"):
            raise ValueError(f"speculative must be 'lookup' or 'draft', not {self.speculative!r}")
        if not 1 <= self.spec_k <= 32:
            raise ValueError("spec_k must be between 1 and 32")
        if self.speculative is not None and self.logprobs is not None:
            raise ValueError("logprobs are not available with speculative decoding")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Request:
    """One submitted prompt and everything it became: its sequences (one, or several after
    forks), its usage and its outcome."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, limits=None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.limits = limits  # its controller Limits: the progress budgets (engine/budget.py)
        self.seqs: list[Sequence] = []
        self.cancelled = False
        self.error: str | None = None
        self.usage = Usage()
        self.work = 0  # tokens appended to, or re-fed into, its sequences, plus a cost per fork
        self.spec_stats = None  # speculative.SpecStats of a speculative request

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def live(self) -> int:
        return sum(not s.finished for s in self.seqs)


class Sequence:
    """`token_ids[:num_cached]` are in the KV cache; the rest wait to be fed to the model.

    A prompt waits in full; after sampling, one token waits; a controller's fast-forward can
    queue several. A backtrack removes tokens from the end (and from the cache). Only
    engine/branching.py's Steering changes a running sequence."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, rng: np.random.Generator,
                 request: Request, branch: int = 0):
        self.seq_id = next(_ids)
        self.request = request
        self.branch = branch
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.num_cached = 0
        self.params = params
        self.rng = rng
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict] = []
        self.output: "TextOutput | None" = None  # the streamed text (set by the engine)
        self.cursor: "ControllerCursor | None" = None  # its controller, and what it has been told
        self.draft = None  # speculative.Draft | None: draft tokens this step verifies
        self.steps = 0  # steps that computed its next-token logits

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def controller(self):
        return None if self.cursor is None else self.cursor.controller

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, cached={self.num_cached}, {self.status.name})"
