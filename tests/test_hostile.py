"""Hostile controllers: each misbehaves in one way and must fail its own request with a
ControllerError of the right kind and a clear message, leaving the runtime usable.

The cases run through both controller shapes (tests/shapes.py): a core module, and the same
module inside a component, which reaches the sandbox through the component ABI. Where the host
can see less of a component (its memory is hidden), the expected kind says so. Cases about one
shape's own calling convention or checks (rudder_input, result pointers, import pointers, the
core module's exports) run for that shape alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from controller_wat import GOOD_WAT, controller_wat, wasm_of
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.tokenizer import Tokenizer
from shapes import COMPONENT, CORE, SHAPES

INIT_MS = 300  # the server's init deadline in these tests (1000 by default: too slow here)
# The loops below never end by themselves: only their deadline can stop them, so each test
# checks that it did, and not before the deadline. The upper bounds are not speed claims:
# they are far past the deadline (any hang fails), generous for a loaded shared machine.
HANG_MARGIN_S = 10.0


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    runtime = ControllerRuntime(Tokenizer.byte_level(512), limits=Limits(init_ms=INIT_MS),
                                cache_dir=tmp_path_factory.mktemp("wasm-cache"))
    yield runtime
    runtime.close()


@pytest.fixture(autouse=True)
def runtime_still_works(rt, request):
    """After every hostile test, a good controller (of the test's shape) still runs on the same runtime."""
    yield
    shape = getattr(request.node, "callspec", None) and request.node.callspec.params.get("shape") or CORE
    ctl = rt.start(rt.load(shape.wasm(GOOD_WAT)), "m")
    [b] = ctl.mid_process(0, 0, [1, 2])
    assert b.ff == [[7, 8, 9]]
    ctl.close()


def load_error(rt, wasm: bytes) -> ControllerError:
    with pytest.raises(ControllerError) as e:
        rt.load(wasm)
    _check_message(e.value)
    return e.value


def start_error(rt, wasm: bytes, arg: str = "", limits=None) -> ControllerError:
    module = rt.load(wasm)
    with pytest.raises(ControllerError) as e:
        rt.start(module, arg, limits)
    _check_message(e.value)
    return e.value


def step_error(rt, wasm: bytes, tokens=(1,), limits=None) -> ControllerError:
    ctl = rt.start(rt.load(wasm), "", limits)
    with pytest.raises(ControllerError) as e:
        ctl.mid_process(0, 0, list(tokens))
    _check_message(e.value)
    # a failed controller is dead: further calls refuse, with the same kind
    with pytest.raises(ControllerError) as again:
        ctl.mid_process(0, 0, [1])
    assert again.value.kind == e.value.kind and "already failed" in str(again.value)
    with pytest.raises(ControllerError):
        ctl.fork()
    ctl.close()
    assert ctl.request.live == 0
    return e.value


def _check_message(e: ControllerError) -> None:
    text = str(e)
    assert text and "\n" not in text and len(text) < 400, text
    print(f"\n[{e.kind}] {text}")


LOOP = "(loop $l (br $l)) (i32.const 0)"
both = pytest.mark.parametrize("shape", SHAPES, ids=str)


def ended_at(e: ControllerError, ms: float) -> bool:
    """A runaway ended by its deadline of `ms` of CPU time, or, on a machine so busy that its
    thread got little of a core, by its wall-clock cap (test_deadlines.py holds the two apart)."""
    from rudder.controller.store import wall_cap_ms

    return e.kind == "timeout" and (f"deadline of {ms:g} ms" in str(e) or f"cap of {wall_cap_ms(ms):g} ms" in str(e))


# ----------------------------------------------------------------------------- runaway code


@both
def test_infinite_loop_in_init(rt, shape):
    t0 = time.perf_counter()
    e = start_error(rt, shape.wasm(controller_wat(init=LOOP)))
    elapsed = time.perf_counter() - t0
    assert ended_at(e, INIT_MS) and shape.hook("rudder_init") in str(e)
    assert INIT_MS / 1000 <= elapsed < INIT_MS / 1000 + HANG_MARGIN_S


@both
def test_infinite_loop_in_start(rt, shape):
    t0 = time.perf_counter()
    e = start_error(rt, shape.wasm(controller_wat(start=LOOP)), limits={"init_ms": 50})
    assert ended_at(e, 50) and shape.hook("rudder_start") in str(e)
    assert 0.05 <= time.perf_counter() - t0 < HANG_MARGIN_S


@both
def test_infinite_loop_in_mid_process(rt, shape):
    ctl = rt.start(rt.load(shape.wasm(controller_wat(mid=LOOP))), "")
    t0 = time.perf_counter()
    with pytest.raises(ControllerError) as e:
        ctl.mid_process(0, 0, [1])
    elapsed = time.perf_counter() - t0
    print(f"\n[{e.value.kind}] {e.value} after {elapsed * 1e3:.1f} ms")
    assert ended_at(e.value, 25) and shape.hook("rudder_mid_process") in str(e.value)
    assert 0.025 <= elapsed < HANG_MARGIN_S
    ctl.close()


def test_infinite_loop_in_rudder_input(rt):
    e = step_error(rt, wasm_of(controller_wat(input_=LOOP)))
    assert e.kind == "timeout" and "rudder_input" in str(e)


@both
def test_memory_bomb(rt, shape):
    """Grow a page at a time until memory.grow says no (-1) at the limit, then give up (abort).
    A core module's host sees the memory at its limit and calls the trap what it is; a
    component's memory is hidden, so there it is a trap (a component's own out-of-memory
    failure is `oom`: test_components.py)."""
    bomb = """(block $done (loop $l
                 (br_if $done (i32.eq (memory.grow (i32.const 1)) (i32.const -1)))
                 (br $l)))
              unreachable"""
    e = step_error(rt, shape.wasm(controller_wat(mid=bomb)), limits={"memory_bytes": 8 << 20})
    kind, words = {"core": ("oom", "8 MiB"), "component": ("trap", "unreachable")}[shape.name]
    assert e.kind == kind and words in str(e)


@both
def test_memory_bomb_that_keeps_going(rt, shape):
    bomb = """(loop $l (drop (memory.grow (i32.const 16))) (br $l)) (i32.const 0)"""
    e = step_error(rt, shape.wasm(controller_wat(mid=bomb)))
    assert e.kind == "timeout"


@both
def test_memory_limit_below_the_snapshot(rt, shape):
    """The post-init state does not fit the request's memory limit: the start fails with `oom`
    (a component's state even arrives in its memory: the copy fails there, as a trap)."""
    init = "(drop (memory.grow (i32.const 40))) (i32.store (i32.const 0x200000) (i32.const 1)) (i32.const 0)"
    e = start_error(rt, shape.wasm(controller_wat(init=init)), limits={"memory_bytes": 1 << 20})
    kind, words = {"core": ("oom", "1 MiB"), "component": ("trap", "restore")}[shape.name]
    assert e.kind == kind and words in str(e)


@both
def test_stack_overflow(rt, shape):
    wat = controller_wat(
        mid="(call $down (i32.const 0))",
        extra="(func $down (param i32) (result i32) (call $down (i32.add (local.get 0) (i32.const 1))))")
    e = step_error(rt, shape.wasm(wat))
    assert e.kind == "trap" and "stack" in str(e)


@both
def test_unreachable(rt, shape):
    e = step_error(rt, shape.wasm(controller_wat(mid="unreachable")))
    assert e.kind == "trap" and "unreachable" in str(e) and shape.hook("rudder_mid_process") in str(e)


@both
def test_out_of_bounds_memory_access(rt, shape):
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.load (i32.const -4))")))
    assert e.kind == "trap" and ("out-of-bounds" in str(e) or "out of bounds" in str(e))


@both
def test_trap_in_init_is_remembered(rt, shape, monkeypatch):
    side, inits = shape.side(rt), []
    run_init = side.run_init
    monkeypatch.setattr(side, "run_init", lambda cmod: inits.append(cmod) or run_init(cmod))
    wasm = shape.wasm(controller_wat(init="unreachable"))
    e = start_error(rt, wasm)
    assert e.kind == "trap" and shape.hook("rudder_init") in str(e) and len(inits) == 1
    e2 = start_error(rt, wasm)  # fails at once, without running init again
    assert e2.kind == "trap" and str(e2) == str(e) and len(inits) == 1


@both
def test_timeout_in_init_is_retried(rt, shape, monkeypatch):
    """A timeout depends on the machine's load, so unlike a trap it is not remembered."""
    side, inits = shape.side(rt), []
    run_init = side.run_init
    monkeypatch.setattr(side, "run_init", lambda cmod: inits.append(cmod) or run_init(cmod))
    wasm = shape.wasm(controller_wat(init=LOOP, abi="(i32.const 1)"))
    for n in (1, 2):
        assert start_error(rt, wasm, limits={"init_ms": 20}).kind == "timeout" and len(inits) == n


@both
def test_init_returns_error(rt, shape):
    wat = controller_wat(init="""(call $log (i32.const 0x300) (i32.const 9)) (i32.const 5)""",
                         extra='(data (i32.const 0x300) "bad table")')
    e = start_error(rt, shape.wasm(wat))
    assert e.kind == "init" and "rudder_init returned 5" in str(e)
    assert e.log_tail == "bad table"


@both
def test_start_returns_error_with_log(rt, shape):
    wat = controller_wat(start="""(call $log (i32.const 0x300) (i32.const 11)) (i32.const -2)""",
                         extra='(data (i32.const 0x300) "bad grammar")')
    e = start_error(rt, shape.wasm(wat))
    assert e.kind == "start" and "rudder_start returned -2" in str(e) and e.log_tail == "bad grammar"


def test_too_many_live_controllers(tmp_path):
    """The pooling allocator of core modules has room for `max_instances` live instances
    (requests, forks): past that, a start or a fork fails alone with kind limit, and a closed
    one frees a slot. (Components have no pool: the guest memory budget bounds them,
    test_budgets.py.)"""
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path, max_instances=4) as small:
        assert small.pooling  # the limit is the pool's (without a pool there is none)
        module = small.load(wasm_of(GOOD_WAT))
        live = [small.start(module, "m") for _ in range(4)]
        with pytest.raises(ControllerError) as e:
            small.start(module, "m")
        _check_message(e.value)
        assert e.value.kind == "limit" and "too many live controllers" in str(e.value)
        with pytest.raises(ControllerError) as e:
            live[0].fork()
        assert e.value.kind == "limit" and "too many live controllers" in str(e.value)
        assert all(c.mid_process(0, 0, [1])[0].ff == [[7, 8, 9]] for c in live)  # the others run on
        live.pop().close()
        ctl = small.start(module, "m")
        assert ctl.mid_process(0, 0, [1])[0].ff == [[7, 8, 9]]
        for c in [*live, ctl]:
            c.close()


def _leb128(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _padded(wasm: bytes, total: int) -> bytes:
    """`wasm` with a custom section appended that makes it exactly `total` bytes."""
    for width in range(1, 6):
        payload = total - len(wasm) - 1 - width - 1 - 3
        if len(_leb128(1 + 3 + payload)) == width:
            return wasm + b"\x00" + _leb128(1 + 3 + payload) + b"\x03pad" + bytes(payload)
    raise AssertionError(total)


@both
def test_module_size_limit(rt, shape):
    """A controller of exactly 64 MiB loads and runs; one byte more is refused before anything
    parses it, and the refusal is remembered."""
    from rudder.controller.component import MAX_COMPONENT_BYTES
    from rudder.controller.core import MAX_MODULE_BYTES

    assert MAX_MODULE_BYTES == MAX_COMPONENT_BYTES == 64 << 20
    good = shape.wasm(GOOD_WAT)
    at_limit = _padded(good, MAX_MODULE_BYTES)
    assert len(at_limit) == MAX_MODULE_BYTES
    module = rt.load(at_limit)
    ctl = rt.start(module, "m")
    assert module.wasm_size == MAX_MODULE_BYTES and ctl.mid_process(0, 0, [1])[0].ff == [[7, 8, 9]]
    ctl.close()
    del module, at_limit
    over = _padded(good, MAX_MODULE_BYTES + 1)
    e = load_error(rt, over)
    assert e.kind == "bad_module" and "over the 64 MiB limit" in str(e)
    compiled = rt.compiler.limits  # (the compiler is never asked again)
    cache = shape.side(rt).cache
    before = cache.stats["compiled"]
    assert load_error(rt, over).kind == "bad_module" and cache.stats["compiled"] == before and compiled


# ----------------------------------------------------------------------------- bad results
# A core module's Branch records, read by the host out of its memory; in a component, lifted
# into `step` values by the wrapper: the host checks both by the same rules.


def result_at(addr: int, data: str) -> str:
    return f'(data (i32.const {addr}) "{data}")'


@both
def test_null_result(rt, shape):
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0)")))
    assert e.kind == "invalid_result" and "null" in str(e)


@both
def test_garbage_result_pointer(rt, shape):
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0xFFFFFFF0)")))
    assert e.kind == "invalid_result" and "outside memory" in str(e)
    assert shape is COMPONENT or "0xfffffff0" in str(e)


@both
def test_branches_pointer_out_of_bounds(rt, shape):
    # {n_branches 2, branches 0x1FFF8}: the records would run past the 128 KiB memory
    wat = controller_wat(mid="(i32.const 0x400)", extra=result_at(0x400, r"\02\00\00\00\f8\ff\01\00"))
    e = step_error(rt, shape.wasm(wat))
    assert e.kind == "invalid_result" and "outside memory" in str(e)


@both
def test_result_in_memory_grown_during_the_call(rt, shape):
    """Not hostile: a result placed in memory the guest grew during this very call."""
    mid = """(drop (memory.grow (i32.const 1)))
             (i32.store (i32.const 0x20000) (i32.const 1))
             (i32.store (i32.const 0x20004) (i32.const 0x20010))
             (i32.const 0x20000)"""
    ctl = rt.start(rt.load(shape.wasm(controller_wat(mid=mid))), "")
    [b] = ctl.mid_process(0, 0, [1])
    assert b.mask is None and b.ff == []
    assert shape is COMPONENT or ctl.memory_size == 3 * 65536  # (a component counts at its limit)
    ctl.close()


@both
def test_out_of_range_token_in_ff(rt, shape):
    # branch {0, no mask, 1 list at 0x420}; list {2 tokens at 0x430} = [5, 512]
    extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                       result_at(0x410, r"\00\00\00\00\00\00\00\00\01\00\00\00\20\04\00\00"),
                       result_at(0x420, r"\02\00\00\00\30\04\00\00"),
                       result_at(0x430, r"\05\00\00\00\00\02\00\00")])
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "invalid_result" and "token id 512" in str(e)


@both
def test_mask_with_bits_past_vocab(tmp_path, shape):
    # vocab 500: 16 mask words, bits 500..511 of the last word must be clear
    with ControllerRuntime(Tokenizer.byte_level(500), cache_dir=tmp_path) as rt:
        def wat(last_word: str) -> str:
            extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                               result_at(0x410, r"\00\00\00\00\00\10\00\00\00\00\00\00\00\00\00\00"),
                               result_at(0x1000 + 15 * 4, last_word)])
            return controller_wat(mid="(i32.const 0x400)", extra=extra)

        e = step_error(rt, shape.wasm(wat(r"\00\00\10\00")))  # bit 20 of word 15: token 500
        assert e.kind == "invalid_result" and "past the vocabulary size 500" in str(e)
        ok = wat(r"\00\00\08\00")  # bit 19: token 499, the last one, is fine
        ctl = rt.start(rt.load(shape.wasm(ok)), "")
        [b] = ctl.mid_process(0, 0, [1])
        assert int(b.mask[15]) == 1 << 19
        ctl.close()


@both
def test_empty_mask(rt, shape):
    extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                       result_at(0x410, r"\00\00\00\00\00\10\00\00\00\00\00\00\00\00\00\00")])
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "invalid_result" and "allows no token" in str(e)


@both
def test_mask_out_of_bounds(rt, shape):
    extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                       result_at(0x410, r"\00\00\00\00\f0\ff\01\00\00\00\00\00\00\00\00\00")])
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "invalid_result" and "outside memory" in str(e)


@both
def test_several_ff_lists_without_mask(rt, shape):
    extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                       result_at(0x410, r"\00\00\00\00\00\00\00\00\02\00\00\00\20\04\00\00")])
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "invalid_result" and "without a mask" in str(e)


@both
def test_too_many_branches(rt, shape):
    # 17 branches > max_forks 16 (the records themselves are all zeros: valid)
    extra = result_at(0x400, r"\11\00\00\00\00\10\00\00")
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "limit" and "17 branches" in str(e) and "16" in str(e)
    four = controller_wat(mid="(i32.const 0x400)", extra=result_at(0x400, r"\04\00\00\00\00\10\00\00"))
    e = step_error(rt, shape.wasm(four), limits={"max_forks": 3})
    assert e.kind == "limit" and "4 branches" in str(e)


@both
def test_oversized_fast_forward(rt, shape):
    # one list of 5000 tokens (> 4096); the token memory is all zeros
    extra = "\n".join([result_at(0x400, r"\01\00\00\00\10\04\00\00"),
                       result_at(0x410, r"\00\00\00\00\00\00\00\00\01\00\00\00\20\04\00\00"),
                       result_at(0x420, r"\88\13\00\00\00\10\00\00")])
    e = step_error(rt, shape.wasm(controller_wat(mid="(i32.const 0x400)", extra=extra)))
    assert e.kind == "limit" and "5000 fast-forward tokens" in str(e)


def test_bad_input_pointer(rt):
    e = step_error(rt, wasm_of(controller_wat(input_="(i32.const 0x1FFF0)")))
    assert e.kind == "invalid_result" and "rudder_input" in str(e)


# ----------------------------------------------------------------------------- imports


@both
def test_log_spam_is_truncated(rt, shape):
    # 1 MB of log in 1 KiB calls: the request still works, the log stops at 64 KiB
    mid = """(local.set $i (i32.const 1024))
             (block $done (loop $l
               (br_if $done (i32.eqz (local.get $i)))
               (call $log (i32.const 0x1000) (i32.const 1024))
               (local.set $i (i32.sub (local.get $i) (i32.const 1)))
               (br $l)))
             (i32.const 0x100)"""
    ctl = rt.start(rt.load(shape.wasm(controller_wat(mid=mid, mid_locals="(local $i i32)"))), "")
    t0 = time.perf_counter()
    [b] = ctl.mid_process(0, 0, [1])
    elapsed = time.perf_counter() - t0
    log = ctl.request.log
    assert b.mask is None and not ctl.failed
    assert len(log) == (64 << 10) + len(b"\n[log truncated]\n") and log.endswith(b"[log truncated]\n")
    print(f"\n1 MB of log in {elapsed * 1e3:.1f} ms, kept {len(log)} bytes")
    ctl.close()


def test_import_with_bad_pointer_traps(rt):
    e = step_error(rt, wasm_of(controller_wat(mid="(call $log (i32.const 0x1FFFF) (i32.const 16)) (i32.const 0x100)")))
    assert e.kind == "trap" and "rudder.log" in str(e) and "outside" in str(e)
    e = step_error(rt, wasm_of(controller_wat(
        mid="(drop (call $token_table_read (i32.const -8) (i32.const 100))) (i32.const 0x100)")))
    assert e.kind == "trap" and "rudder.token_table_read" in str(e)


@both
def test_tokenize_invalid_utf8_traps(rt, shape):
    wat = controller_wat(extra='(data (i32.const 0x300) "\\ff\\fe")',
                         mid="(drop (call $tokenize (i32.const 0x300) (i32.const 2) (i32.const 0x400) (i32.const 4))) (i32.const 0x100)")
    e = step_error(rt, shape.wasm(wat))
    assert e.kind == "trap" and "utf-8" in str(e).lower()


# ----------------------------------------------------------------------------- a core module's checks
# (a component's: test_components.py)


def test_wasi_import_rejected(rt):
    wat = controller_wat(imports='  (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32)))')
    e = load_error(rt, wasm_of(wat))
    assert e.kind == "bad_import" and "wasi_snapshot_preview1.fd_write" in str(e)


def test_unknown_rudder_import_rejected(rt):
    e = load_error(rt, wasm_of(controller_wat(imports='  (import "rudder" "exec" (func (param i32)))')))
    assert e.kind == "bad_import" and "rudder.exec" in str(e)


def test_mistyped_rudder_import_rejected(rt):
    e = load_error(rt, wasm_of(controller_wat(imports='  (import "rudder" "log" (func (param i64)))')))
    assert e.kind == "bad_import" and "rudder.log" in str(e) and "(i64)" in str(e)


def test_imported_memory_rejected(rt):
    wat = controller_wat(imports='  (import "rudder" "memory" (memory 1))', memory="")
    e = load_error(rt, wasm_of(wat.replace("(data (i32.const 0x100)", "(export \"memory\" (memory 0)) (data (i32.const 0x100)")))
    assert e.kind == "bad_import" and "rudder.memory" in str(e)


def test_invalid_bytes(rt):
    e = load_error(rt, b"\0asm\x01\0\0\0\x99garbage")
    assert e.kind == "bad_module"
    e = load_error(rt, b"definitely not wasm")
    assert e.kind == "bad_module" and "not a WebAssembly binary" in str(e)
    e = load_error(rt, b"\0asm\x0d\0\x01\0\x99garbage")  # a component's header, then garbage
    assert e.kind == "bad_module" and "component" in str(e)


def test_bad_module_is_remembered(rt):
    wasm = b"\0asm\x01\0\0\0\x01\x05garbage"
    load_error(rt, wasm)
    compiled = rt.cache.stats["compiled"]
    load_error(rt, wasm)
    assert rt.cache.stats["compiled"] == compiled


def test_missing_export(rt):
    e = load_error(rt, wasm_of(controller_wat(omit=("rudder_mid_process",))))
    assert e.kind == "bad_module" and "rudder_mid_process" in str(e)


def test_mistyped_export(rt):
    wat = controller_wat(omit=("rudder_input",), extra='(func (export "rudder_input") (param i64) (result i32) (i32.const 0))')
    e = load_error(rt, wasm_of(wat))
    assert e.kind == "bad_module" and "rudder_input" in str(e) and "i64" in str(e)


def test_missing_memory_export(rt):
    e = load_error(rt, wasm_of(controller_wat(memory="(memory 1)")))
    assert e.kind == "bad_module" and "memory" in str(e)


def test_start_function_rejected(rt):
    e = load_error(rt, wasm_of(controller_wat(extra="(func $s) (start $s)")))
    assert e.kind == "bad_module" and "start function" in str(e)


def test_wrong_abi_version(rt):
    e = start_error(rt, wasm_of(controller_wat(abi="(i32.const 2)")))
    assert e.kind == "bad_module" and "ABI version 2" in str(e)


# ----------------------------------------------------------------------------- the runtime's lifetime


@both
def test_module_from_another_runtime(rt, shape, tmp_path):
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path) as other:
        module = other.load(shape.wasm(GOOD_WAT))
    with pytest.raises(ValueError):
        rt.start(module, "")


@both
def test_closed_runtime(tmp_path, shape):
    rt = ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path)
    ctl = rt.start(rt.load(shape.wasm(GOOD_WAT)), "m")
    rt.close()
    with pytest.raises(ControllerError, match="runtime was closed"):
        ctl.mid_process(0, 0, [1])
    with pytest.raises(RuntimeError):
        rt.load(shape.wasm(GOOD_WAT))


@both
def test_dropped_runtime_still_enforces_deadlines(tmp_path, shape):
    import gc

    rt = ControllerRuntime(Tokenizer.byte_level(512), cache_dir=tmp_path)
    ctl = rt.start(rt.load(shape.wasm(controller_wat(mid=LOOP))), "")
    del rt
    gc.collect()
    with pytest.raises(ControllerError) as e:  # the ticker outlives the runtime object
        ctl.mid_process(0, 0, [1])
    assert e.value.kind == "timeout"
    ctl.close()


# ----------------------------------------------------------------------------- fuzzing


class _FakeInstance:
    """Just enough of an Instance for the result decoder: a memory and a log."""

    def __init__(self, memory: bytes):
        import ctypes

        import numpy as np

        self.buf = (ctypes.c_ubyte * len(memory)).from_buffer_copy(memory)
        self.size = len(memory)
        self.u8 = np.frombuffer(self.buf, dtype=np.uint8)
        self.u32 = np.frombuffer(self.buf, dtype=np.uint32)

    def check_growth(self) -> bool:
        return False

    def log_tail(self) -> str:
        return ""


def test_result_decoder_fuzz():
    """Arbitrary results (mostly well-formed, with any field possibly wild): the decoder
    returns valid Branches or raises ControllerError, nothing else (no IndexError, no
    struct.error, no crash), and what it returns obeys the ABI's rules."""
    import struct

    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from rudder.controller.result import ResultDecoder

    size = 4096  # result at 0x10, branches at 0x40, masks at 0x200, ff records at 0x400, tokens at 0x600

    @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([500, 512]))
    def check(seed, vocab):
        # Drawing each word through hypothesis is slow: it picks a seed, numpy does the rest.
        rng = np.random.default_rng(seed)

        def field(*good):  # a plausible value, or now and then anything at all
            return int(rng.integers(0, 2**32)) if rng.random() < 0.04 else int(rng.choice(good))

        words = [0] * (size // 4)
        words[4] = field(0, 1, 1, 2, 3, 5, 6)          # n_branches
        words[5] = field(0x40, 0x40, 0x44, 0xFF8)      # branches
        for i in range(6):
            b = 0x10 + 4 * i
            words[b] = field(0, 0, 1, 3)                             # backtrack
            words[b + 1] = field(0, 0, 0x200, 0x240, 0x202, 0xFF0)   # mask
            words[b + 2] = field(0, 1, 1, 2, 4)                      # n_ff
            words[b + 3] = field(0x400, 0x420, 0xFFC)                # ff records
        words[0x80:0xA0] = rng.choice([0, 0xFFFFFFFF, 1, 0x80000000], size=32).tolist()  # masks
        for r in range(0x100, 0x100 + 2 * 16, 2):
            words[r] = field(1, 1, 2, 3, 8, 0, 70)                   # n tokens
            words[r + 1] = field(0x600, 0x604, 0x7F0)                # tokens
        words[0x180:0x200] = rng.integers(0, vocab + 5, size=128).tolist()
        result = field(0x10, 0x10, 0x10, 0x12)
        memory = struct.pack(f"<{len(words)}I", *words)
        decoder = ResultDecoder(vocab, max_forks=4, max_ff_tokens=64)
        try:
            branches = decoder.decode(_FakeInstance(memory), result)
        except ControllerError as e:
            assert e.kind in ("invalid_result", "limit")
            return
        assert len(branches) <= 4
        assert sum(len(f) for b in branches for f in b.ff) <= 64
        for b in branches:
            assert all(0 <= t < vocab for f in b.ff for t in f)
            if b.mask is not None:
                assert b.mask.shape == ((vocab + 31) // 32,) and b.mask.any()
                assert all(b.ff)
                if vocab % 32:
                    assert int(b.mask[-1]) >> (vocab % 32) == 0
            else:
                assert len(b.ff) <= 1 and (b.ff != [[]] or b.backtrack > 0)

    check()


# ----------------------------------------------------------------------------- no native library

NO_NATIVE_SCRIPT = r'''
import gc, json, sys, time
from rudder import native
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.tokenizer import Tokenizer
from controller_wat import controller_wat
from shapes import SHAPES

LOOP = "(loop $l (br $l)) (i32.const 0)"
out = {"library": native.library() is None, "reason": native.unavailable_reason, "binding": native.binding,
       "abi_reason": native.abi_reason}
rt = ControllerRuntime(Tokenizer.byte_level(512), Limits(init_ms=200), cache_dir=False)
out["ticker"] = type(rt._core.engine.ticker).__name__
steps = []
for shape in SHAPES:
    for hook, wat in [("init", controller_wat(init=LOOP)), ("start", controller_wat(start=LOOP))]:
        try:
            rt.start(rt.load(shape.wasm(wat)), "")
        except ControllerError as e:
            out[f"{shape} {hook}"] = [e.kind, str(e)]
    steps += [rt.start(rt.load(shape.wasm(controller_wat(mid=LOOP))), "") for _ in range(2)]
for shape, step in zip(SHAPES, steps[::2]):
    t0 = time.perf_counter()
    try:
        step.mid_process(0, 0, [1])
    except ControllerError as e:
        out[f"{shape} mid_process"] = [e.kind, str(e), time.perf_counter() - t0]
del rt   # a dropped runtime's tickers go on while its controllers live
gc.collect()
for shape, step in zip(SHAPES, steps[1::2]):
    try:
        step.mid_process(0, 0, [1])
    except ControllerError as e:
        out[f"{shape} orphaned"] = [e.kind, str(e)]

from rudder import LLM, SamplingParams
llm = LLM("tiny", dtype="fp32")  # (auto would be fp32 here, without the native kernels)
outs = llm.generate(["x"] * 3, [SamplingParams(max_tokens=24, seed=s, temperature=1.0) for s in range(3)],
                    controller="regex", controller_arg="[a-z]{3,8}( [a-z]{3,8})*")
out["texts"] = [o.text for o in outs]
print(json.dumps(out))
'''


@pytest.mark.parametrize("switch", ["RUDDER_NO_NATIVE", "RUDDER_NATIVE_ABI"])
def test_without_the_native_library_deadlines_still_fire(switch):
    """RUDDER_NO_NATIVE=1 (as when zig cannot build rudder.native): the pure-Python epoch ticker
    interrupts runaway init, start and step code of both shapes (a dropped runtime's too), and the numpy mask
    path samples exactly what the native kernel does. RUDDER_NATIVE_ABI=1 (as without Python's
    headers): the same library through cffi's ABI mode does the same with the native ticker."""
    import json
    import os
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from rudder import LLM, SamplingParams, native
    from rudder.controller.store import wall_cap_ms

    tests = str(Path(__file__).parent)
    env = {**os.environ, switch: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", NO_NATIVE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    if switch == "RUDDER_NO_NATIVE":
        assert out["library"] and "RUDDER_NO_NATIVE" in out["reason"] and out["ticker"] == "_PythonTicker"
    else:
        assert not out["library"] and out["binding"] == "abi" and out["ticker"] == "_NativeTicker"
        assert "RUDDER_NATIVE_ABI" in out["abi_reason"]
    for shape in ("core", "component"):  # both shapes, each in its own engine with its own ticker
        for hook, ms in (("init", 200), ("start", 200), ("mid_process", 25), ("orphaned", 25)):
            kind, message = out[f"{shape} {hook}"][:2]
            # its CPU budget, or on a machine so busy that the thread got little of a core, its wall cap
            ended = f"deadline of {ms} ms" in message or f"wall-clock cap of {wall_cap_ms(ms):g} ms" in message
            assert kind == "timeout" and ended, (shape, hook, message)
        assert 0.025 <= out[f"{shape} mid_process"][2] < HANG_MARGIN_S
    llm = LLM("tiny", dtype="fp32")   # here, with the native mask kernel; the same precision
    if (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert native.binding == "api"   # (here: the extension module)
    outs = llm.generate(["x"] * 3, [SamplingParams(max_tokens=24, seed=s, temperature=1.0) for s in range(3)],
                        controller="regex", controller_arg="[a-z]{3,8}( [a-z]{3,8})*")
    assert out["texts"] == [o.text for o in outs]
    assert all(o.text and set(o.text) <= set("abcdefghijklmnopqrstuvwxyz ") for o in outs)


def test_many_runtimes_in_one_process_never_abort():
    """Each runtime's pool reserves ~4 TiB of address space (1024 slots of ~4 GiB); x86-64 gives
    a process 128 TiB, and wasmtime aborts the process when a reservation fails. So runtimes past
    the room fall back to the default allocator, and still run controllers. (In a child process:
    a clean address space, and an abort fails this test instead of killing the suite.)"""
    import subprocess
    import sys

    code = """
import sys
sys.path.insert(0, sys.argv[1])
from controller_wat import GOOD_WAT, wasm_of
from rudder.controller import ControllerRuntime
from rudder.tokenizer import Tokenizer
tok = Tokenizer.byte_level(512)
runtimes = [ControllerRuntime(tok, cache_dir=False) for _ in range(40)]
pooled = [r.pooling for r in runtimes]
ctl = runtimes[-1].start(runtimes[-1].load(wasm_of(GOOD_WAT)), "m")
assert ctl.mid_process(0, 0, [1])[0].ff == [[7, 8, 9]]
ctl.close()
print(sum(pooled), pooled[0], pooled[-1])
"""
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    n_pooled, first, last = done.stdout.split()
    assert first == "True" and last == "False" and 10 <= int(n_pooled) < 40, done.stdout
