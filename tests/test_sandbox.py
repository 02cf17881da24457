"""The controller sandbox with well-behaved controllers: decoding, state, forks, shared
request state, the token table, the module cache, parallelism. Each case runs for both
controller shapes (tests/shapes.py) unless it is about one shape's own calling convention."""

from __future__ import annotations

import itertools
import struct
import threading
import time

import numpy as np
import pytest

from controller_wat import (GOOD_WAT, INIT_MARK, INPUT_CALLS, LAST_BACKTRACK, LAST_BRANCH, STEPS,
                            TOKEN_SUM, TOKENS_SEEN, VAR_GET_RESULT, VAR_SET_RESULT, VAR_VALUE,
                            busy_wat, controller_wat, peek, wasm_of)
from rudder.branch import Branch
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.controller.token_table import MAGIC, build_token_table, parse_header, token_table_for
from rudder.tokenizer import Tokenizer
from shapes import SHAPES

both = pytest.mark.parametrize("shape", SHAPES, ids=str)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.byte_level(512)


@pytest.fixture(scope="module")
def rt(tok, tmp_path_factory):
    runtime = ControllerRuntime(tok, cache_dir=tmp_path_factory.mktemp("wasm-cache"))
    yield runtime
    runtime.close()


@pytest.fixture(params=SHAPES, ids=str)
def good(rt, request):
    """GOOD_WAT loaded in each shape (loads after the first are memory hits)."""
    return rt.load(request.param.wasm(GOOD_WAT))


def _mask_tokens(mask: np.ndarray) -> list[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


# ----------------------------------------------------------------------------- limits


def test_limits_capped_only_lowers():
    base = Limits()
    assert base.capped(None) is base
    lowered = base.capped({"mid_process_ms": 5, "max_forks": 100, "memory_bytes": 1 << 20})
    assert lowered.mid_process_ms == 5 and lowered.max_forks == 16 and lowered.memory_bytes == 1 << 20
    assert base.capped(Limits(init_ms=5000)).init_ms == 1000
    with pytest.raises(ValueError, match="unknown controller limit"):
        base.capped({"mid_process_msec": 1})
    with pytest.raises(ValueError):
        base.capped({"max_forks": -1})


# ----------------------------------------------------------------------------- decoding


def test_good_controller_mask_and_ff(rt, good):
    ctl = rt.start(good, "m")
    [b] = ctl.mid_process(0, 0, [1, 2, 3])
    assert isinstance(b, Branch)
    assert b.backtrack == 0
    assert b.mask.dtype == np.uint32 and b.mask.shape == (16,)
    assert _mask_tokens(b.mask) == [5, 7]
    assert b.ff == [[7, 8, 9]]
    assert peek(ctl, TOKEN_SUM) == 6 and peek(ctl, TOKENS_SEEN) == 3
    ctl.close()


def test_several_branches(rt, good):
    ctl = rt.start(good, "f")
    b0, b1, b2 = ctl.mid_process(0, 0, [4])
    assert _mask_tokens(b0.mask) == [5, 7] and b0.ff == [[7, 8, 9]]
    assert b1.mask is None and b1.ff == [[10, 11]] and b1.backtrack == 0 and not b1.samples
    assert b2.mask is None and b2.ff == [[]] and b2.backtrack == 1
    ctl.close()


def test_stop_and_arguments(rt, good):
    ctl = rt.start(good, b"s")
    assert ctl.mid_process(0, 0, [1]) == []
    ctl.close()
    with pytest.raises(ControllerError) as e:
        rt.start(good, "!reject")
    assert e.value.kind == "start" and "rudder_start returned 3" in str(e.value)


def test_step_arguments_reach_the_guest(rt, good):
    ctl = rt.start(good, "m")
    ctl.mid_process(0, 0, [10, 20, 30, 40, 50, 60])
    ctl.mid_process(2, 5, np.array([7], dtype=np.int64))
    assert peek(ctl, LAST_BRANCH) == 2 and peek(ctl, LAST_BACKTRACK) == 5
    assert peek(ctl, TOKEN_SUM) == 217 and peek(ctl, STEPS) == 2
    ctl.mid_process(0, 0, [])
    assert peek(ctl, TOKENS_SEEN) == 7 and peek(ctl, STEPS) == 3
    ctl.close()


# ----------------------------------------------------------------------------- a core module's own


def test_input_buffer_reused(rt):
    """rudder_input is asked for room once, then again only when a step brings more tokens."""
    ctl = rt.start(rt.load(wasm_of(GOOD_WAT)), "m")
    ctl.mid_process(0, 0, list(range(10)))
    assert peek(ctl, INPUT_CALLS) == 1
    for t in range(50):
        ctl.mid_process(0, 0, [t])
    assert peek(ctl, INPUT_CALLS) == 1  # one call into the guest per step
    ctl.mid_process(0, 0, list(range(300)))  # more than fits: rudder_input again
    assert peek(ctl, INPUT_CALLS) == 2
    assert peek(ctl, TOKENS_SEEN) == 360
    ctl.close()


# ----------------------------------------------------------------------------- state


def test_snapshot_after_init_and_request_isolation(rt, good):
    a = rt.start(good, "c")
    b = rt.start(good, "c")
    assert peek(a, INIT_MARK) == 0xABCD  # written by rudder_init, restored from the snapshot
    assert a.mid_process(0, 0, [1])[0].ff == [[1, 201]]  # memory counter, global counter
    assert a.mid_process(0, 0, [1])[0].ff == [[2, 202]]
    assert b.mid_process(0, 0, [1])[0].ff == [[1, 201]]  # another request: its own state
    a.close()
    b.close()
    assert "init" not in a.log_text()  # rudder_init's log is not a request's


def test_fork_copies_state_then_diverges(rt, good):
    parent = rt.start(good, "c")
    for _ in range(3):
        parent.mid_process(0, 0, [1])
    child = parent.fork()
    assert child.request is parent.request and parent.request.live == 2
    assert child.mid_process(1, 0, [2])[0].ff == [[4, 204]]
    assert parent.mid_process(0, 0, [2])[0].ff == [[4, 204]]
    assert parent.mid_process(0, 0, [2])[0].ff == [[5, 205]]
    assert child.mid_process(0, 0, [2])[0].ff == [[5, 205]]
    assert peek(child, LAST_BRANCH) == 0 and peek(child, TOKEN_SUM) == 3 + 4
    child.close()
    assert parent.request.live == 1
    child.close()  # idempotent
    assert parent.request.live == 1
    with pytest.raises(ControllerError, match="closed"):
        child.mid_process(0, 0, [1])
    parent.close()


def test_fork_limit(rt, good):
    ctl = rt.start(good, "m", limits={"max_forks": 3})
    forks = [ctl.fork(), ctl.fork()]
    with pytest.raises(ControllerError) as e:
        ctl.fork()
    assert e.value.kind == "limit" and "max_forks 3" in str(e.value)
    forks.pop().close()
    forks.append(ctl.fork())  # room again
    for f in forks:
        f.close()
    ctl.close()


def test_vars_shared_across_forks(rt, good):
    parent = rt.start(good, "v")
    child = parent.fork()
    parent.mid_process(0, 0, [1])
    assert peek(parent, VAR_GET_RESULT) == 0xFFFFFFFF  # -1: unset
    child.mid_process(1, 0, [1])  # branch 1 sets k = "xyz"
    assert peek(child, VAR_SET_RESULT) == 0
    parent.mid_process(0, 0, [1])
    assert peek(parent, VAR_GET_RESULT) == 3 and peek(parent, VAR_VALUE, 3) == b"xyz"
    assert parent.request.vars == {b"k": b"xyz"}
    other = rt.start(good, "v")  # another request does not see them
    other.mid_process(0, 0, [1])
    assert peek(other, VAR_GET_RESULT) == 0xFFFFFFFF
    for c in (parent, child, other):
        c.close()


def test_var_limit(rt, good):
    ctl = rt.start(good, "v", limits={"max_var_bytes": 3})  # key (1) + value (3) > 3
    child = ctl.fork()
    child.mid_process(1, 0, [1])
    assert peek(child, VAR_SET_RESULT) == 0xFFFFFFFF
    assert child.request.vars == {}
    child.close()
    ctl.close()


def test_log_shared_and_truncated(rt, good):
    ctl = rt.start(good, "l", limits={"max_log_bytes": 12})
    child = ctl.fork()
    ctl.mid_process(0, 0, [1])
    assert ctl.log_text() == "step\n"
    child.mid_process(0, 0, [1])
    assert child.log_text() == "step\nstep\n"
    ctl.mid_process(0, 0, [1])
    text = ctl.log_text()
    assert text.startswith("step\nstep\nst") and text.endswith("[log truncated]\n")
    ctl.mid_process(0, 0, [1])
    assert ctl.log_text() == text  # later text is dropped, the marker kept once
    child.close()
    ctl.close()


def test_mask_view_survives_close(rt):
    """A core module's mask is a zero-copy view of its memory, and keeps that memory alive."""
    ctl = rt.start(rt.load(wasm_of(GOOD_WAT)), "m")
    [b] = ctl.mid_process(0, 0, [1])
    assert not b.mask.flags.owndata
    ctl.close()
    del ctl
    assert _mask_tokens(b.mask) == [5, 7]


# ----------------------------------------------------------------------------- host imports


@both
def test_host_imports(tok, rt, shape):
    """vocab_size, eos_token, config, arg_len/arg_read, tokenize, token_table_* called from
    rudder_start; results stored at 0x400.. and read back."""
    wat = controller_wat(
        memory='(memory (export "memory") 32)',
        extra='(data (i32.const 0x600) "hi!")',
        start="""(i32.store (i32.const 0x400) (call $vocab_size))
          (i32.store (i32.const 0x404) (call $eos_token))
          (i32.store (i32.const 0x408) (call $config (i32.const 0)))
          (i32.store (i32.const 0x40c) (call $config (i32.const 1)))
          (i32.store (i32.const 0x410) (call $config (i32.const 2)))
          (i32.store (i32.const 0x414) (call $config (i32.const 3)))
          (i32.store (i32.const 0x418) (call $config (i32.const 99)))
          (i32.store (i32.const 0x41c) (call $arg_len))
          (i32.store (i32.const 0x420) (call $arg_read (i32.const 0x500) (i32.const 4)))
          (i32.store (i32.const 0x424) (call $tokenize (i32.const 0x600) (i32.const 3) (i32.const 0x700) (i32.const 2)))
          (i32.store (i32.const 0x428) (call $token_table_len))
          (i32.store (i32.const 0x42c) (call $token_table_read (i32.const 0x10000) (i32.const 0x100000)))
          (i32.const 0)""",
        init="(i32.store (i32.const 0x430) (call $arg_len)) (i32.const 0)")
    ctl = rt.start(rt.load(shape.wasm(wat)), "hello world", limits={"max_forks": 4})
    u32 = lambda a: peek(ctl, a)
    table = token_table_for(tok)
    assert u32(0x400) == 512 and u32(0x404) == 2
    assert u32(0x408) == 1 and u32(0x40c) == 4 and u32(0x410) == 4096 and u32(0x414) == 3
    assert u32(0x418) == 0xFFFFFFFF
    assert u32(0x430) == 0xFFFFFFFF  # arg_len during init: -1
    assert u32(0x41c) == 11 and u32(0x420) == 4 and peek(ctl, 0x500, 4) == b"hell"
    ids = tok.encode("hi!")
    assert u32(0x424) == len(ids) == 3  # full count, only 2 written
    assert [u32(0x700), u32(0x704), u32(0x708)] == ids[:2] + [0]
    assert u32(0x428) == len(table) and u32(0x42c) == len(table)
    assert peek(ctl, 0x10000, len(table)) == table
    ctl.close()


# ----------------------------------------------------------------------------- token table


def _walk_trie(nodes: np.ndarray) -> dict[bytes, int]:
    """Every token reachable in the trie, by walking children with subtree-size jumps;
    checks the size invariants on the way."""
    found: dict[bytes, int] = {}
    word0, size = nodes[:, 0].astype(np.int64), nodes[:, 1].astype(np.int64)

    def visit(i: int, prefix: bytes) -> None:
        end = i + size[i]
        j = i + 1
        last_byte = -1
        while j < end:
            b = int(word0[j] & 0xFF)
            assert b > last_byte, "children must be in increasing byte order"
            last_byte = b
            assert j + size[j] <= end, "a child's subtree must lie inside its parent's"
            path = prefix + bytes([b])
            tid = int(word0[j] >> 8) - 1
            if tid >= 0:
                found[path] = tid
            stack.append((j, path))
            j += size[j]
        assert j == end

    stack = [(0, b"")]
    while stack:
        visit(*stack.pop())
    return found


def _check_table(tokenizer) -> dict:
    table = build_token_table(tokenizer)
    assert len(table) % 4 == 0
    h = parse_header(table)
    vocab = tokenizer.vocab_size
    assert int(np.frombuffer(table[:4], "<u4")[0]) == MAGIC
    assert h["vocab_size"] == vocab and h["nodes"][0, 1] == h["n_nodes"] and h["nodes"][0, 0] == 0
    offsets, data = h["offsets"], h["bytes"]
    assert offsets[0] == 0 and offsets[-1] == h["bytes_len"]
    expected: dict[bytes, int] = {}
    for i, tb in enumerate(tokenizer.token_bytes):
        got = data[offsets[i]:offsets[i + 1]]
        if i in tokenizer.special_token_ids:
            assert got == b""
            continue
        assert got == tb
        if tb and tb not in expected:
            expected[tb] = i
    assert _walk_trie(h["nodes"]) == expected
    # every node except the root is a distinct prefix of some token
    assert h["n_nodes"] == 1 + len({b[:k] for b in expected for k in range(1, len(b) + 1)})
    return h


def test_token_table_byte_level(tok):
    h = _check_table(tok)
    assert h["n_nodes"] == 257  # root + one node per byte
    assert token_table_for(tok) is token_table_for(tok)  # built once per tokenizer


@pytest.mark.model
def test_token_table_smollm2(smollm2_tokenizer):
    t0 = time.perf_counter()
    h = _check_table(smollm2_tokenizer)
    print(f"\nSmolLM2 token table: {h['n_nodes']} nodes, {h['bytes_len']} bytes of text, "
          f"checked in {time.perf_counter() - t0:.2f} s")


# ----------------------------------------------------------------------------- module cache


@both
def test_module_cache_memory_and_disk(tok, tmp_path, shape):
    wasm = shape.wasm(GOOD_WAT.replace("0xABCD", "0xABCE"))  # a module no other test compiled
    with ControllerRuntime(tok, cache_dir=tmp_path) as rt1:
        t0 = time.perf_counter()
        m1 = rt1.load(wasm)
        t_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert rt1.load(wasm) is m1
        t_memory = time.perf_counter() - t0
        stats = shape.side(rt1).cache.stats
        assert stats["compiled"] == 1 and stats["memory_hits"] == 1
        assert m1.wasm_size == len(wasm) and m1.compiled_size > 0 and len(m1.sha256) == 64
    assert list(tmp_path.glob(f"{m1.sha256}.*.cwasm"))
    with ControllerRuntime(tok, cache_dir=tmp_path) as rt2:
        t0 = time.perf_counter()
        m2 = rt2.load(wasm)
        t_disk = time.perf_counter() - t0
        assert shape.side(rt2).cache.stats == {"memory_hits": 0, "disk_hits": 1, "compiled": 0}
        assert m2.sha256 == m1.sha256 and m2.compiled_size == m1.compiled_size
        ctl = rt2.start(m2, "m")
        assert ctl.mid_process(0, 0, [1])[0].ff == [[7, 8, 9]]
        ctl.close()
    print(f"\nmodule load: compile {t_compile * 1e3:.2f} ms, memory hit {t_memory * 1e6:.1f} us, "
          f"disk hit {t_disk * 1e3:.3f} ms")


@both
def test_corrupt_disk_cache_is_recompiled(tok, tmp_path, shape):
    wasm = shape.wasm(GOOD_WAT.replace("0xABCD", "0xABCF"))
    with ControllerRuntime(tok, cache_dir=tmp_path) as rt1:
        m = rt1.load(wasm)
    [path] = tmp_path.glob(f"{m.sha256}.*.cwasm")
    path.write_bytes(b"garbage")
    with ControllerRuntime(tok, cache_dir=tmp_path) as rt2:
        m2 = rt2.load(wasm)
        assert shape.side(rt2).cache.stats["compiled"] == 1
        ctl = rt2.start(m2, "m")
        ctl.mid_process(0, 0, [1])
        ctl.close()
    assert path.stat().st_size > 100


@both
def test_start_restores_the_snapshot_and_runs_only_rudder_start(tok, tmp_path, monkeypatch, shape):
    """Starting a request on a loaded module compiles nothing and runs rudder_init no more:
    it restores the post-init snapshot into a fresh instance and runs rudder_start; closing
    the controller gives its store back. (How long a start takes is benchmarks/' business.)"""
    wasm = shape.wasm(GOOD_WAT.replace("0xABCD", "0xABCA"))  # a module no other test initialised
    with ControllerRuntime(tok, cache_dir=tmp_path) as rt:
        side, inits = shape.side(rt), []
        run_init = side.run_init
        monkeypatch.setattr(side, "run_init", lambda cmod: inits.append(cmod) or run_init(cmod))
        module = rt.load(wasm)
        stats = dict(side.cache.stats)
        live = side.engine.ticker._live
        for i in range(20):
            ctl = rt.start(module, "c")
            assert peek(ctl, 0x130) == 0xABCA  # rudder_init's write, from the snapshot
            # the snapshot's counters (memory 0, global 200), whatever earlier requests did
            for k in range(1, 3 + i % 3):
                assert ctl.mid_process(0, 0, [1])[0].ff == [[k, 200 + k]]
            ctl.close()
        assert len(inits) == 1  # rudder_init ran once, for the first start
        assert side.cache.stats == stats  # starts load and compile nothing
        assert side.engine.ticker._live == live  # every closed controller gave its store back


# ----------------------------------------------------------------------------- parallelism


def _busy_runtime(tok):
    return ControllerRuntime(tok, limits=Limits(mid_process_ms=5000), cache_dir=False)


def _calibrated(rt, module, seconds: float) -> bytes:
    """The argument making one busy step take about `seconds`."""
    import struct

    n = 2_000_000
    probe = rt.start(module, struct.pack("<I", n))
    t0 = time.perf_counter()
    probe.mid_process(0, 0, [1])
    per_iter = (time.perf_counter() - t0) / n
    probe.close()
    return struct.pack("<I", int(seconds / per_iter))


@both
def test_gil_released_during_guest_code(tok, shape):
    """Python threads keep running while a guest computes (robust to a busy machine: with
    the GIL held they would make no progress at all)."""
    with _busy_runtime(tok) as rt:
        module = rt.load(shape.wasm(busy_wat()))
        arg = _calibrated(rt, module, 0.15)
        ctl = rt.start(module, arg)
        counter, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                counter[0] += 1

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.01)
        before = counter[0]
        ctl.mid_process(0, 0, [1])
        during = counter[0] - before
        stop.set()
        spinner.join()
        ctl.close()
        assert during > 1000, during


HANDSHAKE_WAT = controller_wat(
    extra='(data (i32.const 0x300) "in") (data (i32.const 0x310) "go") (data (i32.const 0x320) "1")',
    # branch 0 says it is in (var "in"), then waits in guest code until var "go" is set;
    # branch 1 sets "go".
    mid="""(if (i32.eqz (local.get $b))
             (then
               (drop (call $var_set (i32.const 0x300) (i32.const 2) (i32.const 0x320) (i32.const 1)))
               (block $done (loop $l
                 (br_if $done (i32.ne (call $var_get (i32.const 0x310) (i32.const 2) (i32.const 0x330) (i32.const 4))
                                      (i32.const -1)))
                 (br $l))))
             (else (drop (call $var_set (i32.const 0x310) (i32.const 2) (i32.const 0x320) (i32.const 1)))))
           (i32.const 0x100)""")


@both
def test_two_controllers_run_at_the_same_time(tok, shape):
    """Two forks of one request step on two threads at once (docs: forks run in parallel).
    Deterministic, whatever the machine's load: fork 0's step cannot return before fork 1's
    step has run, so a runtime that serialised steps would hold fork 1 back until fork 0's
    deadline and fork 0 would fail with a timeout. (The speed-up this gives on two free cores
    is measured in benchmarks/, not asserted here.)"""
    with ControllerRuntime(tok, limits=Limits(mid_process_ms=30_000), cache_dir=False) as rt:
        waiter = rt.start(rt.load(shape.wasm(HANDSHAKE_WAT)), "")
        setter = waiter.fork()
        outcome: list = []

        def wait_in_guest():
            try:
                outcome.append(waiter.mid_process(0, 0, [1]))
            except ControllerError as e:
                outcome.append(e)

        thread = threading.Thread(target=wait_in_guest)
        thread.start()
        deadline = time.monotonic() + 30
        while b"in" not in waiter.request.vars:  # fork 0 is now inside its step
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.001)
        assert setter.mid_process(1, 0, [1])[0].samples  # fork 1's whole step, meanwhile
        thread.join(timeout=60)
        assert not thread.is_alive()
        [result] = outcome
        assert not isinstance(result, ControllerError), result
        assert result[0].samples and waiter.request.vars == {b"in": b"1", b"go": b"1"}
        waiter.close()
        setter.close()


CLOSED_MIDWAY_WAT = controller_wat(
    extra='(data (i32.const 0x300) "in") (data (i32.const 0x310) "go") (data (i32.const 0x320) "1")',
    # says it is in (var "in"), then waits in guest code until var "go" is set
    mid="""(drop (call $var_set (i32.const 0x300) (i32.const 2) (i32.const 0x320) (i32.const 1)))
           (block $done (loop $l
             (br_if $done (i32.ne (call $var_get (i32.const 0x310) (i32.const 2) (i32.const 0x330) (i32.const 4))
                                  (i32.const -1)))
             (br $l)))
           (i32.const 0x100)""")


@both
def test_a_controller_closed_during_its_call_is_freed_after_it(tok, shape):
    """The engine may close a sequence's controller while a late call of it still runs on a
    controller thread (its request failed meanwhile): the call finishes on an instance that is
    still there, and its memory leaves the budget when the call is over."""
    with ControllerRuntime(tok, limits=Limits(mid_process_ms=30_000), cache_dir=False) as rt:
        ctl = rt.start(rt.load(shape.wasm(CLOSED_MIDWAY_WAT)), "")
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(ctl.mid_process(0, 0, [1])))
        thread.start()
        deadline = time.monotonic() + 30
        while b"in" not in ctl.request.vars:  # the call is inside the guest now, and stays until "go"
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.001)
        ctl.close()
        assert rt.guest_memory.used > 0  # still held by the running call
        ctl.request.var_set(b"go", b"1")
        thread.join(60)
        assert not thread.is_alive() and outcome and outcome[0][0].samples
        del outcome, thread, ctl
        assert rt.guest_memory.used == 0


# -- the native step (native/deadline.c, rudder_step_call) against the Python decoder -----------

_POKED_RESULT = 0x200  # the controller answers with the pointer the test stores here


def _poked_answers(vocab: int, words: int, size: int):
    """(result pointer, {address: bytes}) for every combination of valid, edge and broken
    records: the result, the branch records (a second branch is a valid one), a mask's place and
    bits (one set, none, one past the vocabulary), ff lists, a backtrack."""
    for result, n_branches, branches, mask, n_ff, bits, backtrack in itertools.product(
            [0x1000, 0, size - 4, 0x1002], [1, 0, 2], [0x1100, size - 8, 0x7FFFFFF0],
            [0x2000, 0, 0x2002, size - 4, size - 4 * words], [0, 1], ["set", "none", "past"], [0, 2]):
        writes = {0x3000: struct.pack("<II", 2, 0x3100), 0x3100: struct.pack("<II", 7, 8)}
        if result + 8 <= size:
            writes[result] = struct.pack("<II", n_branches, branches)
        recs = struct.pack("<IIII", backtrack, mask, n_ff, 0x3000) + struct.pack("<IIII", 0, 0, 1, 0x3000)
        if branches + len(recs) <= size:
            writes[branches] = recs
        content = np.zeros(words, dtype=np.uint32)
        if bits == "set":
            content[words // 2] = 0x10
        elif bits == "past":
            content[0] = 1
            content[-1] = np.uint32(1 << 31) if vocab % 32 else 0
        if mask and mask + 4 * words <= size:
            writes[mask] = content.tobytes()
        yield result, writes


@pytest.mark.parametrize("vocab", [512, 300])  # 300: a mask whose last word has unused bits
def test_the_native_step_answers_as_the_python_decoder(vocab):
    """Valid, edge and broken result records: mid_process (the native fast path, or the decoder
    where the fast path passes) gives what the Python decoder alone gives for the same memory -
    the same Branches, or the same error."""
    rt = ControllerRuntime(Tokenizer.byte_level(vocab), cache_dir=False)
    try:
        module = rt.load(wasm_of(controller_wat(mid=f"(i32.load (i32.const {_POKED_RESULT}))",
                                               memory='(memory (export "memory") 4)')))
        probe = rt.start(module)
        assert probe._inst.step is not None, "the native library is needed for this test"
        words, size = probe._decoder.mask_words, probe._inst.size
        probe.close()

        def answer(result: int, writes: dict[int, bytes], native: bool):
            ctl = rt.start(module)
            inst = ctl._inst
            for addr, raw in writes.items():
                inst.u8[addr:addr + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            inst.u32[_POKED_RESULT >> 2] = result
            if not native:
                ctl._step = None  # the Python path throughout
            try:
                return [(b.backtrack, None if b.mask is None else b.mask.tobytes(), b.ff)
                        for b in ctl.mid_process(0, 0, [5])]
            except ControllerError as e:
                return e.kind, str(e)
            finally:
                ctl.close()

        fast = 0
        for result, writes in _poked_answers(vocab, words, size):
            native = answer(result, writes, True)
            assert native == answer(result, writes, False), (hex(result), writes)
            fast += isinstance(native, list) and len(native) == 1 and not native[0][2]
        assert fast >= 20  # the fast path's own answers were among them
    finally:
        rt.close()
