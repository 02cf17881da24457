"""Paged KV bookkeeping: random fork/pop/append/free sequences never leak or corrupt blocks."""

import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rudder.engine.block_manager import BlockManager, KVCacheFull

NUM_BLOCKS, BLOCK_SIZE = 24, 4


class KVMachine(RuleBasedStateMachine):
    """Drives a BlockManager and a fake KV store the way the engine does (copies before writes),
    and checks every sequence still reads back exactly the values it wrote."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.store = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)
        self.expected: dict[int, list[int]] = {}
        self.ids = itertools.count()
        self.values = itertools.count()

    def _write(self, seq, n):
        try:
            slots = self.bm.append(seq, n)
        except KVCacheFull:
            return
        for src, dst in self.bm.take_copies():  # what ModelRunner.copy_blocks does
            self.store[dst * BLOCK_SIZE:(dst + 1) * BLOCK_SIZE] = self.store[src * BLOCK_SIZE:(src + 1) * BLOCK_SIZE]
        for slot in slots:
            v = next(self.values)
            self.store[slot] = v
            self.expected[seq].append(v)

    @rule(n=st.integers(0, 9))
    def new_sequence(self, n):
        seq = next(self.ids)
        self.bm.add(seq)
        self.expected[seq] = []
        self._write(seq, n)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self._write(seq, n)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.expected)))
        child = next(self.ids)
        self.bm.fork(parent, child)
        self.expected[child] = list(self.expected[parent])

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def pop(self, data):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        n = data.draw(st.integers(0, len(self.expected[seq])))
        self.bm.pop(seq, n)
        del self.expected[seq][len(self.expected[seq]) - n:]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.expected)))
        self.bm.free(seq)
        del self.expected[seq]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for seq, values in self.expected.items():
            assert self.bm.length(seq) == len(values)
            read = [self.store[self.bm.slot(seq, p)] for p in range(len(values))]
            assert read == values, f"sequence {seq} reads {read}, wrote {values}"

    def teardown(self):
        for seq in list(self.expected):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free == NUM_BLOCKS, "blocks leaked"


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_fork_shares_blocks_and_copies_only_the_partial_last_one():
    bm = BlockManager(8, 4)
    bm.add("a")
    bm.append("a", 6)  # blocks: one full, one half full
    free_before = bm.num_free
    bm.fork("a", "b")
    assert bm.num_free == free_before, "fork must not allocate"
    assert bm.tables["a"] == bm.tables["b"]
    bm.append("b", 1)
    assert bm.tables["b"][0] == bm.tables["a"][0], "full blocks stay shared"
    assert bm.tables["b"][1] != bm.tables["a"][1], "the partial block is copied on write"
    assert bm.take_copies() == [(bm.tables["a"][1], bm.tables["b"][1])]


def test_pop_releases_crossed_blocks():
    bm = BlockManager(8, 4)
    bm.add("a")
    bm.append("a", 10)  # 3 blocks
    assert bm.num_free == 5
    bm.pop("a", 7)  # 3 positions left: 1 block
    assert bm.num_free == 7 and len(bm.tables["a"]) == 1
    with pytest.raises(ValueError):
        bm.pop("a", 4)


def test_out_of_blocks_is_a_clear_error_that_changes_nothing():
    bm = BlockManager(2, 4)
    bm.add("a")
    bm.append("a", 8)
    with pytest.raises(KVCacheFull, match="need 1 KV blocks, 0 free"):
        bm.append("a", 1)
    assert bm.length("a") == 8
    bm.check_invariants()
