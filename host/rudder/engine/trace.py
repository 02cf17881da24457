"""What a controller did, step by step (`LLM.generate(..., trace=True)`, `rudder run --trace`,
`"trace": true` over HTTP).

A TraceStep is one answer the host applied to one sequence: a Branch (how far it backtracked,
what its mask allowed, the fast-forward lists, which fork this sequence took) or a stop (no
Branch), how long the controller took, and the token then sampled under it with the top
alternatives of the distribution it was drawn from (after the mask, before temperature).

Recording costs nothing unless the request asked for it. A traced request pays per step for a
copy of the mask's words (the controller overwrites them at its next call, shown as a `bitarray`
over that copy) and for the sampler's log-softmax and top-k over its row, which the engine asks
for with `sampler_params`. Speculative drafting's intermediate answers are not traced, only the
Branch applied at the end of a verified draft.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
from bitarray import bitarray

from ..branch import Branch

__all__ = ["TOP", "TraceStep", "note_sample", "ready", "sampler_params", "stop_of", "trace_of"]

TOP = 5  # alternatives kept per sampled token


@dataclass
class TraceStep:
    step: int  # the sequence's step (its count of forward passes that gave it logits)
    branch: int  # which sequence of the request (0, or a fork's number)
    fork: int  # which branch of the controller's answer this sequence took (0: the only one)
    backtrack: int
    mask: bitarray | None  # token i allowed = mask[i] (a view of the copied words; None: any token)
    ff: list[list[int]] = field(default_factory=list)
    controller_ms: float = 0.0
    parent: int | None = None  # the sequence that answered, when this one is a fork it made
    stop: bool = False  # the controller answered no Branch: the sequence stopped
    token: int | None = None  # the token sampled under this Branch (-1: its mask allowed none)
    logprob: float | None = None  # the token's logprob in the distribution it was drawn from
    top: list[tuple[int, float]] = field(default_factory=list)  # the TOP likeliest tokens there
    waiting: bool = False  # it samples and its token is not known yet

    @property
    def allowed(self) -> int | None:
        return None if self.mask is None else self.mask.count()

    @property
    def samples(self) -> bool:
        return not self.stop and (self.mask is not None or not self.ff)

    def first_allowed(self, n: int) -> list[int]:
        return [] if self.mask is None else list(itertools.islice(self.mask.search(1), n))

    def describe(self, tokenizer=None, show: int = 5) -> str:
        """One line, tokens decoded when a tokenizer is given."""
        def text(ids):
            return repr(tokenizer.decode(ids)) if tokenizer is not None else str(ids)

        parts = [f"step {self.step} seq {self.branch}" + (f" (fork {self.fork})" if self.fork else "")]
        if self.stop:
            parts.append("stop")
        if self.backtrack:
            parts.append(f"backtrack {self.backtrack}")
        if self.mask is not None:
            parts.append(f"mask allows {self.allowed}: " + ", ".join(text([i]) for i in self.first_allowed(show))
                         + (", ..." if self.allowed > show else ""))
        elif not self.ff and not self.stop:
            parts.append("sample freely")
        if self.ff:
            parts.append("ff " + " | ".join(text(f) for f in self.ff[:show]) + (" | ..." if len(self.ff) > show else ""))
        if self.token is not None:
            parts.append("sampled nothing" if self.token < 0 else f"sampled {text([self.token])}"
                         + (f" p={np.exp(self.logprob):.2f}" if self.logprob is not None else ""))
        parts.append(f"{self.controller_ms:.2f} ms")
        return ", ".join(parts)

    def as_dict(self, tokenizer, first: int = 8, mask: bool = False) -> dict:
        """The step as JSON (the server's trace events): the mask summarized as its count and
        first `first` allowed ids (with `mask`, also the words themselves, base64 of
        little-endian uint32), and `text` mapping every id named to its text."""
        firsts = self.first_allowed(first)
        out = {"step": self.step, "seq": self.branch, "fork": self.fork, "parent": self.parent,
               "backtrack": self.backtrack, "stop": self.stop, "allowed": self.allowed, "first_allowed": firsts,
               "ff": self.ff, "controller_ms": round(self.controller_ms, 3), "token": self.token,
               "logprob": self.logprob, "top": [list(t) for t in self.top]}
        if mask and self.mask is not None:
            out["mask"] = base64.b64encode(self.mask.tobytes()).decode("ascii")
        ids = {*firsts, *itertools.chain.from_iterable(self.ff), *(t for t, _ in self.top)}
        if self.token is not None and self.token >= 0:
            ids.add(self.token)
        table = tokenizer.token_bytes
        out["text"] = {str(i): table[i].decode("utf-8", "replace") for i in sorted(ids) if 0 <= i < len(table)}
        return out


def trace_of(seq, fork: int, branch: Branch, seconds: float, parent: int | None = None) -> TraceStep:
    mask = None
    if branch.mask is not None:
        mask = bitarray(buffer=np.array(branch.mask, dtype="<u4"), endian="little")
    step = TraceStep(seq.steps, seq.branch, fork, branch.backtrack, mask, [list(f) for f in branch.ff],
                     1e3 * seconds, parent)
    step.waiting = step.samples
    return step


def stop_of(seq, seconds: float) -> TraceStep:
    """The controller's empty answer: the sequence stops."""
    return TraceStep(seq.steps, seq.branch, 0, 0, None, [], 1e3 * seconds, stop=True)


def sampler_params(params):
    """What a traced sequence asks of the sampler: its params, with at least TOP logprobs."""
    if params.logprobs is not None and params.logprobs >= TOP:
        return params
    return dataclasses.replace(params, logprobs=TOP)


def note_sample(seq, token: int, logprob: dict | None) -> dict | None:
    """A traced sequence sampled `token`: its latest step, if it waits for one, records it. Returns
    the logprob entry the sequence itself asked for (None, or its own number of alternatives)."""
    for step in reversed(seq.request.trace):
        if step.branch == seq.branch:
            if step.waiting:
                step.waiting, step.token = False, token
                if logprob is not None:
                    # a token the mask left out (-inf) is no alternative
                    step.logprob = logprob["logprob"]
                    step.top = [(t, lp) for t, lp in logprob["top"][:TOP] if lp != float("-inf")]
            break
    n = seq.params.logprobs
    if logprob is None or n is None:
        return None
    return logprob if len(logprob["top"]) <= n else {**logprob, "top": logprob["top"][:n]}


def ready(trace: list[TraceStep], start: int, seqs) -> int:
    """How far from `start` the steps are complete (a stream sends them up to there): a step
    that waits for its token holds back itself and what follows while its sequence runs."""
    end = start
    while end < len(trace) and not (trace[end].waiting and not seqs[trace[end].branch].finished):
        end += 1
    return end
