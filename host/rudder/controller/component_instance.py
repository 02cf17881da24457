"""One component controller instance: its own wasmtime store (memory limit, CPU-time deadline,
WASI granting nothing), the component instantiated in it, and fast calls of its exports
through the C API (`component_capi`).

Deadlines work as for core modules (instance.py): before every call the native deadline
struct of `native/deadline.c` is armed with the call's CPU budget, the store's epoch deadline
is set, and the native epoch callback ends the call once the thread's CPU time is spent (or
its wall-clock cap is reached). Without the native library they are wall-clock epochs.
"""

from __future__ import annotations

import numpy as np

from .component_capi import KIND, ffi, lib, take_error
from .component_host import OUTPUT_CALLBACK, ComponentHostState
from .errors import ControllerError
from .limits import deadline_ticks

__all__ = ["ComponentInstance", "wall_cap_ms"]

VAL_SIZE = ffi.sizeof("wasmtime_component_val_t")
BOOL = KIND["BOOL"]
# Per-store caps besides each linear memory's size: a component is many core instances (a
# componentize-py one: 14 modules) with their tables; these bound what a hostile one can ask.
TABLE_ELEMENTS = 1 << 20
MAX_INSTANCES = 256
MAX_TABLES = 256


def wall_cap_ms(ms: float) -> float:
    """As for core modules: room for a thread waiting for a core (4x), at least 100 ms more."""
    return 4 * ms + 100


class _Native:
    """The native CPU-time deadline (rudder.native), shared by every component store."""

    def __init__(self):
        from .. import native

        self.lib = native.library()
        self.ffi = native.ffi
        if self.lib is not None:
            self.callback = int(self.ffi.cast("uintptr_t", self.ffi.addressof(self.lib, "rudder_deadline_callback")))
            self.arm = self.lib.rudder_deadline_arm
            as_void = lambda f: self.ffi.cast("void *", int(ffi.cast("uintptr_t", f)))  # noqa: E731
            self.error_new = as_void(lib.wasmtime_error_new)
            self.set_deadline = as_void(lib.wasmtime_context_set_epoch_deadline)

    def new(self, tick_ms: float):
        if self.lib is None:
            return None
        d = self.ffi.new("rudder_deadline *")
        d.tick_ns = int(tick_ms * 1e6)
        d.error_new, d.set_deadline = self.error_new, self.set_deadline
        return d  # `call` stays NULL: components are called from here, not by rudder_guarded_call


_native: _Native | None = None


def _native_deadlines() -> _Native:
    global _native
    if _native is None:
        _native = _Native()
    return _native


class _Store:
    """A wasmtime store with its limits, deadline callback and WASI context. Its memory counts
    in the server's guest memory budget (`charge` bytes, the most it may grow to) until freed."""

    def __init__(self, support, state: ComponentHostState, memory_limit: int, memories: int, charge: int):
        self.handle = ffi.new_handle(state)
        ptr = lib.wasmtime_store_new(support.engine_ptr, self.handle, ffi.NULL)
        self.ptr = ffi.gc(ptr, lib.wasmtime_store_delete)
        self.ctx = lib.wasmtime_store_context(ptr)
        self.engine = support.engine  # the engine must outlive its stores
        lib.wasmtime_store_limiter(ptr, int(memory_limit), TABLE_ELEMENTS, MAX_INSTANCES, MAX_TABLES, max(1, memories))
        native = _native_deadlines()
        self.deadline = native.new(support.tick_ms)
        if self.deadline is not None:
            lib.wasmtime_store_epoch_deadline_callback(
                ptr, ffi.cast("void *", native.callback),
                ffi.cast("void *", int(native.ffi.cast("uintptr_t", self.deadline))), ffi.NULL)
        # WASI: wasmtime's defaults grant nothing (no preopens, environment, arguments or
        # network); stdout and stderr go to the request's log.
        wasi = lib.wasi_config_new()
        lib.wasi_config_set_stdout_custom(wasi, OUTPUT_CALLBACK, self.handle, ffi.NULL)
        lib.wasi_config_set_stderr_custom(wasi, OUTPUT_CALLBACK, self.handle, ffi.NULL)
        err = lib.wasmtime_context_set_wasi(self.ctx, wasi)  # takes the config
        if err:
            raise ControllerError("bad_module", f"cannot set up WASI: {take_error(err)}")
        self.meter, self.charge = support.guest_memory, charge
        self.meter.add(charge)
        self.ticker = support.ticker
        self.ticker.store_opened()

    def close(self) -> None:
        """Free the store now (not whenever the garbage collector gets to it)."""
        ffi.release(self.ptr)
        self.__del__()

    def __del__(self):
        if self.meter is not None:
            meter, self.meter = self.meter, None
            meter.add(-self.charge)
        if self.ticker is not None:
            ticker, self.ticker = self.ticker, None
            ticker.store_closed()


class ComponentInstance:
    """A component controller instantiated in its own store."""

    def __init__(self, support, cmod, state: ComponentHostState, memory_limit: int, init_ms: float):
        self.support = support
        self.cmod = cmod
        self.state = state
        self.memory_limit = int(memory_limit)
        self.store = store = _Store(support, state, memory_limit, cmod.memories, cmod.charge(memory_limit))
        self.ctx = store.ctx
        self.deadline = store.deadline
        self._native = _native_deadlines()
        self.instance = ffi.new("wasmtime_component_instance_t *")
        # Instantiation may run guest code (core start functions): it runs under a deadline too.
        self._arm(init_ms)
        err = lib.wasmtime_component_linker_instantiate(support.linker, self.ctx, cmod.ptr, self.instance)
        if err:
            error = self._instantiate_error(take_error(err))
            store.close()
            raise error
        self.funcs = {}
        for name, index in cmod.export_index.items():
            f = ffi.new("wasmtime_component_func_t *")
            if not lib.wasmtime_component_instance_get_func(self.instance, self.ctx, index, f):
                store.close()
                raise ControllerError("bad_module", f"the component has no usable export {name!r}")
            self.funcs[name] = f
        self.result = ffi.new("wasmtime_component_val_t *")
        self.args = ffi.new("wasmtime_component_val_t[3]")
        self.one_token = ffi.new("wasmtime_component_val_t *")
        self.one_token.kind = KIND["U32"]
        self._keep = None  # argument memory the current call reads

    # ------------------------------------------------------------------ calls

    def _arm(self, ms: float) -> None:
        if self.deadline is not None:  # CPU time, first checked at the next tick (native/deadline.c)
            self._native.arm(self.deadline, int(ms * 1e6), int(wall_cap_ms(ms) * 1e6))
            lib.wasmtime_context_set_epoch_deadline(self.ctx, 1)
        else:
            lib.wasmtime_context_set_epoch_deadline(self.ctx, deadline_ticks(ms, self.support.tick_ms))

    def call(self, name: str, nargs: int, ms: float):
        """Call export `name` (arguments already in `self.args`) under a deadline of `ms` of CPU
        time; its result is left in `self.result`, to be read then freed with `free_result()`."""
        func = self.funcs[name]
        self._arm(ms)
        err = lib.wasmtime_component_func_call(func, self.ctx, self.args, nargs, self.result, 1)
        if err:
            raise self._call_error(take_error(err), name, ms)
        return self.result

    def free_result(self) -> None:
        lib.wasmtime_component_val_delete(self.result)
        self.result.kind = BOOL  # the next call's write drops the slot's value: leave a trivial one

    def set_u32(self, i: int, value: int) -> None:
        a = self.args[i]
        a.kind = KIND["U32"]
        a.of.u32 = value

    def set_tokens(self, i: int, tokens) -> None:
        """`tokens` as a list<u32> argument (in our own memory: a call only reads it)."""
        a = self.args[i]
        a.kind = KIND["LIST"]
        n = len(tokens)
        if n == 1:
            self.one_token.of.u32 = tokens[0]
            a.of.list.data = self.one_token
        elif n:
            vals = ffi.new("wasmtime_component_val_t[]", n)
            raw = np.frombuffer(ffi.buffer(vals), dtype=np.uint8).reshape(n, VAL_SIZE)
            raw[:, 0] = KIND["U32"]
            raw[:, 8:12] = np.asarray(tokens, dtype="<u4").view(np.uint8).reshape(n, 4)
            self._keep = vals
            a.of.list.data = vals
        else:
            a.of.list.data = ffi.NULL
        a.of.list.size = n

    def set_string(self, i: int, utf8: bytes) -> None:
        a = self.args[i]
        a.kind = KIND["STRING"]
        buf = ffi.from_buffer(utf8)
        self._keep = buf
        a.of.string.size = len(utf8)
        a.of.string.data = ffi.cast("uint8_t *", buf)

    # ------------------------------------------------------------------ errors

    def log_tail(self) -> str:
        return ControllerError.tail_of(self.state.log_bytes())

    def _call_error(self, message: str, name: str, ms: float) -> ControllerError:
        st = self.state
        host_error, kind, st.host_error, st.host_error_kind = st.host_error, st.host_error_kind, None, "trap"
        if host_error is not None:
            return ControllerError(kind, f"{name}: {host_error}", self.log_tail())
        d = self.deadline
        if d is not None and d.expired:
            what = (f"its deadline of {ms:g} ms of CPU time" if d.expired == 1
                    else f"its wall-clock cap of {wall_cap_ms(ms):g} ms")
            return ControllerError("timeout", f"{name} ran past {what}", self.log_tail())
        text = _describe(message)
        if "interrupt" in text and d is None:
            return ControllerError("timeout", f"{name} ran past its deadline of {ms:g} ms", self.log_tail())
        return ControllerError("trap", f"{name} trapped: {text}", self.log_tail())

    def _instantiate_error(self, message: str) -> ControllerError:
        first = _describe(message)
        low = message.lower()
        if "memory" in low and ("limit" in low or "exceed" in low or "minimum" in low):
            return ControllerError("oom", f"cannot instantiate the component within the memory limit of "
                                   f"{self.memory_limit >> 20} MiB: {first}", self.log_tail())
        if self.deadline is not None and self.deadline.expired:
            return ControllerError("timeout", f"instantiating the component ran past its deadline: {first}",
                                   self.log_tail())
        return ControllerError("trap", f"cannot instantiate the component: {first}", self.log_tail())


def _describe(message: str) -> str:
    """The useful line of a wasmtime error (the innermost cause, without the backtrace)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("Caused by:", "wasm backtrace:", "note:"))
            and not ln[:1].isdigit()]
    text = keep[-1] if keep else (lines[0] if lines else "unknown error")
    return text.removeprefix("wasm trap: ")[:300]
