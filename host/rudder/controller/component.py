"""Controllers that are WebAssembly components (wit/controller.wit): Python and JavaScript
controllers built with componentize-py and componentize-js, run beside core modules in the same
sandbox (stores, deadlines, budgets, module cache, the Controller facade: store.py, runtime.py,
controller.py) under the same rules (docs/components.md).

What is theirs alone, and why:
- The host cannot copy a component's memory (the component model hides it), so state is copied
  by the guest: `save` returns the controller's state as bytes and `restore` loads it into a
  fresh instance (the SDKs pickle / serialise the controller object). That is the post-init
  snapshot every request starts from, and how a fork gets its own state.
- Guest memory cannot be read either, so each instance is counted in the server's guest
  memory budget at the most it may grow to (its memories times the memory limit).
- A component runs in an engine of its own (no pooling allocator: a component has many core
  instances, tables and a large memory image), with its own epoch ticker (engines.py).
- It is called with component values (component_instance.py) and its answer is lifted from
  them (component_result.py), not read out of guest memory.
- Constraint engines: a step may hand the sequence to a built-in controller (json, regex,
  grammar, ...: core modules built from the C SDK) until it stops; its masks stay in its own
  memory, so a constrained step costs what it costs under that controller alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..branch import Branch
from .capi import KIND, addr, ffi, lib
from .component_host import define_host, define_random
from .component_instance import ComponentInstance
from .component_result import HandOff, StepDecoder, read_failure, read_string
from .component_types import check_component
from .controller import Controller, ControllerModule
from .errors import ControllerError
from .host_api import TOKENIZE_BYTES_STEP, HostState, RequestContext
from .snapshot import outside_heap

__all__ = ["ComponentShape", "ComponentModule", "ComponentController", "is_component"]

MAX_COMPONENT_BYTES = 64 << 20  # a componentize-py component is ~18 MB (CPython inside), componentize-js ~12 MB
# A component binary: the wasm magic, then version 0x0d and layer 1.
COMPONENT_HEADER = b"\0asm\x0d\x00\x01\x00"


def is_component(data: bytes) -> bool:
    return data[:8] == COMPONENT_HEADER


@dataclass(frozen=True, eq=False)
class ComponentSnapshot:
    """The post-init state of a component controller, as its `save` returned it (the UTF-8 of a
    WIT bytes string, handed back to `restore` as it is), in an anonymous mmap of its own as a
    core module's snapshot is (snapshot.py says why)."""

    state: np.ndarray

    @classmethod
    def of(cls, state: bytes) -> "ComponentSnapshot":
        kept = outside_heap(len(state))
        kept[:] = np.frombuffer(state, dtype=np.uint8)
        return cls(kept)

    @property
    def stored_bytes(self) -> int:
        return int(self.state.size)


class ComponentModule(ControllerModule):
    """A loaded component controller: the compiled component, the indices of its exports, and
    how many memories it defines."""

    kind = "component"

    def __init__(self, sha256: str, wasm_size: int, compiled_size: int, shape, shared, component, memories: int):
        super().__init__(sha256, wasm_size, compiled_size, shape, shared)
        self.component = component  # the wasmtime-py Component (owns the compiled code)
        self.ptr = ffi.cast("wasmtime_component_t *", addr(component.ptr()))
        self.memories = memories
        self.export_index = {}
        for name in ("init", "start", "mid-process", "save", "restore"):
            raw = name.encode()
            index = lib.wasmtime_component_get_export_index(self.ptr, ffi.NULL, raw, len(raw))
            if index == ffi.NULL:
                raise ControllerError("bad_module", f"the component does not export {name}")
            self.export_index[name] = ffi.gc(index, lib.wasmtime_component_export_index_delete)

    def charge(self, memory_limit: int) -> int:
        """Bytes an instance counts in the guest memory budget: the most its memories may reach."""
        return max(1, self.memories) * int(memory_limit)

    def start_bytes(self, snap, limits) -> int:
        return self.charge(limits.memory_bytes)


class ComponentShape:
    """The component side of a runtime: its engine, linker and compile cache, init and start.
    `builtin(name, arg, limits)` starts a built-in controller for a hand-off."""

    kind = "component"
    max_bytes = MAX_COMPONENT_BYTES

    def __init__(self, shared, engine, cache, builtin):
        self.shared = shared  # the runtime's _Shared: tokenizer, limits, budgets, token table
        self.engine = engine  # engines.Engine
        self.cache = cache    # module_cache.ModuleCache over this engine (components by sha256)
        self.builtin = builtin
        self.linker = ffi.gc(lib.wasmtime_component_linker_new(engine.ptr), lib.wasmtime_component_linker_delete)
        define_host(self.linker)
        self._random_defined: set[str] = set()

    # ---------------------------------------------------------------- load

    def precheck(self, data: bytes) -> None:
        pass  # the compiler validates the bytes; the types are checked once compiled

    def inspect(self, component, data: bytes) -> dict:
        random_imports, memories = check_component(component, self.engine.wasm, data)
        return {"random": random_imports, "memories": memories}

    def module(self, sha: str, data: bytes, compiled, compiled_size: int, meta: dict) -> ComponentModule:
        for name in meta.get("random", []):
            define_random(self.linker, name, self._random_defined)
        return ComponentModule(sha, len(data), compiled_size, self, self.shared, compiled, int(meta.get("memories", 1)))

    # ---------------------------------------------------------------- init / start

    def instance(self, cmod: ComponentModule, request: RequestContext | None, salt: str, memory_limit: int,
                 init_ms: float) -> ComponentInstance:
        """A fresh instance whose random stream is seeded from the request (its seed, else its
        argument) and which instance of it this is, so that a repeated request draws the same numbers."""
        base = request.seed if request is not None else None
        text = f"{base if base is not None else ''}|{request.arg.hex() if request is not None else ''}|{salt}"
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        return ComponentInstance(cmod, HostState(self.shared, request, seed), memory_limit, init_ms)

    def run_init(self, cmod: ComponentModule) -> "ComponentSnapshot":
        """init in a fresh instance; the state its `save` returns."""
        lim = self.shared.limits
        self.shared.guest_memory.admit(cmod.charge(lim.memory_bytes), "initialise a controller")
        inst = self.instance(cmod, None, "init", lim.memory_bytes, lim.init_ms)
        try:
            hook(inst, "init", lim.init_ms, "init")
            return ComponentSnapshot.of(save(inst, lim.init_ms, "init"))
        finally:
            inst.store.close()

    def start(self, cmod: ComponentModule, request: RequestContext, snap) -> "ComponentController":
        """A fresh instance restored from the snapshot, after `start` accepted the request."""
        lim = request.limits
        inst = self.instance(cmod, request, "0", lim.memory_bytes, lim.init_ms)
        try:
            restore(inst, snap.state, lim.init_ms)
            hook(inst, "start", lim.init_ms, "start")
        except BaseException:
            inst.store.close()
            raise
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


def restore(inst: ComponentInstance, state, ms: float) -> None:
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


class ComponentController(Controller):
    """Drives one sequence's component instance, and the built-in controller a hand-off gave
    the sequence to, while its span lasts."""

    def __init__(self, shape: ComponentShape, cmod: ComponentModule, request: RequestContext,
                 inst: ComponentInstance, seq: list[int]):
        super().__init__(shape.shared, cmod, request)
        self._shape = shape
        self._inst: ComponentInstance | None = inst
        lim = request.limits
        self._decoder = StepDecoder(shape.shared.vocab_size, lim.max_forks, lim.max_ff_tokens)
        self._ms = lim.mid_process_ms
        inst.state.tokenize_cap = TOKENIZE_BYTES_STEP
        self.seq = seq                 # the whole sequence, as this controller knows it
        self._sub = None               # the built-in controller of a hand-off, while it lasts
        self._sub_name = ""
        self._pending: list[int] = []  # what the component has not been told during a span ...
        self._pending_back = 0         # ... and how many of its tokens were taken back
        self._forks = 0

    @property
    def memory_size(self) -> int:
        return self._inst.store.accounted if self._inst is not None else 0

    # ---------------------------------------------------------------- the step

    def mid_process(self, branch_idx: int, backtrack: int, tokens) -> list[Branch]:
        inst = self._inst
        if inst is None or self._failure is not None or self._shared.closed:
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
            raise self._failed(e)

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
            sub = self._shape.builtin(h.controller, h.arg, self.request.limits)
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

    def _fork(self) -> "ComponentController":
        """The component's state goes through save and restore into a fresh instance; a
        hand-off's controller forks as it does."""
        inst, req, shape = self._inst, self.request, self._shape
        lim = req.limits
        shape.shared.guest_memory.admit(self._cmod.charge(lim.memory_bytes), "fork the controller")
        state = save(inst, self._ms, "invalid_result")
        self._forks += 1
        child_inst = shape.instance(self._cmod, req, f"{id(self):x}.{self._forks}", lim.memory_bytes, lim.init_ms)
        try:
            restore(child_inst, state, lim.init_ms)
            sub = self._sub.fork() if self._sub is not None else None
        except BaseException:
            child_inst.store.close()
            raise
        child = ComponentController(shape, self._cmod, req, child_inst, list(self.seq))
        child._sub, child._sub_name = sub, self._sub_name
        child._pending, child._pending_back = list(self._pending), self._pending_back
        return child

    def _close_instance(self) -> None:
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        # Dropped, not freed here: a call still running on another thread holds the instance, and
        # its store goes with the last reference (at once when no call runs), as a core module's.
        self._inst = None
