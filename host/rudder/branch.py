"""The Branch record: what a controller asks of one sequence at one step (see docs/abi.md).
What a Branch *does* to a sequence is engine/branching.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Branch", "mask_words"]


def mask_words(vocab_size: int) -> int:
    """Length of a sample mask in uint32 words: token i is bit (i & 31) of word (i >> 5)."""
    return (vocab_size + 31) // 32


@dataclass(slots=True)  # (one per sequence and step: slots make it cheaper to build)
class Branch:
    """Remove `backtrack` tokens; then sample under `mask` (None = unconstrained) extended by a
    matching `ff` list, or - with no mask and exactly one ff list - append that list.

    `mask` may be a zero-copy view of controller memory: valid until the next call into that
    controller."""

    backtrack: int = 0
    mask: np.ndarray | None = None  # uint32 words, token i = bit (i & 31) of word (i >> 5)
    ff: list[list[int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """It samples a token (else it only backtracks and/or fast-forwards)."""
        return self.mask is not None or not self.ff

    @property
    def appends(self) -> list[int]:
        """The tokens it appends without sampling (its one ff list when it does not sample)."""
        return [] if self.samples else self.ff[0]
