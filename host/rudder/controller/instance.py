"""A core module's instance: the module instantiated in its own Store (store.py), fast calls into
its exports under the store's deadline, and zero-copy views of its linear memory.

Instances are made and called through the C API directly (capi.py): wasmtime-py's per-call
type checks and value boxing would cost more than the whole step budget we aim for.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .abi import MEMORY_EXPORT
from .capi import EXTERN_FUNC, EXTERN_GLOBAL, EXTERN_MEMORY, ffi, lib, take_error, take_trap
from .engines import WASM_PAGE
from .errors import ControllerError
from .host_api import HostState
from .store import Store, describe, instantiate_failure, known_failure, native_deadlines, wall_cap_ms

__all__ = ["Instance"]

_set_deadline = lib.wasmtime_context_set_epoch_deadline
_call_unchecked = lib.wasmtime_func_call_unchecked


class Instance:
    """A controller instantiated in its own store."""

    def __init__(self, cmod, state: HostState, memory_limit: int, init_ms: float):
        self.cmod = cmod
        self.state = state
        self.memory_limit = int(memory_limit)
        store = Store(cmod.shape.engine, state, memory_limit, cmod.shared.guest_memory)
        self.deadline = store.deadline
        self.store = store
        ctx = self.ctx = store.ctx
        self.trap = ffi.new("wasm_trap_t **")
        self._instance = ffi.new("wasmtime_instance_t *")
        # Instantiation runs no guest code (modules with a start function are rejected at
        # load), but arm a deadline anyway: wasmtime checks the epoch at function entry.
        store.arm(init_ms)
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
            native = native_deadlines()
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
        # No memory-size check here (a C call on every step): memory never shrinks, so
        # whatever lies inside `self.size` is valid; a pointer past it makes the reader call
        # check_growth() and look again.
        return self.vals_i32[0]

    # ------------------------------------------------------------------ errors

    def log_tail(self) -> str:
        return self.state.log_tail()

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
        self.check_growth()
        known = known_failure(self.state, self.deadline, name, ms, self.log_tail())
        if known is not None:
            return known
        trap, what = describe(message, code)
        if err:
            return ControllerError("trap", f"{name} failed: {what}", self.log_tail())
        if trap == "INTERRUPT":
            return ControllerError("timeout", f"{name} ran past its deadline of {ms:g} ms", self.log_tail())
        if trap != "STACK_OVERFLOW" and self.size + _oom_margin(self.memory_limit) > self.memory_limit:
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
            message = take_trap(self.trap[0])[1]
            self.trap[0] = ffi.NULL
        return instantiate_failure(message, self.memory_limit, None, self.log_tail())


def _oom_margin(limit: int) -> int:
    return max(16 * WASM_PAGE, limit // 8)
