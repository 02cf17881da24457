"""Load-time checks of a component controller: what it imports, the types of the host
functions it imports and of the hooks it exports (wit/controller.wit), and how many linear
memories it defines. Done once per component (wasmtime-py's type reflection is slow but this
is not on any per-call path); the compiled component and what the checks found are cached.

Why the types matter beyond a clean error: host functions defined through the C API are
dynamically typed, and the host reads the hooks' results by their layout, so a component
whose types differ must never get as far as a call.
"""

from __future__ import annotations

import re

import wasmtime
from wasmtime import component as wc

from .errors import ControllerError
from .wasm_shape import read_sizes

__all__ = ["check_component", "render", "EXPECTED_EXPORTS", "EXPECTED_HOST"]

HOST = "rudder:controller/host@1.0.0"
TYPES = "rudder:controller/types@1.0.0"  # only types: the host provides nothing there
# WASI 0.2 interfaces a component may import; the host links them with nothing granted.
WASI_ALLOWED = {
    "wasi:io/poll", "wasi:io/error", "wasi:io/streams",
    "wasi:clocks/monotonic-clock", "wasi:clocks/wall-clock",
    "wasi:random/random", "wasi:random/insecure", "wasi:random/insecure-seed",
    "wasi:cli/environment", "wasi:cli/exit", "wasi:cli/stdin", "wasi:cli/stdout", "wasi:cli/stderr",
    "wasi:cli/terminal-input", "wasi:cli/terminal-output", "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout", "wasi:cli/terminal-stderr",
    "wasi:filesystem/types", "wasi:filesystem/preopens",
    "wasi:sockets/network", "wasi:sockets/instance-network", "wasi:sockets/udp", "wasi:sockets/udp-create-socket",
    "wasi:sockets/tcp", "wasi:sockets/tcp-create-socket", "wasi:sockets/ip-name-lookup",
}
_WASI_NAME = re.compile(r"^(wasi:[a-z-]+/[a-z-]+)@0\.2\.\d+$")

_FAILURE = "variant{refused(string),exception(string),out-of-memory(string)}"
_BRANCH = "record{backtrack:u32,mask:option<string>,ff:list<list<u32>>}"
_STEP = f"variant{{branches(list<{_BRANCH}>),hand-off(record{{controller:string,arg:string}})}}"
EXPECTED_EXPORTS = {
    "init": f"func()->result<_,{_FAILURE}>",
    "start": f"func()->result<_,{_FAILURE}>",
    "mid-process": f"func(branch-idx:u32,backtrack:u32,tokens:list<u32>)->result<{_STEP},{_FAILURE}>",
    "save": f"func()->result<string,{_FAILURE}>",
    "restore": f"func(state:string)->result<_,{_FAILURE}>",
}
EXPECTED_HOST = {
    "vocab-size": "func()->u32",
    "eos-token": "func()->s32",
    "config": "func(key:u32)->s32",
    "arg": "func()->option<string>",
    "tokenize": "func(text:string)->list<u32>",
    "token-table": "func()->string",
    "detokenize": "func(tokens:list<u32>)->string",
    "log": "func(text:string)",
    "var-get": "func(key:string)->option<string>",
    "var-set": "func(key:string,value:string)->bool",
}


def render(ty) -> str:
    """A canonical text of a component type (WIT-like, without spaces)."""
    if isinstance(ty, wc.FuncType):
        params = ",".join(f"{name}:{render(t)}" for name, t in ty.params)
        result = ty.result
        return f"func({params})" + (f"->{render(result)}" if result is not None else "")
    if isinstance(ty, wc.ListType):
        return f"list<{render(ty.element)}>"
    if isinstance(ty, wc.OptionType):
        return f"option<{render(ty.payload)}>"
    if isinstance(ty, wc.ResultType):
        ok, err = ty.ok, ty.err
        return f"result<{render(ok) if ok is not None else '_'},{render(err) if err is not None else '_'}>"
    if isinstance(ty, wc.RecordType):
        return "record{" + ",".join(f"{n}:{render(t)}" for n, t in ty.fields) + "}"
    if isinstance(ty, wc.VariantType):
        return "variant{" + ",".join(f"{n}({render(t)})" if t is not None else n for n, t in ty.cases) + "}"
    if isinstance(ty, wc.TupleType):
        return "tuple<" + ",".join(render(t) for t in ty.elements) + ">"
    return type(ty).__name__.lower()


def _kind(item) -> str:
    if isinstance(item, wc.FuncType):
        return "a function"
    if isinstance(item, wc.ComponentInstanceType):
        return "an instance"
    return type(item).__name__


def check_component(component, engine: wasmtime.Engine, data: bytes) -> tuple[list[str], int]:
    """Check a compiled component against wit/controller.wit; return the versioned names of
    the `wasi:random` interfaces it imports (the host replaces them) and the number of linear
    memories its core modules define (each counts in the guest memory budget at the memory limit).
    Raises ControllerError (bad_import, bad_module)."""
    ctype = component.type
    random_imports = []
    for name, ext in ctype.imports(engine).items():
        item = ext.ty
        if name == HOST:
            _check_host(item, engine)
            continue
        if name == TYPES:
            _check_types_only(item, engine)
            continue
        m = _WASI_NAME.match(name)
        if m is None or m.group(1) not in WASI_ALLOWED:
            if name.startswith("rudder:"):
                raise ControllerError("bad_import", f"the component imports {name}; this host implements "
                                      f"{HOST} (ABI version 1)")
            raise ControllerError("bad_import", f"the component imports {name}, which controllers may not use "
                                  f"(allowed: {HOST} and WASI 0.2 with nothing granted)")
        if m.group(1).startswith("wasi:random/"):
            random_imports.append(name)
    exports = ctype.exports(engine)
    for name, want in EXPECTED_EXPORTS.items():
        ext = exports.get(name)
        if ext is None:
            raise ControllerError("bad_module", f"the component does not export {name} (wit/controller.wit)")
        got = render(ext.ty) if isinstance(ext.ty, wc.FuncType) else _kind(ext.ty)
        if got != want:
            raise ControllerError("bad_module", f"the component's export {name} has type {got}, but "
                                  f"wit/controller.wit says {want}")
    return random_imports, max(1, read_sizes(data).memories)


def _check_types_only(item, engine) -> None:
    if not isinstance(item, wc.ComponentInstanceType):
        raise ControllerError("bad_import", f"the component imports {TYPES} as {_kind(item)}, but it is an instance")
    for name, ext in item.exports(engine).items():
        if isinstance(ext.ty, (wc.FuncType, wc.ComponentInstanceType, wc.ComponentType)):
            raise ControllerError("bad_import", f"the component imports {TYPES}.{name}, which does not exist "
                                  "(that interface holds types only)")


def _check_host(item, engine) -> None:
    if not isinstance(item, wc.ComponentInstanceType):
        raise ControllerError("bad_import", f"the component imports {HOST} as {_kind(item)}, but it is an instance")
    for name, ext in item.exports(engine).items():
        if not isinstance(ext.ty, (wc.FuncType, wc.ComponentInstanceType, wc.ComponentType)):
            continue  # a type the interface defines (`bytes`): nothing the host provides
        want = EXPECTED_HOST.get(name)
        if want is None:
            raise ControllerError("bad_import", f"the component imports {HOST}.{name}, which does not exist "
                                  f"(known: {', '.join(EXPECTED_HOST)})")
        got = render(ext.ty) if isinstance(ext.ty, wc.FuncType) else _kind(ext.ty)
        if got != want:
            raise ControllerError("bad_import", f"the component imports {HOST}.{name} with type {got}, but it is {want}")
