"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts.

The KV tensors themselves live in `ModelRunner.kv_cache`; this module only decides which block
holds which position. Every operation costs O(blocks), never O(tokens x hidden):

- `fork` shares every block of the parent (reference counts go up, nothing is copied);
- the first write into a *shared, partially filled* last block copies that one block
  (copy-on-write); the copy is queued in `pending_copies` and done by the model runner before the
  next forward pass writes anything;
- `pop` rewinds a sequence by n positions and releases the blocks it no longer reaches;
- `free` releases everything a sequence holds.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks; the scheduler preempts or fails the request."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies to do before the next forward

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def length(self, seq: Hashable) -> int:
        return self.lengths[seq]

    def blocks_needed(self, seq: Hashable | None, n: int) -> int:
        """Free blocks that appending n positions to `seq` (None = a new sequence) would take."""
        if seq is None:
            return -(-n // self.block_size)
        length, table = self.lengths[seq], self.tables[seq]
        needed = -(-(length + n) // self.block_size) - len(table)
        if n > 0 and length % self.block_size and self.ref_counts[table[-1]] > 1:
            needed += 1  # copy-on-write of the shared partial last block
        return needed

    def slot(self, seq: Hashable, position: int) -> int:
        return self.tables[seq][position // self.block_size] * self.block_size + position % self.block_size

    # -- mutations -----------------------------------------------------------------------------

    def add(self, seq: Hashable) -> None:
        if seq in self.tables:
            raise KeyError(f"sequence {seq!r} already has a block table")
        self.tables[seq] = []
        self.lengths[seq] = 0

    def append(self, seq: Hashable, n: int) -> list[int]:
        """Make room for n more positions at the end of `seq`; returns their flat KV slots.

        Raises KVCacheFull (changing nothing) when the free blocks do not suffice."""
        if n < 0:
            raise ValueError("cannot append a negative number of positions")
        needed = self.blocks_needed(seq, n)
        if needed > len(self.free_blocks):
            raise KVCacheFull(f"need {needed} KV blocks, {len(self.free_blocks)} free")
        table, length, bs = self.tables[seq], self.lengths[seq], self.block_size
        if n and length % bs and self.ref_counts[table[-1]] > 1:
            shared = table[-1]
            table[-1] = self._take()
            self.ref_counts[shared] -= 1
            self.pending_copies.append((shared, table[-1]))
        while len(table) * bs < length + n:
            table.append(self._take())
        self.lengths[seq] = length + n
        return [table[p // bs] * bs + p % bs for p in range(length, length + n)]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """`child` starts as a copy of `parent`, sharing all its blocks."""
        self.add(child)
        table = self.tables[parent]
        for block in table:
            self.ref_counts[block] += 1
        self.tables[child] = list(table)
        self.lengths[child] = self.lengths[parent]

    def pop(self, seq: Hashable, n: int) -> None:
        """Drop the last n positions of `seq`, releasing blocks that no longer hold any."""
        length = self.lengths[seq]
        if not 0 <= n <= length:
            raise ValueError(f"cannot pop {n} of {length} positions")
        self.lengths[seq] = length - n
        table = self.tables[seq]
        keep = -(-(length - n) // self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq: Hashable) -> None:
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- internals -----------------------------------------------------------------------------

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if reference counts, tables and the free list disagree."""
        counts = [0] * self.num_blocks
        for seq, table in self.tables.items():
            assert len(table) == -(-self.lengths[seq] // self.block_size), f"{seq!r}: table/length mismatch"
            assert len(set(table)) == len(table), f"{seq!r}: block listed twice"
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "reference counts drifted"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is free twice"
        assert free == {b for b in range(self.num_blocks) if counts[b] == 0}, "leaked or double-used block"
