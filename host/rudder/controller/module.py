"""The load-time checks of a core module.

A module is checked once, when it is loaded: that it is a core wasm module, that it imports
only the `rudder` host functions, and that it exports what docs/abi.md requires with the
right types. Later failures can then only come from what the guest *does*.
"""

from __future__ import annotations

import wasmtime

from .abi import FUNC_EXPORTS, IMPORT_MODULE, IMPORTS, MEMORY_EXPORT
from .errors import ControllerError
from .host_api import check_imports
from .wasm_shape import NUMERIC, ShapeError, read_shape, section_ids

__all__ = ["check_binary", "check_shape", "check_module", "inspect_exports"]

_START_SECTION = 8


def check_binary(wasm: bytes) -> None:
    """Reject what is not a core wasm module before compiling, and modules with a start
    function: it would run at every instantiation, outside rudder_init's snapshot, and could
    make fresh instances differ from one another (our snapshots assume they don't)."""
    if len(wasm) < 8 or wasm[:4] != b"\0asm":
        raise ControllerError("bad_module", "not a WebAssembly binary (no \\0asm header)")
    if wasm[4:8] != b"\x01\x00\x00\x00":
        raise ControllerError("bad_module", "not a core WebAssembly module (version "
                              f"{wasm[4:8].hex()}) nor a component")
    if _START_SECTION in section_ids(wasm):
        raise ControllerError("bad_module", "the module has a start function; controllers "
                              "must do their set-up in rudder_init")


def check_shape(wasm: bytes) -> None:
    """Refuse, from the bytes alone, every import and export whose kind or value types the host
    does not handle - before anything asks wasmtime to describe them (its type reflection aborts
    the process on v128 and exnref). Call after compiling: the bytes are then known valid."""
    try:
        shape = read_shape(wasm)
    except ShapeError as e:
        raise ControllerError("bad_module", f"cannot read the module's imports and exports: {e}") from None
    for imp in shape.imports:
        where = f"{imp.module}.{imp.name}"
        if imp.module != IMPORT_MODULE or imp.name not in IMPORTS:
            continue  # check_imports names it
        if imp.kind != "function":
            raise ControllerError("bad_import", f"the controller imports {where} as a {imp.kind}, but it is a function")
        odd = [t for t in imp.value_types() if t not in NUMERIC]
        if odd:
            raise ControllerError("bad_import", f"the controller imports {where} with type {imp.signature()}; "
                                  f"{odd[0]} is not a type of the rudder ABI")
    for imp in shape.imports:
        if imp.module != IMPORT_MODULE or imp.name not in IMPORTS:
            allowed = ", ".join(IMPORTS)
            raise ControllerError("bad_import", f"the controller imports {imp.module}.{imp.name} ({imp.kind}), but "
                                  f"controllers may only import the `rudder` host functions ({allowed})")
    for exp in shape.exports:
        if exp.kind == "tag":
            raise ControllerError("bad_module", f"the controller exports exception tag {exp.name!r}; "
                                  "exceptions are not supported")
        odd = [t for t in exp.value_types() if t not in NUMERIC]
        if odd:
            what = "global" if exp.kind == "global" else "function"
            raise ControllerError("bad_module", f"the controller exports {what} {exp.name!r} of type {exp.signature()}; "
                                  f"only i32, i64, f32 and f64 may cross the ABI ({odd[0]} does not)")


def inspect_exports(module: wasmtime.Module) -> tuple[str, ...]:
    """Check the exports against the ABI; return the names of the exported mutable globals
    (part of a controller's state, copied with its memory)."""
    exports = {e.name: e.type for e in module.exports}
    memory = exports.get(MEMORY_EXPORT)
    if not isinstance(memory, wasmtime.MemoryType):
        raise ControllerError("bad_module", "the controller does not export its linear memory as `memory`")
    if memory.is_64:
        raise ControllerError("bad_module", "the controller's memory is 64-bit; wasm32 is required")
    for name, (n_params, n_results) in FUNC_EXPORTS.items():
        ty = exports.get(name)
        want = f"({', '.join(['i32'] * n_params)}) -> i32"
        if ty is None:
            raise ControllerError("bad_module", f"the controller does not export {name}{want}")
        if not isinstance(ty, wasmtime.FuncType):
            raise ControllerError("bad_module", f"the controller's export {name} is not a function")
        params, results = [str(p) for p in ty.params], [str(r) for r in ty.results]
        if params != ["i32"] * n_params or results != ["i32"] * n_results:
            got = f"({', '.join(params)}) -> ({', '.join(results)})"
            raise ControllerError("bad_module", f"the controller's export {name} has type {got}, "
                                  f"but the ABI says {want}")
    mutable = []
    for name, ty in exports.items():
        if isinstance(ty, wasmtime.GlobalType) and ty.mutable:
            if str(ty.content) not in NUMERIC:
                raise ControllerError("bad_module", f"the controller exports mutable global {name} of "
                                      f"type {ty.content}; only numeric globals are supported")
            mutable.append(name)
    return tuple(mutable)


def check_module(module: wasmtime.Module) -> tuple[str, ...]:
    """All load-time checks of a compiled module; returns its mutable global exports."""
    problem = check_imports(module)
    if problem:
        raise ControllerError("bad_import", problem)
    return inspect_exports(module)
