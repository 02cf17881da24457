"""ControllerRuntime: loads controllers and starts them for requests, one path for every shape.

A runtime holds what every controller of one LLM/server shares: the tokenizer and its token
table, the server's limits, the guest memory and snapshot budgets, the compiler and the
compiled-code cache, and one `shape` per kind of controller: core modules (core.py, always)
and components (component.py, made when the first one loads). A shape holds its engine and
linker and knows what is its own: the checks of compiled code, instantiation, the calling
convention, lifting an answer and copying state. Loading (cached by sha256, failures
remembered), init once per module (its snapshot kept within the snapshot budget), and the
admission of every start into the guest memory budget are the same for both.
"""

from __future__ import annotations

import platform
import threading
import weakref
from importlib.metadata import version as _pkg_version
from pathlib import Path

from .budgets import GuestMemory, SnapshotCache
from .compile_worker import COMPONENT_ENGINE, CONTROLLER_ENGINE
from .compiler import CompileLimits, Compiler
from .component import ComponentShape, is_component
from .component_host import bytes_to_wit
from .controller import Controller, ControllerModule
from .core import CoreShape, pooling
from .engines import KEEP_RESIDENT, TICK_MS, WASM_PAGE, Engine
from .errors import ControllerError
from .host_api import RequestContext
from .limits import Limits
from .module_cache import ModuleCache, default_cache_dir, fingerprint, read_wasm, sha256_hex
from .token_table import parse_header, token_table_for

__all__ = ["ControllerRuntime"]

# Deterministic init failures are remembered so a broken module fails fast on every request;
# timeouts and pool exhaustion depend on load, so those are retried.
_STICKY_INIT_KINDS = {"init", "bad_module", "trap", "oom", "invalid_result"}
# Server-wide memory budgets (rudder serve --guest-memory-mb / --snapshot-memory-mb).
DEFAULT_GUEST_MEMORY = 4 << 30    # linear memory of all live instances together
DEFAULT_SNAPSHOT_BYTES = 512 << 20  # post-init snapshots kept for loaded modules


class _Shared:
    """What shapes, instances and host functions need from the runtime (no reference back to
    it, so the runtime can be collected while controllers are still alive)."""

    def __init__(self, tokenizer, limits: Limits, backtrack_allowed: bool, guest_memory: GuestMemory,
                 snapshots: SnapshotCache):
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.limits = limits
        self.backtrack_allowed = backtrack_allowed
        self.closed = False
        self.guest_memory = guest_memory  # every live instance's linear memory, against a budget
        self.snapshots = snapshots  # post-init snapshots of loaded modules, bounded in bytes
        self._table: bytes | None = None
        self._table_wit: bytes | None = None
        self._pieces: list[bytes] | None = None
        self._table_lock = threading.Lock()

    @property
    def token_table(self) -> bytes:
        """The token table (docs/abi.md), built on first use."""
        if self._table is None:
            with self._table_lock:
                if self._table is None:
                    self._table = token_table_for(self.tokenizer)
        return self._table

    @property
    def token_table_wit(self) -> bytes:
        """The token table as a component reads it (a WIT bytes string)."""
        if self._table_wit is None:
            self._table_wit = bytes_to_wit(self.token_table)
        return self._table_wit

    @property
    def token_pieces(self) -> list[bytes]:
        """Each token's bytes (a component's `detokenize`)."""
        if self._pieces is None:
            t = parse_header(self.token_table)
            offsets, data = t["offsets"].tolist(), t["bytes"]
            self._pieces = [data[offsets[i]:offsets[i + 1]] for i in range(t["vocab_size"])]
        return self._pieces


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
            limits = Limits().lowered(limits)
        keep_resident = -(-int(keep_resident) // WASM_PAGE) * WASM_PAGE
        self.limits = limits
        self.tick_ms = tick_ms
        self._shared = _Shared(tokenizer, limits, backtrack_allowed, GuestMemory(guest_memory_bytes),
                               SnapshotCache(snapshot_bytes))
        self._cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        self.compiler = Compiler(compile_limits or CompileLimits(memory_pages=limits.memory_bytes // WASM_PAGE))
        engine = Engine(CONTROLLER_ENGINE, tick_ms, pooling(limits, max_instances, keep_resident) if max_instances > 0
                        else None)
        self.pooling = engine.pooling
        # What changes compiled code or what the load-time checks accept (bump the
        # "rudder-controller-N" tag when the checks change): runtimes that differ in these
        # use different files instead of overwriting each other's.
        self._core = CoreShape(self._shared, engine, self._cache(
            engine, CONTROLLER_ENGINE, "rudder-controller-2", "pooling" if self.pooling else "ondemand",
            limits.memory_bytes))
        self.cache = self._core.cache
        self._components: ComponentShape | None = None  # made when the first component loads
        self._components_lock = threading.Lock()
        self._engines = [engine]
        # A runtime dropped without close() lets its tickers end with their last store.
        self._finalizer = weakref.finalize(self, _orphan_all, self._engines)

    @property
    def tokenizer(self):
        return self._shared.tokenizer

    def _cache(self, engine: Engine, settings: dict, *tags) -> ModuleCache:
        fp = fingerprint(*tags[:1], _pkg_version("wasmtime"), platform.machine(), "epoch", "speed", *tags[1:])
        return ModuleCache(engine.wasm, fp, self._cache_dir or None, compiler=self.compiler, settings=settings,
                           component=settings is COMPONENT_ENGINE)

    # ------------------------------------------------------------------ load

    def load(self, wasm: bytes | str | Path) -> ControllerModule:
        """Validate and compile a controller, a core module or a component (cached by the sha256
        of its bytes). Raises ControllerError (kind bad_module, bad_import or limit)."""
        self._check_open()
        data = read_wasm(wasm)
        sha = sha256_hex(data)
        shape = self._component_shape() if is_component(data) else self._core
        cached = shape.cache.get(sha)
        if isinstance(cached, ControllerError):  # a module that failed before: fail fast
            raise ControllerError(cached.kind, str(cached))
        if cached is not None:
            return cached
        try:
            hit = shape.cache.from_disk(sha)
            if hit is not None:
                compiled, compiled_size, meta = hit
            else:
                if len(data) > shape.max_bytes:
                    raise ControllerError("bad_module", f"the {shape.kind} is {len(data) >> 20} MiB, over the "
                                          f"{shape.max_bytes >> 20} MiB limit")
                shape.precheck(data)
                compiled = shape.cache.compile(data)
                meta = shape.inspect(compiled, data)
                compiled_size = shape.cache.store(sha, compiled, meta)
            module = shape.module(sha, data, compiled, compiled_size, meta)
        except ControllerError as e:
            # a copy: `e`'s traceback holds this frame, and with it the wasm bytes and the
            # compiled code, for as long as the cache keeps the failure; a busy compiler is
            # no failure of the module's
            if not e.busy:
                shape.cache.put(sha, ControllerError(e.kind, str(e), e.log_tail))
            raise
        return shape.cache.put(sha, module)

    # ------------------------------------------------------------------ start

    def start(self, module: ControllerModule, arg: bytes | str = b"",
              limits: Limits | dict | None = None, seed: int | None = None) -> Controller:
        """A controller for a new request: a fresh instance holding the module's post-init
        state, after its start hook accepted `arg`. `seed` seeds a component's WASI random
        (else it derives from the argument, so a repeated request repeats). Raises ControllerError."""
        self._check_open()
        if module.shared is not self._shared:
            raise ValueError("this module was loaded by another ControllerRuntime")
        lim = self.limits.capped(limits)
        if isinstance(arg, str):
            arg = arg.encode("utf-8")
        snap = self._ensure_init(module)
        shared = self._shared
        shared.snapshots.used(module)
        shared.guest_memory.admit(module.start_bytes(snap, lim), "start a controller")
        request = RequestContext(bytes(arg), lim, seed)
        try:
            ctl = module.shape.start(module, request, snap)
        except ControllerError as e:
            reason = _last_line(e.log_tail)
            if e.kind != "start" or not reason or str(e).endswith(reason):
                raise
            # what the controller printed just before refusing is, with every SDK, why
            raise ControllerError("start", f"{e}: {reason}", e.log_tail) from None
        request.live = 1
        return ctl

    def _ensure_init(self, cmod: ControllerModule):
        """The module's post-init snapshot, running its init the first time (and again after
        the snapshot budget dropped it)."""
        snap = cmod.snapshot
        if snap is not None:
            return snap
        with cmod.init_lock:
            if cmod.snapshot is not None:
                return cmod.snapshot
            if cmod.init_error is not None:
                e = cmod.init_error
                raise ControllerError(e.kind, str(e), e.log_tail)
            self._shared.token_table  # built before any deadline starts, not inside an import
            try:
                snap = cmod.shape.run_init(cmod)
            except ControllerError as e:
                if e.kind in _STICKY_INIT_KINDS:
                    cmod.init_error = e.detached()
                raise
            self._shared.snapshots.add(cmod, snap)
            return snap

    # ------------------------------------------------------------------ components

    def _component_shape(self) -> ComponentShape:
        """The engine, linker and cache of component controllers, made on first use."""
        with self._components_lock:
            if self._components is None:
                engine = Engine(COMPONENT_ENGINE, self.tick_ms)
                self._engines.append(engine)
                self._components = ComponentShape(self._shared, engine, self._cache(
                    engine, COMPONENT_ENGINE, "rudder-component-1"), self._hand_off)
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
        for engine in list(self._engines):
            engine.ticker.stop()
            engine.ticker.join(timeout=1.0)

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


def _orphan_all(engines: list) -> None:
    for engine in engines:
        engine.ticker.orphan()


def _last_line(log: str) -> str:
    """The last non-empty line of a log, printable."""
    lines = [ln.strip() for ln in log.strip().splitlines() if ln.strip()]
    return "".join(ch if ch.isprintable() else "?" for ch in lines[-1][:300]) if lines else ""
