"""Core WebAssembly modules (controllers built with the C guest SDK, docs/abi.md): what is theirs
alone in the sandbox. How they are checked and instantiated (a pre-linked module in a pooled
engine), how they are called (i32 slots, a native step that crosses from Python once a token),
how their answer is lifted (Branch records read out of guest memory, result.py), and how their
state is copied (their memory, snapshot.py). Stores, deadlines, budgets, the module cache and
the Controller facade are every shape's (store.py, runtime.py, controller.py).
"""

from __future__ import annotations

import wasmtime

from ..branch import Branch
from .capi import addr, ffi, lib
from .controller import Controller, ControllerModule
from .engines import WASM_PAGE
from .errors import ControllerError
from .host_api import TOKENIZE_BYTES_STEP, HostState, RequestContext, define_imports
from .instance import Instance
from .limits import deadline_ticks
from .module import check_binary, check_module, check_shape
from .result import ResultDecoder
from .snapshot import clone_state, restore_snapshot, take_snapshot
from .store import wall_cap_ms

__all__ = ["CoreShape", "CoreModule", "CoreController"]

MAX_MODULE_BYTES = 64 << 20  # compile time grows with size; no real controller is near this
# rudder_input is asked for at least this many tokens, so that the common one-token steps
# after a short prompt don't each need a second call into the guest.
MIN_INPUT_CAPACITY = 64
_memory_size = lib.wasmtime_memory_data_size
STEP_FAILED = -1  # rudder_step_call's codes (native/deadline.c)


class CoreModule(ControllerModule):
    """A loaded core module: the wasmtime module, its pre-linked form and the exported mutable
    globals that are part of its state."""

    kind = "module"

    def __init__(self, sha256: str, wasm_size: int, compiled_size: int, shape, shared, module: wasmtime.Module,
                 mutable_globals: tuple[str, ...]):
        super().__init__(sha256, wasm_size, compiled_size, shape, shared)
        self.wasm_module = module
        try:
            self.pre = shape.linker.instantiate_pre(module)  # keeps the wasmtime_instance_pre_t alive
        except wasmtime.WasmtimeError as e:
            raise ControllerError("bad_import", f"cannot link the controller: {str(e).splitlines()[0]}") from None
        self.pre_ptr = ffi.cast("wasmtime_instance_pre_t *", addr(self.pre.ptr()))  # ... which cffi calls use
        self.func_exports = ("rudder_abi_version", "rudder_init", "rudder_start", "rudder_input", "rudder_mid_process")
        self.mutable_globals = mutable_globals

    def start_bytes(self, snap, limits) -> int:
        """Guest memory a new instance starts with: its snapshot's."""
        return snap.size


class CoreShape:
    """The core-module side of a runtime: its engine (pooled), linker and module cache."""

    kind = "module"
    max_bytes = MAX_MODULE_BYTES

    def __init__(self, shared, engine, cache):
        self.shared = shared
        self.engine = engine  # engines.Engine
        self.cache = cache    # module_cache.ModuleCache over this engine
        self.linker = wasmtime.Linker(engine.wasm)
        define_imports(self.linker)
        # a fork copies this much of memory eagerly: what the pool keeps resident (snapshot.py)
        self.eager_bytes = engine.keep_resident if engine.pooling else 0

    # ---------------------------------------------------------------- load

    def precheck(self, data: bytes) -> None:
        check_binary(data)

    def inspect(self, module: wasmtime.Module, data: bytes) -> dict:
        """The checks of a compiled module; what they found is kept with its compiled code."""
        check_shape(data)  # before wasmtime describes any type (v128 would abort)
        return {"mutable_globals": list(check_module(module))}

    def module(self, sha: str, data: bytes, compiled, compiled_size: int, meta: dict) -> CoreModule:
        return CoreModule(sha, len(data), compiled_size, self, self.shared, compiled,
                          tuple(meta.get("mutable_globals", ())))

    # ---------------------------------------------------------------- init / start

    def run_init(self, cmod: CoreModule):
        """rudder_abi_version and rudder_init in a fresh instance; its state as a snapshot."""
        lim = self.shared.limits
        inst = Instance(cmod, HostState(self.shared), lim.memory_bytes, lim.init_ms)
        try:
            ticks = deadline_ticks(lim.init_ms, self.engine.tick_ms)
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
            fresh = Instance(cmod, HostState(self.shared), lim.memory_bytes, lim.init_ms)
            try:
                return take_snapshot(inst, fresh)
            finally:
                fresh.store.close()
        finally:
            # Both go now, success or not: their memory leaves the guest memory budget at once
            # (a traceback that holds them could keep them for as long as it lives).
            inst.store.close()

    def start(self, cmod: CoreModule, request: RequestContext, snap) -> "CoreController":
        """A fresh instance holding the snapshot, after rudder_start accepted the request."""
        lim = request.limits
        inst = Instance(cmod, HostState(self.shared, request), lim.memory_bytes, lim.init_ms)
        try:
            restore_snapshot(inst, snap)
            inst.vals_i32[0] = 0
            status = inst.call("rudder_start", 1, deadline_ticks(lim.init_ms, self.engine.tick_ms), lim.init_ms)
            if status != 0:
                raise ControllerError("start", f"the controller rejected the request (rudder_start returned {status})",
                                      inst.log_tail())
        except BaseException:
            inst.store.close()  # its memory goes now, not when a traceback that holds it is collected
            raise
        return CoreController(self.shared, cmod, request, inst)


class CoreController(Controller):
    """A core module's instance, stepped through rudder_input and rudder_mid_process."""

    def __init__(self, shared, cmod: CoreModule, request: RequestContext, inst: Instance):
        super().__init__(shared, cmod, request)
        self._inst: Instance | None = inst
        limits = request.limits
        self._decoder = ResultDecoder(shared.vocab_size, limits.max_forks, limits.max_ff_tokens)
        self._ms = limits.mid_process_ms
        self._ticks = deadline_ticks(limits.mid_process_ms, cmod.shape.engine.tick_ms)
        inst.state.tokenize_cap = TOKENIZE_BYTES_STEP  # a step's budget is milliseconds
        self._in_ptr = 0   # the guest's input buffer, from the last rudder_input call
        self._in_cap = 0   # ... and its capacity in tokens
        self._step = inst.step  # the native step (None without the native library)
        self._mask_words = self._decoder.mask_words
        if self._step is not None:
            st = self._step
            st.mask_words, st.tail_bits = self._decoder.mask_words, self._decoder.tail_bits
            st.cpu_budget_ns, st.wall_budget_ns = int(self._ms * 1e6), int(wall_cap_ms(self._ms) * 1e6)

    # ------------------------------------------------------------------ the step

    def mid_process(self, branch_idx: int, backtrack: int, tokens) -> list[Branch]:
        """Call rudder_mid_process with the tokens appended since the last call; return the
        Branch records. Masks are zero-copy views of guest memory, valid until the next call
        into this controller."""
        inst = self._inst
        if inst is None or self._failure is not None or self._shared.closed:
            raise self._unusable()
        try:
            n = len(tokens)
            if n > self._in_cap:
                self._reserve_input(n)
            st = self._step
            if n > 1 or (n and st is None):  # (the native step writes a lone token itself)
                p = self._in_ptr >> 2
                inst.u32[p:p + n] = tokens
            if st is not None:
                # One crossing: the token written, the guarded call, the common answer checked
                # (native/deadline.c, rudder_step_call); anything else is read below.
                r = inst.step_call(st, branch_idx, backtrack, n, tokens[0] if n == 1 else 0)
                if r > 0:  # one Branch: 1 | mask pointer << 1 | backtrack << 33
                    mask = (r >> 1) & 0xFFFFFFFF
                    if mask:
                        view = inst.views.get(mask)  # (mask_view, its common case inlined)
                        return [Branch(r >> 33, view if view is not None else inst.mask_view(mask, self._mask_words))]
                    return [Branch(r >> 33)]
                if r == 0:
                    return []
                if r == STEP_FAILED:
                    raise inst.native_call_error(st.error, "rudder_mid_process", self._ms)
                ptr = st.result  # STEP_DECODE: result.py reads it
            else:
                slots = inst.vals_i32
                slots[0] = branch_idx
                slots[4] = backtrack
                slots[8] = n
                ptr = inst.call("rudder_mid_process", 3, self._ticks, self._ms)
            if _memory_size(inst.ctx, inst.memory) != inst.size:  # it grew: count it
                inst.remap()
                if not inst.within_budget:
                    raise ControllerError("oom", f"the controller grew its memory to {inst.size >> 20} MiB while the "
                                          f"server's guest memory budget is spent", inst.log_tail())
            return self._decoder.decode(inst, ptr)
        except ControllerError as e:
            raise self._failed(e)

    def _reserve_input(self, n: int) -> None:
        inst = self._inst
        cap = max(n, MIN_INPUT_CAPACITY)
        inst.vals_i32[0] = cap
        ptr = inst.call("rudder_input", 1, self._ticks, self._ms) & 0xFFFFFFFF
        if ptr + 4 * cap > inst.size:
            inst.check_growth()  # the guest may have grown its memory to make room
        if ptr == 0 or ptr & 3 or ptr + 4 * cap > inst.size:
            raise ControllerError(
                "invalid_result", f"rudder_input({cap}) returned {ptr:#x}: not a 4-byte aligned "
                f"buffer of {4 * cap} bytes inside memory ({inst.size} bytes)", inst.log_tail())
        self._set_input(ptr, cap)

    def _set_input(self, ptr: int, cap: int) -> None:
        self._in_ptr, self._in_cap = ptr, cap
        if self._step is not None:
            self._step.in_ptr = ptr

    # ------------------------------------------------------------------ fork / close

    def _fork(self) -> "CoreController":
        """A fresh instance with this one's memory and exported mutable globals."""
        inst, shared, req = self._inst, self._shared, self.request
        shared.guest_memory.admit(inst.size, "fork the controller")
        child_inst = Instance(self._cmod, HostState(shared, req), req.limits.memory_bytes, req.limits.init_ms)
        try:
            clone_state(inst, child_inst, self._cmod.shape.eager_bytes)
        except BaseException:
            child_inst.store.close()
            raise
        child = CoreController(shared, self._cmod, req, child_inst)
        child._set_input(self._in_ptr, self._in_cap)
        return child

    def _close_instance(self) -> None:
        # The store goes with its last reference: masks handed out earlier keep it readable.
        self._inst = None

    @property
    def memory_size(self) -> int:
        return self._inst.size if self._inst is not None else 0


def pooling(limits, slots: int, keep_resident: int) -> dict:
    """The pooling allocator's settings for `slots` instances of up to `limits.memory_bytes`."""
    return {"slots": slots, "max_memory": max(limits.memory_bytes, WASM_PAGE), "keep_resident": keep_resident}

