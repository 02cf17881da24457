"""A component's instance: the component instantiated in its own Store (store.py: limits,
deadline, memory budget, as for a core module) with WASI granting nothing, and fast calls of its
exports through the C API (capi.py). What differs from a core module's instance: how it is
instantiated, and that arguments and results are component values instead of i32 slots.
"""

from __future__ import annotations

import numpy as np

from .capi import KIND, ffi, lib, take_error
from .component_host import OUTPUT_CALLBACK
from .errors import ControllerError
from .host_api import HostState
from .store import Store, describe, instantiate_failure, known_failure

__all__ = ["ComponentInstance"]

VAL_SIZE = ffi.sizeof("wasmtime_component_val_t")
BOOL = KIND["BOOL"]
# What one store may hold besides each linear memory's size: a component is many core
# instances (a componentize-py one: 14 modules) with their tables; these bound what a hostile
# one can ask.
MAX_INSTANCES = 256
MAX_TABLES = 256


class ComponentInstance:
    """A component controller instantiated in its own store."""

    def __init__(self, cmod, state: HostState, memory_limit: int, init_ms: float):
        self.cmod = cmod
        self.state = state
        self.memory_limit = int(memory_limit)
        self.store = store = Store(cmod.shape.engine, state, memory_limit, cmod.shared.guest_memory,
                                   instances=MAX_INSTANCES, tables=MAX_TABLES, memories=max(1, cmod.memories))
        # Its memory cannot be read (the component model hides it): it counts at the most it may reach.
        store.account(cmod.charge(memory_limit))
        self.ctx = store.ctx
        self.deadline = store.deadline
        # WASI: wasmtime's defaults grant nothing (no preopens, environment, arguments or
        # network); stdout and stderr go to the request's log.
        wasi = lib.wasi_config_new()
        lib.wasi_config_set_stdout_custom(wasi, OUTPUT_CALLBACK, store.handle, ffi.NULL)
        lib.wasi_config_set_stderr_custom(wasi, OUTPUT_CALLBACK, store.handle, ffi.NULL)
        err = lib.wasmtime_context_set_wasi(self.ctx, wasi)  # takes the config
        if err:
            store.close()
            raise ControllerError("bad_module", f"cannot set up WASI: {take_error(err)}")
        self.instance = ffi.new("wasmtime_component_instance_t *")
        # Instantiation may run guest code (core start functions): it runs under a deadline too.
        store.arm(init_ms)
        err = lib.wasmtime_component_linker_instantiate(cmod.shape.linker, self.ctx, cmod.ptr, self.instance)
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

    def call(self, name: str, nargs: int, ms: float):
        """Call export `name` (arguments already in `self.args`) under a deadline of `ms` of CPU
        time; its result is left in `self.result`, to be read then freed with `free_result()`."""
        func = self.funcs[name]
        self.store.arm(ms)
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
        return self.state.log_tail()

    def _call_error(self, message: str, name: str, ms: float) -> ControllerError:
        known = known_failure(self.state, self.deadline, name, ms, self.log_tail())
        if known is not None:
            return known
        trap, text = describe(message)
        if trap == "INTERRUPT":
            return ControllerError("timeout", f"{name} ran past its deadline of {ms:g} ms", self.log_tail())
        return ControllerError("trap", f"{name} trapped: {text}", self.log_tail())

    def _instantiate_error(self, message: str) -> ControllerError:
        return instantiate_failure(message, self.memory_limit, self.deadline, self.log_tail())
