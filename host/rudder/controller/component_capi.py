"""A cffi binding of wasmtime's component-model C API (the library inside the `wasmtime` wheel).

Why not `wasmtime.component`: its `Func.__call__` re-reads the function's type and converts
every value in Python on each call (39 us for a trivial call here, 5.9 ms to return a
6144-byte `list<u8>`). Through the C API directly, a call is a few microseconds and a list
of numbers is read out of the C value array with one strided numpy view, no Python loop.

Ownership, as wasmtime 50's C API has it (and wasmtime-py relies on): arguments given to
`wasmtime_component_func_call` are only read (they may live in our own memory); results are
wasmtime's, written over the result slot (the C API drops what the slot held first: a slot
must hold a freed-and-reset value or none) and freed with `wasmtime_component_val_delete`,
which does not reset it. In a host function, the arguments belong to the C API (it drops
them after the callback) and the results must be allocated by wasmtime's allocators
(`wasm_byte_vec_new`, `wasmtime_component_vallist_new_uninit`, `wasmtime_component_val_new`),
which the C API takes over. `wasmtime_component_func_post_return` has no effect any more.

The layouts are checked against wasmtime-py's ctypes declarations at import, like
`fastcall.py` does for the core API.
"""

from __future__ import annotations

import ctypes

import cffi
from wasmtime import _bindings as _wb
from wasmtime import _ffi as _wffi

__all__ = ["ffi", "lib", "KIND", "take_error", "addr"]

CDEF = """
typedef struct wasm_engine_t wasm_engine_t;
typedef struct wasmtime_context wasmtime_context_t;
typedef struct wasmtime_error wasmtime_error_t;
typedef struct wasmtime_component_t wasmtime_component_t;
typedef struct wasmtime_component_linker_t wasmtime_component_linker_t;
typedef struct wasmtime_component_linker_instance_t wasmtime_component_linker_instance_t;
typedef struct wasmtime_component_export_index_t wasmtime_component_export_index_t;
typedef struct wasmtime_component_func_type_t wasmtime_component_func_type_t;
typedef struct wasi_config_t wasi_config_t;
typedef struct wasmtime_store wasmtime_store_t;

typedef struct { size_t size; uint8_t *data; } wasm_byte_vec_t;
typedef wasm_byte_vec_t wasm_name_t;

typedef struct wasmtime_component_val wasmtime_component_val_t;
typedef struct wasmtime_component_valrecord_entry wasmtime_component_valrecord_entry_t;
typedef struct { size_t size; wasmtime_component_val_t *data; } wasmtime_component_vallist_t;
typedef struct { size_t size; wasmtime_component_valrecord_entry_t *data; } wasmtime_component_valrecord_t;
typedef struct { wasm_name_t discriminant; wasmtime_component_val_t *val; } wasmtime_component_valvariant_t;
typedef struct { bool is_ok; wasmtime_component_val_t *val; } wasmtime_component_valresult_t;
typedef struct { size_t size; wasm_name_t *data; } wasmtime_component_valflags_t;

typedef union {
    bool boolean; int8_t s8; uint8_t u8; int16_t s16; uint16_t u16; int32_t s32; uint32_t u32;
    int64_t s64; uint64_t u64; float f32; double f64; uint32_t character;
    wasm_name_t string; wasmtime_component_vallist_t list; wasmtime_component_valrecord_t record;
    wasmtime_component_vallist_t tuple; wasmtime_component_valvariant_t variant;
    wasm_name_t enumeration; wasmtime_component_val_t *option; wasmtime_component_valresult_t result;
    wasmtime_component_valflags_t flags; uint8_t raw[24];
} wasmtime_component_valunion_t;

struct wasmtime_component_val { uint8_t kind; wasmtime_component_valunion_t of; };
struct wasmtime_component_valrecord_entry { wasm_name_t name; wasmtime_component_val_t val; };

typedef struct { struct { uint64_t store_id; uint32_t p1; } a; uint32_t p2; void *p3; } wasmtime_component_func_t;
typedef struct { uint64_t store_id; uint32_t p1; } wasmtime_component_instance_t;

typedef wasmtime_error_t *(*wasmtime_component_func_callback_t)(void *env, wasmtime_context_t *context,
    const wasmtime_component_func_type_t *ty, wasmtime_component_val_t *args, size_t nargs,
    wasmtime_component_val_t *results, size_t nresults);
typedef ptrdiff_t (*wasi_output_callback_t)(void *data, const unsigned char *buf, size_t len);

wasmtime_error_t *wasmtime_component_new(const wasm_engine_t *engine, const uint8_t *buf, size_t len,
                                         wasmtime_component_t **component_out);
wasmtime_error_t *wasmtime_component_serialize(const wasmtime_component_t *component, wasm_byte_vec_t *ret);
wasmtime_error_t *wasmtime_component_deserialize(const wasm_engine_t *engine, const uint8_t *buf, size_t len,
                                                 wasmtime_component_t **component_out);
wasmtime_error_t *wasmtime_component_deserialize_file(const wasm_engine_t *engine, const char *path,
                                                      wasmtime_component_t **component_out);
void wasmtime_component_delete(wasmtime_component_t *component);
wasmtime_component_export_index_t *wasmtime_component_get_export_index(const wasmtime_component_t *component,
    const wasmtime_component_export_index_t *instance_export_index, const char *name, size_t name_len);
void wasmtime_component_export_index_delete(wasmtime_component_export_index_t *export_index);

wasmtime_component_linker_t *wasmtime_component_linker_new(const wasm_engine_t *engine);
void wasmtime_component_linker_allow_shadowing(wasmtime_component_linker_t *linker, bool allow);
wasmtime_component_linker_instance_t *wasmtime_component_linker_root(wasmtime_component_linker_t *linker);
wasmtime_error_t *wasmtime_component_linker_add_wasip2(wasmtime_component_linker_t *linker);
wasmtime_error_t *wasmtime_component_linker_instantiate(const wasmtime_component_linker_t *linker,
    wasmtime_context_t *context, const wasmtime_component_t *component, wasmtime_component_instance_t *instance_out);
void wasmtime_component_linker_delete(wasmtime_component_linker_t *linker);
wasmtime_error_t *wasmtime_component_linker_instance_add_instance(wasmtime_component_linker_instance_t *li,
    const char *name, size_t name_len, wasmtime_component_linker_instance_t **out);
wasmtime_error_t *wasmtime_component_linker_instance_add_func(wasmtime_component_linker_instance_t *li,
    const char *name, size_t name_len, wasmtime_component_func_callback_t cb, void *data, void (*finalizer)(void *));
void wasmtime_component_linker_instance_delete(wasmtime_component_linker_instance_t *li);

bool wasmtime_component_instance_get_func(const wasmtime_component_instance_t *instance,
    wasmtime_context_t *context, const wasmtime_component_export_index_t *export_index,
    wasmtime_component_func_t *func_out);
wasmtime_error_t *wasmtime_component_func_call(const wasmtime_component_func_t *func, wasmtime_context_t *context,
    const wasmtime_component_val_t *args, size_t args_size, wasmtime_component_val_t *results, size_t results_size);
wasmtime_error_t *wasmtime_component_func_post_return(const wasmtime_component_func_t *func,
                                                      wasmtime_context_t *context);

void wasmtime_component_val_delete(wasmtime_component_val_t *value);
wasmtime_component_val_t *wasmtime_component_val_new(wasmtime_component_val_t *value);
void wasmtime_component_vallist_new_uninit(wasmtime_component_vallist_t *out, size_t size);
void wasm_byte_vec_new(wasm_byte_vec_t *out, size_t size, const uint8_t *data);
void wasm_byte_vec_delete(wasm_byte_vec_t *vec);

wasmtime_store_t *wasmtime_store_new(wasm_engine_t *engine, void *data, void (*finalizer)(void *));
wasmtime_context_t *wasmtime_store_context(wasmtime_store_t *store);
void wasmtime_store_delete(wasmtime_store_t *store);
void wasmtime_store_limiter(wasmtime_store_t *store, int64_t memory_size, int64_t table_elements,
                            int64_t instances, int64_t tables, int64_t memories);
void *wasmtime_context_get_data(const wasmtime_context_t *context);
void wasmtime_context_set_epoch_deadline(wasmtime_context_t *context, uint64_t ticks_beyond_current);
void wasmtime_store_epoch_deadline_callback(wasmtime_store_t *store, void *func, void *data, void *finalizer);
wasmtime_error_t *wasmtime_error_new(const char *message);
void wasmtime_error_message(const wasmtime_error_t *error, wasm_byte_vec_t *message);
void wasmtime_error_delete(wasmtime_error_t *error);

wasi_config_t *wasi_config_new(void);
void wasi_config_set_stdout_custom(wasi_config_t *config, wasi_output_callback_t cb, void *data, void (*fin)(void *));
void wasi_config_set_stderr_custom(wasi_config_t *config, wasi_output_callback_t cb, void *data, void (*fin)(void *));
wasmtime_error_t *wasmtime_context_set_wasi(wasmtime_context_t *context, wasi_config_t *wasi);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)
lib = ffi.dlopen(str(_wffi.filename))

# wasmtime_component_valkind_t (wasmtime/component/val.h), from wasmtime-py's constants.
KIND = {name: getattr(_wffi, f"WASMTIME_COMPONENT_{name}").value
        for name in ("BOOL", "S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64", "F32", "F64", "CHAR",
                     "STRING", "LIST", "RECORD", "TUPLE", "VARIANT", "ENUM", "OPTION", "RESULT", "FLAGS")}


def _check_layouts() -> None:
    pairs = {"wasmtime_component_val_t": _wb.wasmtime_component_val_t,
             "wasmtime_component_func_t": _wb.wasmtime_component_func_t,
             "wasmtime_component_instance_t": _wb.wasmtime_component_instance_t,
             "wasmtime_component_valrecord_entry_t": _wb.wasmtime_component_valrecord_entry_t,
             "wasmtime_component_vallist_t": _wb.wasmtime_component_vallist_t}
    for name, ct in pairs.items():
        if ffi.sizeof(name) != ctypes.sizeof(ct) or ffi.alignof(name) != ctypes.alignment(ct):
            raise ImportError(f"wasmtime component C API layout changed: {name} is {ctypes.sizeof(ct)} bytes "
                              f"in wasmtime-py but {ffi.sizeof(name)} in rudder's binding")
    if ffi.offsetof("wasmtime_component_val_t", "of") != _wb.wasmtime_component_val_t.of.offset:
        raise ImportError("wasmtime component C API layout changed: wasmtime_component_val_t.of")
    if ffi.sizeof("wasmtime_component_valunion_t") != ctypes.sizeof(_wb.wasmtime_component_valunion_t):
        raise ImportError("wasmtime component C API layout changed: wasmtime_component_valunion_t")


_check_layouts()


def addr(pointer) -> int:
    """Integer address of a wasmtime-py (ctypes) pointer or a cffi pointer of another FFI."""
    if isinstance(pointer, ffi.CData):
        return int(ffi.cast("uintptr_t", pointer))
    if hasattr(pointer, "_type_") or isinstance(pointer, ctypes._Pointer):
        return ctypes.cast(pointer, ctypes.c_void_p).value or 0
    return int(pointer)


def take_error(error) -> str:
    """The message of a `wasmtime_error_t *`, which is deleted."""
    vec = ffi.new("wasm_byte_vec_t *")
    lib.wasmtime_error_message(error, vec)
    text = ffi.unpack(ffi.cast("char *", vec.data), vec.size).decode("utf-8", "replace") if vec.size else ""
    lib.wasm_byte_vec_delete(vec)
    lib.wasmtime_error_delete(error)
    return text.rstrip("\0")
