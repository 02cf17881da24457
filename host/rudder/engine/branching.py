"""Branch semantics: the one place where a controller's answer changes a sequence (docs/abi.md,
"What a Branch does").

The rules (`check`, `tokens_after`, `ends_sequence`) and `Steering`, which applies them to
sequences - backtrack, fast-forward, fork, defer, sample, append, finish, and a speculative
draft's tokens (attach, settle, rewind) - keeping the KV block tables, the streamed text and
each controller's cursor in step. The engine loop, the speculator and the pipeline all go
through it; none of them edits a sequence itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..branch import Branch
from .output import Delta
from .sequence import Request, Sequence, SeqStatus
from .trace import note_sample, stop_of, trace_of

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .scheduler import Scheduler

__all__ = ["InvalidBranch", "Sample", "Steering", "check", "ends_sequence", "mask_allows", "tokens_after", "FORK_WORK"]

# A fork costs its request this much work (engine/budget.py): it copies a controller's memory,
# and a controller that forks and stops in turns must not get unbounded forks for free.
FORK_WORK = 16


class InvalidBranch(ValueError):
    """A Branch the sequence cannot take (too long a backtrack, an empty fast-forward...)."""


class BranchLimit(InvalidBranch):
    """Branches that would take the request past a limit (max_forks): kind `limit`."""

    kind = "limit"


@dataclass
class Sample:
    """A row to sample this step: which sequence, which logits row, under which Branch (None:
    unconstrained). Forks of one sequence share a row."""

    seq: Sequence
    row: int
    branch: Branch | None


# -- the rules ---------------------------------------------------------------------------------


def check(branch: Branch, length: int) -> None:
    """Raise InvalidBranch unless a sequence of `length` tokens can take `branch`."""
    n = branch.backtrack
    if branch.mask is None and len(branch.ff) > 1:
        raise InvalidBranch("several fast-forward lists need a mask")
    if branch.mask is not None and any(not ff for ff in branch.ff):
        raise InvalidBranch("fast-forward lists under a mask must not be empty")
    appends = branch.appends
    if not 0 <= n <= length or (n == length and not appends):
        raise InvalidBranch(f"cannot backtrack {n} of {length} tokens and keep a non-empty sequence")
    if not branch.samples and not appends and n == 0:
        raise InvalidBranch("a branch must sample, fast-forward or backtrack")


def tokens_after(branch: Branch | None, token: int) -> list[int]:
    """What a sampled `token` appends: the first ff list of the Branch that starts with it, else
    the token alone."""
    if branch is not None:
        for ff in branch.ff:
            if ff[0] == token:
                return list(ff)
    return [token]


def ends_sequence(token: int, seq: Sequence, stop_ids: frozenset[int] | set[int]) -> bool:
    """Sampling a stop token ends the sequence (unless the request ignores EOS); it is not appended."""
    return token in stop_ids and not seq.params.ignore_eos


# -- applying them -----------------------------------------------------------------------------


class Steering:
    """Every change to a sequence, for one engine: its block manager (KV positions), scheduler
    (who runs) and limits. `on_finish(seq)` lets the engine release what it holds for a
    sequence (its controller, a speculative draft) when the sequence ends."""

    def __init__(self, block_manager: "BlockManager", scheduler: "Scheduler", stop_ids, max_position: int,
                 max_forks: int, on_finish: Callable[[Sequence], None]):
        self.bm = block_manager
        self.scheduler = scheduler
        self.stop_ids = frozenset(stop_ids)
        self.max_position = max_position
        self.max_forks = max_forks
        self.on_finish = on_finish

    # -- a controller's answer

    def apply_answer(self, seq: Sequence, row: int, answer, deltas: list[Delta], seconds: float = 0.0) -> list[Sample]:
        """Apply what `mid_process` returned (a Branch list, or the exception it raised) to a
        sequence whose logits are `row`; returns the rows that sample now. A controller's failure
        or an invalid Branch ends its own request, nothing else. `seconds`: what the call took
        (for a traced request)."""
        req = seq.request
        if isinstance(answer, BaseException):  # not raised here: its traceback would hold this frame
            self._fail_by(req, answer, deltas)
            return []
        try:
            if not answer:
                if req.trace is not None:
                    req.trace.append(stop_of(seq, seconds))
                deltas.append(self.finish(seq, "stop"))
                return []
            if req.live + len(answer) - 1 > self.max_forks:
                raise BranchLimit(f"{len(answer)} branches would exceed {self.max_forks} live sequences")
            forks = [seq] + [self.fork(seq, deltas) for _ in answer[1:]]
            samples = []
            for k, (s, branch) in enumerate(zip(forks, answer)):
                s.cursor.on_branch(k if len(answer) > 1 else 0)
                if req.trace is not None:
                    req.trace.append(trace_of(s, k, branch, seconds, seq.branch if k else None))
                if self.apply_branch(s, branch, deltas):
                    samples.append(Sample(s, row, branch))
            return samples
        except Exception as e:  # noqa: BLE001  (whatever the controller did, only its request fails)
            self._fail_by(req, e, deltas)
            return []

    def _fail_by(self, req: Request, e: BaseException, deltas: list[Delta]) -> None:
        kind = getattr(e, "kind", None) or ("invalid_branch" if isinstance(e, InvalidBranch) else "error")
        self.fail_request(req, f"controller {kind}: {e}", deltas)

    def apply_branch(self, seq: Sequence, branch: Branch, deltas: list[Delta]) -> bool:
        """Backtrack and fast-forward; True when the sequence samples from this step's logits."""
        check(branch, len(seq))
        n, appends = branch.backtrack, branch.appends
        if seq.heal:  # token healing: the first answer takes back the prompt tokens the host named
            if n != seq.heal:
                raise InvalidBranch(f"token healing: the first answer must take back the prompt's last {seq.heal} "
                                    f"tokens; it took back {n} (only the built-in constraint controllers and "
                                    "`heal` heal)")
            seq.heal = 0
        if n:
            deltas.append(self.backtrack(seq, n))
            if not appends:
                # Stale logits: drop one more position and re-feed it, then sample (docs/abi.md).
                # Before the prefill there are none: the prefill computes the logits.
                if seq.num_cached:
                    self.rewind(seq, 1)
                    seq.request.work += 1
                if branch.samples:
                    seq.cursor.defer(branch)
                return False
        if appends:
            deltas.append(self.append(seq, list(appends)))
            return False
        return True

    def fork(self, parent: Sequence, deltas: list[Delta]) -> Sequence:
        """A new sequence of the parent's request: its tokens, its KV blocks (shared,
        copy-on-write), a copy of its controller and of its text; it runs from the next step."""
        req = parent.request
        child = Sequence(parent.token_ids, parent.params, parent.rng.spawn(1)[0], req, branch=len(req.seqs))
        child.num_prompt, child.num_cached, child.steps = parent.num_prompt, parent.num_cached, parent.steps
        child.cursor = parent.cursor.fork()
        child.output = parent.output.fork(child.output_ids)
        req.usage.forks += 1
        req.work += FORK_WORK
        self.bm.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)
        self.scheduler.add_running(child)
        deltas.append(Delta(req.request_id, child.branch, "", []))  # announces the fork before any text
        return child

    # -- a sampled token

    def take_sample(self, seq: Sequence, branch: Branch | None, token: int, logprob: dict | None,
                    deltas: list[Delta]) -> None:
        """What a sampled token does: end the sequence (a stop token, or a mask that allowed
        nothing: token -1), or append it with the ff list it selects."""
        if seq.request.trace is not None:
            logprob = note_sample(seq, token, logprob)
        if token < 0:
            deltas.append(self.finish(seq, "error", "the sample mask allowed no token"))
            return
        if ends_sequence(token, seq, self.stop_ids):
            deltas.append(self.finish(seq, "stop"))
            return
        if logprob is not None:
            seq.logprobs.append(logprob)
        deltas.append(self.append(seq, tokens_after(branch, token), [logprob] if logprob else [], sampled=1))

    # -- the edits themselves

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None = None, sampled: int = 0) -> Delta:
        """Append tokens (`sampled` of them drawn by the sampler, the rest fast-forwarded), stream
        their text, check the stops (stop strings, max_tokens, the context)."""
        usage = seq.request.usage
        usage.sampled_tokens += sampled
        usage.ff_tokens += len(tokens) - sampled
        seq.request.work += len(tokens)
        params, output = seq.params, seq.output
        tokens = tokens[: max(params.max_tokens - seq.num_output, 0)]
        seq.token_ids.extend(tokens)
        if seq.cursor is not None:
            seq.cursor.on_append(tokens)
        text, hit_stop = output.add(tokens)
        delta = Delta(seq.request_id, seq.branch, text, tokens, logprobs=logprobs or [])
        reason = None
        if hit_stop:
            reason = "stop"
        elif seq.num_output >= params.max_tokens or len(seq) >= self.max_position:
            reason = "length"
        if reason:
            self._end(seq, reason)
            delta.text += output.finish() if not hit_stop else ""
            delta.finished, delta.finish_reason = True, reason
        return delta

    def backtrack(self, seq: Sequence, n: int) -> Delta:
        """Remove the last n tokens: from the sequence, its KV positions, its logprobs and its text
        (the delta counts the output tokens among them: a backtrack may reach into the prompt)."""
        shown = min(n, seq.num_output)
        del seq.token_ids[len(seq.token_ids) - n:]
        if seq.num_cached:  # (a sequence waiting for its prefill holds no KV positions yet)
            self.rewind(seq, n)
        seq.num_prompt = min(seq.num_prompt, len(seq.token_ids))
        if seq.cursor is not None:
            seq.cursor.on_backtrack(n)
        del seq.logprobs[max(0, len(seq.logprobs) - n):]
        chars = seq.output.pop(n)
        return Delta(seq.request_id, seq.branch, "", [], backtrack_chars=chars, backtrack_tokens=shown)

    def rewind(self, seq: Sequence, n: int) -> None:
        """Drop the KV positions of the last n fed tokens: taken back, or to be fed again."""
        if n:
            self.bm.pop(seq.seq_id, n)
            seq.num_cached -= n

    # -- a speculative draft (engine/speculative.py decides what stays; these apply it)

    def attach_draft(self, seq: Sequence, draft) -> None:
        """The draft's tokens become pending tokens: the step feeds them with the sampled one, and
        `settle_draft` decides what stays. The controller has been told them (`tell_ahead`)."""
        seq.draft = draft
        seq.token_ids.extend(draft.tokens)

    def tell_ahead(self, seq: Sequence, tokens: list[int]) -> None:
        """The controller is told `tokens` while drafting, before the sequence holds them."""
        if seq.cursor is not None:
            seq.cursor.on_draft(tokens)

    def settle_draft(self, seq: Sequence, accepted: list[tuple[list[int], int]], fed: bool,
                     deltas: list[Delta]) -> None:
        """End the sequence's draft: its tokens come off, the `accepted` ones - (tokens, how many
        of them sampled) each - are appended again (counted, streamed, stops checked), and when
        the step `fed` the draft, the KV positions of the rest are rewound. The controller, told
        every draft token, takes the rest back at its next call (as a backtrack)."""
        draft, seq.draft = seq.draft, None
        del seq.token_ids[draft.base:]
        if fed:
            self.rewind(seq, len(draft.tokens) - sum(len(tokens) for tokens, _ in accepted))
        for tokens, sampled in accepted:
            deltas.append(self.append(seq, list(tokens), sampled=sampled))
            if seq.finished:
                return
        if seq.cursor is not None:
            seq.cursor.settle_draft()

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> Delta:
        self._end(seq, reason, error)
        return Delta(seq.request_id, seq.branch, seq.output.finish(), [], True, reason, error=error)

    def fail_request(self, req: Request, message: str, deltas: list[Delta]) -> None:
        req.error = message
        for s in req.seqs:
            if not s.finished:
                deltas.append(self.finish(s, "error", message))

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.scheduler.remove(seq)
        self.on_finish(seq)


def mask_allows(mask: np.ndarray | None, token: int) -> bool:
    """Whether a mask (uint32 words; None = everything) allows `token`."""
    return mask is None or bool((int(mask[token >> 5]) >> (token & 31)) & 1)
