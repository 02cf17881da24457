"""What a request produces: streamed deltas, final completions, and the text bookkeeping behind
them (detokenization, stop strings, backtracking)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass
class Delta:
    """What one step changed in one sequence of a request.

    Apply `backtrack_chars` first (delete that many characters from the end of the text shown so
    far), then append `text`."""

    request_id: int
    branch: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    logprobs: list[dict] = field(default_factory=list)
    error: str | None = None  # what went wrong, when finish_reason is "error"
    backtrack_chars: int = 0
    backtrack_tokens: int = 0
    speculative: dict | None = None  # on a finished delta of a speculative stream (LLM.stream): its stats


@dataclass
class Usage:
    """What one request cost (all its forks together), counted by the engine as it goes."""

    sampled_tokens: int = 0     # tokens drawn by the sampler
    ff_tokens: int = 0          # tokens a controller forced (fast-forward)
    forks: int = 0              # sequences added by forks
    controller_s: float = 0.0   # time spent in the controller's mid_process calls
    forward_s: float = 0.0      # time of the forward passes the request took part in
    last_step: int = -1         # the engine step last counted into forward_s


@dataclass
class Completion:
    """The final result of one sequence of a request."""

    request_id: int
    branch: int
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[dict] | None = None
    error: str | None = None
    branches: list["Completion"] = field(default_factory=list, repr=False)  # all forks (LLM.generate)
    speculative: dict | None = None  # speculative decoding stats of the request (engine/speculative.py)


class TextOutput:
    """Text bookkeeping for one sequence: detokenization, stop strings, backtracking.

    Text that could still turn out to begin a stop string is held back from the stream until it
    is decided, so a client never sees text that is later cut."""

    def __init__(self, tokenizer: "Tokenizer", stop: list[str]):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Returns the new text that is safe to stream and whether a stop string was hit."""
        self.text += self.decoder.push(token_ids)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold), False

    def pop(self, n_tokens: int) -> int:
        """Forget the last output tokens; returns how many streamed characters to delete."""
        removed = self.decoder.pop(min(n_tokens, len(self.decoder)))
        self.text = self.text[: len(self.text) - removed]
        unsent = max(0, self.emitted - len(self.text))
        self.emitted -= unsent
        return unsent

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._take(len(self.text))

    def fork(self, output_ids: list[int]) -> "TextOutput":
        """A copy for a forked sequence; its first delta carries the whole text so far."""
        twin = TextOutput(self.tokenizer, self.stop)
        twin.text = twin.decoder.push(output_ids)
        return twin

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted: upto], upto
        return delta
