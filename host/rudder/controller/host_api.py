"""The `rudder` import module: the host functions a controller may call (docs/abi.md).

They are defined once per runtime on a wasmtime Linker, store-independently, through
`wasmtime_linker_define_func_unchecked` with cffi callbacks (~3 us a call instead of ~20 us
for wasmtime-py's generic trampoline). A callback finds its caller's state through the
store's data pointer, which holds a cffi handle to that store's `HostState`.

Every pointer/length the guest passes is bounds-checked against its memory; a bad one traps
the guest (the request fails with a message naming the import), it never reads or writes
host memory. Imports are not on the per-token hot path, except perhaps var_get/var_set.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import wasmtime

from .abi import (ABI_VERSION, CONFIG_ABI_VERSION, CONFIG_FLAGS, CONFIG_HEAL, CONFIG_MAX_FF_TOKENS, CONFIG_MAX_FORKS,
                  FLAG_BACKTRACK, FLAG_FORKS, IMPORT_MODULE, IMPORTS)
from .fastcall import EXTERN_MEMORY, ffi, lib, addr
from .limits import Limits

__all__ = ["HostState", "RequestContext", "define_imports", "check_imports"]

LOG_TRUNCATED = b"\n[log truncated]\n"
# Text one `tokenize` call may take: an import cannot be interrupted, so its input bounds how
# long it runs (worst case, one token per byte: ~5 us a byte here). rudder_init/rudder_start
# may tokenize more at once than a step, whose budget is tens of milliseconds.
TOKENIZE_BYTES_SETUP = 256 << 10
TOKENIZE_BYTES_STEP = 16 << 10


class RequestContext:
    """What all forks of one request share: the argument, the shared variables, the log,
    the limits and the number of live sequences. Host imports may run on several threads
    at once (forks of one request run in parallel), hence the lock."""

    def __init__(self, arg: bytes, limits: Limits):
        self.arg = arg
        self.limits = limits
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


@dataclass(eq=False)
class HostState:
    """Per-store state the host functions see. `request` is None while rudder_init runs
    (there is no request yet); the log then goes to its own `log`."""

    runtime: object  # the ControllerRuntime's _Shared: tokenizer, token table, limits
    request: RequestContext | None = None
    memory: object = None  # wasmtime_memory_t of the instance, set after instantiation
    host_error: str | None = None  # why an import trapped the guest
    host_error_kind: str = "trap"  # ... and the request's error kind ("limit" for a spent budget)
    log: bytearray = field(default_factory=bytearray)  # rudder_init's log
    log_truncated: bool = False
    tokenize_cap: int = TOKENIZE_BYTES_SETUP  # one tokenize call's text (Controller lowers it for steps)
    tokenized_bytes: int = 0  # rudder_init's tokenize text (no request to count it yet)


class _GuestFault(Exception):
    """A guest passed a bad argument to an import: trap it with this message."""

    kind = "trap"


class _GuestOverBudget(_GuestFault):
    """An import would exceed a per-request budget: the request fails with kind `limit`."""

    kind = "limit"


def _memory(state: HostState, caller, ctx):
    """(base pointer, size) of the caller's memory."""
    mem = state.memory
    if mem is None:  # before the host looked it up (cannot happen without a start function)
        ext = ffi.new("wasmtime_extern_t *")
        if not lib.wasmtime_caller_export_get(caller, b"memory", 6, ext) or ext.kind != EXTERN_MEMORY:
            raise _GuestFault("the controller exports no memory")
        mem = ffi.new("wasmtime_memory_t *", ext.of.memory)
        state.memory = mem
    return lib.wasmtime_memory_data(ctx, mem), lib.wasmtime_memory_data_size(ctx, mem)


def _span(name: str, what: str, ptr: int, length: int, size: int) -> int:
    """The guest's pointer as unsigned, checked so that [ptr, ptr + length) lies inside the
    memory (`length` is already a non-negative byte count)."""
    ptr &= 0xFFFFFFFF
    if ptr + length > size:
        raise _GuestFault(f"rudder.{name}: {what} [{ptr:#x}, +{length}) lies outside the "
                          f"controller's memory ({size} bytes)")
    return ptr


def _read(base, ptr: int, length: int) -> bytes:
    return ffi.unpack(ffi.cast("char *", base) + ptr, length) if length else b""


def _write(base, ptr: int, data: bytes) -> None:
    if data:
        ffi.memmove(base + ptr, data, len(data))


# ----------------------------------------------------------------------------- the imports
# Each takes (state, caller, ctx, vals) and returns the i32 result (or None for no result).

def _vocab_size(state, caller, ctx, vals):
    return state.runtime.vocab_size


def _eos_token(state, caller, ctx, vals):
    eos = state.runtime.eos_token_id
    return -1 if eos is None else eos


def _config(state, caller, ctx, vals):
    limits = state.request.limits if state.request is not None else state.runtime.limits
    key = vals[0].i32
    if key == CONFIG_ABI_VERSION:
        return ABI_VERSION
    if key == CONFIG_MAX_FORKS:
        return limits.max_forks
    if key == CONFIG_MAX_FF_TOKENS:
        return limits.max_ff_tokens
    if key == CONFIG_FLAGS:
        forks = limits.max_forks > 1
        return (FLAG_FORKS if forks else 0) | (FLAG_BACKTRACK if state.runtime.backtrack_allowed else 0)
    if key == CONFIG_HEAL:
        return state.request.heal if state.request is not None else 0
    return -1


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
    # Budgets first, before any work: one call's text (it cannot be interrupted) and the request's.
    if length > state.tokenize_cap:
        raise _GuestOverBudget(f"rudder.tokenize: text of {length} bytes is over the {state.tokenize_cap} "
                               f"bytes one call may tokenize {'in a step' if state.tokenize_cap < TOKENIZE_BYTES_SETUP else 'at set-up'}")
    holder = state.request if state.request is not None else state
    budget = state.runtime.limits.max_tokenize_bytes if state.request is None else state.request.limits.max_tokenize_bytes
    if holder.tokenized_bytes + length > budget:
        raise _GuestOverBudget(f"rudder.tokenize: the request's tokenize budget of {budget} bytes is spent "
                               f"({holder.tokenized_bytes} used, {length} more asked)")
    holder.tokenized_bytes += length
    text_ptr = _span("tokenize", "text", vals[0].i32, length, size)
    try:
        text = _read(base, text_ptr, length).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _GuestFault(f"rudder.tokenize: text is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    # encode_without_gil lets go of the GIL while it works: the server's event loop and the
    # engine go on meanwhile. It runs on this thread (rudder.tokenizer turns the tokenizers
    # library's thread pool off), so its CPU time counts against this call's deadline.
    ids = state.runtime.tokenizer.encode_without_gil(text)
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
    limit = (state.request.limits if state.request is not None else state.runtime.limits).max_log_bytes
    if holder.log_truncated:  # cheap exit for log spam: no copy at all
        return None
    # Copy only what can still be kept (a 1 GB log call costs no more than the limit).
    keep = min(length, max(limit - len(holder.log), 0) + 1)
    data = _read(base, ptr, keep)
    if holder is state:
        _append_bounded(state, data, limit)
    else:
        holder.append_log(data)
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
        return -1
    ok = state.request.var_set(_read(base, key_ptr, klen), _read(base, val_ptr, vlen))
    return 0 if ok else -1


_HANDLERS = {
    "vocab_size": _vocab_size, "eos_token": _eos_token, "config": _config,
    "arg_len": _arg_len, "arg_read": _arg_read, "tokenize": _tokenize,
    "token_table_len": _token_table_len, "token_table_read": _token_table_read,
    "log": _log, "var_get": _var_get, "var_set": _var_set,
}
assert _HANDLERS.keys() == IMPORTS.keys()


def _trap(state: HostState | None, message: str, kind: str = "trap"):
    if state is not None and state.host_error is None:
        state.host_error = message
        state.host_error_kind = kind
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
        except _GuestFault as e:
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
            from .fastcall import take_error
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
