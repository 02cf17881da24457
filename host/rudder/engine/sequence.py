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
    # Logit processing, in the sampler, before masks and temperature (OpenAI / vLLM semantics):
    presence_penalty: float = 0.0    # minus this, once, for every token already in the output
    frequency_penalty: float = 0.0   # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: /p if positive, *p if not
    min_p: float = 0.0               # drop tokens whose probability is under min_p * the top one's
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100)
    # Structured output without naming a controller (LLM turns it into a built-in one; the
    # engine itself takes controllers, and refuses params that still carry these).
    json_schema: dict | str | None = None  # a JSON Schema (dict or JSON text): the `json` controller
    regex: str | None = None               # the whole output matches it: `regex`
    choice: list[str] | None = None        # the output is one of these strings: `choices`
    grammar: str | None = None             # a Lark (or GBNF: `::=`) grammar: `grammar`
    structural_tag: dict | str | None = None  # free text with tagged, constrained regions (structural_tag.py)
    json_undeclared: str | None = None     # "allow": undeclared properties too (the spec's reading; default "forbid")
    # Thinking before the answer (reasoning.py): True, {"start", "end", "budget"} or a Reasoning;
    # the constraint applies after the thinking, which comes back apart (Completion.reasoning).
    reasoning: object = None
    # Take back the prompt's last token(s) and write their text again first, in tokens of the
    # model's choice; the output shown starts after it (rudder/healing.py).
    token_healing: bool = False

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
        if self.token_healing and self.logprobs is not None:
            raise ValueError("token_healing: logprobs are not available with it (the first token spans the end of "
                             "the prompt)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias maps token ids to numbers") from None
            if any(k < 0 for k in bias) or any(not -100.0 <= v <= 100.0 for v in bias.values()):
                raise ValueError("logit_bias maps token ids (>= 0) to values between -100 and 100")
            self.logit_bias = bias
        if self.speculative is not None:  # verification draws from sampling_weights, after masks alone
            refused = [n for n in self.processing_fields() if n != "min_p"]
            if refused:
                raise ValueError(f"{', '.join(refused)}: not available with speculative decoding")
        constraint = self.constraint_fields() + [n for n in ("json_undeclared", "reasoning")
                                                 if getattr(self, n) not in (None, False)]
        if constraint:
            raise ValueError(f"{', '.join(constraint)}: structured output is turned into a controller by LLM "
                             "(LLM.generate/stream/chat); Engine.add_request takes the controller itself")
        return self

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's tokens (presence/frequency/repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether the sampler changes the logits beyond masks, temperature and top-k/p."""
        return self.penalized or bool(self.logit_bias) or self.min_p > 0

    def processing_fields(self) -> list[str]:
        """The logit-processing fields that are set (what makes the params `processed`)."""
        return [n for n, on in (("presence_penalty", self.presence_penalty),
                                ("frequency_penalty", self.frequency_penalty),
                                ("repetition_penalty", self.repetition_penalty != 1.0), ("min_p", self.min_p),
                                ("logit_bias", self.logit_bias)) if on]

    def constraint_fields(self) -> list[str]:
        """The structured-output fields that are set."""
        return [n for n in ("json_schema", "regex", "choice", "grammar", "structural_tag") if getattr(self, n) is not None]


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
        self.trace: list | None = None  # engine/trace.py's TraceSteps, when the request asked for them
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
        self.heal = 0  # token healing: the prompt tokens its controller's first answer must take back

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
