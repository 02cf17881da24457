"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts,
and the prefix cache.

The KV tensors themselves live in `ModelRunner.kv_cache`; this module only decides which block
holds which position. Every operation costs O(blocks), never O(tokens x hidden):

- `fork` shares every block of the parent (reference counts go up, nothing is copied);
- the first write into a *shared, partially filled* last block copies that one block
  (copy-on-write); the copy is queued in `pending_copies` and done by the model runner before the
  next forward pass writes anything;
- `pop` rewinds a sequence by n positions and releases the blocks it no longer reaches;
- `free` releases everything a sequence holds.

Prefix caching (`prefix_caching=True`): a full block whose keys and values have been computed
is registered (`commit`) under a digest of its tokens and of every token before it (the digest
of the previous block chains in), so the same digest means the same KV data. A new sequence
starts from the blocks of its longest registered prefix (`cached_prefix`, then `add`). A
registered block that no sequence holds stays cached, *evictable*: it counts as free, and is
reused - least recently released first, a chain's tail before its head - only once no
never-registered block is left. A registered block is never written: a write into a shared
partial last block copies it first (as for any shared block), and a write into one held by a
single sequence (popped into by a backtrack or a rewind) takes it out of the cache first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Hashable, Sequence


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks; the scheduler preempts or fails the request."""


def block_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its tokens and (through `previous`, the digest of the block
    before it, b"" for the first) every token before them. 128 bits: equal digests are equal
    prefixes."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        # Never-registered free blocks, the most recently released first (its memory is warm).
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies to do before the next forward
        # The prefix cache: digest -> registered block and back; registered blocks no sequence
        # holds, least recently released first; each sequence's digests of its leading full
        # blocks committed so far.
        self.cached: dict[bytes, int] = {}
        self.digest_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.chains: dict[Hashable, list[bytes]] = {}

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones, and cached ones no sequence holds."""
        return len(self.free_blocks) + len(self.evictable)

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

    def cached_prefix(self, token_ids: Sequence[int]) -> list[tuple[int, bytes]]:
        """(block, digest) of each block of the longest registered prefix of `token_ids`, leaving
        at least one token out (its logits must be computed)."""
        if not self.prefix_caching:
            return []
        bs, found, digest = self.block_size, [], b""
        for i in range((len(token_ids) - 1) // bs):
            digest = block_digest(digest, token_ids[i * bs:(i + 1) * bs])
            block = self.cached.get(digest)
            if block is None:
                break
            found.append((block, digest))
        return found

    def blocks_to_admit(self, prefix: list[tuple[int, bytes]], n: int) -> int:
        """Free blocks a new sequence starting from `prefix` (cached_prefix's) and n positions in
        all would take: the evictable blocks of the prefix it revives, and the rest's."""
        revived = sum(1 for block, _ in prefix if self.ref_counts[block] == 0)
        return revived + self.blocks_needed(None, n - len(prefix) * self.block_size)

    # -- mutations -----------------------------------------------------------------------------

    def add(self, seq: Hashable, prefix: list[tuple[int, bytes]] = ()) -> int:
        """A new sequence, holding the blocks of `prefix` (cached_prefix's); returns the positions
        it starts with (the prefix's)."""
        if seq in self.tables:
            raise KeyError(f"sequence {seq!r} already has a block table")
        for block, _ in prefix:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        self.tables[seq] = [block for block, _ in prefix]
        self.chains[seq] = [digest for _, digest in prefix]
        self.lengths[seq] = len(prefix) * self.block_size
        return self.lengths[seq]

    def append(self, seq: Hashable, n: int) -> list[int]:
        """Make room for n more positions at the end of `seq`; returns their flat KV slots.

        Raises KVCacheFull (changing nothing) when the free blocks do not suffice."""
        if n < 0:
            raise ValueError("cannot append a negative number of positions")
        needed = self.blocks_needed(seq, n)
        if needed > self.num_free:
            raise KVCacheFull(f"need {needed} KV blocks, {self.num_free} free")
        table, length, bs = self.tables[seq], self.lengths[seq], self.block_size
        if n and length % bs:
            last = table[-1]
            if self.ref_counts[last] > 1:
                table[-1] = self._take()
                self.ref_counts[last] -= 1
                self.pending_copies.append((last, table[-1]))
            elif last in self.digest_of:  # its own, popped into: the cached data is about to change
                del self.cached[self.digest_of.pop(last)]
        while len(table) * bs < length + n:
            table.append(self._take())
        self.lengths[seq] = length + n
        return [table[p // bs] * bs + p % bs for p in range(length, length + n)]

    def commit(self, seq: Hashable, token_ids: Sequence[int], computed: int) -> None:
        """The keys and values of `token_ids[:computed]` are in `seq`'s blocks (a forward pass
        wrote them): register its full blocks among them. A block whose digest is already
        registered (the same prefix computed twice at once) stays the sequence's own."""
        if not self.prefix_caching or seq not in self.tables:
            return
        chain, table, bs = self.chains[seq], self.tables[seq], self.block_size
        for i in range(len(chain), min(computed, self.lengths[seq]) // bs):
            digest = block_digest(chain[-1] if chain else b"", token_ids[i * bs:(i + 1) * bs])
            chain.append(digest)
            block = table[i]
            if digest not in self.cached and block not in self.digest_of:
                self.cached[digest] = block
                self.digest_of[block] = digest

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """`child` starts as a copy of `parent`, sharing all its blocks."""
        self.add(child)
        table = self.tables[parent]
        for block in table:
            self.ref_counts[block] += 1
        self.tables[child] = list(table)
        self.chains[child] = list(self.chains[parent])
        self.lengths[child] = self.lengths[parent]

    def pop(self, seq: Hashable, n: int) -> None:
        """Drop the last n positions of `seq`, releasing blocks that no longer hold any."""
        length = self.lengths[seq]
        if not 0 <= n <= length:
            raise ValueError(f"cannot pop {n} of {length} positions")
        self.lengths[seq] = length - n
        del self.chains[seq][(length - n) // self.block_size:]
        table = self.tables[seq]
        keep = -(-(length - n) // self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq: Hashable) -> None:
        # the tail first: a released chain is evicted from its end, its head (shared by more
        # prompts) last
        for block in reversed(self.tables.pop(seq)):
            self._release(block)
        del self.lengths[seq]
        del self.chains[seq]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- internals -----------------------------------------------------------------------------

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # the least recently released cached block leaves the cache
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.digest_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.digest_of:
                self.evictable[block] = None
            else:
                self.free_blocks.appendleft(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if reference counts, tables, the free list and the prefix cache
        disagree."""
        counts = [0] * self.num_blocks
        for seq, table in self.tables.items():
            assert len(table) == -(-self.lengths[seq] // self.block_size), f"{seq!r}: table/length mismatch"
            assert len(set(table)) == len(table), f"{seq!r}: block listed twice"
            assert len(self.chains[seq]) <= self.lengths[seq] // self.block_size, f"{seq!r}: digest of a partial block"
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "reference counts drifted"
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is free twice"
        assert not free & set(self.digest_of), "a free block is registered"
        assert free | set(self.evictable) == {b for b in range(self.num_blocks) if counts[b] == 0}, \
            "leaked or double-used block"
        assert all(b in self.digest_of for b in self.evictable), "an evictable block is not registered"
        assert {self.cached[d]: d for d in self.cached} == self.digest_of, "digest maps disagree"
        if not self.prefix_caching:
            assert not self.cached and not any(self.chains.values()), "prefix cache used while off"
