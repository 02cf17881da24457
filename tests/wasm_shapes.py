"""Controller modules of every shape wasmtime can compile: value types (v128, funcref, externref,
exnref, typed references), multi-value, tables, several memories, memory64, shared memory,
atomics, tail calls, GC types, exceptions, custom page sizes, out-of-bounds segments.

Each shape is a working controller (`controller_wat`) with one feature added, so a module the
host accepts also runs. `SHAPES` maps a name to (wat, the outcomes allowed): "ok" (it loads,
starts and steps) or a ControllerError kind. Used by tests/test_module_shapes.py, which loads
them in a child process: a shape that aborted the host would otherwise take pytest down too.
"""

from __future__ import annotations

import random

from controller_wat import controller_wat

OK = {"ok"}
REFUSED = {"bad_module", "bad_import"}

_V = "(v128.const i32x4 1 2 3 4)"


def _with(extra: str = "", **kw) -> str:
    return controller_wat(extra=extra, **kw)


SHAPES: dict[str, tuple[str, set[str]]] = {
    # v128: inside a function it is fine (SIMD is on); at the ABI boundary it is refused.
    "v128_private_global": (_with(f"(global v128 {_V})"), OK),
    "v128_exported_global": (_with(f'(global (export "g") v128 {_V})'), {"bad_module"}),
    "v128_exported_mut_global": (_with(f'(global (export "g") (mut v128) {_V})'), {"bad_module"}),
    "v128_import_param": (controller_wat(imports='  (import "rudder" "log" (func (param v128)))'), {"bad_import"}),
    "v128_import_result": (controller_wat(imports='  (import "rudder" "vocab_size" (func (result v128)))'),
                           {"bad_import"}),
    "v128_foreign_import": (controller_wat(imports='  (import "env" "f" (func (param v128)))'), {"bad_import"}),
    "v128_export_param": (_with('(func (export "f") (param v128))'), {"bad_module"}),
    "v128_export_result": (_with(f'(func (export "f") (result v128) {_V})'), {"bad_module"}),
    "v128_in_mid_process": (controller_wat(mid=f"(drop (i32x4.extract_lane 0 {_V})) (i32.const 0x100)"), OK),
    "relaxed_simd": (controller_wat(mid=f"(drop (i32x4.relaxed_trunc_f32x4_s {_V})) (i32.const 0x100)"), OK),
    "v128_abi_export": (controller_wat(omit=("rudder_init",), extra=f'(func (export "rudder_init") (result v128) {_V})'),
                        {"bad_module"}),
    # Reference types.
    "funcref_exported_global": (_with('(global (export "g") funcref (ref.null func))'), {"bad_module"}),
    "funcref_exported_mut_global": (_with('(global (export "g") (mut funcref) (ref.null func))'), {"bad_module"}),
    "externref_exported_global": (_with('(global (export "g") (mut externref) (ref.null extern))'), {"bad_module"}),
    "funcref_export_param": (_with('(func (export "f") (param funcref))'), {"bad_module"}),
    "externref_export_result": (_with('(func (export "f") (result externref) (ref.null extern))'), {"bad_module"}),
    "funcref_import_param": (controller_wat(imports='  (import "rudder" "log" (func (param funcref)))'),
                             {"bad_import"}),
    "externref_table_exported": (_with('(table (export "t") 4 externref)'), OK),
    "funcref_table_with_elements": (_with('(table 2 funcref) (func $f) (elem (i32.const 0) $f $f)'), OK),
    "table_grow_bomb": (controller_wat(mid="(drop (table.grow 0 (ref.null func) (i32.const 100000000))) (i32.const 0x100)",
                                       extra="(table 1 funcref)"), OK | {"trap", "limit"}),
    "exnref_export_param": (_with('(func (export "f") (param exnref))'), REFUSED),
    "typed_funcref_param": (_with('(type $t (func)) (func (export "f") (param (ref null $t)))'), REFUSED),
    "anyref_param": (_with('(func (export "f") (param anyref))'), REFUSED),
    # Multi-value.
    "multi_value_private": (_with('(func (export "pair") (result i32 i32) (i32.const 1) (i32.const 2))'), OK),
    "multi_value_abi_export": (controller_wat(omit=("rudder_start",),
                                              extra='(func (export "rudder_start") (result i32 i32) (i32.const 0) (i32.const 0))'),
                               {"bad_module"}),
    "multi_value_block": (controller_wat(mid="(block (result i32 i32) (i32.const 1) (i32.const 2)) (drop) (drop) (i32.const 0x100)"), OK),
    # Memories.
    "memory64": (controller_wat(memory='(memory (export "memory") i64 2)'), REFUSED),
    "shared_memory": (controller_wat(memory='(memory (export "memory") 2 4 shared)'), REFUSED),
    "two_memories": (_with('(memory $m2 1)'), REFUSED),
    "custom_page_size": (controller_wat(memory='(memory (export "memory") 2 (pagesize 1))'), REFUSED),
    "atomics": (controller_wat(mid="(drop (i32.atomic.load (i32.const 0))) (i32.const 0x100)"), REFUSED | OK),
    "exported_second_memory": (_with('(memory (export "m2") 1)'), REFUSED),
    "huge_initial_memory": (controller_wat(memory='(memory (export "memory") 60000)'), {"limit"}),
    # Control flow and other proposals.
    "tail_call": (_with('(func $t (result i32) (return_call $u)) (func $u (result i32) (i32.const 0))'), OK),
    "gc_struct": (_with('(type $s (struct (field i32))) (func (export "f") (param (ref null $s)))'), REFUSED),
    "gc_private_struct": (_with('(type $s (struct (field i32)))'), REFUSED | OK),
    "exception_tag": (_with('(tag $e (param i32))'), REFUSED),
    "exported_tag": (_with('(tag $e (export "e") (param i32))'), REFUSED),
    "throw": (controller_wat(mid="(throw $e (i32.const 1))", extra="(tag $e (param i32))"), REFUSED),
    "imported_global": (controller_wat(imports='  (import "rudder" "g" (global i32))'), {"bad_import"}),
    "imported_rudder_log_as_global": (controller_wat(imports='  (import "rudder" "log" (global i32))'), {"bad_import"}),
    "imported_table": (controller_wat(imports='  (import "rudder" "t" (table 1 funcref))'), {"bad_import"}),
    "imported_tag": (controller_wat(imports='  (import "rudder" "e" (tag (param i32)))'), REFUSED),
    "start_function": (_with("(func $s) (start $s)"), {"bad_module"}),
    "exported_mutable_i64_global": (_with('(global (export "g64") (mut i64) (i64.const 5))'), OK),
    "v128_const_global_with_end_byte": (_with("(global v128 (v128.const i8x16 11 11 11 11 11 11 11 11 11 11 11 11 11 11 11 11))"
                                              ' (global (export "after") (mut i32) (i32.const 3))'), OK),
    # Segments out of bounds: instantiation traps (the request fails; the process lives on).
    "data_segment_out_of_bounds": (_with('(data (i32.const 200000) "xx")'), {"trap"}),
    "elem_segment_out_of_bounds": (_with("(table 1 funcref) (func $f) (elem (i32.const 5) $f)"), {"trap"}),
}


def random_shape(rng: random.Random) -> str:
    """A controller with a random mix of globals, functions, tables, imports and exports over
    every value type: the shape fuzzer's input (which features are valid is wasmtime's call)."""
    valtypes = ["i32", "i64", "f32", "f64", "v128", "funcref", "externref", "exnref", "anyref"]
    consts = {"i32": "(i32.const 7)", "i64": "(i64.const 7)", "f32": "(f32.const 1)", "f64": "(f64.const 1)",
              "v128": _V, "funcref": "(ref.null func)", "externref": "(ref.null extern)", "exnref": "(ref.null exn)",
              "anyref": "(ref.null any)"}
    extra, imports = [], []
    for i in range(rng.randint(0, 6)):
        choice = rng.randrange(6)
        t, u = rng.choice(valtypes), rng.choice(valtypes)
        exported = f'(export "x{i}")' if rng.random() < 0.6 else ""
        if choice == 0:
            mut = f"(mut {t})" if rng.random() < 0.5 else t
            extra.append(f"(global {exported} {mut} {consts[t]})")
        elif choice == 1:
            results = [rng.choice(valtypes) for _ in range(rng.randint(0, 3))]
            body = " ".join(consts[r] for r in results)
            extra.append(f"(func {exported} (param {t} {u}) {''.join(f'(result {r})' for r in results)} {body})")
        elif choice == 2:
            extra.append(f"(table {exported} {rng.randint(0, 4)} {rng.choice(['funcref', 'externref'])})")
        elif choice == 3:
            name = rng.choice(["log", "vocab_size", "tokenize", "nope"])
            imports.append(f'  (import "{rng.choice(["rudder", "env"])}" "{name}" (func (param {t}) (result {u})))')
        elif choice == 4:
            extra.append(f"(tag {exported} (param {t}))")
        else:
            extra.append(f"(memory {exported} {rng.randint(0, 2)})")
    return controller_wat(extra=" ".join(extra), imports="\n".join(imports) if imports else None)
