"""Compile bombs: working controllers (every hook answers like controller_wat's minimal one)
whose extra, never-called functions make Cranelift's memory or time explode, written straight
in the binary format (a text module of 300,000 functions takes wat2wasm longer than this).

Each bomb carries a `nonce` in a custom section: a new nonce is a new module (a new sha256), so
a test compiles it even where an earlier run left it in a compiled-code cache.
"""

from __future__ import annotations

I32 = 0x7F
# types: 0 () -> i32, 1 (i32) -> i32, 2 (i32 i32 i32) -> i32, 3 () -> ()
_TYPES = [((), (I32,)), ((I32,), (I32,)), ((I32, I32, I32), (I32,)), ((), ())]
# the ABI's exports: (name, type, body code)
_HOOKS = [("rudder_abi_version", 0, b"\x41\x01"), ("rudder_init", 0, b"\x41\x00"), ("rudder_start", 0, b"\x41\x00"),
          ("rudder_input", 1, b"\x41\x80\x80\x02"), ("rudder_mid_process", 2, b"\x41\x80\x02")]
# mid_process's answer at 0x100: one branch record at 0x110 (all zero: sample freely)
_RESULT = b"\x01\x00\x00\x00\x10\x01\x00\x00"


def uleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _section(sid: int, payload: bytes) -> bytes:
    return bytes([sid]) + uleb(len(payload)) + payload


def _vec(items) -> bytes:
    items = list(items)
    return uleb(len(items)) + b"".join(items)


def _name(text: str) -> bytes:
    return uleb(len(text)) + text.encode()


def controller(extra: list[tuple[int, bytes]] = (), *, memory_pages: int = 2, table: int | None = None,
               data_segments: int = 1, element_segments: int = 0, nonce: str = "") -> bytes:
    """A minimal working controller plus `extra` functions, each (type index, body: locals
    declarations + code + end); `table`: a funcref table of that minimum; `data_segments` (the
    first holds the step result), `element_segments` (passive, empty)."""
    bodies = [uleb(0) + code + b"\x0b" for _, _, code in _HOOKS] + [body for _, body in extra]
    types = [bytes([0x60]) + _vec(bytes([t]) for t in params) + _vec(bytes([t]) for t in results)
             for params, results in _TYPES]
    out = bytearray(b"\0asm\x01\x00\x00\x00")
    out += _section(1, _vec(types))
    out += _section(3, _vec(uleb(t) for t in [t for _, t, _ in _HOOKS] + [t for t, _ in extra]))
    if table is not None:
        out += _section(4, _vec([b"\x70\x00" + uleb(table)]))
    out += _section(5, _vec([b"\x00" + uleb(memory_pages)]))
    exports = [_name("memory") + b"\x02\x00"] + [_name(n) + b"\x00" + uleb(i) for i, (n, _, _) in enumerate(_HOOKS)]
    out += _section(7, _vec(exports))
    if element_segments:
        out += _section(9, _vec([b"\x01\x00\x00"] * element_segments))  # passive, elemkind funcref, no entries
    out += _section(10, _vec(uleb(len(b)) + b for b in bodies))
    segments = [b"\x00\x41\x80\x02\x0b" + uleb(len(_RESULT)) + _RESULT]  # active at 0x100
    segments += [b"\x01\x01\x00"] * (data_segments - 1)  # passive, one zero byte
    out += _section(11, _vec(segments))
    if nonce:
        out += _section(0, _name("nonce") + nonce.encode())
    return bytes(out)


def empty_functions(n: int, nonce: str = "") -> bytes:
    """`n` functions that do nothing: ~6 KiB of compiler memory and ~60 us each."""
    return controller([(3, b"\x00\x0b")] * n, nonce=nonce)


def huge_function(n: int, nonce: str = "") -> bytes:
    """One function of 3n + 5 bytes: i32.const 0, then n times (i32.const 1, i32.add), drop."""
    return controller([(3, b"\x00\x41\x00" + b"\x41\x01\x6a" * n + b"\x1a\x0b")], nonce=nonce)


def many_locals(functions: int, locals_each: int, nonce: str = "") -> bytes:
    """`functions` functions declaring `locals_each` i32 locals each (a few bytes whatever the count)."""
    body = uleb(1) + uleb(locals_each) + bytes([I32]) + b"\x0b"
    return controller([(3, body)] * functions, nonce=nonce)


def deep_nesting(depth: int, nonce: str = "") -> bytes:
    """One function of `depth` nested `if (result i32)`s, each with an else: Cranelift's memory
    grows with the square of the depth (20,000: 2.3 GB; 10,000: 0.6 GB)."""
    code = b"\x20\x00\x04\x7f" * depth + b"\x41\x01" + b"\x05\x41\x02\x0b" * depth + b"\x1a"
    return controller([(1, b"\x00" + code + b"\x41\x00\x0b")], nonce=nonce)
