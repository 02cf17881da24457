"""What a request produces: streamed deltas, final completions, and the text bookkeeping behind
them (detokenization, stop strings, backtracking)."""

from __future__ import annotations

from collections import deque
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
    trace: list | None = None  # on a finished delta of a traced stream: the Branch records applied (engine/trace.py)
    reasoning: str = ""  # a reasoning request's thinking in this delta (LLM.stream; `text` is the answer)


@dataclass
class Usage:
    """What one request cost (all its forks together), counted by the engine as it goes."""

    sampled_tokens: int = 0     # tokens drawn by the sampler
    ff_tokens: int = 0          # tokens a controller forced (fast-forward)
    forks: int = 0              # sequences added by forks
    controller_s: float = 0.0   # time spent in the controller's mid_process calls
    forward_s: float = 0.0      # time of the forward passes the request took part in
    last_step: int = -1         # the engine step last counted into forward_s
    cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache (at its first admission)
    admissions: int = 0         # times its sequences were admitted and prefilled (more after preemption)


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
    trace: list | None = None  # the Branch records applied to this sequence (engine/trace.py), when asked for
    reasoning: str | None = None  # a reasoning request's thinking (SamplingParams.reasoning); `text` is the answer
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held when the request was admitted


class TextOutput:
    """Text bookkeeping for one sequence: detokenization, stop strings, backtracking.

    Text that could still turn out to begin a stop string is held back from the stream until it
    is decided, so a client never sees text that is later cut. With token healing the output
    first writes `healed` (the prompt text taken back) again: that is never shown, and stop
    strings look at what follows it."""

    def __init__(self, tokenizer: "Tokenizer", stop: list[str], healed: str = ""):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.healed = healed
        self.unhealed = healed  # the part of it not written again yet

    def _after_healed(self, text: str) -> str:
        """Decoded text without the part that writes the healed text again."""
        k = min(len(text), len(self.unhealed))
        self.unhealed = self.unhealed[k:]
        return text[k:]

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Returns the new text that is safe to stream and whether a stop string was hit."""
        text = self.decoder.push(token_ids)
        self.text += self._after_healed(text) if self.unhealed else text
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
        cut = min(removed, len(self.text))
        self.text = self.text[: len(self.text) - cut]
        if removed > cut:  # into the healed text: it is to be written again
            written = len(self.healed) - len(self.unhealed)
            self.unhealed = self.healed[written - (removed - cut):]
        unsent = max(0, self.emitted - len(self.text))
        self.emitted -= unsent
        return unsent

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._take(len(self.text))

    def fork(self, output_ids: list[int]) -> "TextOutput":
        """A copy for a forked sequence; its first delta carries the whole text so far."""
        twin = TextOutput(self.tokenizer, self.stop, self.healed)
        twin.text = twin._after_healed(twin.decoder.push(output_ids))
        return twin

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted: upto], upto
        return delta


@dataclass
class Piece:
    """Stream content released to a client: text, its tokens and their logprobs (aligned with
    the tokens; None for a token the controller forced)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict | None] = field(default_factory=list)

    def extend(self, other: "Piece") -> None:
        self.text += other.text
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs


class BacktrackTooFar(Exception):
    """A backtrack reached text already released: the controller took back more than it declared."""


class HeldStream:
    """One sequence's stream for a client that cannot take text back (an OpenAI client).

    A controller declares a backtrack depth N (`window`): once N tokens follow a token, it never
    takes that token back. So a delta is held until at least N tokens follow it, then released:
    nothing released can be taken back by a controller that keeps its word. `window` 0 releases
    at once (the built-in constraint controllers never backtrack); None holds everything until
    the sequence ends (a controller that declared nothing). A backtrack that reaches released
    text raises BacktrackTooFar."""

    def __init__(self, window: int | None):
        self.window = window
        self._held: deque[Piece] = deque()
        self._held_tokens = 0
        self.released_tokens = 0

    def push(self, delta: Delta) -> Piece:
        """Take one engine delta; returns what may be shown now."""
        if delta.backtrack_tokens or delta.backtrack_chars:
            self._take_back(delta.backtrack_tokens, delta.backtrack_chars)
        logprobs: list[dict | None] = [None] * len(delta.token_ids)
        if delta.logprobs and delta.token_ids:  # a sampled token comes first; the rest were forced
            logprobs[0] = delta.logprobs[0]
        if delta.text or delta.token_ids:
            self._held.append(Piece(delta.text, list(delta.token_ids), logprobs))
            self._held_tokens += len(delta.token_ids)
        if delta.finished or self.window is None:
            return self._release(everything=delta.finished)
        return self._release()

    def _release(self, everything: bool = False) -> Piece:
        out = Piece()
        if self.window is None and not everything:
            return out
        while self._held and (everything or self._held_tokens - len(self._held[0].token_ids) >= self.window):
            piece = self._held.popleft()
            self._held_tokens -= len(piece.token_ids)
            self.released_tokens += len(piece.token_ids)
            out.extend(piece)
        return out

    def _take_back(self, n_tokens: int, n_chars: int) -> None:
        held_chars = sum(len(p.text) for p in self._held)
        if n_chars > held_chars or (n_tokens > self._held_tokens and self.released_tokens):
            raise BacktrackTooFar(f"the controller took back {n_tokens} tokens, past the {self.window} it "
                                  "declared (max_backtrack); their text had been streamed")
        for piece in reversed(self._held):  # the text: from the end of the held pieces
            if not n_chars:
                break
            cut = min(n_chars, len(piece.text))
            piece.text = piece.text[: len(piece.text) - cut]
            n_chars -= cut
        remaining = n_tokens
        for piece in reversed(self._held):  # the tokens, with their logprobs
            if not remaining:
                break
            k = min(remaining, len(piece.token_ids))
            del piece.token_ids[len(piece.token_ids) - k:]
            del piece.logprobs[len(piece.logprobs) - k:]
            remaining -= k
        self._held_tokens = max(0, self._held_tokens - n_tokens)
        while self._held and not self._held[-1].text and not self._held[-1].token_ids:
            self._held.pop()
