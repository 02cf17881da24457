"""A cffi binding of the wasmtime C library that ships inside the `wasmtime` wheel.

Why not wasmtime-py alone: its `Func.__call__` re-reads the function type and boxes every
value on each call (~50 us), and its host functions go through a generic trampoline (~20 us).
The C API has unchecked entry points (`wasmtime_func_call_unchecked`,
`wasmtime_linker_define_func_unchecked`) that take raw 16-byte value slots; we check each
function's type once (when the module is loaded) and then call through them for ~1-2 us.

We open the *same* shared library wasmtime-py already loaded (dlopen of the same path returns
the same handle), so engines, modules and linkers made by wasmtime-py can be handed to these
functions: `addr()` turns a ctypes pointer into the integer that `ffi.cast` accepts.

cffi calls in ABI mode release the GIL for the duration of the C call, so guest code runs in
parallel with other Python threads; our callbacks re-take it (cffi does that itself).

The struct layouts below are the C API's (wasmtime 50). They are checked against the ctypes
declarations of wasmtime-py at import (`_check_layouts`), so a wasmtime upgrade that changes
them fails loudly here instead of corrupting memory.
"""

from __future__ import annotations

import ctypes

import cffi
from wasmtime import _bindings as _wb
from wasmtime import _ffi as _wffi

__all__ = ["ffi", "lib", "addr", "TRAP_CODES", "take_trap", "take_error"]

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

typedef struct { size_t size; uint8_t *data; } wasm_byte_vec_t;

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

void wasmtime_engine_increment_epoch(wasm_engine_t *engine);
wasm_engine_t *wasmtime_engine_clone(wasm_engine_t *engine);
void wasm_engine_delete(wasm_engine_t *engine);

wasmtime_store_t *wasmtime_store_new(wasm_engine_t *engine, void *data, void (*finalizer)(void *));
wasmtime_context_t *wasmtime_store_context(wasmtime_store_t *store);
void wasmtime_store_delete(wasmtime_store_t *store);
void wasmtime_store_limiter(wasmtime_store_t *store, int64_t memory_size, int64_t table_elements,
                            int64_t instances, int64_t tables, int64_t memories);
void *wasmtime_context_get_data(const wasmtime_context_t *context);
void wasmtime_context_set_epoch_deadline(wasmtime_context_t *context, uint64_t ticks_beyond_current);
void wasmtime_store_epoch_deadline_callback(wasmtime_store_t *store, void *func, void *data, void *finalizer);
wasmtime_error_t *wasmtime_error_new(const char *message);

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
void wasmtime_error_message(const wasmtime_error_t *error, wasm_byte_vec_t *message);
void wasmtime_error_delete(wasmtime_error_t *error);
void wasm_byte_vec_delete(wasm_byte_vec_t *vec);
"""

# Extern kinds and value kinds of the C API (wasmtime/extern.h, wasmtime/val.h).
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
TRAP_INTERRUPT = _wb.wasmtime_trap_code_enum.WASMTIME_TRAP_CODE_INTERRUPT.value
TRAP_STACK_OVERFLOW = _wb.wasmtime_trap_code_enum.WASMTIME_TRAP_CODE_STACK_OVERFLOW.value


def _check_layouts() -> None:
    pairs = {
        "wasmtime_func_t": _wb.wasmtime_func_t, "wasmtime_instance_t": _wb.wasmtime_instance_t,
        "wasmtime_global_t": _wb.wasmtime_global_t, "wasmtime_memory_t": _wb.wasmtime_memory_t,
        "wasmtime_val_raw_t": _wb.wasmtime_val_raw_t, "wasmtime_val_t": _wb.wasmtime_val_t,
        "wasmtime_extern_t": _wb.wasmtime_extern_t, "wasm_byte_vec_t": _wb.wasm_byte_vec_t,
    }
    for name, ct in pairs.items():
        if ffi.sizeof(name) != ctypes.sizeof(ct) or ffi.alignof(name) != ctypes.alignment(ct):
            raise ImportError(f"wasmtime C API layout changed: {name} is {ctypes.sizeof(ct)} bytes "
                              f"in wasmtime-py but {ffi.sizeof(name)} in rudder's binding")
    if ffi.offsetof("wasmtime_extern_t", "of") != _wb.wasmtime_extern_t.of.offset:
        raise ImportError("wasmtime C API layout changed: wasmtime_extern_t.of")
    if ffi.offsetof("wasmtime_val_t", "of") != _wb.wasmtime_val_t.of.offset:
        raise ImportError("wasmtime C API layout changed: wasmtime_val_t.of")


_check_layouts()


def addr(ctypes_pointer) -> int:
    """Integer address of a wasmtime-py (ctypes) pointer, for `ffi.cast`."""
    return ctypes.cast(ctypes_pointer, ctypes.c_void_p).value or 0


def _vec_text(vec) -> str:
    text = ffi.unpack(ffi.cast("char *", vec.data), vec.size).decode("utf-8", "replace")
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
