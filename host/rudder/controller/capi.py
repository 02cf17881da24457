"""A cffi binding of the wasmtime C library that ships inside the `wasmtime` wheel: the core API
and the component model's, in one binding, so that a store is one type whatever it runs.

Why not wasmtime-py alone: its `Func.__call__` re-reads the function type and boxes every
value on each call, its host functions go through a generic trampoline, and its component
`Func.__call__` converts every value in Python (a `list<u8>` element by element). The C API
has unchecked entry points (`wasmtime_func_call_unchecked`,
`wasmtime_linker_define_func_unchecked`) that take raw 16-byte value slots, and component
values whose lists a numpy view reads in one piece; types are checked once, when a controller
is loaded (benchmarks/RESULTS.md has the costs).

We open the *same* shared library wasmtime-py already loaded (dlopen of the same path returns
the same handle), so engines, modules and linkers made by wasmtime-py can be handed to these
functions: `addr()` turns a ctypes pointer into the integer that `ffi.cast` accepts.

cffi calls in ABI mode release the GIL for the duration of the C call, so guest code runs in
parallel with other Python threads; our callbacks re-take it (cffi does that itself).

Component values, as wasmtime's C API has it (and wasmtime-py relies on): arguments given to
`wasmtime_component_func_call` are only read (they may live in our own memory); results are
wasmtime's, written over the result slot (the C API drops what the slot held first: a slot
must hold a freed-and-reset value or none) and freed with `wasmtime_component_val_delete`,
which does not reset it. In a host function, the arguments belong to the C API (it drops
them after the callback) and the results must be allocated by wasmtime's allocators
(`wasm_byte_vec_new`, `wasmtime_component_vallist_new_uninit`, `wasmtime_component_val_new`),
which the C API takes over.

The struct layouts below are the C API's (wasmtime 50). They are checked against the ctypes
declarations of wasmtime-py at import (`_check_layouts`), so a wasmtime upgrade that changes
them fails loudly here instead of corrupting memory.
"""

from __future__ import annotations

import ctypes

import cffi
from wasmtime import _bindings as _wb
from wasmtime import _ffi as _wffi

__all__ = ["ffi", "lib", "addr", "KIND", "TRAP_CODES", "take_trap", "take_error"]

CDEF = """
typedef struct wasm_engine_t wasm_engine_t;
typedef struct wasmtime_store wasmtime_store_t;
typedef struct wasmtime_context wasmtime_context_t;
typedef struct wasmtime_caller wasmtime_caller_t;
typedef struct wasmtime_linker wasmtime_linker_t;
typedef struct wasmtime_module wasmtime_module_t;
typedef struct wasmtime_instance_pre wasmtime_instance_pre_t;
typedef struct wasm_functype_t wasm_functype_t;
typedef struct wasm_trap_t wasm_trap_t;
typedef struct wasmtime_error wasmtime_error_t;
typedef struct wasi_config_t wasi_config_t;

typedef struct { size_t size; uint8_t *data; } wasm_byte_vec_t;
typedef wasm_byte_vec_t wasm_name_t;

/* ---- the store, shared by both shapes */
wasmtime_store_t *wasmtime_store_new(wasm_engine_t *engine, void *data, void (*finalizer)(void *));
wasmtime_context_t *wasmtime_store_context(wasmtime_store_t *store);
void wasmtime_store_delete(wasmtime_store_t *store);
void wasmtime_store_limiter(wasmtime_store_t *store, int64_t memory_size, int64_t table_elements,
                            int64_t instances, int64_t tables, int64_t memories);
void *wasmtime_context_get_data(const wasmtime_context_t *context);
void wasmtime_context_set_epoch_deadline(wasmtime_context_t *context, uint64_t ticks_beyond_current);
void wasmtime_store_epoch_deadline_callback(wasmtime_store_t *store, void *func, void *data, void *finalizer);
void wasmtime_engine_increment_epoch(wasm_engine_t *engine);
wasm_engine_t *wasmtime_engine_clone(wasm_engine_t *engine);
void wasm_engine_delete(wasm_engine_t *engine);
wasmtime_error_t *wasmtime_error_new(const char *message);
void wasmtime_error_message(const wasmtime_error_t *error, wasm_byte_vec_t *message);
void wasmtime_error_delete(wasmtime_error_t *error);
void wasm_byte_vec_new(wasm_byte_vec_t *out, size_t size, const uint8_t *data);
void wasm_byte_vec_delete(wasm_byte_vec_t *vec);

/* ---- core modules */
typedef struct { uint64_t store_id; void *private_; } wasmtime_func_t;
typedef struct { uint64_t store_id; size_t private_; } wasmtime_instance_t;
typedef struct { uint64_t store_id; uint32_t p1; uint32_t p2; uint32_t p3; } wasmtime_global_t;
/* memory/table: { { u64 store_id; u32 } (padded to 16); u32 } = 24 bytes */
typedef struct { struct { uint64_t store_id; uint32_t p1; } a; uint32_t p2; } wasmtime_memory_t;
typedef struct { struct { uint64_t store_id; uint32_t p1; } a; uint32_t p2; } wasmtime_table_t;

typedef union {
    int32_t i32; int64_t i64; float f32; double f64; uint8_t v128[16];
    uint32_t anyref; uint32_t externref; uint32_t exnref; void *funcref;
} wasmtime_val_raw_t;

/* wasmtime_val_t: kind + 24-byte union; we only move numeric values through it. */
typedef struct {
    uint8_t kind;
    union { int32_t i32; int64_t i64; float f32; double f64; uint8_t raw[24]; } of;
} wasmtime_val_t;

typedef struct {
    uint8_t kind;
    union {
        wasmtime_func_t func; wasmtime_global_t global_; wasmtime_table_t table;
        wasmtime_memory_t memory; void *sharedmemory; uint8_t raw[24];
    } of;
} wasmtime_extern_t;

typedef wasm_trap_t *(*wasmtime_func_unchecked_callback_t)(
    void *env, wasmtime_caller_t *caller, wasmtime_val_raw_t *args_and_results, size_t n);

wasmtime_error_t *wasmtime_instance_pre_instantiate(const wasmtime_instance_pre_t *pre,
    wasmtime_context_t *store, wasmtime_instance_t *instance, wasm_trap_t **trap);
bool wasmtime_instance_export_get(wasmtime_context_t *store, const wasmtime_instance_t *instance,
    const char *name, size_t name_len, wasmtime_extern_t *item);

wasmtime_error_t *wasmtime_func_call_unchecked(wasmtime_context_t *store,
    const wasmtime_func_t *func, wasmtime_val_raw_t *args_and_results,
    size_t args_and_results_len, wasm_trap_t **trap);

wasmtime_error_t *wasmtime_linker_define_func_unchecked(wasmtime_linker_t *linker,
    const char *module, size_t module_len, const char *name, size_t name_len,
    const wasm_functype_t *ty, wasmtime_func_unchecked_callback_t cb, void *data,
    void (*finalizer)(void *));
wasmtime_context_t *wasmtime_caller_context(wasmtime_caller_t *caller);
bool wasmtime_caller_export_get(wasmtime_caller_t *caller, const char *name, size_t name_len,
                                wasmtime_extern_t *item);

uint8_t *wasmtime_memory_data(const wasmtime_context_t *store, const wasmtime_memory_t *memory);
size_t wasmtime_memory_data_size(const wasmtime_context_t *store, const wasmtime_memory_t *memory);
wasmtime_error_t *wasmtime_memory_grow(wasmtime_context_t *store, const wasmtime_memory_t *memory,
                                       uint64_t delta, uint64_t *prev_size);

void wasmtime_global_get(wasmtime_context_t *store, const wasmtime_global_t *global, wasmtime_val_t *out);
wasmtime_error_t *wasmtime_global_set(wasmtime_context_t *store, const wasmtime_global_t *global,
                                      const wasmtime_val_t *val);

wasm_trap_t *wasmtime_trap_new(const char *msg, size_t msg_len);
bool wasmtime_trap_code(const wasm_trap_t *trap, uint8_t *code);
void wasm_trap_message(const wasm_trap_t *trap, wasm_byte_vec_t *out);
void wasm_trap_delete(wasm_trap_t *trap);

/* ---- components */
typedef struct wasmtime_component_t wasmtime_component_t;
typedef struct wasmtime_component_linker_t wasmtime_component_linker_t;
typedef struct wasmtime_component_linker_instance_t wasmtime_component_linker_instance_t;
typedef struct wasmtime_component_export_index_t wasmtime_component_export_index_t;
typedef struct wasmtime_component_func_type_t wasmtime_component_func_type_t;

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

void wasmtime_component_val_delete(wasmtime_component_val_t *value);
wasmtime_component_val_t *wasmtime_component_val_new(wasmtime_component_val_t *value);
void wasmtime_component_vallist_new_uninit(wasmtime_component_vallist_t *out, size_t size);

wasi_config_t *wasi_config_new(void);
void wasi_config_set_stdout_custom(wasi_config_t *config, wasi_output_callback_t cb, void *data, void (*fin)(void *));
void wasi_config_set_stderr_custom(wasi_config_t *config, wasi_output_callback_t cb, void *data, void (*fin)(void *));
wasmtime_error_t *wasmtime_context_set_wasi(wasmtime_context_t *context, wasi_config_t *wasi);
"""

# Extern kinds of the core API (wasmtime/extern.h).
EXTERN_FUNC = 0
EXTERN_GLOBAL = 1
EXTERN_MEMORY = 3

ffi = cffi.FFI()
ffi.cdef(CDEF)
lib = ffi.dlopen(str(_wffi.filename))

# wasmtime_trap_code_t values, named (wasmtime/trap.h), taken from wasmtime-py's own enum.
TRAP_CODES: dict[int, str] = {
    v.value: k.removeprefix("WASMTIME_TRAP_CODE_").removeprefix("WASMTIME_TRAP_")
    for k, v in _wb.wasmtime_trap_code_enum.__members__.items()
}

# wasmtime_component_valkind_t (wasmtime/component/val.h), from wasmtime-py's constants.
KIND = {name: getattr(_wffi, f"WASMTIME_COMPONENT_{name}").value
        for name in ("BOOL", "S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64", "F32", "F64", "CHAR",
                     "STRING", "LIST", "RECORD", "TUPLE", "VARIANT", "ENUM", "OPTION", "RESULT", "FLAGS")}


def _check_layouts() -> None:
    pairs = {
        "wasmtime_func_t": _wb.wasmtime_func_t, "wasmtime_instance_t": _wb.wasmtime_instance_t,
        "wasmtime_global_t": _wb.wasmtime_global_t, "wasmtime_memory_t": _wb.wasmtime_memory_t,
        "wasmtime_val_raw_t": _wb.wasmtime_val_raw_t, "wasmtime_val_t": _wb.wasmtime_val_t,
        "wasmtime_extern_t": _wb.wasmtime_extern_t, "wasm_byte_vec_t": _wb.wasm_byte_vec_t,
        "wasmtime_component_val_t": _wb.wasmtime_component_val_t,
        "wasmtime_component_func_t": _wb.wasmtime_component_func_t,
        "wasmtime_component_instance_t": _wb.wasmtime_component_instance_t,
        "wasmtime_component_valrecord_entry_t": _wb.wasmtime_component_valrecord_entry_t,
        "wasmtime_component_vallist_t": _wb.wasmtime_component_vallist_t,
        "wasmtime_component_valunion_t": _wb.wasmtime_component_valunion_t,
    }
    for name, ct in pairs.items():
        if ffi.sizeof(name) != ctypes.sizeof(ct) or ffi.alignof(name) != ctypes.alignment(ct):
            raise ImportError(f"wasmtime C API layout changed: {name} is {ctypes.sizeof(ct)} bytes "
                              f"in wasmtime-py but {ffi.sizeof(name)} in rudder's binding")
    for name, ct in (("wasmtime_extern_t", _wb.wasmtime_extern_t), ("wasmtime_val_t", _wb.wasmtime_val_t),
                     ("wasmtime_component_val_t", _wb.wasmtime_component_val_t)):
        if ffi.offsetof(name, "of") != ct.of.offset:
            raise ImportError(f"wasmtime C API layout changed: {name}.of")


_check_layouts()


def addr(pointer) -> int:
    """Integer address of a wasmtime-py (ctypes) pointer or a cffi pointer of another FFI."""
    if isinstance(pointer, ffi.CData):
        return int(ffi.cast("uintptr_t", pointer))
    if hasattr(pointer, "_type_") or isinstance(pointer, ctypes._Pointer):
        return ctypes.cast(pointer, ctypes.c_void_p).value or 0
    return int(pointer)


def _vec_text(vec) -> str:
    text = ffi.unpack(ffi.cast("char *", vec.data), vec.size).decode("utf-8", "replace") if vec.size else ""
    lib.wasm_byte_vec_delete(vec)
    return text.rstrip("\0")


def take_trap(trap) -> tuple[int | None, str]:
    """(trap code or None, message) of a `wasm_trap_t*`, which is deleted."""
    code = ffi.new("uint8_t *")
    has_code = lib.wasmtime_trap_code(trap, code)
    vec = ffi.new("wasm_byte_vec_t *")
    lib.wasm_trap_message(trap, vec)
    message = _vec_text(vec)
    lib.wasm_trap_delete(trap)
    return (code[0] if has_code else None), message


def take_error(error) -> str:
    """Message of a `wasmtime_error_t*`, which is deleted."""
    vec = ffi.new("wasm_byte_vec_t *")
    lib.wasmtime_error_message(error, vec)
    message = _vec_text(vec)
    lib.wasmtime_error_delete(error)
    return message
