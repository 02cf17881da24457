"""The wasmtime engines controllers run in, each with the epoch ticker its deadlines count.

One engine per controller shape, both made the same way (`Engine`): core modules in one with
the pooling allocator, components in one of their own (no pooling: a componentize-py component
is many core modules and a large memory image), made when the first component is loaded.

Engine settings, and why (compile_worker.py holds them: serialized code only loads into an
engine of the same settings):
- epoch interruption (not fuel): deadlines cost less guest speed than fuel, and a ticker
  thread gives wall-clock deadlines, which is what the step budget is about.
- for core modules, wasm threads/shared memory, memory64, multi-memory, GC off: a controller
  has exactly one 32-bit private memory (the ABI's pointers are u32; snapshots copy one
  memory). Exceptions and stack switching off too; SIMD stays on (fast guest mask kernels),
  and every import and export is read from the bytes (`wasm_shape`) before wasmtime is asked
  about its types.
- the pooling allocator with the first `keep_resident` bytes of each memory slot kept
  resident: every request and fork is a new instance, and writing its snapshot into fresh
  pages costs a page fault per 4 KiB, while in a reused, resident slot the same copy is a
  plain memcpy. If the pool cannot be reserved (it is virtual address space: ~4 GiB per slot,
  so ~4 TiB for 1024 slots, and x86-64 gives a process 128 TiB), we fall back to wasmtime's
  default allocator. The room is probed first: wasmtime aborts the process, rather than
  return an error, when the pool's reservation fails.
  Every slot that was ever used keeps up to `keep_resident` bytes resident for good (wasmtime
  zeroes them on reuse instead of giving them back), and wasmtime uses a never-used slot for a
  new instance while fewer than WARM_SLOTS unused slots are warm, so idle guest pages in RSS
  reach (WARM_SLOTS + the most live instances ever at once) x keep_resident. Both are kept
  small (wasmtime's default of warm slots is far more); keep_resident holds the snapshots of
  the built-in constraint controllers (benchmarks/RESULTS.md, "Numbers the code's design rests
  on", has what it saves a start).
"""

from __future__ import annotations

import platform
import threading
import time

import wasmtime
from wasmtime import _bindings as _wb

from .capi import addr, ffi, lib
from .compile_worker import make_config

__all__ = ["Engine", "TICK_MS", "KEEP_RESIDENT", "WASM_PAGE"]

WASM_PAGE = 65536
# The epoch tick. Deadlines are ceil(ms / tick) + 1 ticks, so a 25 ms deadline fires between
# 26 and 28 ms: 2 ms keeps that slack within a tenth of the step budget.
TICK_MS = 2.0


class Engine:
    """A wasmtime engine made with `settings` (compile_worker.py), its C pointer, and the ticker
    that advances its epoch while any of its stores is alive. `pooling`: the pooling allocator's
    slots, memory size and resident bytes (None: wasmtime's default allocator); when the pool
    cannot be had, `self.pooling` is False."""

    def __init__(self, settings: dict, tick_ms: float, pooling: dict | None = None):
        from .. import native

        native.library()  # first: its crash report must sit below wasmtime's signal handlers (native/crash.c)
        self.wasm, self.pooling = _make_engine(settings, pooling)
        self.keep_resident = pooling["keep_resident"] if self.pooling else 0
        self.ptr = ffi.cast("wasm_engine_t *", addr(self.wasm.ptr()))
        self.tick_ms = tick_ms
        self.ticker = _make_ticker(self.wasm, self.ptr, tick_ms / 1000)


WARM_SLOTS = 16  # unused pool slots kept warm before a new one is used (see the module docstring)
KEEP_RESIDENT = 2 << 20  # bytes of each used pool slot kept resident (see the module docstring)


def _config(settings: dict, pooling: dict | None) -> wasmtime.Config:
    cfg = make_config(settings)
    if pooling:
        pc = _wb.wasmtime_pooling_allocation_config_new()
        try:
            _wb.wasmtime_pooling_allocation_config_total_memories_set(pc, pooling["slots"])
            _wb.wasmtime_pooling_allocation_config_total_core_instances_set(pc, pooling["slots"])
            _wb.wasmtime_pooling_allocation_config_total_tables_set(pc, pooling["slots"])
            _wb.wasmtime_pooling_allocation_config_total_stacks_set(pc, 0)
            _wb.wasmtime_pooling_allocation_config_total_component_instances_set(pc, 0)
            _wb.wasmtime_pooling_allocation_config_max_memories_per_module_set(pc, 1)
            _wb.wasmtime_pooling_allocation_config_max_tables_per_module_set(pc, 1)
            _wb.wasmtime_pooling_allocation_config_max_memory_size_set(pc, pooling["max_memory"])
            _wb.wasmtime_pooling_allocation_config_linear_memory_keep_resident_set(pc, pooling["keep_resident"])
            _wb.wasmtime_pooling_allocation_config_max_unused_warm_slots_set(pc, WARM_SLOTS)
            _wb.wasmtime_pooling_allocation_strategy_set(cfg.ptr(), pc)
        finally:
            _wb.wasmtime_pooling_allocation_config_delete(pc)
    return cfg


SLOT_RESERVATION = (4 << 30) + (64 << 20)  # a pool slot's address space: a 4 GiB memory + guards (wasmtime's defaults)


def _address_space_free(nbytes: int) -> bool:
    """Whether `nbytes` of address space can be reserved now (reserved and given back at once)."""
    if platform.system() != "Linux":
        return True
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot_none, private_anonymous_noreserve = 0, 0x02 | 0x20 | 0x4000
    p = libc.mmap(None, nbytes, prot_none, private_anonymous_noreserve, -1, 0)
    if p is None or p == ctypes.c_void_p(-1).value:
        return False
    libc.munmap(p, nbytes)
    return True


def _make_engine(settings: dict, pooling: dict | None) -> tuple[wasmtime.Engine, bool]:
    if pooling and _address_space_free(pooling["slots"] * SLOT_RESERVATION + (1 << 40)):  # (and a TiB to spare)
        try:
            return wasmtime.Engine(_config(settings, pooling)), True
        except (wasmtime.WasmtimeError, OSError):
            pass  # e.g. a `ulimit -v` too small for the pool's reservations
    return wasmtime.Engine(_config(settings, None)), False


class _Ticker:
    """Advances the engine's epoch every tick while any store exists: an idle runtime (no live
    store: nothing could be running) doesn't tick at all. A store is created before any call
    into it, so deadlines always run against a ticking clock. Subclasses say how it ticks."""

    def __init__(self, engine, engine_ptr, period_s: float):
        self._engine = engine  # the engine must outlive the thread
        self._engine_ptr = engine_ptr
        self._period = period_s
        self._cond = threading.Condition()
        self._live = 0
        self._stopped = False
        self._orphaned = False  # the runtime is gone; end once its last store is

    def store_opened(self) -> None:
        with self._cond:
            self._live += 1
            self._wake()

    def store_closed(self) -> None:
        with self._cond:
            self._live -= 1
            if self._live == 0 and self._orphaned:
                self._end()

    def orphan(self) -> None:
        """The runtime was dropped without close(): controllers it started may still run,
        and their deadlines need ticks, so keep going until the last store is gone."""
        with self._cond:
            self._orphaned = True
            if self._live <= 0:
                self._end()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._end()

    def join(self, timeout: float) -> None:
        pass

    def _wake(self) -> None:
        """A store opened (the lock is held)."""
        raise NotImplementedError

    def _end(self) -> None:
        """Stopped, or orphaned with no store left (the lock is held)."""
        raise NotImplementedError


class _PythonTicker(_Ticker):
    """A daemon thread: each wake-up takes the GIL, so it is the fallback."""

    def __init__(self, engine, engine_ptr, period_s: float):
        super().__init__(engine, engine_ptr, period_s)
        self._thread = threading.Thread(target=self._run, name="rudder-epoch-ticker", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        if self._live == 1:
            self._cond.notify()

    def _end(self) -> None:
        self._cond.notify()

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        # A handle of our own on the engine: Python may free the runtime's handle before the
        # last store (objects in a reference cycle are finalised in any order at exit).
        increment, ptr, cond = lib.wasmtime_engine_increment_epoch, lib.wasmtime_engine_clone(self._engine_ptr), self._cond
        try:
            while True:
                with cond:
                    while self._live <= 0 and not self._stopped and not self._orphaned:
                        cond.wait()
                    if self._stopped or (self._orphaned and self._live <= 0):
                        return
                time.sleep(self._period)
                increment(ptr)
        finally:
            lib.wasm_engine_delete(ptr)


class _NativeTicker(_Ticker):
    """A native thread (rudder.native): no GIL, so the model's forward pass does not feel it. It
    starts with the first store and runs until the runtime is closed (or orphaned with no store
    left); a tick costs a few microseconds of one core."""

    def __init__(self, engine, engine_ptr, period_s: float):
        super().__init__(engine, engine_ptr, period_s)
        self._thread = None  # a rudder.native.NativeTicker while ticking
        self._engine_clone = None  # the engine handle it ticks

    def _wake(self) -> None:
        if self._thread is None:
            from .. import native

            increment = int(ffi.cast("uintptr_t", lib.wasmtime_engine_increment_epoch))
            # The thread ticks a handle of its own, deleted after it stopped: Python may
            # free the runtime's handle first (a reference cycle is finalised in any order
            # at exit), and a tick on a freed engine killed the process with SIGSEGV.
            self._engine_clone = lib.wasmtime_engine_clone(self._engine_ptr)
            self._thread = native.NativeTicker(int(ffi.cast("uintptr_t", self._engine_clone)), increment,
                                               self._period)

    def _end(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
            lib.wasm_engine_delete(self._engine_clone)
            self._engine_clone = None


def _make_ticker(engine, engine_ptr, period_s: float):
    """The native ticker when the native library builds, else the Python one."""
    from .. import native

    if native.library() is not None:
        return _NativeTicker(engine, engine_ptr, period_s)
    return _PythonTicker(engine, engine_ptr, period_s)
