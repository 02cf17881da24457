"""One wasmtime store, whatever runs in it: its limits, its CPU-time deadline, its place in the
server's guest memory budget and in its engine's ticker. A core module's instance
(instance.py) and a component's (component_instance.py) each live in one of these; only how
they are instantiated and called differs.

Every request and every fork gets its own store, so controllers never share memory and a
failed one can simply be dropped.

Deadlines: before every call the native deadline struct (native/deadline.c) is armed with the
call's CPU budget and the store's epoch deadline is set; when the epoch deadline passes, the
native callback checks the thread's CPU time and moves the deadline on while the call is
within budget, and ends it past its budget or past its wall-clock cap. Without the native
library they are wall-clock epochs (`deadline_ticks`).
"""

from __future__ import annotations

import math
import re

from .capi import TRAP_CODES, ffi, lib
from .errors import ControllerError
from .limits import deadline_ticks

__all__ = ["Store", "NativeDeadlines", "native_deadlines", "wall_cap_ms", "WORKER_NICE", "known_failure", "describe",
           "instantiate_failure"]

# Table elements one store may hold: a `table.grow` loop would otherwise eat host memory.
TABLE_ELEMENTS = 1 << 20


# The controller workers' niceness above the engine's threads (engine/controller_calls.py): on a
# busy host the forward pass, which every request shares, comes first.
WORKER_NICE = 10
# The kernel weighs a thread ~1.25x less per nice level (1024 at 0, 110 at +10): beside three busy
# threads of normal priority a worker gets 1 / (1 + 3 * 1.25 ** WORKER_NICE) of its core (1/29).
_WALL_FACTOR = math.ceil(1 + 3 * 1.25 ** WORKER_NICE)


def wall_cap_ms(ms: float) -> float:
    """The wall-clock cap of a call with a CPU budget of `ms`: room for a call on a controller
    worker (WORKER_NICE) whose core three busy threads of normal priority share with it, never
    less than 100 ms more. (The former cap, 4 x + 100 ms, left room for three busy threads of the
    worker's own priority: beside two ordinary ones, a worker's 10 ms calls took ~200-330 ms and
    14 of 15 were ended.)"""
    return _WALL_FACTOR * ms + 100


class NativeDeadlines:
    """The native CPU-time deadline (native/deadline.c), when the native library builds: the
    epoch callback, and the C API functions it calls, as the native library's pointers."""

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
            self.arm = nlib.rudder_deadline_arm

    def pointer(self, cdata, ctype: str = "void *"):
        """A pointer of the C API binding as one of the native library's (two cffi FFIs)."""
        return self.ffi.cast(ctype, int(ffi.cast("uintptr_t", cdata)))

    def new(self, tick_ms: float):
        """A deadline struct for one store, or None (then deadlines are wall-clock epochs)."""
        if self.lib is None:
            return None
        d = self.ffi.new("rudder_deadline *")
        d.tick_ns = int(tick_ms * 1e6)
        d.error_new, d.set_deadline, d.call = self.error_new, self.set_deadline, self.call
        return d


_deadlines: NativeDeadlines | None = None


def native_deadlines() -> NativeDeadlines:
    global _deadlines
    if _deadlines is None:
        _deadlines = NativeDeadlines()
    return _deadlines


class Store:
    """Owns a wasmtime store (and with it the instances and memories in it).

    The store's data pointer is a handle to its HostState: host functions find their state from
    the caller's context with no lookup table. Its memory counts in `meter` (the runtime's
    GuestMemory) for `account`ed bytes until it is freed. It is freed when its last reference
    goes, or at once by `close()`; a core instance's numpy views of guest memory hold a
    reference, so a mask the engine still holds after `close()` never points at freed memory.
    `instances`, `tables`, `memories`: what the store may hold besides memory bytes (-1: any).
    """

    __slots__ = ("ptr", "ctx", "handle", "engine", "ticker", "deadline", "meter", "accounted", "tick_ms")

    def __init__(self, engine, state, memory_limit: int, meter, *, instances: int = 1, tables: int = -1,
                 memories: int = 1):
        self.handle = ffi.new_handle(state)
        ptr = lib.wasmtime_store_new(engine.ptr, self.handle, ffi.NULL)
        self.ptr = ffi.gc(ptr, lib.wasmtime_store_delete)
        self.ctx = lib.wasmtime_store_context(ptr)
        self.engine = engine  # the engine must outlive its stores
        self.tick_ms = engine.tick_ms
        lib.wasmtime_store_limiter(ptr, int(memory_limit), TABLE_ELEMENTS, instances, tables, memories)
        deadlines = native_deadlines()
        self.deadline = deadlines.new(engine.tick_ms)
        if self.deadline is not None:
            lib.wasmtime_store_epoch_deadline_callback(ptr, ffi.cast("void *", deadlines.callback),
                                                       ffi.cast("void *", int(deadlines.ffi.cast("uintptr_t", self.deadline))),
                                                       ffi.NULL)
        self.meter = meter
        self.accounted = 0
        self.ticker = engine.ticker
        self.ticker.store_opened()

    def account(self, size: int) -> bool:
        """The store's memory is now `size` bytes; False if that leaves the server's budget exceeded."""
        delta, self.accounted = size - self.accounted, size
        return self.meter is None or self.meter.add(delta)

    def arm(self, ms: float) -> None:
        """Arm a deadline of `ms` for the next call into the store: CPU time, first checked at
        the next tick (native deadlines), else wall-clock epoch ticks."""
        if self.deadline is not None:
            native_deadlines().arm(self.deadline, int(ms * 1e6), int(wall_cap_ms(ms) * 1e6))
            lib.wasmtime_context_set_epoch_deadline(self.ctx, 1)
        else:
            lib.wasmtime_context_set_epoch_deadline(self.ctx, deadline_ticks(ms, self.tick_ms))

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


def known_failure(state, deadline, name: str, ms: float, log_tail: str) -> ControllerError | None:
    """The error of a failed call whose cause the host knows, whatever the shape: a host function
    that trapped the guest (its message and kind), or a native deadline that ended the call."""
    host_error, kind, state.host_error, state.host_error_kind = state.host_error, state.host_error_kind, None, "trap"
    if host_error is not None:
        return ControllerError(kind, f"{name}: {host_error}", log_tail)
    if deadline is not None and deadline.expired:
        what = (f"its deadline of {ms:g} ms of CPU time" if deadline.expired == 1
                else f"its wall-clock cap of {wall_cap_ms(ms):g} ms")
        return ControllerError("timeout", f"{name} ran past {what}", log_tail)
    return None


# Traps in words, by wasmtime's trap code; a component's call gives no code, only wasmtime's
# text, which `_TRAP_NAMES` maps back to the same code, so both shapes say the same.
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
_TRAP_NAMES = {
    "call stack exhausted": "STACK_OVERFLOW", "out of bounds memory access": "MEMORY_OUT_OF_BOUNDS",
    "misaligned memory access": "HEAP_MISALIGNED", "undefined element: out of bounds table access": "TABLE_OUT_OF_BOUNDS",
    "uninitialized element": "INDIRECT_CALL_TO_NULL", "indirect call type mismatch": "BAD_SIGNATURE",
    "integer overflow": "INTEGER_OVERFLOW", "integer divide by zero": "INTEGER_DIVISION_BY_ZERO",
    "invalid conversion to integer": "BAD_CONVERSION_TO_INTEGER",
    "wasm `unreachable` instruction executed": "UNREACHABLE_CODE_REACHED", "interrupt": "INTERRUPT",
}
_FRAME = re.compile(r"^\d+:\s+0x[0-9a-f]+ - (.+)$")


def describe(message: str, code: int | None = None) -> tuple[str | None, str]:
    """(trap name or None, one line in words) of a wasmtime trap or error: the innermost cause
    (wasmtime puts it last, under "Caused by:"), and the guest function the first backtrace
    frame names."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    frames = [m.group(1) for m in map(_FRAME.match, lines) if m]
    if "Caused by:" in lines:
        causes = [re.sub(r"^\d+:\s*", "", ln) for ln in lines[lines.index("Caused by:") + 1:]]
    else:
        causes = [ln for ln in lines if not _FRAME.match(ln) and ln != "wasm backtrace:"][:1]
    cause = causes[-1].removeprefix("wasm trap: ") if causes else "unknown error"
    name = TRAP_CODES.get(code) if code is not None else _TRAP_NAMES.get(cause)
    text = _TRAP_TEXT.get(name, cause)[:300]
    if frames:
        func = frames[0].split("!", 1)[-1]
        text += f" in {func[1:-1] if func.startswith('<') and func.endswith('>') else func}"
    return name, text


def instantiate_failure(message: str, memory_limit: int, deadline, log_tail: str) -> ControllerError:
    """Why a controller could not be instantiated: no room in the pool (busy), its memory limit,
    a start function past its deadline, or a trap."""
    first = describe(message)[1]
    low = message.lower()
    if "concurrent" in low:  # the pooling allocator has no free slot
        return ControllerError("limit", f"too many live controllers on this server: {first}", log_tail, busy=True)
    if "memory" in low and ("limit" in low or "exceed" in low or "minimum" in low):
        return ControllerError("oom", f"cannot instantiate the controller within the memory limit of "
                               f"{memory_limit >> 20} MiB: {first}", log_tail)
    if deadline is not None and deadline.expired:
        return ControllerError("timeout", f"instantiating the controller ran past its deadline: {first}", log_tail)
    return ControllerError("trap", f"cannot instantiate the controller: {first}", log_tail)
