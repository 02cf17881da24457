"""The host side of every controller: what all forks of a request share (RequestContext), what
each store's host functions see (HostState), the logic of the host functions whatever carries
them (config, tokenize budgets, variables, the log), and the `rudder` import module of a core
module (docs/abi.md). A component's imports carry the same logic (component_host.py).

Core imports are defined once per runtime on a wasmtime Linker, store-independently, through
`wasmtime_linker_define_func_unchecked` with cffi callbacks (far cheaper a call than
wasmtime-py's generic trampoline). A callback finds its caller's state through the store's
data pointer, which holds a cffi handle to that store's `HostState`.

Every pointer/length the guest passes is bounds-checked against its memory; a bad one traps
the guest (the request fails with a message naming the import), it never reads or writes
host memory. Imports are not on the per-token hot path, except perhaps var_get/var_set.
"""

from __future__ import annotations

import random
import threading

import wasmtime

from .abi import (ABI_VERSION, CONFIG_ABI_VERSION, CONFIG_FLAGS, CONFIG_HEAL, CONFIG_MAX_FF_TOKENS, CONFIG_MAX_FORKS,
                  FLAG_BACKTRACK, FLAG_FORKS, IMPORT_MODULE, IMPORTS)
from .capi import EXTERN_MEMORY, addr, ffi, lib, take_error
from .errors import ControllerError
from .limits import Limits

__all__ = ["HostState", "RequestContext", "GuestFault", "config_value", "charge_tokenize", "tokenize", "var_set",
           "define_imports", "check_imports"]

LOG_TRUNCATED = b"\n[log truncated]\n"
# Text one `tokenize` call may take: an import cannot be interrupted, so its input bounds how
# long it runs (worst case, one token per byte). init and start may tokenize more at once than
# a step, whose budget is tens of milliseconds.
TOKENIZE_BYTES_SETUP = 256 << 10
TOKENIZE_BYTES_STEP = 16 << 10


class RequestContext:
    """What all forks of one request share: the argument, the shared variables, the log,
    the limits and the number of live sequences. Host imports may run on several threads
    at once (forks of one request run in parallel), hence the lock. `seed` seeds a
    component's WASI random (None: it derives from the argument)."""

    def __init__(self, arg: bytes, limits: Limits, seed: int | None = None):
        self.arg = arg
        self.limits = limits
        self.seed = seed
        self.vars: dict[bytes, bytes] = {}
        self.var_bytes = 0
        self.tokenized_bytes = 0  # text given to `tokenize` by all its forks
        self.log = bytearray()
        self.log_truncated = False
        self.live = 0
        self.heal = 0  # prompt tokens its first answer takes back (token healing: rudder/healing.py)
        self.lock = threading.Lock()

    def append_log(self, data: bytes | memoryview) -> None:
        with self.lock:
            _append_bounded(self, data, self.limits.max_log_bytes)

    def log_text(self) -> str:
        with self.lock:
            return bytes(self.log).decode("utf-8", "replace")

    def var_get(self, key: bytes) -> bytes | None:
        with self.lock:
            return self.vars.get(key)

    def var_set(self, key: bytes, value: bytes) -> bool:
        """False (and nothing changes) when the variables would exceed max_var_bytes."""
        with self.lock:
            old = self.vars.get(key)
            used = self.var_bytes - (len(key) + len(old) if old is not None else 0)
            if used + len(key) + len(value) > self.limits.max_var_bytes:
                return False
            self.vars[key] = value
            self.var_bytes = used + len(key) + len(value)
            return True


def _append_bounded(holder, data, limit: int) -> None:
    """Append to `holder.log`, keeping at most `limit` bytes of text; the first time text is
    dropped a marker is appended, so readers know the log is incomplete."""
    if holder.log_truncated:
        return
    room = limit - len(holder.log)
    if len(data) <= room:
        holder.log += data
        return
    holder.log += data[:max(room, 0)]
    holder.log += LOG_TRUNCATED
    holder.log_truncated = True


class HostState:
    """Per-store state the host functions see, for a core module and a component alike.
    `request` is None while init runs (there is no request yet): the log, the limits and the
    tokenize budget are then the state's own. `seed` starts a component's random stream."""

    def __init__(self, runtime, request: RequestContext | None = None, seed: int | None = None):
        self.runtime = runtime  # the ControllerRuntime's _Shared: tokenizer, token table, limits
        self.request = request
        self.memory = None  # a core instance's wasmtime_memory_t, set after instantiation
        self.host_error: str | None = None  # why an import trapped the guest
        self.host_error_kind = "trap"  # ... and the request's error kind ("limit" for a spent budget)
        self.log = bytearray()  # init's log
        self.log_truncated = False
        self.tokenize_cap = TOKENIZE_BYTES_SETUP  # one tokenize call's text (a step lowers it)
        self.tokenized_bytes = 0  # init's tokenize text (no request to count it yet)
        self.rng = random.Random(seed) if seed is not None else None

    @property
    def limits(self) -> Limits:
        return self.request.limits if self.request is not None else self.runtime.limits

    def append_log(self, data: bytes) -> None:
        if self.request is not None:
            self.request.append_log(data)
        else:
            _append_bounded(self, data, self.limits.max_log_bytes)

    def log_tail(self) -> str:
        """The end of the log (the request's, or init's), for an error message."""
        return ControllerError.tail_of(self.request.log if self.request is not None else self.log)

    def fault(self, message: str, kind: str = "trap") -> None:
        """Record why a host function traps the guest (the first reason stands)."""
        if self.host_error is None:
            self.host_error, self.host_error_kind = message, kind


class GuestFault(Exception):
    """A guest's call of a host function that must trap it; `kind`: the request's error kind."""

    def __init__(self, message: str, kind: str = "trap"):
        super().__init__(message)
        self.kind = kind


# ----------------------------------------------------------------------------- host logic
# What a host function answers, whatever the calling convention that carries it.

def config_value(state: HostState, key: int) -> int:
    """The `config` import: the ABI version, this request's limits, flags, token healing."""
    limits = state.limits
    if key == CONFIG_ABI_VERSION:
        return ABI_VERSION
    if key == CONFIG_MAX_FORKS:
        return limits.max_forks
    if key == CONFIG_MAX_FF_TOKENS:
        return limits.max_ff_tokens
    if key == CONFIG_FLAGS:
        return (FLAG_FORKS if limits.max_forks > 1 else 0) | (FLAG_BACKTRACK if state.runtime.backtrack_allowed else 0)
    if key == CONFIG_HEAL:
        return state.request.heal if state.request is not None else 0
    return -1


def charge_tokenize(state: HostState, length: int) -> None:
    """Count `length` bytes of text to tokenize, before any work: one call's cap (a call cannot
    be interrupted) and the request's budget; GuestFault(kind limit) past either."""
    if length > state.tokenize_cap:
        where = "in a step" if state.tokenize_cap < TOKENIZE_BYTES_SETUP else "at set-up"
        raise GuestFault(f"rudder.tokenize: text of {length} bytes is over the {state.tokenize_cap} bytes one call "
                         f"may tokenize {where}", "limit")
    holder = state.request if state.request is not None else state
    budget = state.limits.max_tokenize_bytes
    if holder.tokenized_bytes + length > budget:
        raise GuestFault(f"rudder.tokenize: the request's tokenize budget of {budget} bytes is spent "
                         f"({holder.tokenized_bytes} used, {length} more asked)", "limit")
    holder.tokenized_bytes += length


def tokenize(state: HostState, text: str) -> list[int]:
    """Token ids of text already charged. encode_without_gil lets go of the GIL while it works:
    the server's event loop and the engine go on meanwhile. It runs on this thread
    (rudder.tokenizer turns the tokenizers library's thread pool off), so its CPU time counts
    against the calling hook's deadline."""
    return state.runtime.tokenizer.encode_without_gil(text)


def var_set(state: HostState, key: bytes, value: bytes) -> bool:
    """The `var_set` import: False during init and when over the request's limit."""
    request = state.request
    return request is not None and len(key) + len(value) <= request.limits.max_var_bytes \
        and request.var_set(key, value)


# ----------------------------------------------------------------------------- core modules
# The `rudder` import module of a core module: i32 arguments in raw value slots, data in the
# guest's memory. Each import takes (state, caller, ctx, vals) and returns the i32 result (or
# None for no result).

def _memory(state: HostState, caller, ctx):
    """(base pointer, size) of the caller's memory."""
    mem = state.memory
    if mem is None:  # before the host looked it up (cannot happen without a start function)
        ext = ffi.new("wasmtime_extern_t *")
        if not lib.wasmtime_caller_export_get(caller, b"memory", 6, ext) or ext.kind != EXTERN_MEMORY:
            raise GuestFault("the controller exports no memory")
        mem = ffi.new("wasmtime_memory_t *", ext.of.memory)
        state.memory = mem
    return lib.wasmtime_memory_data(ctx, mem), lib.wasmtime_memory_data_size(ctx, mem)


def _span(name: str, what: str, ptr: int, length: int, size: int) -> int:
    """The guest's pointer as unsigned, checked so that [ptr, ptr + length) lies inside the
    memory (`length` is already a non-negative byte count)."""
    ptr &= 0xFFFFFFFF
    if ptr + length > size:
        raise GuestFault(f"rudder.{name}: {what} [{ptr:#x}, +{length}) lies outside the "
                          f"controller's memory ({size} bytes)")
    return ptr


def _read(base, ptr: int, length: int) -> bytes:
    return ffi.unpack(ffi.cast("char *", base) + ptr, length) if length else b""


def _write(base, ptr: int, data: bytes) -> None:
    if data:
        ffi.memmove(base + ptr, data, len(data))


def _vocab_size(state, caller, ctx, vals):
    return state.runtime.vocab_size


def _eos_token(state, caller, ctx, vals):
    eos = state.runtime.eos_token_id
    return -1 if eos is None else eos


def _config(state, caller, ctx, vals):
    return config_value(state, vals[0].i32)


def _arg_len(state, caller, ctx, vals):
    return -1 if state.request is None else len(state.request.arg)


def _arg_read(state, caller, ctx, vals):
    if state.request is None:
        return -1
    arg = state.request.arg
    base, size = _memory(state, caller, ctx)
    n = min(len(arg), vals[1].i32 & 0xFFFFFFFF)
    dst = _span("arg_read", "destination", vals[0].i32, n, size)
    _write(base, dst, arg[:n])
    return n


def _tokenize(state, caller, ctx, vals):
    base, size = _memory(state, caller, ctx)
    length = vals[1].i32 & 0xFFFFFFFF
    charge_tokenize(state, length)
    text_ptr = _span("tokenize", "text", vals[0].i32, length, size)
    try:
        text = _read(base, text_ptr, length).decode("utf-8")
    except UnicodeDecodeError as e:
        raise GuestFault(f"rudder.tokenize: text is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    ids = tokenize(state, text)
    n = min(len(ids), vals[3].i32 & 0xFFFFFFFF)
    if n:
        dst = _span("tokenize", "destination", vals[2].i32, 4 * n, size)
        ffi.memmove(base + dst, ffi.new("uint32_t[]", ids[:n]), 4 * n)
    return len(ids)


def _token_table_len(state, caller, ctx, vals):
    return len(state.runtime.token_table)


def _token_table_read(state, caller, ctx, vals):
    table = state.runtime.token_table
    base, size = _memory(state, caller, ctx)
    n = min(len(table), vals[1].i32 & 0xFFFFFFFF)
    dst = _span("token_table_read", "destination", vals[0].i32, n, size)
    _write(base, dst, table[:n] if n < len(table) else table)
    return n


def _log(state, caller, ctx, vals):
    base, size = _memory(state, caller, ctx)
    length = vals[1].i32 & 0xFFFFFFFF
    ptr = _span("log", "text", vals[0].i32, length, size)
    holder = state.request if state.request is not None else state
    if holder.log_truncated:  # cheap exit for log spam: no copy at all
        return None
    # Copy only what can still be kept (a 1 GB log call costs no more than the limit).
    keep = min(length, max(state.limits.max_log_bytes - len(holder.log), 0) + 1)
    state.append_log(_read(base, ptr, keep))
    return None


def _var_get(state, caller, ctx, vals):
    if state.request is None:
        return -1
    base, size = _memory(state, caller, ctx)
    klen = vals[1].i32 & 0xFFFFFFFF
    key_ptr = _span("var_get", "key", vals[0].i32, klen, size)
    key = _read(base, key_ptr, klen)
    value = state.request.var_get(key)
    if value is None:
        return -1
    n = min(len(value), vals[3].i32 & 0xFFFFFFFF)
    dst = _span("var_get", "destination", vals[2].i32, n, size)
    _write(base, dst, value[:n])
    return len(value)


def _var_set(state, caller, ctx, vals):
    if state.request is None:
        return -1
    base, size = _memory(state, caller, ctx)
    klen = vals[1].i32 & 0xFFFFFFFF
    vlen = vals[3].i32 & 0xFFFFFFFF
    key_ptr = _span("var_set", "key", vals[0].i32, klen, size)
    val_ptr = _span("var_set", "value", vals[2].i32, vlen, size)
    if klen + vlen > state.request.limits.max_var_bytes:
        return -1  # (before reading either)
    return 0 if var_set(state, _read(base, key_ptr, klen), _read(base, val_ptr, vlen)) else -1


_HANDLERS = {
    "vocab_size": _vocab_size, "eos_token": _eos_token, "config": _config,
    "arg_len": _arg_len, "arg_read": _arg_read, "tokenize": _tokenize,
    "token_table_len": _token_table_len, "token_table_read": _token_table_read,
    "log": _log, "var_get": _var_get, "var_set": _var_set,
}
assert _HANDLERS.keys() == IMPORTS.keys()


def _trap(state: HostState | None, message: str, kind: str = "trap"):
    if state is not None:
        state.fault(message, kind)
    data = message.encode("utf-8", "replace")
    return lib.wasmtime_trap_new(data, len(data))


def _make_callback(name: str, handler):
    has_result = IMPORTS[name][1] == 1

    def callback(env, caller, vals, nvals):
        state = None
        try:
            ctx = lib.wasmtime_caller_context(caller)
            state = ffi.from_handle(lib.wasmtime_context_get_data(ctx))
            result = handler(state, caller, ctx, vals)
            if has_result:
                vals[0].i32 = result
            return ffi.NULL
        except GuestFault as e:
            return _trap(state, str(e), e.kind)
        except BaseException as e:  # a host bug must not unwind through wasm frames
            return _trap(state, f"rudder.{name}: host error: {type(e).__name__}: {e}")

    return ffi.callback("wasmtime_func_unchecked_callback_t", callback)


# Made once per process: the callbacks are store- and runtime-independent, and must stay
# alive as long as any linker refers to them.
_CALLBACKS = {name: _make_callback(name, h) for name, h in _HANDLERS.items()}


def define_imports(linker: wasmtime.Linker) -> None:
    """Define every `rudder.*` import on `linker` (store-independent definitions)."""
    linker_p = ffi.cast("wasmtime_linker_t *", addr(linker.ptr()))
    i32 = wasmtime.ValType.i32()
    for name, (n_params, n_results) in IMPORTS.items():
        ty = wasmtime.FuncType([i32] * n_params, [i32] * n_results)
        err = lib.wasmtime_linker_define_func_unchecked(
            linker_p, IMPORT_MODULE.encode(), len(IMPORT_MODULE), name.encode(), len(name),
            ffi.cast("wasm_functype_t *", addr(ty.ptr())), _CALLBACKS[name], ffi.NULL, ffi.NULL)
        if err:
            raise RuntimeError(f"cannot define rudder.{name}: {take_error(err)}")


def check_imports(module: wasmtime.Module) -> str | None:
    """Why the module's imports are unacceptable, or None if they are all `rudder` host
    functions with the right signatures."""
    allowed = ", ".join(IMPORTS)
    for imp in module.imports:
        where = f"{imp.module}.{imp.name}"
        if imp.module != IMPORT_MODULE:
            return (f"the controller imports {where}, but controllers may only import the "
                    f"`rudder` host functions ({allowed})")
        if imp.name not in IMPORTS:
            return f"the controller imports {where}, which does not exist (known: {allowed})"
        ty = imp.type
        if not isinstance(ty, wasmtime.FuncType):
            return f"the controller imports {where} as a {type(ty).__name__}, but it is a function"
        n_params, n_results = IMPORTS[imp.name]
        params = [str(p) for p in ty.params]
        results = [str(r) for r in ty.results]
        if params != ["i32"] * n_params or results != ["i32"] * n_results:
            want = f"({', '.join(['i32'] * n_params)}) -> ({', '.join(['i32'] * n_results)})"
            got = f"({', '.join(params)}) -> ({', '.join(results)})"
            return f"the controller imports {where} with type {got}, but it is {want}"
    return None
