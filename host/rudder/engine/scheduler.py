"""Continuous batching: which sequences run this step, and how many of their tokens.

Running sequences go first (their pending tokens: one sampled token, or several fast-forwarded
ones); waiting sequences are admitted while the step's token budget and the free KV blocks
allow, with long prompts fed in chunks. When the KV cache runs out, the most recently admitted
sequence is preempted (its blocks freed, recomputed later); a sequence that cannot fit even
alone fails with a clear reason instead of stalling the engine.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager, KVCacheFull
from .step import ScheduledSeq
from .sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int = 512, max_seqs: int = 64):
        self.bm = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        if seq.seq_id in self.bm.tables:
            self.bm.free(seq.seq_id)

    def schedule(self, busy: frozenset | set = frozenset(), limit: int | None = None
                 ) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """Plan one step. Returns the batch and the sequences that cannot ever fit (to fail).

        `busy`: ids of sequences already in a step in flight (pipeline micro-batches): they are
        neither scheduled nor preempted. `limit`: the most sequences in the batch."""
        limit = len(self.running) + len(self.waiting) if limit is None else limit
        batch: list[ScheduledSeq] = []
        unfit: list[Sequence] = []
        budget = self.max_batch_tokens
        capacity = self.bm.num_blocks * self.bm.block_size

        for seq in list(self.running):
            if seq not in self.running or seq.seq_id in busy:  # preempted below, or in flight
                continue
            if len(batch) >= limit:
                break
            n = min(seq.num_pending, budget)
            if n <= 0:
                continue
            if len(seq) > capacity:
                unfit.append(seq)
                continue
            while True:
                try:
                    slots = self.bm.append(seq.seq_id, n)
                    break
                except KVCacheFull:
                    victims = [s for s in self.running if s.seq_id not in busy]
                    victim = victims[-1]  # never empty: seq itself is a candidate
                    budget += self._preempt(victim, batch)
                    if victim is seq:
                        slots = None
                        break
            if slots is None:
                continue
            batch.append(ScheduledSeq(seq, n, slots, self.bm.tables[seq.seq_id], n == seq.num_pending))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and len(batch) < limit:
            seq = self.waiting[0]
            if len(seq) > capacity:
                self.waiting.popleft()
                unfit.append(seq)
                continue
            # Admit only when the whole pending part fits now, so admission does not thrash.
            if self.bm.blocks_needed(None, seq.num_pending) > self.bm.num_free:
                if not self.running:  # the cache is empty and it still does not fit
                    unfit.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            n = min(seq.num_pending, budget)
            self.bm.add(seq.seq_id)
            slots = self.bm.append(seq.seq_id, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n, slots, self.bm.tables[seq.seq_id], n == seq.num_pending))
            budget -= n
        return batch, unfit

    def headroom(self, running: list[Sequence]) -> "Headroom":
        """What the next step can take beyond the pending tokens of `running` (the sequences it
        takes first)."""
        return Headroom(self, running)

    def _preempt(self, victim: Sequence, batch: list[ScheduledSeq]) -> int:
        """Free the victim's blocks (it is recomputed from scratch when readmitted).
        Returns the step tokens this gives back."""
        given_back = 0
        for i, entry in enumerate(batch):
            if entry.seq is victim:
                given_back = entry.num_tokens
                del batch[i]
                break
        self.running.remove(victim)
        self.bm.free(victim.seq_id)
        victim.num_cached = 0
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        return given_back


class Headroom:
    """Step tokens and free KV blocks left over by the sequences a step takes first, handed out
    to sequences that feed extra positions after their pending token (speculative drafts): the
    step then takes each of them whole, with no preemption and no partial feed."""

    def __init__(self, scheduler: Scheduler, running: list[Sequence]):
        bm = self.bm = scheduler.bm
        self.tokens = scheduler.max_batch_tokens - sum(s.num_pending for s in running)
        self.blocks = bm.num_free - sum(bm.blocks_needed(s.seq_id, s.num_pending) for s in running
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
