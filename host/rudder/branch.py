"""The Branch record: what a controller asks of one sequence at one step (see docs/abi.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
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
        return self.mask is not None or not self.ff
