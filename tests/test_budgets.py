"""The sandbox's server-wide memory budgets (controller/budgets.py): post-init snapshots are
bounded in bytes (least recently used dropped, re-made by running rudder_init again), and the
linear memory of all live instances is bounded (a start or fork that does not fit is refused as
`limit` with `busy` set; growth past the budget fails the request that grew, as `oom`). Every
case runs for both controller shapes (tests/shapes.py); a component counts at the most its
memories may reach from its start, since the host cannot read them."""

from __future__ import annotations

import gc
import time

import pytest

from controller_wat import controller_wat, peek
from hostile_wat import HOSTILE, dirty_init_wat, kinds
from rudder.controller import ControllerError, ControllerRuntime, Limits
from rudder.tokenizer import Tokenizer
from shapes import COMPONENT, CORE, SHAPES

MiB = 1 << 20
both = pytest.mark.parametrize("shape", SHAPES, ids=str)


@both
def test_snapshots_are_bounded_in_bytes_and_come_back(shape):
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False, snapshot_bytes=40 * MiB) as rt:
        modules = [rt.load(shape.wasm(dirty_init_wat(16, mark))) for mark in range(1, 7)]
        for m in modules:
            rt.start(m, "").close()
            assert rt.stats()["snapshot_bytes"] <= 40 * MiB + 16 * MiB
        kept = [m for m in modules if m.snapshot is not None]
        assert 1 <= len(kept) <= 3 and modules[-1].snapshot is not None  # the newest stays
        first = modules[0]
        assert first.snapshot is None  # dropped: least recently used
        ctl = rt.start(first, "")  # rudder_init runs again and gives the same state
        assert peek(ctl, 0x20000, 4) == bytes([1] * 4) and peek(ctl, 16 * MiB - 4, 4) == bytes([1] * 4)
        ctl.close()
        assert first.snapshot is not None and rt.stats()["snapshot_bytes"] <= 56 * MiB + MiB


def _malloc_bytes() -> int | None:
    """Bytes the process holds from malloc (glibc's mallinfo2: in use in its arenas + mmapped)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    fn.restype = MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


@both
def test_snapshots_live_outside_the_malloc_heap(shape):
    """A snapshot's bytes are an mmap of their own: in glibc's heap, snapshots that came and
    went left holes that kept the server's RSS growing (benchmarks/soak.py)."""
    if _malloc_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False) as rt:
        module = rt.load(shape.wasm(dirty_init_wat(16, 5)))
        before = _malloc_bytes()
        rt.start(module, "").close()
        grown = _malloc_bytes() - before
        assert module.snapshot.stored_bytes >= 15 * MiB
        assert grown < 4 * MiB, f"malloc holds {grown >> 20} MiB more after a 16 MiB snapshot"
        ctl = rt.start(module, "")  # and it restores from there
        assert peek(ctl, 0x20000, 4) == bytes([5] * 4) and peek(ctl, 16 * MiB - 4, 4) == bytes([5] * 4)
        ctl.close()


@both
def test_modules_are_not_kept_for_their_snapshots(shape):
    """The snapshot cache holds modules weakly: modules the runtime's LRU dropped go, even when
    their snapshots are empty (held strongly, every distinct module stayed for good)."""
    import weakref

    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False) as rt:
        cache = rt._core.cache if shape is CORE else rt._component_shape().cache
        cache.max_in_memory = 8  # (the LRU's size does not matter here, only that it drops modules)
        refs = []
        for i in range(cache.max_in_memory + 12):
            init = "(i32.const 0)" if i % 2 else f"(i32.store (i32.const 0x8000) (i32.const {i + 1})) (i32.const 0)"
            module = rt.load(shape.wasm(controller_wat(init=init, extra=f"(global $g{i} i32 (i32.const {i}))")))
            rt.start(module, "").close()
            refs.append(weakref.ref(module))
            del module
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert len(alive) <= cache.max_in_memory
        assert rt.stats()["snapshot_bytes"] == sum(m.snapshot.stored_bytes for m in alive if m.snapshot is not None)
        assert len(rt._shared.snapshots) == len(alive)
        del alive
        module = rt.load(shape.wasm(controller_wat(init="(i32.store (i32.const 0x8000) (i32.const 1)) (i32.const 0)",
                                                   extra="(global $g0 i32 (i32.const 0))")))
        ctl = rt.start(module, "")  # a dropped module comes back: loaded and initialised again
        assert peek(ctl, 0x8000, 1) == b"\x01"
        ctl.close()


@both
def test_live_guest_memory_is_bounded_and_given_back(shape):
    """Room for two instances and a half: the third start and a fork are refused as busy, and a
    closed instance makes room again. A core module counts its memory (its 8 MiB snapshot); a
    component, the most its two memories may reach."""
    limit = 20 * MiB
    per = 8 * MiB if shape is CORE else 2 * limit
    budget = 2 * per + per // 2
    with ControllerRuntime(Tokenizer.byte_level(512), Limits(memory_bytes=limit), cache_dir=False,
                           guest_memory_bytes=budget) as rt:
        module = rt.load(shape.wasm(dirty_init_wat(8, 7)))
        a = rt.start(module, "")
        b = rt.start(module, "")
        assert rt.guest_memory.used >= 2 * per
        with pytest.raises(ControllerError) as e:
            rt.start(module, "")
        assert e.value.kind == "limit" and e.value.busy and f"guest memory budget of {budget >> 20} MiB" in str(e.value)
        with pytest.raises(ControllerError) as e:
            a.fork()
        assert e.value.kind == "limit" and e.value.busy
        del e  # its traceback holds the forking frame, and with it a's instance
        assert a.mid_process(0, 0, [1])  # a refused fork leaves the controller as it was
        a.close()
        del a
        c = rt.start(module, "")  # room again once an instance is gone
        for ctl in (b, c):
            ctl.close()
        del b, c
        assert rt.guest_memory.used == 0 and rt.guest_memory.peak >= 2 * per


GROW = controller_wat(mid="(drop (memory.grow (i32.const 160))) (i32.const 0x100)")  # +10 MiB a step


def test_growth_past_the_budget_fails_the_request_that_grew():
    """A core module counts what it grows to: growth past the budget fails its own request."""
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False, guest_memory_bytes=24 * MiB) as rt:
        module = rt.load(CORE.wasm(GROW))
        quiet = rt.start(rt.load(CORE.wasm(controller_wat())), "")
        ctl = rt.start(module, "")
        ctl.mid_process(0, 0, [1])  # 10 MiB: fits
        ctl.mid_process(0, 0, [1])  # 20 MiB: fits
        with pytest.raises(ControllerError) as e:
            ctl.mid_process(0, 0, [1])  # 30 MiB: over
        assert e.value.kind == "oom" and "guest memory budget" in str(e.value)
        assert quiet.mid_process(0, 0, [1])  # the neighbour is not touched
        ctl.close()
        quiet.close()


def test_a_component_counts_its_most_from_the_start():
    """A component's memory cannot be read, so it counts at the most its memories may reach from
    its start: growing up to its limit changes nothing, and the budget is never exceeded."""
    limit = 16 * MiB
    with ControllerRuntime(Tokenizer.byte_level(512), Limits(memory_bytes=limit), cache_dir=False,
                           guest_memory_bytes=3 * limit) as rt:
        ctl = rt.start(rt.load(COMPONENT.wasm(GROW)), "")
        assert rt.guest_memory.used == ctl.memory_size == 2 * limit  # its memory and its scratch memory
        for _ in range(3):  # 10 MiB, then past its 16 MiB limit: memory.grow says -1, the step goes on
            assert ctl.mid_process(0, 0, [1])
        assert rt.guest_memory.used == 2 * limit and rt.guest_memory.peak == 2 * limit
        with pytest.raises(ControllerError) as e:
            rt.start(rt.load(COMPONENT.wasm(controller_wat())), "")
        assert e.value.kind == "limit" and e.value.busy
        ctl.close()
        assert rt.guest_memory.used == 0


@both
def test_a_refusal_names_its_reason(shape):
    reason = 'json: unsupported keyword "foo" at /\n'
    refuse = controller_wat(start=f"(call $log (i32.const 0x900) (i32.const {len(reason)})) (i32.const 1)",
                            extra='(data (i32.const 0x900) "json: unsupported keyword \\"foo\\" at /\\n")')
    with ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False) as rt:
        with pytest.raises(ControllerError) as e:
            rt.start(rt.load(shape.wasm(refuse)), "")
    assert e.value.kind == "start" and str(e.value).endswith('json: unsupported keyword "foo" at /')


def test_limits_are_only_lowered():
    assert Limits().capped({"max_tokenize_bytes": 5}).max_tokenize_bytes == 5
    assert Limits().capped({"mid_process_ms": 60_000}).mid_process_ms == 25  # a request asking more gets the most


def test_an_operators_raise_given_as_a_dict_is_refused_by_name():
    """An operator's KEY=VALUE limits (a dict: --limit, an LLM's or ServerConfig's controller_limits)
    lower the defaults; one above them is refused, not silently left at the default, and a
    runtime built with it never starts. A Limits(...) sets higher limits."""
    assert Limits().lowered({"max_forks": 2, "init_ms": None}).max_forks == 2
    with pytest.raises(ValueError, match=r"mid_process_ms=250 \(default 25\)"):
        Limits().lowered({"mid_process_ms": 250, "max_forks": 2})
    with pytest.raises(ValueError, match="unknown controller limit"):
        Limits().lowered({"mid_process_msec": 5})
    with pytest.raises(ValueError, match="memory_bytes"):
        ControllerRuntime(Tokenizer.byte_level(512), {"memory_bytes": 1 << 30}, cache_dir=False)
    with ControllerRuntime(Tokenizer.byte_level(512), Limits(mid_process_ms=250), cache_dir=False) as rt:
        assert rt.limits.mid_process_ms == 250


@both
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_failed_request_gives_its_guest_memory_back_at_once(name, shape):
    """Whatever a controller did, its instance is freed when its request ends (or when a call
    still running then returns), without waiting for the garbage collector: a kept traceback (a
    controller's exception, or one it was raised from) makes a cycle that would hold the
    instance's memory (the soak saw it pile up)."""
    from rudder import SamplingParams

    expected = kinds(name, shape)
    llm = _tiny_llm()
    gc.collect()
    gc.disable()
    try:
        out = llm.generate(["hi"], SamplingParams(max_tokens=8, temperature=0), controller=shape.wasm(HOSTILE[name][0]))
        kind = "ok" if out[0].finish_reason != "error" else out[0].error.split(":")[0].split()[-1]
        assert kind in expected or out[0].finish_reason != "error", (name, out[0].error)
        # A fork's mid_process may still be running on a controller thread when the request has
        # failed (the engine does not wait for a late call): its instance is closed when that call
        # returns, ~1 ms later - still without the garbage collector, which stays off here.
        deadline = time.monotonic() + 5
        while llm.runtime.guest_memory.used and time.monotonic() < deadline:
            time.sleep(0.001)
        assert llm.runtime.guest_memory.used == 0, (name, llm.runtime.guest_memory.used)
    except ControllerError as e:  # refused at start (init loops, start refuses): nothing may be left either
        assert e.kind in expected, (name, e)
        assert llm.runtime.guest_memory.used == 0, (name, llm.runtime.guest_memory.used)
    finally:
        gc.enable()


_LLM = []


def _tiny_llm():
    from rudder import LLM

    if not _LLM:  # (a short init deadline: the init that loops need not run its default second)
        _LLM.append(LLM("tiny", controller_limits={"init_ms": 200}))
    return _LLM[0]
