"""Controllers that are WebAssembly components (wit/controller.wit): Python and JavaScript
controllers built with componentize-py and componentize-js, run beside core modules under the
same rules (docs/components.md).

What differs from core modules, and why:
- The host cannot copy a component's memory (the component model hides it), so state is copied
  by the guest: `save` returns the controller's state as bytes and `restore` loads it into a
  fresh instance (the SDKs pickle / serialise the controller object). That is the post-init
  snapshot every request starts from, and how a fork gets its own state.
- Guest memory cannot be read either, so each instance is counted in the server's guest
  memory budget at the most it may grow to (its memories times the memory limit).
- A component runs in an engine of its own (no pooling allocator: a component has many core
  instances, tables and a large memory image), with its own epoch ticker.
- Constraint engines: a step may hand the sequence to a built-in controller (json, regex,
  grammar, ...: core modules built from the C SDK) until it stops; its masks stay in its own
  memory, so a constrained step costs what it costs under that controller alone.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from ..branch import Branch
from .component_capi import KIND, addr, ffi, lib
from .component_host import ComponentHostState, bytes_to_wit, define_host, define_random
from .component_instance import ComponentInstance
from .component_result import HandOff, StepDecoder, read_failure, read_string
from .component_types import check_component
from .errors import ControllerError
from .host_api import TOKENIZE_BYTES_STEP, RequestContext
from .token_table import parse_header

__all__ = ["ComponentCache", "ComponentModule", "ComponentSupport", "ComponentController", "is_component"]

# A component binary: the wasm magic, then version 0x0d and layer 1.
COMPONENT_HEADER = b"\0asm\x0d\x00\x01\x00"


def is_component(data: bytes) -> bool:
    return data[:8] == COMPONENT_HEADER


@dataclass(frozen=True)
class ComponentSnapshot:
    """The post-init state of a component controller, as its `save` returned it (the UTF-8 of a
    WIT bytes string, handed back to `restore` as it is)."""

    state: bytes

    @property
    def stored_bytes(self) -> int:
        return len(self.state)


class ComponentModule:
    """A loaded component controller (same public fields as ControllerModule)."""

    kind = "component"

    def __init__(self, sha256: str, wasm_size: int, compiled_size: int, component, memories: int, support):
        self.sha256 = sha256
        self.wasm_size = wasm_size
        self.compiled_size = compiled_size
        self.component = component  # the wasmtime-py Component (owns the compiled code)
        self.ptr = ffi.cast("wasmtime_component_t *", addr(component.ptr()))
        self.memories = memories
        self.shared = support.shared
        self.support = support
        self.export_index = {}
        for name in ("init", "start", "mid-process", "save", "restore"):
            raw = name.encode()
            index = lib.wasmtime_component_get_export_index(self.ptr, ffi.NULL, raw, len(raw))
            if index == ffi.NULL:
                raise ControllerError("bad_module", f"the component does not export {name}")
            self.export_index[name] = ffi.gc(index, lib.wasmtime_component_export_index_delete)
        self.init_lock = threading.Lock()
        self.snapshot: ComponentSnapshot | None = None
        self.init_error: ControllerError | None = None

    def charge(self, memory_limit: int) -> int:
        """Bytes an instance counts in the guest memory budget: the most its memories may reach."""
        return max(1, self.memories) * int(memory_limit)

    def __repr__(self) -> str:
        return f"ComponentModule(sha256={self.sha256[:12]}..., wasm_size={self.wasm_size})"


class ComponentSupport:
    """The component side of a ControllerRuntime: engine, linker, compile cache, init and start."""

    def __init__(self, shared, engine, ticker, cache, builtin):
        self.shared = shared           # the runtime's _Shared: tokenizer, limits, budgets, token table
        self.engine = engine
        self.engine_ptr = ffi.cast("wasm_engine_t *", addr(engine.ptr()))
        self.ticker = ticker
        self.cache = cache             # a ModuleCache over this engine (components by sha256)
        self.builtin = builtin         # name -> a loaded built-in core module (for hand-offs)
        self.linker = ffi.gc(lib.wasmtime_component_linker_new(self.engine_ptr), lib.wasmtime_component_linker_delete)
        define_host(self.linker)
        self._random_defined: set[str] = set()
        self._pieces: list[bytes] | None = None
        self._table_wit: bytes | None = None
        self._lock = threading.Lock()
        self._seeds = 0

    # ---------------------------------------------------------------- what host functions read

    @property
    def vocab_size(self) -> int:
        return self.shared.vocab_size

    @property
    def eos_token_id(self):
        return self.shared.eos_token_id

    @property
    def limits(self):
        return self.shared.limits

    @property
    def backtrack_allowed(self) -> bool:
        return self.shared.backtrack_allowed

    @property
    def tokenizer(self):
        return self.shared.tokenizer

    @property
    def tick_ms(self) -> float:
        return self.shared.tick_ms

    @property
    def guest_memory(self):
        return self.shared.guest_memory

    @property
    def token_table_wit(self) -> bytes:
        if self._table_wit is None:
            self._table_wit = bytes_to_wit(self.shared.token_table)
        return self._table_wit

    @property
    def token_pieces(self) -> list[bytes]:
        if self._pieces is None:
            t = parse_header(self.shared.token_table)
            offsets, data = t["offsets"].tolist(), t["bytes"]
            self._pieces = [data[offsets[i]:offsets[i + 1]] for i in range(t["vocab_size"])]
        return self._pieces

    # ---------------------------------------------------------------- load

    def load(self, data: bytes, sha: str):
        """Compile (or take from the disk cache) and check a component; ControllerError if bad."""
        cached = self.cache.get(sha)
        if isinstance(cached, ControllerError):
            raise ControllerError(cached.kind, str(cached))
        if cached is not None:
            return cached
        hit = self.cache.from_disk(sha)
        if hit is not None:
            component, compiled_size, meta = hit
            random_imports = meta.get("random", [])
            memories = int(meta.get("memories", 1))
        else:
            try:
                component = self.cache.compile(data)
                random_imports, memories = check_component(component, self.engine, data)
            except ControllerError as e:
                if not e.busy:  # a busy compiler is no failure of the component's
                    self.cache.put(sha, e)
                raise
            compiled_size = self.cache.store(sha, component, {"random": random_imports, "memories": memories})
        for name in random_imports:
            define_random(self.linker, name, self._random_defined)
        try:
            cmod = ComponentModule(sha, len(data), compiled_size, component, memories, self)
        except ControllerError as e:
            self.cache.put(sha, e)
            raise
        return self.cache.put(sha, cmod)

    # ---------------------------------------------------------------- init / start

    def seed_for(self, request: RequestContext | None, salt: str) -> int:
        """The random seed of an instance: from the request (its seed, else its argument) and
        which instance of it this is, so that a repeated request draws the same numbers."""
        base = getattr(request, "seed", None) if request is not None else None
        text = f"{base if base is not None else ''}|{request.arg.hex() if request is not None else ''}|{salt}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")

    def instance(self, cmod, request: RequestContext | None, salt: str, memory_limit: int, init_ms: float):
        state = ComponentHostState(self, request, self.seed_for(request, salt))
        return ComponentInstance(self, cmod, state, memory_limit, init_ms)

    def ensure_init(self, cmod: ComponentModule, sticky: set) -> ComponentSnapshot:
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
                self.shared.snapshots.add(cmod, self._run_init(cmod))
            except ControllerError as e:
                if e.kind in sticky:
                    cmod.init_error = e
                raise
            return cmod.snapshot

    def _run_init(self, cmod: ComponentModule) -> ComponentSnapshot:
        lim = self.limits
        self.shared.token_table  # built before any deadline starts, not inside an import
        self.shared.guest_memory.admit(cmod.charge(lim.memory_bytes), "initialise a controller")
        inst = self.instance(cmod, None, "init", lim.memory_bytes, lim.init_ms)
        try:
            hook(inst, "init", lim.init_ms, "init")
            return ComponentSnapshot(save(inst, lim.init_ms, "init"))
        finally:
            inst.store.close()

    def start(self, cmod: ComponentModule, arg: bytes, lim, sticky: set, seed=None) -> "ComponentController":
        snap = self.ensure_init(cmod, sticky)
        self.shared.snapshots.used(cmod)
        self.shared.guest_memory.admit(cmod.charge(lim.memory_bytes), "start a controller")
        request = RequestContext(bytes(arg), lim)
        request.seed = seed
        inst = self.instance(cmod, request, "0", lim.memory_bytes, lim.init_ms)
        try:
            restore(inst, snap.state, lim.init_ms)
            hook(inst, "start", lim.init_ms, "start")
        except BaseException:
            inst.store.close()
            raise
        request.live = 1
        return ComponentController(self, cmod, request, inst, [])


def hook(inst: ComponentInstance, name: str, ms: float, refused_kind: str) -> None:
    """Call a `func() -> result<_, failure>` export; a failure raises ControllerError."""
    res = inst.call(name, 0, ms)
    try:
        _check_ok(inst, res[0], name, refused_kind)
    finally:
        inst.free_result()


def save(inst: ComponentInstance, ms: float, refused_kind: str) -> bytes:
    res = inst.call("save", 0, ms)
    try:
        payload = _check_ok(inst, res[0], "save", refused_kind)
        if payload == ffi.NULL:
            raise ControllerError("invalid_result", "save returned no state", inst.log_tail())
        return read_string(payload[0])
    finally:
        inst.free_result()


def restore(inst: ComponentInstance, state: bytes, ms: float) -> None:
    inst.set_string(0, state)
    res = inst.call("restore", 1, ms)
    try:
        _check_ok(inst, res[0], "restore", "trap")
    finally:
        inst.free_result()


_FAILURE_KINDS = {"exception": "trap", "out-of-memory": "oom"}


def _check_ok(inst, val, name: str, refused_kind: str):
    """The ok payload (a val pointer, maybe NULL) of a result value, or raise its failure."""
    if val.kind != KIND["RESULT"]:
        raise ControllerError("invalid_result", f"{name} returned something other than a result", inst.log_tail())
    r = val.of.result
    if r.is_ok:
        return r.val
    try:
        case, text = read_failure(r.val[0])
    except Exception:  # noqa: BLE001 - a malformed failure is still a failure
        case, text = "refused", ""
    kind = _FAILURE_KINDS.get(case, refused_kind)
    what = {"refused": "refused", "exception": "raised", "out-of-memory": "ran out of memory"}.get(case, case)
    raise ControllerError(kind, f"{name} {what}" + (f": {text}" if text else ""), inst.log_tail())


class ComponentController:
    """Drives one sequence's component instance (the engine's Controller protocol), and the
    built-in controller a hand-off gave the sequence to, while its span lasts."""

    def __init__(self, support: ComponentSupport, cmod: ComponentModule, request: RequestContext,
                 inst: ComponentInstance, seq: list[int]):
        self.request = request
        self._support = support
        self._cmod = cmod
        self._inst: ComponentInstance | None = inst
        lim = request.limits
        self._decoder = StepDecoder(support.vocab_size, lim.max_forks, lim.max_ff_tokens)
        self._ms = lim.mid_process_ms
        inst.state.tokenize_cap = TOKENIZE_BYTES_STEP
        self.seq = seq                 # the whole sequence, as this controller knows it
        self._sub = None               # the built-in controller of a hand-off, while it lasts
        self._sub_name = ""
        self._pending: list[int] = []  # what the component has not been told during a span ...
        self._pending_back = 0         # ... and how many of its tokens were taken back
        self._forks = 0
        self._failure: ControllerError | None = None
        self._closed = False

    @property
    def limits(self):
        return self.request.limits

    def log_text(self) -> str:
        return self.request.log_text()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def memory_size(self) -> int:
        return self._inst.store.charge if self._inst is not None else 0

    # ---------------------------------------------------------------- the step

    def mid_process(self, branch_idx: int, backtrack: int, tokens) -> list[Branch]:
        inst = self._inst
        if inst is None or self._failure is not None or self._support.shared.closed:
            raise self._unusable()
        try:
            tokens = list(tokens)
            if backtrack:
                if backtrack > len(self.seq):
                    raise ControllerError("invalid_result", "the host took back more tokens than the sequence has")
                del self.seq[len(self.seq) - backtrack:]
            self.seq.extend(tokens)
            if self._sub is None:
                return self._ask(branch_idx, backtrack, tokens)
            told = min(backtrack, len(self._pending))
            if told:
                del self._pending[len(self._pending) - told:]
            self._pending_back += backtrack - told
            self._pending.extend(tokens)
            answer = self._sub.mid_process(branch_idx, backtrack, tokens)
            if answer:
                return answer
            self._end_span()
            pending, back, self._pending, self._pending_back = self._pending, self._pending_back, [], 0
            return self._ask(branch_idx, back, pending, after_span=True)
        except ControllerError as e:
            self._failure = e
            raise

    def _ask(self, branch_idx: int, backtrack: int, tokens: list[int], after_span: bool = False) -> list[Branch]:
        inst = self._inst
        inst.set_u32(0, branch_idx)
        inst.set_u32(1, backtrack)
        inst.set_tokens(2, tokens)
        res = inst.call("mid-process", 3, self._ms)
        try:
            payload = _check_ok(inst, res[0], "mid-process", "invalid_result")
            answer = self._decoder.decode(payload[0], inst.log_tail)
        finally:
            inst.free_result()
        if isinstance(answer, HandOff):
            if after_span:
                raise ControllerError("invalid_result", f"mid-process handed the sequence to {answer.controller!r} "
                                      f"again right after a hand-off ended (it would never make progress)",
                                      inst.log_tail())
            return self._start_span(answer)
        return answer

    def _start_span(self, h: HandOff) -> list[Branch]:
        inst = self._inst
        try:
            sub = self._support.builtin(h.controller, h.arg, self.request.limits)
        except ControllerError as e:
            raise ControllerError(e.kind, f"hand-off to {h.controller!r}: {e}", inst.log_tail()) from None
        self._sub, self._sub_name = sub, h.controller
        answer = sub.mid_process(0, 0, list(self.seq))  # its "prompt": the whole sequence so far
        if not answer:
            self._end_span()
            raise ControllerError("invalid_result", f"the hand-off to {h.controller!r} stopped before its first token",
                                  inst.log_tail())
        return answer

    def _end_span(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        log = sub.log_text()
        if log:
            self.request.append_log(log.encode())
        sub.close()

    # ---------------------------------------------------------------- fork / close

    def fork(self) -> "ComponentController":
        """A copy for a new sequence of the same request: the component's state goes through
        save and restore into a fresh instance; a hand-off's controller forks as it does."""
        inst = self._inst
        if inst is None or self._failure is not None or self._support.shared.closed:
            raise self._unusable()
        req = self.request
        with req.lock:
            if req.live >= req.limits.max_forks:
                raise ControllerError("limit", f"cannot fork: the request already has {req.live} live "
                                      f"sequences (max_forks {req.limits.max_forks})", inst.log_tail())
            req.live += 1
        try:
            lim = req.limits
            support = self._support
            support.guest_memory.admit(self._cmod.charge(lim.memory_bytes), "fork the controller")
            state = save(inst, self._ms, "invalid_result")
            self._forks += 1
            salt = f"{id(self):x}.{self._forks}"
            child_inst = support.instance(self._cmod, req, salt, lim.memory_bytes, lim.init_ms)
            try:
                restore(child_inst, state, lim.init_ms)
                sub = self._sub.fork() if self._sub is not None else None
            except BaseException:
                child_inst.store.close()
                raise
        except ControllerError as e:
            with req.lock:
                req.live -= 1
            if not e.busy:
                self._failure = e
            raise
        except BaseException:
            with req.lock:
                req.live -= 1
            raise
        child = ComponentController(support, self._cmod, req, child_inst, list(self.seq))
        child._sub, child._sub_name = sub, self._sub_name
        child._pending, child._pending_back = list(self._pending), self._pending_back
        return child

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        inst, self._inst = self._inst, None
        if inst is not None:
            inst.store.close()
        with self.request.lock:
            self.request.live -= 1

    def __enter__(self) -> "ComponentController":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unusable(self) -> ControllerError:
        tail = ControllerError.tail_of(self.request.log)
        if self._failure is not None:
            return ControllerError(self._failure.kind, f"controller already failed: {self._failure}", tail)
        if self._support.shared.closed:
            return ControllerError("limit", "the controller runtime was closed", tail)
        return ControllerError("limit", "the controller was closed", tail)



class ComponentCache:
    """Compiled components by sha256, in memory and on disk (serialized native code, ~40 ms to
    load back against 15-20 s to compile a componentize-py component). Same layout and trust
    as module_cache.ModuleCache, which it wraps for the in-memory map and file naming."""

    def __init__(self, module_cache):
        self._mc = module_cache
        self.stats = module_cache.stats

    def get(self, sha: str):
        return self._mc.get(sha)

    def put(self, sha: str, item):
        return self._mc.put(sha, item)

    def compile(self, data: bytes):
        return self._mc.compile(data)  # in a bounded worker (compiler.py)

    def from_disk(self, sha: str):
        import json

        import wasmtime
        from wasmtime import component as wc

        path = self._mc.path(sha)
        if path is None:
            return None
        try:
            meta = json.loads(path.with_suffix(".json").read_text())
            component = wc.Component.deserialize_file(self._mc.engine, str(path))
            size = path.stat().st_size
        except (wasmtime.WasmtimeError, OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        self.stats["disk_hits"] += 1
        return component, size, meta

    def store(self, sha: str, component, meta: dict) -> int:
        return self._mc.store(sha, component, meta)  # Component.serialize() as Module's
