"""ControllerRuntime: the wasmtime engine, the epoch ticker, the module cache and the token
table, shared by every controller of one LLM/server.

Engine settings, and why:
- epoch interruption (not fuel): deadlines cost ~6% of guest speed instead of ~9%, and a
  ticker thread gives wall-clock deadlines, which is what the step budget is about.
- wasm threads/shared memory, memory64, multi-memory, GC off: a controller has exactly one
  32-bit private memory (the ABI's pointers are u32; snapshots copy one memory). Exceptions
  and stack switching off too; SIMD stays on (fast guest mask kernels), and every import and
  export is read from the bytes (`wasm_shape`) before wasmtime is asked about its types.
- the pooling instance allocator with the first `keep_resident` bytes of each memory slot
  kept resident: every request and fork is a new instance, and writing its snapshot into
  fresh pages costs a page fault per 4 KiB (a 1.3 MB token table: ~0.8 ms); in a reused,
  resident slot the same copy takes ~0.1 ms. If the pool cannot be reserved (it is virtual
  address space: ~4 GiB per slot, so ~4 TiB for 1024 slots, and x86-64 gives a process 128 TiB),
  we fall back to wasmtime's default allocator. The room is probed first: wasmtime aborts the
  process, rather than return an error, when the pool's reservation fails.
  Every slot that was ever used keeps up to `keep_resident` bytes resident for good (wasmtime
  zeroes them on reuse instead of giving them back), and wasmtime uses a never-used slot for a
  new instance while fewer than WARM_SLOTS unused slots are warm, so idle guest pages in RSS
  reach (WARM_SLOTS + the most live instances ever at once) x keep_resident. Both are kept
  small: WARM_SLOTS 16 (wasmtime's default of 100 kept ~100 x keep_resident), keep_resident
  2 MiB, which holds the snapshots of the built-in constraint controllers (1.3-1.6 MB; a start
  took the same 0.3 ms as with 4 MiB, 0.5-0.6 ms with 1 MiB, 0.8-0.9 ms with none) and halved
  the pool's share of the growth benchmarks/soak.py measured.
"""

from __future__ import annotations

import platform
import threading
import time
import weakref
from importlib.metadata import version as _pkg_version
from pathlib import Path

import wasmtime
from wasmtime import _bindings as _wb

from .controller import Controller
from .errors import ControllerError
from .fastcall import addr, ffi, lib
from .host_api import HostState, RequestContext, define_imports
from .budgets import GuestMemory, SnapshotCache
from .compile_worker import COMPONENT_ENGINE, CONTROLLER_ENGINE, make_config
from .compiler import CompileLimits, Compiler
from .component import ComponentCache, ComponentModule, ComponentSupport, is_component
from .instance import WASM_PAGE, Instance
from .limits import Limits, deadline_ticks
from .module import ControllerModule, check_binary, check_module, check_shape
from .module_cache import ModuleCache, default_cache_dir, fingerprint, read_wasm, sha256_hex
from .snapshot import restore_snapshot, take_snapshot
from .token_table import token_table_for

__all__ = ["ControllerRuntime"]

# The epoch tick. Deadlines are ceil(ms / tick) + 1 ticks, so a 25 ms deadline fires between
# 26 and 28 ms: 2 ms keeps that slack within ~10% of the step budget. The native ticker costs a
# few microseconds a tick; the Python fallback is a GIL-taking wake-up (~2% of one core at
# 500/s, measured here, and only while a controller instance exists).
TICK_MS = 2.0
MAX_MODULE_BYTES = 64 << 20  # compile time grows with size; no real controller is near this
MAX_COMPONENT_BYTES = 64 << 20  # a componentize-py component is ~18 MB (CPython inside), componentize-js ~12 MB
# Deterministic init failures are remembered so a broken module fails fast on every request;
# timeouts and pool exhaustion depend on load, so those are retried.
_STICKY_INIT_KINDS = {"init", "bad_module", "trap", "oom", "invalid_result"}
# Server-wide memory budgets (rudder serve --guest-memory-mb / --snapshot-memory-mb).
DEFAULT_GUEST_MEMORY = 4 << 30    # linear memory of all live instances together
DEFAULT_SNAPSHOT_BYTES = 512 << 20  # post-init snapshots kept for loaded modules


class _Shared:
    """What instances and host functions need from the runtime (no reference back to it, so
    the runtime can be collected while controllers are still alive)."""

    def __init__(self, engine, tokenizer, limits: Limits, tick_ms: float, eager_bytes: int,
                 backtrack_allowed: bool, guest_memory: GuestMemory, snapshots: SnapshotCache):
        self.engine = engine
        self.engine_ptr = ffi.cast("wasm_engine_t *", addr(engine.ptr()))
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.limits = limits
        self.tick_ms = tick_ms
        self.eager_bytes = eager_bytes
        self.backtrack_allowed = backtrack_allowed
        self.closed = False
        self.guest_memory = guest_memory  # every live instance's linear memory, against a budget
        self.snapshots = snapshots  # post-init snapshots of loaded modules, bounded in bytes
        self.ticker = None  # the runtime's _Ticker, told when stores come and go
        self._table: bytes | None = None
        self._table_lock = threading.Lock()

    @property
    def token_table(self) -> bytes:
        if self._table is None:
            with self._table_lock:
                if self._table is None:
                    self._table = token_table_for(self.tokenizer)
        return self._table


WARM_SLOTS = 16  # unused pool slots kept warm before a new one is used (see the module docstring)
KEEP_RESIDENT = 2 << 20  # bytes of each used pool slot kept resident (see the module docstring)


def _config(pooling: dict | None) -> wasmtime.Config:
    cfg = make_config(CONTROLLER_ENGINE)  # the compile worker's settings too (compile_worker.py)
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


def _make_engine(limits: Limits, slots: int, keep_resident: int) -> tuple[wasmtime.Engine, bool]:
    if slots > 0 and _address_space_free(slots * SLOT_RESERVATION + (1 << 40)):  # (and a TiB to spare)
        pooling = {"slots": slots, "max_memory": max(limits.memory_bytes, WASM_PAGE),
                   "keep_resident": keep_resident}
        try:
            return wasmtime.Engine(_config(pooling)), True
        except (wasmtime.WasmtimeError, OSError):
            pass  # e.g. a `ulimit -v` too small for the pool's reservations
    return wasmtime.Engine(_config(None)), False


class _Ticker:
    """A daemon thread that advances the engine's epoch every tick while any store exists.

    Each wake-up costs ~50 us of CPU in Python (2-3% of a core at 500/s), so an idle runtime
    (no live store: nothing could be running) doesn't tick at all. A store is created before
    any call into it, so deadlines always run against a ticking clock."""

    def __init__(self, engine, engine_ptr, period_s: float):
        self._engine = engine  # the engine must outlive the thread
        self._engine_ptr = engine_ptr
        self._period = period_s
        self._cond = threading.Condition()
        self._live = 0
        self._stopped = False
        self._orphaned = False  # the runtime is gone; exit once its last store is
        self._thread = threading.Thread(target=self._run, name="rudder-epoch-ticker", daemon=True)
        self._thread.start()

    def store_opened(self) -> None:
        with self._cond:
            self._live += 1
            if self._live == 1:
                self._cond.notify()

    def store_closed(self) -> None:
        with self._cond:
            self._live -= 1
            if self._live == 0 and self._orphaned:
                self._cond.notify()

    def orphan(self) -> None:
        """The runtime was dropped without close(): controllers it started may still run,
        and their deadlines need ticks, so keep going until the last store is gone."""
        with self._cond:
            self._orphaned = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
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


class _NativeTicker:
    """The same duty from a native thread (rudder.native): no GIL, so the model's forward pass
    does not feel it. It starts with the first store and runs until the runtime is closed (or
    orphaned with no store left); a tick costs a few microseconds of one core."""

    def __init__(self, engine, engine_ptr, period_s: float):
        self._engine = engine  # the engine must outlive the thread
        self._engine_ptr = engine_ptr
        self._period = period_s
        self._lock = threading.Lock()
        self._live = 0
        self._orphaned = False
        self._thread = None  # a rudder.native.NativeTicker while ticking
        self._engine_clone = None  # the engine handle it ticks

    def store_opened(self) -> None:
        with self._lock:
            self._live += 1
            if self._thread is None:
                from .. import native

                increment = int(ffi.cast("uintptr_t", lib.wasmtime_engine_increment_epoch))
                # The thread ticks a handle of its own, deleted after it stopped: Python may
                # free the runtime's handle first (a reference cycle is finalised in any order
                # at exit), and a tick on a freed engine killed the process with SIGSEGV.
                self._engine_clone = lib.wasmtime_engine_clone(self._engine_ptr)
                self._thread = native.NativeTicker(int(ffi.cast("uintptr_t", self._engine_clone)), increment,
                                                   self._period)

    def store_closed(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0 and self._orphaned:
                self._stop_locked()

    def orphan(self) -> None:
        with self._lock:
            self._orphaned = True
            if self._live <= 0:
                self._stop_locked()

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def join(self, timeout: float) -> None:
        pass  # stop() already waited for the thread

    def _stop_locked(self) -> None:
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
    return _Ticker(engine, engine_ptr, period_s)


class ControllerRuntime:
    """Loads controller modules and starts controllers for requests.

    `limits` are the server's defaults and ceilings (a dict lowers the ABI defaults); a
    request passes its own to `start`, which can only lower them. `cache_dir` holds compiled modules (default
    `$RUDDER_HOME/wasm-cache`; pass `False` for no disk cache). `max_instances` bounds the
    live instances (requests + forks + one per module being initialised) the pooling
    allocator reserves room for. Modules are compiled in worker processes within
    `compile_limits` (compiler.py; default: CompileLimits with memories up to `limits`), at most
    two at once: `self.compiler.configure(...)` changes that.
    """

    def __init__(self, tokenizer, limits: Limits = Limits(), cache_dir: Path | None = None, *,
                 max_instances: int = 1024, keep_resident: int = KEEP_RESIDENT,
                 backtrack_allowed: bool = True, tick_ms: float = TICK_MS,
                 guest_memory_bytes: int = DEFAULT_GUEST_MEMORY, snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
                 compile_limits: CompileLimits | None = None):
        if not isinstance(limits, Limits):
            limits = Limits().capped(limits)
        keep_resident = -(-int(keep_resident) // WASM_PAGE) * WASM_PAGE
        self.limits = limits
        engine, self.pooling = _make_engine(limits, max_instances, keep_resident)
        self.engine = engine
        self._shared = _Shared(engine, tokenizer, limits, tick_ms, keep_resident if self.pooling else 0,
                               backtrack_allowed, GuestMemory(guest_memory_bytes), SnapshotCache(snapshot_bytes))
        self.linker = wasmtime.Linker(engine)
        define_imports(self.linker)
        # Everything that changes compiled code or what the load-time checks accept (bump the
        # "rudder-controller-N" tag when the checks change): runtimes that differ in these
        # use different files instead of overwriting each other's.
        fp = fingerprint("rudder-controller-2", _pkg_version("wasmtime"), platform.machine(),
                         "epoch", "speed", "pooling" if self.pooling else "ondemand",
                         limits.memory_bytes)
        if cache_dir is None:
            cache_dir = default_cache_dir()
        self.compiler = Compiler(compile_limits or CompileLimits(memory_pages=limits.memory_bytes // WASM_PAGE))
        self.cache = ModuleCache(engine, fp, cache_dir or None, compiler=self.compiler, settings=CONTROLLER_ENGINE)
        self._ticker = _make_ticker(engine, self._shared.engine_ptr, tick_ms / 1000)
        self._shared.ticker = self._ticker
        self._cache_dir = cache_dir
        self._components: ComponentSupport | None = None  # made when the first component loads
        self._components_lock = threading.Lock()
        self._tickers = [self._ticker]
        # A runtime dropped without close() lets its tickers end with their last store.
        self._finalizer = weakref.finalize(self, _orphan_all, self._tickers)

    @property
    def tokenizer(self):
        return self._shared.tokenizer

    @property
    def tick_ms(self) -> float:
        return self._shared.tick_ms

    # ------------------------------------------------------------------ load

    def load(self, wasm: bytes | str | Path) -> ControllerModule:
        """Validate and compile a controller (cached by the sha256 of its bytes).
        Raises ControllerError (kind bad_module or bad_import)."""
        self._check_open()
        data = read_wasm(wasm)
        sha = sha256_hex(data)
        if is_component(data):  # a Python or JavaScript controller (component.py)
            if len(data) > MAX_COMPONENT_BYTES:
                raise ControllerError("bad_module", f"the component is {len(data) >> 20} MiB, over the "
                                      f"{MAX_COMPONENT_BYTES >> 20} MiB limit")
            return self._component_support().load(data, sha)
        cached = self.cache.get(sha)
        if isinstance(cached, ControllerError):  # a module that failed before: fail fast
            raise ControllerError(cached.kind, str(cached))
        if cached is not None:
            return cached
        hit = self.cache.from_disk(sha)
        if hit is not None:
            module, compiled_size, meta = hit
            mutable_globals = tuple(meta.get("mutable_globals", ()))
        else:
            try:
                if len(data) > MAX_MODULE_BYTES:
                    raise ControllerError("bad_module", f"the module is {len(data) >> 20} MiB, over "
                                          f"the {MAX_MODULE_BYTES >> 20} MiB limit")
                check_binary(data)
                module = self.cache.compile(data)
                check_shape(data)  # before wasmtime describes any type (v128 would abort)
                mutable_globals = check_module(module)
            except ControllerError as e:
                # a copy: `e`'s traceback holds this frame, and with it the wasm bytes and the
                # compiled module, for as long as the cache keeps the failure; a busy compiler
                # is no failure of the module's
                if not e.busy:
                    self.cache.put(sha, ControllerError(e.kind, str(e), e.log_tail))
                raise
            compiled_size = self.cache.store(sha, module, {"mutable_globals": list(mutable_globals)})
        try:
            pre = self.linker.instantiate_pre(module)
        except wasmtime.WasmtimeError as e:
            raise ControllerError("bad_import", f"cannot link the controller: {str(e).splitlines()[0]}") from None
        pre_ptr = ffi.cast("wasmtime_instance_pre_t *", addr(pre.ptr()))
        cmod = ControllerModule(sha, len(data), compiled_size, module, pre, pre_ptr,
                                mutable_globals, self._shared)
        return self.cache.put(sha, cmod)

    # ------------------------------------------------------------------ start

    def start(self, module: ControllerModule, arg: bytes | str = b"",
              limits: Limits | dict | None = None, seed: int | None = None) -> Controller:
        """A controller for a new request: a fresh instance holding the module's post-init
        state, after rudder_start has accepted `arg`. `seed` seeds a component's WASI random
        (else it derives from the argument, so a repeated request repeats). Raises ControllerError."""
        self._check_open()
        if module.shared is not self._shared:
            raise ValueError("this module was loaded by another ControllerRuntime")
        lim = self.limits.capped(limits)
        if isinstance(arg, str):
            arg = arg.encode("utf-8")
        if isinstance(module, ComponentModule):
            return self._components.start(module, arg, lim, _STICKY_INIT_KINDS, seed)
        snap = self._ensure_init(module)
        shared = self._shared
        shared.snapshots.used(module)
        shared.guest_memory.admit(snap.size, "start a controller")
        request = RequestContext(bytes(arg), lim)
        ticks = deadline_ticks(lim.init_ms, shared.tick_ms)
        inst = Instance(shared, module, HostState(shared, request), lim.memory_bytes, ticks)
        try:
            restore_snapshot(inst, snap)
            inst.vals_i32[0] = 0
            status = inst.call("rudder_start", 1, ticks, lim.init_ms)
            if status != 0:
                reason = _last_line(inst.log_tail())
                raise ControllerError("start", f"the controller rejected the request (rudder_start returned {status})"
                                      + (f": {reason}" if reason else "; its log is empty"), inst.log_tail())
        except BaseException:
            inst.store.close()  # its memory goes now, not when a traceback that holds it is collected
            raise
        request.live = 1
        return Controller(shared, module, request, inst)

    def _ensure_init(self, cmod: ControllerModule):
        """The module's post-init snapshot, running rudder_init the first time."""
        snap = cmod.snapshot
        if snap is not None:
            return snap
        with cmod.init_lock:
            if cmod.snapshot is not None:
                return cmod.snapshot
            if cmod.init_error is not None:
                e = cmod.init_error
                raise ControllerError(e.kind, str(e), e.log_tail)
            try:
                self._shared.snapshots.add(cmod, self._run_init(cmod))
            except ControllerError as e:
                if e.kind in _STICKY_INIT_KINDS:
                    cmod.init_error = e
                raise
            return cmod.snapshot

    def _run_init(self, cmod: ControllerModule):
        shared, lim = self._shared, self.limits
        shared.token_table  # built before the deadline starts, not inside an import
        ticks = deadline_ticks(lim.init_ms, shared.tick_ms)
        inst = Instance(shared, cmod, HostState(shared), lim.memory_bytes, ticks)
        try:
            inst.vals_i32[0] = 0
            abi = inst.call("rudder_abi_version", 1, ticks, lim.init_ms)
            if abi != 1:
                raise ControllerError("bad_module", f"the controller was built for ABI version {abi}; "
                                      f"this host implements version 1", inst.log_tail())
            inst.vals_i32[0] = 0
            status = inst.call("rudder_init", 1, ticks, lim.init_ms)
            if status != 0:
                raise ControllerError("init", f"rudder_init returned {status} (see the controller's log)",
                                      inst.log_tail())
            fresh = Instance(shared, cmod, HostState(shared), lim.memory_bytes, ticks)
            try:
                return take_snapshot(inst, fresh)
            finally:
                fresh.store.close()
        finally:
            # Both go now, success or not: their memory leaves the guest memory budget at once
            # (a traceback that holds them could keep them for as long as it lives).
            inst.store.close()

    # ------------------------------------------------------------------ components

    def _component_support(self) -> ComponentSupport:
        """The engine, ticker, linker and cache of component controllers, made on first use."""
        with self._components_lock:
            if self._components is None:
                engine = wasmtime.Engine(_component_config())
                engine_ptr = ffi.cast("wasm_engine_t *", addr(engine.ptr()))
                ticker = _make_ticker(engine, engine_ptr, self._shared.tick_ms / 1000)
                self._tickers.append(ticker)
                fp = fingerprint("rudder-component-1", _pkg_version("wasmtime"), platform.machine(), "epoch", "speed")
                cache_dir = default_cache_dir() if self._cache_dir is None else self._cache_dir
                cache = ComponentCache(ModuleCache(engine, fp, cache_dir or None, compiler=self.compiler,
                                                   settings=COMPONENT_ENGINE, component=True))
                self._components = ComponentSupport(self._shared, engine, ticker, cache, self._hand_off)
            return self._components

    def _hand_off(self, name: str, arg: str, limits: Limits) -> Controller:
        """A built-in controller started for a component's hand-off (within its request's limits)."""
        from .build import BUILTIN_CONTROLLERS, BuildError, builtin_controller

        if name not in BUILTIN_CONTROLLERS:
            raise ControllerError("invalid_result", f"there is no built-in controller {name!r} "
                                  f"(known: {', '.join(BUILTIN_CONTROLLERS)})")
        try:
            module = self.load(builtin_controller(name).read_bytes())
        except BuildError as e:
            raise ControllerError("limit", f"the built-in controller {name!r} cannot be built here: "
                                  f"{e.summary}") from None
        return self.start(module, arg, limits)

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._shared.closed:
            raise RuntimeError("the ControllerRuntime is closed")

    def close(self) -> None:
        """Stop the epoch ticker. Live controllers refuse further calls (without ticks a
        runaway guest could no longer be interrupted)."""
        if self._shared.closed:
            return
        self._shared.closed = True
        for ticker in list(self._tickers):
            ticker.stop()
            ticker.join(timeout=1.0)

    def __enter__(self) -> "ControllerRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        shared = self._shared
        return dict(self.cache.stats, pooling=self.pooling, guest_memory_bytes=shared.guest_memory.used,
                    guest_memory_budget=shared.guest_memory.budget, snapshot_bytes=shared.snapshots.bytes,
                    snapshot_budget=shared.snapshots.budget)

    @property
    def guest_memory(self):
        """The live instances' linear memory against its budget (GuestMemory: used, budget, peak)."""
        return self._shared.guest_memory


def _orphan_all(tickers: list) -> None:
    for ticker in tickers:
        ticker.orphan()


def _component_config() -> wasmtime.Config:
    """The component engine (COMPONENT_ENGINE); the default allocator (see component.py)."""
    return make_config(COMPONENT_ENGINE)


def _last_line(log: str) -> str:
    """The last non-empty line of a log: what a controller printed just before refusing."""
    lines = [ln.strip() for ln in log.strip().splitlines() if ln.strip()]
    return "".join(ch if ch.isprintable() else "?" for ch in lines[-1][:300]) if lines else ""

