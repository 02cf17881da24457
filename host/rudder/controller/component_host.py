"""The host side of a component controller's imports: `rudder:controller/host` (the `rudder`
module of the core form, docs/abi.md) and the parts of WASI the host replaces.

WASI is linked with nothing granted (wasmtime's defaults: no preopened directory, no
environment, no arguments, no network). Two parts are ours instead of wasmtime's:
- stdout and stderr go to the request's log (the same bounded log as `log`);
- `wasi:random` (secure and insecure) is a generator seeded from the request, so that a seeded
  run repeats exactly; each instance (a request, a fork) has its own stream.

Host functions are defined once per linker through the C API with cffi callbacks. A callback
finds its caller's state through the store's data pointer (a cffi handle to its HostState, the
same class as a core module's), and answers with the same logic (host_api.py).
The C API's host functions are dynamically typed: a component could import `log` with any
signature. Types are checked at load (component_module), and each callback still checks the
kind of every argument before reading it, so a mismatch can never make the host read
memory it should not.
"""

from __future__ import annotations

import threading

import numpy as np

from .capi import KIND, ffi, lib, take_error
from .host_api import GuestFault, charge_tokenize, config_value, tokenize, var_set

__all__ = ["HOST_INTERFACE", "define_host", "define_random", "RANDOM_INTERFACES", "bytes_to_wit", "wit_to_bytes"]

HOST_INTERFACE = "rudder:controller/host@1.0.0"
VAL_SIZE = ffi.sizeof("wasmtime_component_val_t")
# The WASI interfaces whose functions we define ourselves (the rest come from wasmtime's
# add_wasip2): the versions are those a component imports (wasmtime picks a compatible one).
RANDOM_INTERFACES = ("wasi:random/random", "wasi:random/insecure", "wasi:random/insecure-seed")


def bytes_to_wit(data: bytes) -> bytes:
    """Bytes as the UTF-8 of the WIT `bytes` string (one char per byte, U+0000..U+00FF)."""
    return data.decode("latin-1").encode("utf-8")


def wit_to_bytes(utf8: bytes) -> bytes:
    """The bytes a WIT `bytes` string stands for; ValueError if a char is past U+00FF."""
    if utf8.isascii():
        return utf8
    return utf8.decode("utf-8").encode("latin-1")


# ----------------------------------------------------------------------------- values

def _arg_string(args, i: int, name: str) -> bytes:
    v = args[i]
    if v.kind != KIND["STRING"]:
        raise GuestFault(f"{name}: argument {i} is not a string")
    s = v.of.string
    return ffi.unpack(ffi.cast("char *", s.data), s.size) if s.size else b""


def _arg_u32(args, i: int, name: str) -> int:
    v = args[i]
    if v.kind != KIND["U32"]:
        raise GuestFault(f"{name}: argument {i} is not a u32")
    return v.of.u32


def u32_list(val) -> np.ndarray | None:
    """The numbers of a list<u32> value (one strided view, no loop); None if it is not one."""
    if val.kind != KIND["LIST"]:
        return None
    lst = val.of.list
    if lst.size == 0:
        return np.zeros(0, dtype=np.uint32)
    raw = np.frombuffer(ffi.buffer(lst.data, VAL_SIZE * lst.size), dtype=np.uint8).reshape(lst.size, VAL_SIZE)
    if not (raw[:, 0] == KIND["U32"]).all():
        return None
    return raw[:, 8:12].copy().view("<u4").reshape(-1)


def _arg_u32_list(args, i: int, name: str) -> np.ndarray:
    tokens = u32_list(args[i])
    if tokens is None:
        raise GuestFault(f"{name}: argument {i} is not a list<u32>")
    return tokens


def _new_list(n: int, kind: int, width: int):
    """A list value of `n` numbers of `kind` in memory wasmtime owns, and a numpy view of the
    payload bytes (`width` of them) of each element to fill. The list is made in a fresh
    struct: the C API's constructors overwrite their target as a Rust value (dropping what
    it held), and a result slot holds no valid list."""
    lst = ffi.new("wasmtime_component_vallist_t *")
    lib.wasmtime_component_vallist_new_uninit(lst, n)
    if not n:
        return lst, None
    raw = np.frombuffer(ffi.buffer(lst.data, VAL_SIZE * n), dtype=np.uint8).reshape(n, VAL_SIZE)
    raw[:, 0] = kind
    return lst, raw[:, 8:8 + width]


def set_string(val, utf8: bytes) -> None:
    """Fill `val` (a result slot) with a string wasmtime owns."""
    vec = ffi.new("wasm_byte_vec_t *")
    lib.wasm_byte_vec_new(vec, len(utf8), utf8)
    val.kind = KIND["STRING"]
    val.of.string = vec[0]


def set_option_string(val, utf8: bytes | None) -> None:
    val.kind = KIND["OPTION"]
    if utf8 is None:
        val.of.option = ffi.NULL
        return
    inner = ffi.new("wasmtime_component_val_t *")
    set_string(inner[0], utf8)
    val.of.option = lib.wasmtime_component_val_new(inner)  # moves it into a box wasmtime owns


def set_u32_list(val, values) -> None:
    lst, payload = _new_list(len(values), KIND["U32"], 4)
    if payload is not None:
        payload[:] = np.asarray(values, dtype="<u4").view(np.uint8).reshape(-1, 4)
    val.kind = KIND["LIST"]
    val.of.list = lst[0]


def set_u8_list(val, data: bytes) -> None:
    lst, payload = _new_list(len(data), KIND["U8"], 1)
    if payload is not None:
        payload[:, 0] = np.frombuffer(data, dtype=np.uint8)
    val.kind = KIND["LIST"]
    val.of.list = lst[0]


# ----------------------------------------------------------------------------- rudder:controller/host

def _vocab_size(st, args, res):
    res[0].kind = KIND["U32"]
    res[0].of.u32 = st.runtime.vocab_size


def _eos_token(st, args, res):
    eos = st.runtime.eos_token_id
    res[0].kind = KIND["S32"]
    res[0].of.s32 = -1 if eos is None else eos


def _config(st, args, res):
    res[0].kind = KIND["S32"]
    res[0].of.s32 = config_value(st, _arg_u32(args, 0, "config"))


def _arg(st, args, res):
    set_option_string(res[0], None if st.request is None else bytes_to_wit(st.request.arg))


def _tokenize(st, args, res):
    text = _arg_string(args, 0, "tokenize")
    charge_tokenize(st, len(text))
    set_u32_list(res[0], tokenize(st, text.decode("utf-8")))


def _token_table(st, args, res):
    set_string(res[0], st.runtime.token_table_wit)


def _detokenize(st, args, res):
    ids = _arg_u32_list(args, 0, "detokenize")
    if len(ids) > st.runtime.vocab_size * 4 + 65536:
        raise GuestFault("rudder.detokenize: too many tokens at once")
    pieces = st.runtime.token_pieces
    out = b"".join(pieces[t] if t < len(pieces) else b"" for t in ids.tolist())
    set_string(res[0], bytes_to_wit(out))


def _log(st, args, res):
    text = _arg_string(args, 0, "log")
    st.append_log(text)


def _var_get(st, args, res):
    key = _arg_string(args, 0, "var-get")
    value = None if st.request is None else st.request.var_get(key)
    set_option_string(res[0], None if value is None else bytes_to_wit(value))


def _var_set(st, args, res):
    key = _arg_string(args, 0, "var-set")
    try:
        value = wit_to_bytes(_arg_string(args, 1, "var-set"))
    except ValueError:
        raise GuestFault("rudder.var-set: the value is not a bytes string (a char past U+00FF)") from None
    res[0].kind = KIND["BOOL"]
    res[0].of.boolean = var_set(st, key, value)


HOST_FUNCS = {
    "vocab-size": _vocab_size, "eos-token": _eos_token, "config": _config, "arg": _arg,
    "tokenize": _tokenize, "token-table": _token_table, "detokenize": _detokenize, "log": _log,
    "var-get": _var_get, "var-set": _var_set,
}


# ----------------------------------------------------------------------------- wasi:random

def _random_bytes(st, args, res):
    v = args[0]
    if v.kind != KIND["U64"]:
        raise GuestFault("get-random-bytes: the length is not a u64")
    n = v.of.u64
    if n > 1 << 20:  # the guest asks for its own entropy: a MiB is far more than any needs
        raise GuestFault(f"wasi:random: {n} random bytes asked in one call (at most 1 MiB)")
    set_u8_list(res[0], st.rng.randbytes(n))


def _random_u64(st, args, res):
    res[0].kind = KIND["U64"]
    res[0].of.u64 = st.rng.getrandbits(64)


def _insecure_seed(st, args, res):
    tup, payload = _new_list(2, KIND["U64"], 8)
    payload[:] = np.frombuffer(st.rng.randbytes(16), dtype=np.uint8).reshape(2, 8)
    res[0].kind = KIND["TUPLE"]
    res[0].of.tuple = tup[0]


RANDOM_FUNCS = {
    "wasi:random/random": {"get-random-bytes": _random_bytes, "get-random-u64": _random_u64},
    "wasi:random/insecure": {"get-insecure-random-bytes": _random_bytes, "get-insecure-random-u64": _random_u64},
    "wasi:random/insecure-seed": {"insecure-seed": _insecure_seed},
}


# ----------------------------------------------------------------------------- callbacks

def _make_callback(name: str, handler):
    def callback(env, ctx, ty, args, nargs, results, nresults):
        st = None
        try:
            st = ffi.from_handle(lib.wasmtime_context_get_data(ctx))
            handler(st, args, results)
            return ffi.NULL
        except GuestFault as e:
            _reset(results, nresults)
            return _trap(st, str(e), e.kind)
        except BaseException as e:  # a host bug must not unwind through wasm frames
            _reset(results, nresults)
            return _trap(st, f"{name}: host error: {type(e).__name__}: {e}")

    return ffi.callback("wasmtime_component_func_callback_t", callback)


def _reset(results, n: int) -> None:
    """Leave the result slots trivial: the C API drops them, and a half-made value (a kind set,
    its payload not) would make it free garbage. (A value fully made is leaked: rare, bounded.)"""
    for i in range(n):
        results[i].kind = KIND["BOOL"]


def _trap(st, message: str, kind: str = "trap"):
    if st is not None:
        st.fault(message, kind)
    return lib.wasmtime_error_new(message.encode("utf-8", "replace"))


def _output(data, buf, n):
    """WASI stdout/stderr of a store: into its request's log."""
    try:
        ffi.from_handle(data).append_log(ffi.unpack(ffi.cast("char *", buf), n))
    except BaseException:  # noqa: BLE001 - never unwind into wasmtime
        pass
    return n


OUTPUT_CALLBACK = ffi.callback("wasi_output_callback_t", _output)
_CALLBACKS = {name: _make_callback(name, h) for name, h in HOST_FUNCS.items()}
_RANDOM_CALLBACKS = {(iface, name): _make_callback(f"{iface}.{name}", h)
                     for iface, funcs in RANDOM_FUNCS.items() for name, h in funcs.items()}
_define_lock = threading.Lock()


def _instance(linker, name: str):
    root = lib.wasmtime_component_linker_root(linker)
    try:
        out = ffi.new("wasmtime_component_linker_instance_t **")
        raw = name.encode()
        err = lib.wasmtime_component_linker_instance_add_instance(root, raw, len(raw), out)
        if err:
            raise RuntimeError(f"cannot define {name}: {take_error(err)}")
        return out[0]
    finally:
        lib.wasmtime_component_linker_instance_delete(root)


def _add(li, name: str, cb) -> None:
    raw = name.encode()
    err = lib.wasmtime_component_linker_instance_add_func(li, raw, len(raw), cb, ffi.NULL, ffi.NULL)
    if err:
        raise RuntimeError(f"cannot define {name}: {take_error(err)}")


def define_host(linker) -> None:
    """WASI (nothing granted) and `rudder:controller/host` on a component linker."""
    err = lib.wasmtime_component_linker_add_wasip2(linker)
    if err:
        raise RuntimeError(f"cannot link WASI: {take_error(err)}")
    lib.wasmtime_component_linker_allow_shadowing(linker, True)
    li = _instance(linker, HOST_INTERFACE)
    try:
        for name, cb in _CALLBACKS.items():
            _add(li, name, cb)
    finally:
        lib.wasmtime_component_linker_instance_delete(li)


def define_random(linker, interface: str, defined: set) -> None:
    """Our seeded `wasi:random` for the version `interface` (e.g. wasi:random/random@0.2.9)
    names, replacing wasmtime's (the linker allows shadowing)."""
    with _define_lock:
        if interface in defined:
            return
        base = interface.split("@", 1)[0]
        li = _instance(linker, interface)
        try:
            for (iface, name), cb in _RANDOM_CALLBACKS.items():
                if iface == base:
                    _add(li, name, cb)
        finally:
            lib.wasmtime_component_linker_instance_delete(li)
        defined.add(interface)
