"""Reasoning models: the output begins with thinking that ends with a marker (`</think>`, the
convention of DeepSeek-R1 and Qwen3), then comes the answer.

`Reasoning` says where the thinking ends and how long it may be (`budget`, vLLM's
`thinking_token_budget`); `constraint_plan.with_reasoning` turns it and an optional constraint into
the `triggers` controller (the thinking free, the constraint from the end marker on, the end
marker fast-forwarded once the budget is spent); `ReasoningSplitter` splits the output into the
thinking (`reasoning_content`) and the answer as it streams. Docs: docs/server.md, "Reasoning".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Reasoning", "ReasoningSplitter", "split"]

# `--reasoning-parser` names: all use the same markers (`start` is optional in the output).
PARSERS = ("deepseek_r1", "qwen3", "think")


@dataclass(frozen=True)
class Reasoning:
    """The thinking: an optional `start` marker, an `end` marker, and a token budget (None: none)."""

    start: str = "<think>"
    end: str = "</think>"
    budget: int | None = None

    def __post_init__(self):
        if not isinstance(self.end, str) or not 1 <= len(self.end.encode()) <= 64:
            raise ValueError("reasoning: the end marker is a string of 1 to 64 bytes")
        if not isinstance(self.start, str):
            raise ValueError("reasoning: the start marker is a string")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValueError("thinking_token_budget must be a whole number of tokens (>= 0)")

    @classmethod
    def of(cls, value: Any) -> "Reasoning | None":
        """None/False: no reasoning; True: the default markers; a dict of the fields; a Reasoning."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"start", "end", "budget"}
            if unknown:
                raise ValueError(f"reasoning: unknown field {sorted(unknown)[0]!r} (start, end, budget)")
            return cls(**value)
        raise ValueError("reasoning is True, a dict {start, end, budget} or a Reasoning")


def split(text: str, reasoning: Reasoning) -> tuple[str, str | None]:
    """(thinking, answer) of a whole output; the answer is None while the thinking has not ended."""
    s = ReasoningSplitter(reasoning)
    thinking, answer = s.feed(text)
    more_thinking, more_answer = s.finish()
    return thinking + more_thinking, (answer + more_answer) if s.ended else None


class ReasoningSplitter:
    """Splits streamed text into thinking and answer. Text that could still turn out to be (the
    beginning of) a marker is held back until it is decided, so each part only ever grows."""

    def __init__(self, reasoning: Reasoning):
        self.r = reasoning
        self.pending = ""          # undecided text
        self.opened = not reasoning.start   # past the place where a start marker may stand
        self.ended = False         # the end marker was written: the rest is the answer

    def feed(self, text: str) -> tuple[str, str]:
        if self.ended:
            return "", text
        self.pending += text
        thinking = ""
        if not self.opened:
            head = self.pending.lstrip()
            if head.startswith(self.r.start):
                self.pending = head[len(self.r.start):]
                self.opened = True
            elif not self.r.start.startswith(head) or not head and len(self.pending) > 64:
                self.opened = True   # no start marker: the thinking begins with the text itself
            else:
                return "", ""
        at = self.pending.find(self.r.end)
        if at >= 0:
            thinking, answer = self.pending[:at], self.pending[at + len(self.r.end):]
            self.pending, self.ended = "", True
            return thinking, answer
        keep = _partial_suffix(self.pending, self.r.end)
        thinking, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return thinking, ""

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output (it is thinking: the end marker never came)."""
        out, self.pending = self.pending, ""
        return (out, "") if not self.ended else ("", out)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
