"""One sandboxed instance: a wasmtime Store, the controller instantiated in it, fast calls into
its exports under an epoch deadline, and zero-copy views of its linear memory.

Every request and every fork gets its own Store, so controllers never share memory and a
failed one can simply be dropped. Stores are made and called through the C API directly
(`fastcall`): wasmtime-py's per-call type checks and value boxing would cost more than
the whole step budget we aim for.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .abi import MEMORY_EXPORT
from .errors import ControllerError
from .fastcall import (EXTERN_FUNC, EXTERN_GLOBAL, EXTERN_MEMORY, TRAP_CODES, TRAP_INTERRUPT,
                       TRAP_STACK_OVERFLOW, ffi, lib, take_error, take_trap)
from .host_api import HostState

__all__ = ["Instance", "WASM_PAGE"]

WASM_PAGE = 65536
# Per-store caps besides linear memory: table elements (a `table.grow` loop would otherwise
# eat host memory, 8 bytes an element), one instance, one memory. Tables: any number.
TABLE_ELEMENTS = 1 << 20

_TRAP_TEXT = {
    "STACK_OVERFLOW": "stack overflow (call stack exhausted)",
    "MEMORY_OUT_OF_BOUNDS": "out-of-bounds memory access",
    "HEAP_MISALIGNED": "misaligned atomic memory access",
    "TABLE_OUT_OF_BOUNDS": "out-of-bounds table access",
    "INDIRECT_CALL_TO_NULL": "indirect call to a null table entry",
    "BAD_SIGNATURE": "indirect call signature mismatch",
    "INTEGER_OVERFLOW": "integer overflow",
    "INTEGER_DIVISION_BY_ZERO": "integer division by zero",
    "BAD_CONVERSION_TO_INTEGER": "invalid float-to-integer conversion",
    "UNREACHABLE_CODE_REACHED": "`unreachable` instruction executed (e.g. abort())",
}


_set_deadline = lib.wasmtime_context_set_epoch_deadline
_call_unchecked = lib.wasmtime_func_call_unchecked


def wall_cap_ms(ms: float) -> float:
    """The wall-clock cap of a call with a CPU budget of `ms`: room for a thread that waits for a
    core on a busy machine (4x), never less than 100 ms more."""
    return 4 * ms + 100


class _Deadlines:
    """The native CPU-time deadline (native/deadline.c), when the native library builds."""

    def __init__(self):
        from .. import native

        nlib = native.library()
        self.ffi, self.lib = native.ffi, nlib
        if nlib is not None:
            self.callback = int(native.ffi.cast("uintptr_t", native.ffi.addressof(nlib, "rudder_deadline_callback")))
            self.error_new = self.pointer(lib.wasmtime_error_new)
            self.set_deadline = self.pointer(lib.wasmtime_context_set_epoch_deadline)
            self.call = self.pointer(lib.wasmtime_func_call_unchecked)
            self.guarded_call = nlib.rudder_guarded_call

    def pointer(self, cdata, ctype: str = "void *"):
        """A pointer of the fastcall binding as one of the native library's (two cffi FFIs)."""
        return self.ffi.cast(ctype, int(ffi.cast("uintptr_t", cdata)))

    def new(self, tick_ms: float):
        """A deadline struct for one store, or None (then deadlines are wall-clock epochs)."""
        if self.lib is None:
            return None
        d = self.ffi.new("rudder_deadline *")
        d.tick_ns = int(tick_ms * 1e6)
        d.error_new, d.set_deadline, d.call = self.error_new, self.set_deadline, self.call
        return d


_deadlines: _Deadlines | None = None


def _native_deadlines() -> _Deadlines:
    global _deadlines
    if _deadlines is None:
        _deadlines = _Deadlines()
    return _deadlines


class _Store:
    """Owns a wasmtime store (and with it the instance and its memory).

    It is freed when its last reference goes. The Instance holds one; so does every numpy
    view of guest memory handed out (through the memory buffer's `_owner`), so a mask view
    that the engine still holds after `close()` never points at freed memory.
    """

    __slots__ = ("ptr", "ctx", "handle", "engine", "ticker", "deadline", "meter", "accounted")

    def __init__(self, engine, engine_ptr, state: HostState, memory_limit: int, ticker=None, tick_ms: float = 2.0,
                 meter=None):
        # The store's data pointer is a handle to its HostState: host functions find their
        # state from the caller's context with no lookup table.
        self.handle = ffi.new_handle(state)
        ptr = lib.wasmtime_store_new(engine_ptr, self.handle, ffi.NULL)
        self.ptr = ffi.gc(ptr, lib.wasmtime_store_delete)
        self.ctx = lib.wasmtime_store_context(ptr)
        self.engine = engine  # the engine must outlive its stores
        lib.wasmtime_store_limiter(ptr, int(memory_limit), TABLE_ELEMENTS, 1, -1, 1)
        # CPU-time deadlines: when the epoch deadline passes, the native callback checks the
        # guest thread's CPU time and moves the deadline on while the call is within budget.
        deadlines = _native_deadlines()
        self.deadline = deadlines.new(tick_ms)
        if self.deadline is not None:
            lib.wasmtime_store_epoch_deadline_callback(ptr, ffi.cast("void *", deadlines.callback),
                                                       ffi.cast("void *", int(deadlines.ffi.cast("uintptr_t", self.deadline))),
                                                       ffi.NULL)
        self.meter = meter  # the runtime's GuestMemory: this store's memory counts there
        self.accounted = 0  # ... this many bytes of it
        self.ticker = ticker
        if ticker is not None:
            ticker.store_opened()

    def account(self, size: int) -> bool:
        """The memory is now `size` bytes; False if that leaves the server's budget exceeded."""
        delta, self.accounted = size - self.accounted, size
        return self.meter is None or self.meter.add(delta)

    def close(self) -> None:
        """Free the store now (not whenever the garbage collector gets to it)."""
        ffi.release(self.ptr)
        self.__del__()

    def __del__(self):
        if self.meter is not None:
            meter, self.meter = self.meter, None
            meter.add(-self.accounted)
        if self.ticker is not None:
            ticker, self.ticker = self.ticker, None
            ticker.store_closed()


class Instance:
    """A controller instantiated in its own store."""

    def __init__(self, shared, cmod, state: HostState, memory_limit: int, init_ticks: int):
        self.shared = shared
        self.cmod = cmod
        self.state = state
        self.memory_limit = int(memory_limit)
        store = _Store(shared.engine, shared.engine_ptr, state, memory_limit, shared.ticker, shared.tick_ms,
                       shared.guest_memory)
        self.deadline = store.deadline
        self.store = store
        ctx = self.ctx = store.ctx
        self.trap = ffi.new("wasm_trap_t **")
        self._instance = ffi.new("wasmtime_instance_t *")
        # Instantiation runs no guest code (modules with a start function are rejected at
        # load), but arm a deadline anyway: wasmtime checks the epoch at function entry.
        lib.wasmtime_context_set_epoch_deadline(ctx, init_ticks)
        err = lib.wasmtime_instance_pre_instantiate(cmod.pre_ptr, ctx, self._instance, self.trap)
        if err or self.trap[0]:
            error = self._instantiate_error(err)
            store.close()  # nothing of a failed instance should wait for the garbage collector
            raise error

        ext = ffi.new("wasmtime_extern_t *")
        self.funcs = {}
        for name in cmod.func_exports:
            self.funcs[name] = ffi.new("wasmtime_func_t *", self._export(ext, name, EXTERN_FUNC).func)
        self.memory = ffi.new("wasmtime_memory_t *", self._export(ext, MEMORY_EXPORT, EXTERN_MEMORY).memory)
        self.globals = [ffi.new("wasmtime_global_t *", self._export(ext, name, EXTERN_GLOBAL).global_)
                        for name in cmod.mutable_globals]
        state.memory = self.memory
        # Argument/result slots of the unchecked calls: 16 bytes each, i32 in the first 4.
        self.vals = ffi.new("wasmtime_val_raw_t[4]")
        self.vals_i32 = ffi.cast("int32_t *", self.vals)  # slot k is vals_i32[4 * k]
        self.step = None  # the native per-token step's arguments (controller.py's fast path)
        if self.deadline is not None:  # the native guarded call's arguments, converted once
            native = _native_deadlines()
            self._guarded = native.guarded_call
            self._native_ffi = native.ffi
            self._n_args = (native.pointer(ctx), native.pointer(self.vals), native.pointer(self.trap, "void **"))
            self._n_funcs = {name: native.pointer(f) for name, f in self.funcs.items()}
            step = self.step = native.ffi.new("rudder_step *")
            step.deadline, step.func = self.deadline, self._n_funcs["rudder_mid_process"]
            step.context, step.trap = self._n_args[0], self._n_args[2]
            step.args = native.pointer(self.vals, "int32_t *")
            step.memory = native.pointer(self.memory)
            step.memory_size = native.pointer(lib.wasmtime_memory_data_size)
            self.step_call = native.lib.rudder_step_call
        self.views: dict[int, np.ndarray] = {}  # mask views by pointer, until memory is remapped
        self.size = -1
        self.remap()

    # ------------------------------------------------------------------ exports

    def _export(self, ext, name: str, kind: int):
        raw = name.encode()
        if not lib.wasmtime_instance_export_get(self.ctx, self._instance, raw, len(raw), ext) or ext.kind != kind:
            # Types were checked at load, so this is a host bug, not a guest one.
            raise ControllerError("bad_module", f"the controller has no usable export {name!r}")
        return ext.of

    # ------------------------------------------------------------------ memory

    def remap(self) -> None:
        """(Re)make the views of linear memory; needed after it grows. With the default
        memory reservation the base never moves, but we re-read it anyway."""
        size = lib.wasmtime_memory_data_size(self.ctx, self.memory)
        base = int(ffi.cast("uintptr_t", lib.wasmtime_memory_data(self.ctx, self.memory)))
        buf = (ctypes.c_ubyte * size).from_address(base)
        buf._owner = self.store  # numpy views keep the store (and so this memory) alive
        self.buf = buf
        self.base = base
        self.u8 = np.frombuffer(buf, dtype=np.uint8)
        self.u32 = np.frombuffer(buf, dtype=np.uint32)  # sizes are whole 64 KiB pages
        self.size = size
        self.views = {}
        if self.step is not None:
            self.step.base = self._native_ffi.cast("uint8_t *", base)
            self.step.size = size
        self.within_budget = self.store.account(size)

    def mask_view(self, ptr: int, words: int) -> np.ndarray:
        """The zero-copy view of `words` mask words at `ptr` (4-byte aligned, checked inside memory
        by the caller); a guest mostly answers with the same buffer, so views are kept by address."""
        view = self.views.get(ptr)
        if view is None:  # (one controller, one vocabulary: always `words` long)
            if len(self.views) >= 256:  # (the token layer keeps up to 128 masks)
                self.views.clear()
            view = self.views[ptr] = self.u32[ptr >> 2:(ptr >> 2) + words]
        return view

    def check_growth(self) -> bool:
        """Remap if the guest grew its memory; True if it did."""
        if lib.wasmtime_memory_data_size(self.ctx, self.memory) != self.size:
            self.remap()
            return True
        return False

    def grow_to(self, nbytes: int) -> None:
        """Grow linear memory to at least `nbytes` (a snapshot's or a fork source's size)."""
        if nbytes <= self.size:
            return
        pages = -(-(nbytes - self.size) // WASM_PAGE)
        prev = ffi.new("uint64_t *")
        err = lib.wasmtime_memory_grow(self.ctx, self.memory, pages, prev)
        if err:
            msg = take_error(err)
            raise ControllerError(
                "oom", f"the controller's state needs {nbytes >> 20} MiB of memory, over this "
                f"request's limit of {self.memory_limit >> 20} MiB ({msg})", self.log_tail())
        self.remap()

    # ------------------------------------------------------------------ globals

    def get_globals(self) -> list[bytes]:
        out = []
        val = ffi.new("wasmtime_val_t *")
        for g in self.globals:
            lib.wasmtime_global_get(self.ctx, g, val)
            out.append(bytes(ffi.buffer(val)))
        return out

    def set_globals(self, values: list[bytes]) -> None:
        val = ffi.new("wasmtime_val_t *")
        for g, raw in zip(self.globals, values):
            ffi.memmove(val, raw, len(raw))
            err = lib.wasmtime_global_set(self.ctx, g, val)
            if err:
                raise ControllerError("trap", f"cannot restore a global: {take_error(err)}")

    # ------------------------------------------------------------------ calls

    def call(self, name: str, n_slots: int, ticks: int, ms: float) -> int:
        """Call export `name` (its i32 arguments already in the slots) under a deadline of `ms`
        of this thread's CPU time (native deadlines) or `ticks` epoch ticks of wall time (without
        them); return its i32 result (signed). The deadline counts from when it is set, so it is
        re-armed before every call."""
        if self.deadline is not None:
            ctx, vals, trap = self._n_args
            err = self._guarded(self.deadline, ctx, self._n_funcs[name], vals, n_slots, trap,
                                int(ms * 1e6), int(wall_cap_ms(ms) * 1e6))
            if err or self.trap[0]:
                raise self.native_call_error(err, name, ms)
            return self.vals_i32[0]
        _set_deadline(self.ctx, ticks)
        err = _call_unchecked(self.ctx, self.funcs[name], self.vals, n_slots, self.trap)
        if err or self.trap[0]:
            raise self._call_error(err, name, ms)
        # No memory-size check here (it would cost ~0.5 us a call): memory never shrinks, so
        # whatever lies inside `self.size` is valid; a pointer past it makes the reader call
        # check_growth() and look again.
        return self.vals_i32[0]

    # ------------------------------------------------------------------ errors

    def log_tail(self) -> str:
        state = self.state
        log = state.request.log if state.request is not None else state.log
        return ControllerError.tail_of(log)

    def native_call_error(self, err, name: str, ms: float) -> ControllerError:
        """The error of a call through the native library that returned `err` (its pointer type)
        or trapped."""
        if err:
            err = ffi.cast("wasmtime_error_t *", int(self._native_ffi.cast("uintptr_t", err)))
        return self._call_error(err, name, ms)

    def _call_error(self, err, name: str, ms: float) -> ControllerError:
        # A trap raised by a host function arrives as an error, not as a trap.
        if err:
            code, message = None, take_error(err)
        else:
            code, message = take_trap(self.trap[0])
            self.trap[0] = ffi.NULL
        state = self.state
        host_error, kind, state.host_error, state.host_error_kind = state.host_error, state.host_error_kind, None, "trap"
        self.check_growth()
        if host_error is not None:
            return ControllerError(kind, f"{name}: {host_error}", self.log_tail())
        if err and self.deadline is not None and self.deadline.expired:
            what = (f"its deadline of {ms:g} ms of CPU time" if self.deadline.expired == 1
                    else f"its wall-clock cap of {wall_cap_ms(ms):g} ms")
            return ControllerError("timeout", f"{name} ran past {what}", self.log_tail())
        if err:
            return ControllerError("trap", f"{name} failed: {_first_line(message)}", self.log_tail())
        if code == TRAP_INTERRUPT:
            return ControllerError("timeout", f"{name} ran past its deadline of {ms:g} ms", self.log_tail())
        what = _describe_trap(code, message)
        if code != TRAP_STACK_OVERFLOW and self.size + _oom_margin(self.memory_limit) > self.memory_limit:
            # Near the limit, memory.grow has most likely been failing (a guest may grow in big
            # steps, so "near" is an eighth of the limit): the trap is most likely the guest's
            # reaction to running out of memory (a failed malloc, an abort()).
            return ControllerError(
                "oom", f"{name} trapped with its memory at {self.size >> 20} of its {self.memory_limit >> 20} MiB "
                f"limit (out of memory?): {what}", self.log_tail())
        return ControllerError("trap", f"{name} trapped: {what}", self.log_tail())

    def _instantiate_error(self, err) -> ControllerError:
        if err:
            message = take_error(err)
        else:
            code, message = take_trap(self.trap[0])
            self.trap[0] = ffi.NULL
        first = message.strip().splitlines()[0] if message.strip() else "unknown error"
        low = message.lower()
        if "concurrent" in low:  # the pooling allocator has no free slot
            return ControllerError("limit", f"too many live controllers on this server: {first}",
                                   self.log_tail(), busy=True)
        if "memory" in low and ("limit" in low or "exceed" in low or "minimum" in low):
            return ControllerError("oom", f"cannot instantiate the controller within the memory "
                                   f"limit of {self.memory_limit >> 20} MiB: {first}", self.log_tail())
        return ControllerError("trap", f"cannot instantiate the controller: {first}", self.log_tail())


def _oom_margin(limit: int) -> int:
    return max(16 * WASM_PAGE, limit // 8)


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "unknown error"


def _describe_trap(code: int | None, message: str) -> str:
    name = TRAP_CODES.get(code) if code is not None else None
    text = _TRAP_TEXT.get(name) if name else None
    if text is None:
        lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
        text = lines[0] if lines else (name or "unknown trap").lower()
        text = text.removeprefix("wasm trap: ")
    # wasmtime appends a backtrace; its first frame names the guest function that trapped.
    for line in message.splitlines():
        line = line.strip()
        if line.startswith("0:") and " - " in line:
            func = line.split(" - ", 1)[1].strip().removeprefix("<unknown>!")
            if func.startswith("<") and func.endswith(">"):
                func = func[1:-1]  # "<wasm function 15>": no name section
            if func:
                text += f" in {func}"
            break
    return text
