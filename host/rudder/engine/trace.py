"""What a controller did, step by step (`LLM.generate(..., trace=True)`, `rudder run --trace`).

A TraceStep is one Branch the host applied to one sequence: how far it backtracked, what its
mask allowed, the fast-forward lists, and how long the controller took to answer. Recording
costs nothing unless the request asked for it: then each step copies the mask's words (the
controller overwrites them at its next call) and shows them as a `bitarray` over that copy.
Speculative drafting's intermediate answers are not traced, only the Branch applied at the end
of a verified draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from bitarray import bitarray

from ..branch import Branch

__all__ = ["TraceStep", "trace_of"]


@dataclass
class TraceStep:
    step: int  # the sequence's step (its count of forward passes that gave it logits)
    branch: int  # which sequence of the request (0, or a fork's number)
    fork: int  # which branch of the controller's answer this sequence took (0: the only one)
    backtrack: int
    mask: bitarray | None  # token i allowed = mask[i] (a view of the copied words; None: any token)
    ff: list[list[int]] = field(default_factory=list)
    controller_ms: float = 0.0

    @property
    def allowed(self) -> int | None:
        return None if self.mask is None else self.mask.count()

    def describe(self, tokenizer=None, show: int = 5) -> str:
        """One line, tokens decoded when a tokenizer is given."""
        def text(ids):
            return repr(tokenizer.decode(ids)) if tokenizer is not None else str(ids)

        parts = [f"step {self.step} seq {self.branch}" + (f" (fork {self.fork})" if self.fork else "")]
        if self.backtrack:
            parts.append(f"backtrack {self.backtrack}")
        if self.mask is not None:
            first = [i for i in self.mask.search(1, show)]
            parts.append(f"mask allows {self.allowed}: " + ", ".join(text([i]) for i in first)
                         + (", ..." if self.allowed > show else ""))
        elif not self.ff:
            parts.append("sample freely")
        if self.ff:
            parts.append("ff " + " | ".join(text(f) for f in self.ff[:show]) + (" | ..." if len(self.ff) > show else ""))
        parts.append(f"{self.controller_ms:.2f} ms")
        return ", ".join(parts)


def trace_of(seq, fork: int, branch: Branch, seconds: float) -> TraceStep:
    mask = None
    if branch.mask is not None:
        mask = bitarray(buffer=np.array(branch.mask, dtype="<u4"), endian="little")
    return TraceStep(seq.steps, seq.branch, fork, branch.backtrack, mask, [list(f) for f in branch.ff], 1e3 * seconds)
