"""WAT controllers for the sandbox tests, compiled with wasmtime.wat2wasm (no C SDK needed).

`GOOD_WAT` is a well-behaved controller whose behaviour the request argument selects (its
first byte); `controller_wat(...)` builds a minimal controller with some hook replaced, for
the hostile tests. Memory addresses below are the guest's own conventions, read back by the
tests with `peek`.
"""

from __future__ import annotations

import struct

import wasmtime

# Guest state of GOOD_WAT (addresses in its memory)
STEPS = 0x100        # mid_process calls (u32)
LAST_BRANCH = 0x104  # branch_idx of the last call
TOKEN_SUM = 0x108    # sum of all appended tokens
TOKENS_SEEN = 0x10C  # number of appended tokens
LAST_BACKTRACK = 0x110
INPUT_CALLS = 0x120  # rudder_input calls
INIT_MARK = 0x130    # rudder_init writes 0xABCD here
VAR_GET_RESULT = 0x410
VAR_SET_RESULT = 0x414
VAR_VALUE = 0x400
INPUT_BUF = 0x10000

GOOD_WAT = r'''
(module
  (import "rudder" "arg_len" (func $arg_len (result i32)))
  (import "rudder" "arg_read" (func $arg_read (param i32 i32) (result i32)))
  (import "rudder" "log" (func $log (param i32 i32)))
  (import "rudder" "var_get" (func $var_get (param i32 i32 i32 i32) (result i32)))
  (import "rudder" "var_set" (func $var_set (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 3)
  (global $steps (export "steps") (mut i32) (i32.const 0))
  (data (i32.const 0x0800) "step\n")
  (data (i32.const 0x0810) "k")
  (data (i32.const 0x0820) "xyz")
  (data (i32.const 0x0830) "init\n")
  ;; mask allowing tokens 5 and 7
  (data (i32.const 0x2000) "\a0\00\00\00")
  ;; token lists: [7, 8, 9] and [10, 11]
  (data (i32.const 0x3000) "\07\00\00\00\08\00\00\00\09\00\00\00")
  (data (i32.const 0x3020) "\0a\00\00\00\0b\00\00\00")
  ;; ff records: {3, 0x3000} {2, 0x3020} {0, 0}
  (data (i32.const 0x3100) "\03\00\00\00\00\30\00\00\02\00\00\00\20\30\00\00\00\00\00\00\00\00\00\00")
  ;; mode m: one branch {backtrack 0, mask 0x2000, 1 ff list at 0x3100}
  (data (i32.const 0x3200) "\00\00\00\00\00\20\00\00\01\00\00\00\00\31\00\00")
  (data (i32.const 0x3300) "\01\00\00\00\00\32\00\00")
  ;; mode f: three branches: the one above; ff [10, 11] without mask; backtrack 1 + empty ff
  (data (i32.const 0x3400) "\00\00\00\00\00\20\00\00\01\00\00\00\00\31\00\00"
                           "\00\00\00\00\00\00\00\00\01\00\00\00\08\31\00\00"
                           "\01\00\00\00\00\00\00\00\01\00\00\00\10\31\00\00")
  (data (i32.const 0x3500) "\03\00\00\00\00\34\00\00")
  ;; mode s: no branch (stop) at 0x3600 (all zero)
  ;; mode c: fast-forward [memory counter, global counter]
  (data (i32.const 0x3700) "\01\00\00\00\10\37\00\00")
  (data (i32.const 0x3710) "\00\00\00\00\00\00\00\00\01\00\00\00\20\37\00\00")
  (data (i32.const 0x3720) "\02\00\00\00\30\37\00\00")

  (func (export "rudder_abi_version") (result i32) (i32.const 1))
  (func (export "rudder_init") (result i32)
    (call $log (i32.const 0x830) (i32.const 5))
    (i32.store (i32.const 0x130) (i32.const 0xABCD))
    (global.set $steps (i32.const 200))
    (i32.const 0))
  (func (export "rudder_start") (result i32)
    (i32.store8 (i32.const 0xF0) (i32.const 109))
    (if (i32.gt_s (call $arg_len) (i32.const 0))
      (then
        (drop (call $arg_read (i32.const 0xE0) (i32.const 16)))
        (i32.store8 (i32.const 0xF0) (i32.load8_u (i32.const 0xE0)))))
    (if (result i32) (i32.eq (i32.load8_u (i32.const 0xF0)) (i32.const 33))
      (then (i32.const 3)) (else (i32.const 0))))
  (func (export "rudder_input") (param $n i32) (result i32)
    (i32.store (i32.const 0x120) (i32.add (i32.load (i32.const 0x120)) (i32.const 1)))
    (if (result i32) (i32.gt_u (local.get $n) (i32.const 16384))
      (then (i32.const 0)) (else (i32.const 0x10000))))
  (func (export "rudder_mid_process") (param $b i32) (param $bt i32) (param $n i32) (result i32)
    (local $i i32) (local $mode i32)
    (i32.store (i32.const 0x100) (i32.add (i32.load (i32.const 0x100)) (i32.const 1)))
    (global.set $steps (i32.add (global.get $steps) (i32.const 1)))
    (i32.store (i32.const 0x104) (local.get $b))
    (i32.store (i32.const 0x110) (local.get $bt))
    (i32.store (i32.const 0x10C) (i32.add (i32.load (i32.const 0x10C)) (local.get $n)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (i32.store (i32.const 0x108) (i32.add (i32.load (i32.const 0x108))
        (i32.load (i32.add (i32.const 0x10000) (i32.shl (local.get $i) (i32.const 2))))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $l)))
    (local.set $mode (i32.load8_u (i32.const 0xF0)))
    (if (i32.eq (local.get $mode) (i32.const 102)) (then (return (i32.const 0x3500))))
    (if (i32.eq (local.get $mode) (i32.const 115)) (then (return (i32.const 0x3600))))
    (if (i32.eq (local.get $mode) (i32.const 99)) (then
      (i32.store (i32.const 0x3730) (i32.load (i32.const 0x100)))
      (i32.store (i32.const 0x3734) (global.get $steps))
      (return (i32.const 0x3700))))
    (if (i32.eq (local.get $mode) (i32.const 118)) (then
      (if (i32.eq (local.get $b) (i32.const 1))
        (then (i32.store (i32.const 0x414)
          (call $var_set (i32.const 0x810) (i32.const 1) (i32.const 0x820) (i32.const 3)))))
      (i32.store (i32.const 0x410)
        (call $var_get (i32.const 0x810) (i32.const 1) (i32.const 0x400) (i32.const 16)))))
    (if (i32.eq (local.get $mode) (i32.const 108)) (then
      (call $log (i32.const 0x800) (i32.const 5))))
    (i32.const 0x3300))
)
'''

ALL_IMPORTS = {
    "vocab_size": "(result i32)", "eos_token": "(result i32)", "config": "(param i32) (result i32)",
    "arg_len": "(result i32)", "arg_read": "(param i32 i32) (result i32)",
    "tokenize": "(param i32 i32 i32 i32) (result i32)", "token_table_len": "(result i32)",
    "token_table_read": "(param i32 i32) (result i32)", "log": "(param i32 i32)",
    "var_get": "(param i32 i32 i32 i32) (result i32)", "var_set": "(param i32 i32 i32 i32) (result i32)",
}


def controller_wat(*, abi: str = "(i32.const 1)", init: str = "(i32.const 0)",
                   start: str = "(i32.const 0)", input_: str = "(i32.const 0x8000)",
                   mid: str = "(i32.const 0x100)", mid_locals: str = "", extra: str = "",
                   memory: str = '(memory (export "memory") 2)', imports: str | None = None,
                   omit: tuple[str, ...] = ()) -> str:
    """A minimal controller: every hook succeeds, mid_process returns one unconstrained
    Branch (the record at 0x100). Replace any body to make it misbehave. All rudder imports
    are declared ($name), so bodies can call them."""
    if imports is None:
        imports = "\n".join(f'  (import "rudder" "{n}" (func ${n} {sig}))' for n, sig in ALL_IMPORTS.items())
    funcs = {
        "rudder_abi_version": f'(func (export "rudder_abi_version") (result i32) {abi})',
        "rudder_init": f'(func (export "rudder_init") (result i32) {init})',
        "rudder_start": f'(func (export "rudder_start") (result i32) {start})',
        "rudder_input": f'(func (export "rudder_input") (param $n i32) (result i32) {input_})',
        "rudder_mid_process": (f'(func (export "rudder_mid_process") (param $b i32) (param $bt i32) '
                               f'(param $n i32) (result i32) {mid_locals} {mid})'),
    }
    body = "\n  ".join(f for name, f in funcs.items() if name not in omit)
    return f'''(module
{imports}
  {memory}
  (data (i32.const 0x100) "\\01\\00\\00\\00\\10\\01\\00\\00")
  {extra}
  {body}
)'''


def wasm_of(wat: str) -> bytes:
    return wasmtime.wat2wasm(wat)


def good_wasm() -> bytes:
    return wasm_of(GOOD_WAT)


def peek(ctl, addr: int, n: int | None = None) -> int | bytes:
    """Read the guest memory of a Controller (white-box, either shape: shapes.memory_of): a u32,
    or `n` bytes."""
    from shapes import memory_of

    mem = memory_of(ctl)
    if n is not None:
        return bytes(mem[addr:addr + n])
    return struct.unpack("<I", bytes(mem[addr:addr + 4]))[0]


def busy_wat() -> str:
    """mid_process spins for the u32 count that rudder_start reads from the argument."""
    return controller_wat(
        start="(drop (call $arg_read (i32.const 0x200) (i32.const 4))) (i32.const 0)",
        mid_locals="(local $i i32) (local $acc i32)",
        mid="""(local.set $i (i32.load (i32.const 0x200)))
               (block $done (loop $l
                 (br_if $done (i32.eqz (local.get $i)))
                 (local.set $acc (i32.add (local.get $acc) (i32.mul (local.get $i) (local.get $i))))
                 (local.set $i (i32.sub (local.get $i) (i32.const 1)))
                 (br $l)))
               (i32.store (i32.const 0x204) (local.get $acc))
               (i32.const 0x100)""")


def full_mask_wat() -> str:
    """A no-op controller that returns a full-vocabulary mask (built once in rudder_init):
    the host-overhead benchmark's subject."""
    return controller_wat(
        memory='(memory (export "memory") 2)',
        init="""(local $i i32) (local $v i32) (local $w i32)
          (local.set $v (call $vocab_size))
          (local.set $w (i32.shr_u (i32.add (local.get $v) (i32.const 31)) (i32.const 5)))
          ;; the mask lives at 0x10000; grow memory so that it fits
          (drop (memory.grow (i32.add (i32.shr_u (i32.shl (local.get $w) (i32.const 2)) (i32.const 16)) (i32.const 1))))
          (block $done (loop $l
            (br_if $done (i32.ge_u (local.get $i) (local.get $w)))
            (i32.store (i32.add (i32.const 0x10000) (i32.shl (local.get $i) (i32.const 2))) (i32.const -1))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br $l)))
          (if (i32.and (local.get $v) (i32.const 31)) (then
            (i32.store (i32.add (i32.const 0x10000) (i32.shl (i32.sub (local.get $w) (i32.const 1)) (i32.const 2)))
              (i32.sub (i32.shl (i32.const 1) (i32.and (local.get $v) (i32.const 31))) (i32.const 1)))))
          ;; the result at 0x200: one branch {0, mask 0x10000, 0, 0}
          (i32.store (i32.const 0x200) (i32.const 1))
          (i32.store (i32.const 0x204) (i32.const 0x210))
          (i32.store (i32.const 0x214) (i32.const 0x10000))
          (i32.const 0)""",
        mid="(i32.const 0x200)")
