"""Continuous batching: which sequences run this step, and how many of their tokens.

Decodes never wait behind prefills (stall-free batching, as in Sarathi-Serve). Each step first
gives every decoding sequence its pending tokens (one sampled token, several fast-forwarded
ones, a speculative draft); the rest of the step's token budget goes to prompts, oldest first:
running sequences still prefilling, then waiting sequences admitted while the budget and the
free KV blocks allow. While anything decodes, the prompts' share is sized by `StepBudget` so
the step stays near a target time, from this host's measured cost per token: a long prompt
arriving slows the running streams by a bounded factor, never by its whole prefill.

A waiting sequence starts from the KV blocks of its longest cached prefix (the block manager's
prefix cache) and prefills only the rest. When the KV cache runs out, the most recently admitted
sequence is preempted (its blocks freed, recomputed later, largely from the prefix cache); a
sequence that cannot fit even alone fails with a clear reason instead of stalling the engine.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager, KVCacheFull
from .step import ScheduledSeq
from .sequence import Sequence, SeqStatus

__all__ = ["Headroom", "Scheduler", "StepBudget"]

# Without a target time, a step with decodes in it takes at most this many times what a step
# decoding every sequence there is (running and waiting) would: the streams' inter-token latency
# while prompts are prefilled stays within that factor of what it is once they all decode.
STALL_FACTOR = 1.75
# The fewest prompt tokens a step with decodes still takes, so that a prompt always moves on
# (with many decodes, or a target shorter than the decodes themselves).
MIN_PREFILL_TOKENS = 16
# Steps the cost fit mostly remembers (each older step weighs this much less than the next).
_DECAY = 0.97
# How much the steps' token counts must vary (standard deviation) before their slope is trusted.
_MIN_SPREAD = 8.0


class StepBudget:
    """How many prompt tokens a step with decodes can take, from what steps cost on this host.

    The engine reports every step's tokens and forward time (`observe`); a least-squares line
    `seconds = fixed + per_token * tokens`, older steps forgotten geometrically, models the host.
    `target_s` is the step time to stay near; None: STALL_FACTOR times a step that decodes every
    sequence there is (a burst of arrivals then gets in within a few steps: the streams' steps
    grow as they will once all decode, not by the whole burst's prefill). Until the host has been
    measured, prompts take the whole budget."""

    def __init__(self, target_s: float | None = None, fixed_s: float | None = None,
                 per_token_s: float | None = None):
        if target_s is not None and target_s <= 0:
            raise ValueError("the step target time must be positive")
        self.target_s = target_s
        self.fixed_s, self.per_token_s = fixed_s, per_token_s  # given: a fixed model (tests), never refitted
        self._fitted = fixed_s is None or per_token_s is None
        self._sums = [0.0] * 5  # decayed n, sum t, sum t^2, sum y, sum t*y

    def observe(self, tokens: int, seconds: float) -> None:
        if not self._fitted or tokens <= 0:
            return
        n, t, tt, y, ty = (_DECAY * s for s in self._sums)
        n, t, tt, y, ty = n + 1, t + tokens, tt + tokens * tokens, y + seconds, ty + tokens * seconds
        self._sums = [n, t, tt, y, ty]
        spread = n * tt - t * t  # n^2 times the tokens' variance
        if spread > (_MIN_SPREAD * n) ** 2:
            slope = (n * ty - t * y) / spread
            if slope > 0:
                self.per_token_s = slope
        if self.per_token_s is not None:
            self.fixed_s = max(0.0, (y - self.per_token_s * t) / n)

    def prompt_tokens(self, decode_tokens: int, sequences: int, most: int) -> int:
        """Prompt tokens, at most `most`, for a step that feeds `decode_tokens` for decodes, with
        `sequences` running and waiting (the batch they will decode in)."""
        if decode_tokens == 0 or self.per_token_s is None or self.fixed_s is None:
            return most
        decodes_s = self.fixed_s + self.per_token_s * decode_tokens
        if self.target_s is not None:
            target = self.target_s
        else:
            target = STALL_FACTOR * (self.fixed_s + self.per_token_s * max(decode_tokens, sequences))
        return min(most, max(MIN_PREFILL_TOKENS, int((target - decodes_s) / self.per_token_s + 1e-6)))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int = 512, max_seqs: int = 64,
                 budget: StepBudget | None = None):
        """`budget`: sizes the prompts' share of a step with decodes (None: prompts take whatever
        the decodes leave of max_batch_tokens)."""
        self.bm = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.budget = budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefill_end: dict[int, int] = {}  # seq_id -> length at admission: prefilling until it is cached

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork: it already holds (shared) KV blocks."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and release its KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._prefill_end.pop(seq.seq_id, None)
        if seq.seq_id in self.bm.tables:
            self.bm.free(seq.seq_id)

    def prefilling(self, seq: Sequence) -> bool:
        """Whether a running sequence is still feeding what it was admitted with (its prompt, or
        all it held when it was preempted): it takes a share of the prompts' budget."""
        end = self._prefill_end.get(seq.seq_id)
        if end is None:
            return False
        if seq.num_cached >= min(end, len(seq)):
            del self._prefill_end[seq.seq_id]
            return False
        return True

    def runnable(self, busy=frozenset(), limit: int | None = None) -> list[Sequence]:
        """The running sequences the next step takes first, in its order: decodes, then prompts
        (`busy`: in a step in flight, left out; `limit`: the most it takes)."""
        free = [s for s in self.running if s.seq_id not in busy]
        return ([s for s in free if not self.prefilling(s)] + [s for s in free if self.prefilling(s)])[:limit]

    def schedule(self, busy: frozenset | set = frozenset(), limit: int | None = None
                 ) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """Plan one step. Returns the batch and the sequences that cannot ever fit (to fail).

        `busy`: ids of sequences already in a step in flight (pipeline micro-batches): they are
        neither scheduled nor preempted. `limit`: the most sequences in the batch."""
        limit = len(self.running) + len(self.waiting) if limit is None else limit
        self._batch: list[ScheduledSeq] = []
        self._room = self._prompt_room = self.max_batch_tokens  # tokens left in the step; of them, for prompts
        unfit: list[Sequence] = []
        capacity = self.bm.num_blocks * self.bm.block_size
        free = [s for s in self.running if s.seq_id not in busy]
        decodes = [s for s in free if not self.prefilling(s)]
        prompts = [s for s in free if self.prefilling(s)]

        for seq in decodes:
            if len(self._batch) >= limit:
                break
            self._feed(seq, self._room, busy, capacity, unfit)
        decode_tokens = self.max_batch_tokens - self._room
        if self.budget is not None:
            sequences = min(limit, self.max_seqs, len(self.running) + len(self.waiting))
            self._prompt_room = self.budget.prompt_tokens(decode_tokens, sequences, self._room)

        for seq in prompts:
            if len(self._batch) >= limit or self._prompt_room <= 0:
                break
            self._feed(seq, self._prompt_room, busy, capacity, unfit)

        while (self.waiting and self._prompt_room > 0 and len(self.running) < self.max_seqs
               and len(self._batch) < limit):
            seq = self.waiting[0]
            if len(seq) > capacity:
                self.waiting.popleft()
                unfit.append(seq)
                continue
            # Admit only when the whole pending part fits now, so admission does not thrash.
            prefix = self.bm.cached_prefix(seq.token_ids)
            if self.bm.blocks_to_admit(prefix, len(seq)) > self.bm.num_free:
                if not self.running:  # the cache is empty and it still does not fit
                    unfit.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            seq.num_cached = self.bm.add(seq.seq_id, prefix)
            usage = seq.request.usage
            if usage.admissions == 0:  # its prompt's hit (a readmission finds its own blocks)
                usage.cached_tokens = min(seq.num_cached, seq.num_prompt)
            usage.admissions += 1
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._prefill_end[seq.seq_id] = len(seq)
            n = min(seq.num_pending, self._prompt_room)
            self._put(seq, n, self.bm.append(seq.seq_id, n))
        batch, self._batch = self._batch, []
        return batch, unfit

    def _feed(self, seq: Sequence, most: int, busy, capacity: int, unfit: list[Sequence]) -> None:
        """Schedule up to `most` of a running sequence's pending tokens, preempting the latest
        admitted sequences while the KV blocks do not suffice."""
        n = min(seq.num_pending, most)
        if n <= 0 or seq.status is not SeqStatus.RUNNING:  # (preempted earlier in this step)
            return
        if len(seq) > capacity:
            unfit.append(seq)
            return
        while True:
            try:
                slots = self.bm.append(seq.seq_id, n)
                break
            except KVCacheFull:
                victim = [s for s in self.running if s.seq_id not in busy][-1]  # never empty: seq is one
                self._preempt(victim)
                if victim is seq:
                    return
        self._put(seq, n, slots)

    def _put(self, seq: Sequence, n: int, slots: list[int]) -> None:
        self._batch.append(ScheduledSeq(seq, n, slots, self.bm.tables[seq.seq_id], n == seq.num_pending))
        self._room -= n
        if seq.seq_id in self._prefill_end:
            self._prompt_room -= n
        else:
            self._prompt_room = min(self._prompt_room, self._room)

    def headroom(self, running: list[Sequence]) -> "Headroom":
        """What the next step can take beyond the pending tokens of `running` (the sequences it
        takes first)."""
        return Headroom(self, running)

    def _preempt(self, victim: Sequence) -> None:
        """Free the victim's blocks (it is recomputed when readmitted, from the prefix cache as
        far as it goes) and give back the step tokens it had."""
        for i, entry in enumerate(self._batch):
            if entry.seq is victim:
                del self._batch[i]
                self._room += entry.num_tokens
                if victim.seq_id in self._prefill_end:
                    self._prompt_room += entry.num_tokens
                break
        self.running.remove(victim)
        self._prefill_end.pop(victim.seq_id, None)
        self.bm.free(victim.seq_id)
        victim.num_cached = 0
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)


class Headroom:
    """Step tokens and free KV blocks left over by the decoding sequences a step takes first,
    handed out to sequences that feed extra positions after their pending token (speculative
    drafts): the step then takes each of them whole, with no preemption and no partial feed.
    Prompts being prefilled take what is left after that."""

    def __init__(self, scheduler: Scheduler, running: list[Sequence]):
        bm = self.bm = scheduler.bm
        decodes = [s for s in running if not scheduler.prefilling(s)]
        self.tokens = scheduler.max_batch_tokens - sum(s.num_pending for s in decodes)
        self.blocks = bm.num_free - sum(bm.blocks_needed(s.seq_id, s.num_pending) for s in decodes
                                        if s.seq_id in bm.tables)

    def room(self, seq: Sequence, most: int) -> int:
        """The most extra positions, up to `most`, that `seq` (one token pending) can feed."""
        room = min(most, self.tokens, self.bm.num_blocks * self.bm.block_size - len(seq))
        while room > 0 and self._blocks(seq, room) > self.blocks:
            room -= 1
        return max(room, 0)

    def take(self, seq: Sequence, extra: int) -> None:
        """`seq` feeds `extra` positions more this step."""
        self.tokens -= extra
        self.blocks -= self._blocks(seq, extra)

    def _blocks(self, seq: Sequence, extra: int) -> int:
        return self.bm.blocks_needed(seq.seq_id, 1 + extra) - self.bm.blocks_needed(seq.seq_id, 1)
