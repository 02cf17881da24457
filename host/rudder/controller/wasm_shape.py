"""The shape of a wasm module - its imports, exports and their value types - read from its bytes.

Why not ask wasmtime: wasmtime-py's type reflection aborts the whole process (SIGABRT, "support
for v128 is not implemented") when it meets a `v128` or `exnref` value type in an import, an
export or a global, and any client may upload such a module. So the host reads what it will
touch from the binary itself, refuses every value type the ABI does not use, and only then lets
wasmtime describe the module. The reader runs after wasmtime has validated the bytes (so the
structure is sound), but it still checks every bound itself and treats anything it does not
know as a refusal, never as a crash.

Only the sections that name types are read: type (1), import (2), function (3), global (6)
and export (7). Reference: the WebAssembly core specification, binary format (chapter 5).

`read_sizes` is the other reader here: what a module (or every core module of a component)
asks the compiler to do - functions, code bytes, locals, segments, table and memory minimums -
read *before* anything is compiled, so that an upload too big to compile cheaply is refused in
milliseconds (compiler.py). It reads section headers, vector counts and the start of each
function body (its local declarations); the code itself is skipped by its size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["CodeSizes", "ModuleShape", "ShapeError", "read_shape", "read_sizes", "section_ids", "NUMERIC"]

NUMERIC = frozenset({"i32", "i64", "f32", "f64"})

_VALTYPES = {0x7F: "i32", 0x7E: "i64", 0x7D: "f32", 0x7C: "f64", 0x7B: "v128"}
# Abbreviated reference types (`ref null <abstract heap type>`).
_REFTYPES = {0x70: "funcref", 0x6F: "externref", 0x69: "exnref", 0x6E: "anyref", 0x6D: "eqref",
             0x6C: "i31ref", 0x6B: "structref", 0x6A: "arrayref", 0x71: "nullref", 0x72: "nullexternref",
             0x73: "nullfuncref", 0x74: "nullexnref", 0x68: "contref", 0x75: "nullcontref"}
_KINDS = {0: "function", 1: "table", 2: "memory", 3: "global", 4: "tag"}


class ShapeError(ValueError):
    """The module uses something the host does not read (one line, for a bad_module error)."""


@dataclass(frozen=True)
class Extern:
    """One import or export: `kind` is function/table/memory/global/tag; `types` is
    (params, results) for a function, ((value type,), ()) for a global, ((), ()) otherwise."""

    module: str  # "" for an export
    name: str
    kind: str
    params: tuple[str, ...] = ()
    results: tuple[str, ...] = ()
    mutable: bool = False

    def signature(self) -> str:
        if self.kind == "global":
            return f"{'mut ' if self.mutable else ''}{self.params[0]}"
        return f"({', '.join(self.params)}) -> ({', '.join(self.results)})"

    def value_types(self) -> tuple[str, ...]:
        return self.params + self.results


@dataclass(frozen=True)
class ModuleShape:
    imports: tuple[Extern, ...]
    exports: tuple[Extern, ...]


class _Reader:
    def __init__(self, data: bytes, pos: int, end: int):
        self.data, self.pos, self.end = data, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise ShapeError("truncated section")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise ShapeError("truncated section")
        self.pos += n

    def uleb(self, bits: int = 32) -> int:
        result = shift = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result
            if shift >= bits + 7:
                raise ShapeError("malformed LEB128 integer")

    def sleb(self, bits: int) -> None:
        self.uleb(bits)  # only skipped: the value does not matter here

    def name(self) -> str:
        n = self.uleb()
        start = self.pos
        self.skip(n)
        return self.data[start:self.pos].decode("utf-8", "replace")

    def valtype(self) -> str:
        b = self.byte()
        if b in _VALTYPES:
            return _VALTYPES[b]
        if b in _REFTYPES:
            return _REFTYPES[b]
        if b in (0x63, 0x64):  # (ref null? <heap type>): typed function references or GC
            self.heaptype()
            return "typed reference"
        raise ShapeError(f"unknown value type 0x{b:02x}")

    def heaptype(self) -> None:
        b = self.data[self.pos] if self.pos < self.end else None
        if b is not None and b in _REFTYPES:
            self.pos += 1
        else:
            self.sleb(33)  # a type index

    def limits(self) -> None:
        flags = self.byte()
        if flags & ~0x07:
            raise ShapeError(f"unknown limits flags 0x{flags:02x}")
        wide = 64 if flags & 0x04 else 32
        self.uleb(wide)
        if flags & 0x01:
            self.uleb(wide)

    def const_expr(self) -> None:
        """Skip a constant expression up to its `end`, decoding each instruction (a v128.const's
        16 bytes may contain 0x0b)."""
        while True:
            op = self.byte()
            if op == 0x0B:
                return
            if op == 0x41:
                self.sleb(32)
            elif op == 0x42:
                self.sleb(64)
            elif op == 0x43:
                self.skip(4)
            elif op == 0x44:
                self.skip(8)
            elif op in (0x23, 0xD2):  # global.get, ref.func
                self.uleb()
            elif op == 0xD0:  # ref.null
                self.heaptype()
            elif op in (0x6A, 0x6B, 0x6C, 0x7C, 0x7D, 0x7E):  # extended-const arithmetic
                pass
            elif op == 0xFD:  # SIMD prefix: only v128.const is constant
                if self.uleb() != 12:
                    raise ShapeError("unsupported instruction in a constant expression")
                self.skip(16)
            else:
                raise ShapeError(f"unsupported instruction 0x{op:02x} in a constant expression")


def read_shape(wasm: bytes) -> ModuleShape:
    """The imports and exports of a core module with their value types. Raises ShapeError."""
    if len(wasm) < 8 or wasm[:4] != b"\0asm":
        raise ShapeError("not a WebAssembly binary")
    types: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    funcs: list[int] = []  # type index of each function, imported ones first
    globals_: list[tuple[str, bool]] = []
    imports: list[Extern] = []
    exports: list[tuple[str, int, int]] = []
    top = _Reader(wasm, 8, len(wasm))
    while top.pos < len(wasm):
        section = top.byte()
        size = top.uleb()
        start = top.pos
        top.skip(size)
        r = _Reader(wasm, start, start + size)
        if section == 1:
            for _ in range(r.uleb()):
                form = r.byte()
                if form != 0x60:
                    raise ShapeError(f"type form 0x{form:02x} (GC and other non-function types are not supported)")
                params = tuple(r.valtype() for _ in range(r.uleb()))
                results = tuple(r.valtype() for _ in range(r.uleb()))
                types.append((params, results))
        elif section == 2:
            for _ in range(r.uleb()):
                module, name, kind = r.name(), r.name(), r.byte()
                if kind == 0:
                    index = r.uleb()
                    params, results = _type(types, index)
                    funcs.append(index)
                    imports.append(Extern(module, name, "function", params, results))
                elif kind == 1:
                    r.valtype()
                    r.limits()
                    imports.append(Extern(module, name, "table"))
                elif kind == 2:
                    r.limits()
                    imports.append(Extern(module, name, "memory"))
                elif kind == 3:
                    ty, mut = r.valtype(), r.byte()
                    globals_.append((ty, bool(mut)))
                    imports.append(Extern(module, name, "global", (ty,), (), bool(mut)))
                elif kind == 4:
                    r.byte()
                    r.uleb()
                    imports.append(Extern(module, name, "tag"))
                else:
                    raise ShapeError(f"unknown import kind 0x{kind:02x}")
        elif section == 3:
            funcs.extend(r.uleb() for _ in range(r.uleb()))
        elif section == 6:
            for _ in range(r.uleb()):
                ty, mut = r.valtype(), r.byte()
                r.const_expr()
                globals_.append((ty, bool(mut)))
        elif section == 7:
            for _ in range(r.uleb()):
                name, kind, index = r.name(), r.byte(), r.uleb()
                if kind not in _KINDS:
                    raise ShapeError(f"unknown export kind 0x{kind:02x}")
                exports.append((name, kind, index))
    out = []
    for name, kind, index in exports:
        if kind == 0:
            if index >= len(funcs):
                raise ShapeError(f"export {name!r} names function {index}, which does not exist")
            params, results = _type(types, funcs[index])
            out.append(Extern("", name, "function", params, results))
        elif kind == 3:
            if index >= len(globals_):
                raise ShapeError(f"export {name!r} names global {index}, which does not exist")
            ty, mut = globals_[index]
            out.append(Extern("", name, "global", (ty,), (), mut))
        else:
            out.append(Extern("", name, _KINDS[kind]))
    return ModuleShape(tuple(imports), tuple(out))


def _type(types: list, index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if index >= len(types):
        raise ShapeError(f"type index {index} does not exist")
    return types[index]


@dataclass
class CodeSizes:
    """What compiling a module costs, in the units the compile limits use (compiler.py); a
    component's core modules are added up (the largest function, table, memory: the largest of all)."""

    functions: int = 0          # functions defined (not imported)
    code_bytes: int = 0         # bytes of all function bodies
    function_bytes: int = 0     # bytes of the largest function body
    function_locals: int = 0    # locals declared by the function with the most
    locals: int = 0             # locals declared by all functions
    data_segments: int = 0
    element_segments: int = 0
    table_elements: int = 0     # the largest table minimum, in elements
    memory_pages: int = 0       # the largest memory minimum, in 64 KiB pages
    memories: int = 0           # memories defined (not a compile cost: each counts in the guest memory budget)

    def as_dict(self) -> dict[str, int]:
        """The sizes a compile limit bounds."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "memories"}


_COMPONENT_VERSION = b"\x0d\x00\x01\x00"
_CORE_MODULE_SECTION, _COMPONENT_SECTION = 1, 4  # in a component: a nested core module, component


def read_sizes(wasm: bytes, max_functions: int | None = None) -> CodeSizes:
    """The sizes of a core module or of every core module inside a component (nested components
    too). Function bodies are not scanned once more than `max_functions` functions are declared
    (the module is refused for its count anyway). A malformed part ends the reading of its module
    quietly: the compiler then reports it precisely, under its own limits."""
    sizes = CodeSizes()
    if len(wasm) < 8 or wasm[:4] != b"\0asm":
        return sizes
    pending = [(0, len(wasm))]  # (start, end) of each binary still to read: iterative, nesting is unbounded
    while pending:
        start, end = pending.pop()
        if wasm[start + 4:start + 8] != _COMPONENT_VERSION:
            _core_sizes(wasm, start, end, sizes, max_functions)
            continue
        top = _Reader(wasm, start + 8, end)
        try:
            while top.pos < end:
                section = top.byte()
                size = top.uleb()
                if section in (_CORE_MODULE_SECTION, _COMPONENT_SECTION) and size >= 8:
                    pending.append((top.pos, top.pos + size))
                top.skip(size)
        except ShapeError:
            pass
    return sizes


def section_ids(wasm: bytes) -> list[int]:
    """The ids of a module's top-level sections, in order, as far as they can be read."""
    ids = []
    top = _Reader(wasm, 8, len(wasm))
    try:
        while top.pos < len(wasm):
            ids.append(top.byte())
            top.skip(top.uleb())
    except ShapeError:
        pass  # malformed: the compiler reports it precisely
    return ids


def _core_sizes(wasm: bytes, start: int, end: int, sizes: CodeSizes, max_functions: int | None) -> None:
    top = _Reader(wasm, start + 8, end)
    try:
        while top.pos < end:
            section = top.byte()
            size = top.uleb()
            r = _Reader(wasm, top.pos, top.pos + size)
            top.skip(size)
            if section == 2:
                for _ in range(r.uleb()):
                    r.name()
                    r.name()
                    kind = r.byte()
                    if kind == 0:
                        r.uleb()
                    elif kind == 1:
                        sizes.table_elements = max(sizes.table_elements, _table_min(r))
                    elif kind == 2:
                        sizes.memory_pages = max(sizes.memory_pages, _limits_min(r))
                    elif kind == 3:
                        r.valtype()
                        r.byte()
                    elif kind == 4:
                        r.byte()
                        r.uleb()
                    else:
                        return
            elif section == 3:
                sizes.functions += r.uleb()
            elif section == 4:
                for _ in range(r.uleb()):
                    sizes.table_elements = max(sizes.table_elements, _table_min(r))
            elif section == 5:
                count = r.uleb()
                sizes.memories += count
                for _ in range(count):
                    sizes.memory_pages = max(sizes.memory_pages, _limits_min(r))
            elif section == 9:
                sizes.element_segments += r.uleb()
            elif section == 11:
                sizes.data_segments += r.uleb()
            elif section == 10:
                bodies = r.uleb()
                sizes.code_bytes += size
                if max_functions is not None and sizes.functions > max_functions:
                    continue
                for _ in range(bodies):
                    body = r.uleb()
                    body_end = r.pos + body
                    sizes.function_bytes = max(sizes.function_bytes, body)
                    declared = 0
                    body_reader = _Reader(wasm, r.pos, min(body_end, r.end))
                    for _ in range(body_reader.uleb()):
                        declared += body_reader.uleb()
                        body_reader.valtype()
                    sizes.function_locals = max(sizes.function_locals, declared)
                    sizes.locals += declared
                    r.skip(body)
    except ShapeError:
        pass


def _limits_min(r: _Reader) -> int:
    flags = r.byte()
    if flags & ~0x0F:
        raise ShapeError(f"unknown limits flags 0x{flags:02x}")
    wide = 64 if flags & 0x04 else 32
    minimum = r.uleb(wide)
    if flags & 0x01:
        r.uleb(wide)
    if flags & 0x08:  # custom page size: its log2 follows
        r.uleb()
    return minimum


def _table_min(r: _Reader) -> int:
    if r.data[r.pos:r.pos + 2] == b"\x40\x00":  # a table with an initial value: reftype, limits, expression
        r.skip(2)
        r.valtype()
        minimum = _limits_min(r)
        r.const_expr()
        return minimum
    r.valtype()
    return _limits_min(r)
