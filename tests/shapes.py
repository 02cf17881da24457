"""The two controller shapes the sandbox runs, for tests that run the same cases through both.

A test case is a core module's WAT (controller_wat.py, hostile_wat.py): its hooks loop, trap,
grow memory, call host functions or answer with Branch records in guest memory. `CORE` loads it
as it is. `COMPONENT` wraps the very same module in a component (wit/controller.wit) whose glue,
written here in WAT, speaks the component ABI: the module's `rudder` imports become calls of
`rudder:controller/host`, its hooks become the component's exports, its Branch records are
lifted into `step` values (the host checks them by the same rules), and its state - its memory
and exported mutable i32 globals - goes through `save` and `restore`. So the misbehaviour runs
in a component's store, under the component's deadlines, limits and calling convention, and
the component compiles in milliseconds (no componentize-py inside).

Layout of the wrapper: a core module `Mem` defines the controller's memory and a scratch memory
for the component ABI's values (so the controller's memory holds only its own state, as in a
core module) with a bump allocator; `Shim` gives the controller its `rudder` imports over the
lowered host functions; the controller module itself; `Hooks` calls the controller's exports
and writes the component ABI's results into scratch memory.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import wasmtime

from controller_wat import wasm_of

__all__ = ["CORE", "COMPONENT", "SHAPES", "Shape", "component_of", "memory_of"]

_MEMORY = re.compile(r'\(memory\s+(?:\$\w+\s+)?\(export\s+"memory"\)\s+([0-9 ]+)\)')
_GLOBAL = re.compile(r'\(global\s+(?:\$\w+\s+)?\(export\s+"([^"]+)"\)\s+\(mut\s+i32\)')

# What the controller's `rudder` imports become: the lowered host functions of wit/controller.wit.
_HOST_TYPES = '''
    (export "vocab-size" (func (result u32)))
    (export "eos-token" (func (result s32)))
    (export "config" (func (param "key" u32) (result s32)))
    (export "arg" (func (result (option string))))
    (export "tokenize" (func (param "text" string) (result (list u32))))
    (export "token-table" (func (result string)))
    (export "log" (func (param "text" string)))
    (export "var-get" (func (param "key" string) (result (option string))))
    (export "var-set" (func (param "key" string) (param "value" string) (result bool)))'''
_LOWERED = {"vocab-size": "(result i32)", "eos-token": "(result i32)", "config": "(param i32) (result i32)",
            "arg": "(param i32)", "tokenize": "(param i32 i32 i32)", "token-table": "(param i32)",
            "log": "(param i32 i32)", "var-get": "(param i32 i32 i32)", "var-set": "(param i32 i32 i32 i32) (result i32)"}

# Scratch memory helpers, shared by Shim and Hooks (each module gets its own copy).
_HELPERS = r'''
  (func $alloc (param $n i32) (result i32) (call $realloc (i32.const 0) (i32.const 0) (i32.const 4) (local.get $n)))
  ;; bytes [src, src+n) of the controller's memory into scratch
  (func $to_scratch (param $src i32) (param $n i32) (result i32) (local $p i32)
    (local.set $p (call $alloc (local.get $n)))
    (memory.copy $s $u (local.get $p) (local.get $src) (local.get $n))
    (local.get $p))
  ;; one byte as a WIT bytes string (U+0000..U+00FF in UTF-8) at dst in scratch; returns the end
  (func $put (param $dst i32) (param $b i32) (result i32)
    (local.set $b (i32.and (local.get $b) (i32.const 255)))
    (if (result i32) (i32.lt_u (local.get $b) (i32.const 0x80))
      (then (i32.store8 $s (local.get $dst) (local.get $b)) (i32.add (local.get $dst) (i32.const 1)))
      (else
        (i32.store8 $s (local.get $dst) (i32.or (i32.const 0xC0) (i32.shr_u (local.get $b) (i32.const 6))))
        (i32.store8 $s offset=1 (local.get $dst) (i32.or (i32.const 0x80) (i32.and (local.get $b) (i32.const 0x3F))))
        (i32.add (local.get $dst) (i32.const 2)))))
  ;; bytes [src, src+n) of the controller's memory as a bytes string: (pointer, length) in scratch
  (func $enc (param $src i32) (param $n i32) (result i32 i32) (local $p i32) (local $q i32) (local $end i32)
    (local.set $p (call $alloc (i32.shl (local.get $n) (i32.const 1))))
    (local.set $q (local.get $p))
    (local.set $end (i32.add (local.get $src) (local.get $n)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $src) (local.get $end)))
      (local.set $q (call $put (local.get $q) (i32.load8_u $u (local.get $src))))
      (local.set $src (i32.add (local.get $src) (i32.const 1)))
      (br $l)))
    (local.get $p) (i32.sub (local.get $q) (local.get $p)))
  ;; the bytes of a bytes string in scratch: how many there are
  (func $dec_len (param $src i32) (param $len i32) (result i32) (local $end i32) (local $k i32)
    (local.set $end (i32.add (local.get $src) (local.get $len)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $src) (local.get $end)))
      (if (i32.ne (i32.and (i32.load8_u $s (local.get $src)) (i32.const 0xC0)) (i32.const 0x80))
        (then (local.set $k (i32.add (local.get $k) (i32.const 1)))))
      (local.set $src (i32.add (local.get $src) (i32.const 1)))
      (br $l)))
    (local.get $k))
  ;; ... the first `cap` of them written at dst in the controller's memory; returns how many there are
  (func $dec (param $src i32) (param $len i32) (param $dst i32) (param $cap i32) (result i32)
    (local $end i32) (local $k i32) (local $c i32)
    (local.set $end (i32.add (local.get $src) (local.get $len)))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $src) (local.get $end)))
      (local.set $c (i32.load8_u $s (local.get $src)))
      (if (i32.ge_u (local.get $c) (i32.const 0x80)) (then
        (local.set $src (i32.add (local.get $src) (i32.const 1)))
        (local.set $c (i32.or (i32.shl (i32.and (local.get $c) (i32.const 0x1F)) (i32.const 6))
                              (i32.and (i32.load8_u $s (local.get $src)) (i32.const 0x3F))))))
      (if (i32.lt_u (local.get $k) (local.get $cap))
        (then (i32.store8 $u (i32.add (local.get $dst) (local.get $k)) (local.get $c))))
      (local.set $k (i32.add (local.get $k) (i32.const 1)))
      (local.set $src (i32.add (local.get $src) (i32.const 1)))
      (br $l)))
    (local.get $k))
'''

_SHIM = r'''
(core module $Shim
  (import "mem" "memory" (memory $u {user_limits}))
  (import "mem" "scratch" (memory $s 1))
  (import "mem" "realloc" (func $realloc (param i32 i32 i32 i32) (result i32)))
  {host_imports}
  {helpers}
  (func $min (param i32 i32) (result i32)
    (select (local.get 0) (local.get 1) (i32.lt_u (local.get 0) (local.get 1))))
  (func (export "vocab_size") (result i32) (call $h_vocab-size))
  (func (export "eos_token") (result i32) (call $h_eos-token))
  (func (export "config") (param i32) (result i32) (call $h_config (local.get 0)))
  (func $arg (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 12)))
    (call $h_arg (local.get $r))
    (if (result i32) (i32.load8_u $s (local.get $r)) (then (local.get $r)) (else (i32.const 0))))
  (func (export "arg_len") (result i32) (local $r i32)
    (local.set $r (call $arg))
    (if (result i32) (local.get $r)
      (then (call $dec_len (i32.load $s offset=4 (local.get $r)) (i32.load $s offset=8 (local.get $r))))
      (else (i32.const -1))))
  (func (export "arg_read") (param $dst i32) (param $cap i32) (result i32) (local $r i32)
    (local.set $r (call $arg))
    (if (result i32) (local.get $r)
      (then (call $min (local.get $cap) (call $dec (i32.load $s offset=4 (local.get $r)) (i32.load $s offset=8 (local.get $r))
                                                   (local.get $dst) (local.get $cap))))
      (else (i32.const -1))))
  (func (export "tokenize") (param $text i32) (param $n i32) (param $out i32) (param $cap i32) (result i32)
    (local $r i32) (local $len i32)
    (local.set $r (call $alloc (i32.const 8)))
    (call $h_tokenize (call $to_scratch (local.get $text) (local.get $n)) (local.get $n) (local.get $r))
    (local.set $len (i32.load $s offset=4 (local.get $r)))
    (memory.copy $u $s (local.get $out) (i32.load $s (local.get $r))
                 (i32.shl (call $min (local.get $len) (local.get $cap)) (i32.const 2)))
    (local.get $len))
  (func (export "token_table_len") (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 8)))
    (call $h_token-table (local.get $r))
    (call $dec_len (i32.load $s (local.get $r)) (i32.load $s offset=4 (local.get $r))))
  (func (export "token_table_read") (param $dst i32) (param $cap i32) (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 8)))
    (call $h_token-table (local.get $r))
    (call $min (local.get $cap) (call $dec (i32.load $s (local.get $r)) (i32.load $s offset=4 (local.get $r))
                                           (local.get $dst) (local.get $cap))))
  (func (export "log") (param $p i32) (param $n i32)
    (call $h_log (call $to_scratch (local.get $p) (local.get $n)) (local.get $n)))
  (func (export "var_get") (param $k i32) (param $kn i32) (param $dst i32) (param $cap i32) (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 12)))
    (call $h_var-get (call $to_scratch (local.get $k) (local.get $kn)) (local.get $kn) (local.get $r))
    (if (result i32) (i32.load8_u $s (local.get $r))
      (then (call $dec (i32.load $s offset=4 (local.get $r)) (i32.load $s offset=8 (local.get $r)) (local.get $dst) (local.get $cap)))
      (else (i32.const -1))))
  (func (export "var_set") (param $k i32) (param $kn i32) (param $v i32) (param $vn i32) (result i32) (local $kp i32)
    (local.set $kp (call $to_scratch (local.get $k) (local.get $kn)))
    (if (result i32) (call $h_var-set (local.get $kp) (local.get $kn) (call $enc (local.get $v) (local.get $vn)))
      (then (i32.const 0)) (else (i32.const -1))))
)
'''

_HOOKS = r'''
(core module $Hooks
  (import "mem" "memory" (memory $u {user_limits}))
  (import "mem" "scratch" (memory $s 1))
  (import "mem" "realloc" (func $realloc (param i32 i32 i32 i32) (result i32)))
  (import "mem" "reset" (func $reset))
  (import "host" "vocab-size" (func $h_vocab-size (result i32)))
  (import "user" "rudder_abi_version" (func $abi (result i32)))
  (import "user" "rudder_init" (func $init (result i32)))
  (import "user" "rudder_start" (func $start (result i32)))
  (import "user" "rudder_input" (func $input (param i32) (result i32)))
  (import "user" "rudder_mid_process" (func $mid (param i32 i32 i32) (result i32)))
  {global_imports}
  (global $in_ptr (mut i32) (i32.const 0))
  (global $in_cap (mut i32) (i32.const 0))
  (data (memory $s) (i32.const 16) "{texts}")
  {helpers}
  ;; a failure's text: the data at [p, p+n) of scratch, then a signed number unless `with_num` is 0
  (func $text (param $p i32) (param $n i32) (param $num i32) (param $with_num i32) (result i32 i32)
    (local $q i32) (local $d i32) (local $start i32) (local $neg i32)
    (local.set $q (call $alloc (i32.add (local.get $n) (i32.const 12))))
    (memory.copy $s $s (local.get $q) (local.get $p) (local.get $n))
    (local.set $start (local.get $q))
    (local.set $q (i32.add (local.get $q) (local.get $n)))
    (if (local.get $with_num) (then
      (if (i32.lt_s (local.get $num) (i32.const 0)) (then
        (i32.store8 $s (local.get $q) (i32.const 45))
        (local.set $q (i32.add (local.get $q) (i32.const 1)))
        (local.set $num (i32.sub (i32.const 0) (local.get $num)))))
      (local.set $d (i32.const 1000000000))
      (block $done (loop $l
        (br_if $done (i32.or (i32.le_u (local.get $d) (local.get $num)) (i32.eq (local.get $d) (i32.const 1))))
        (local.set $d (i32.div_u (local.get $d) (i32.const 10)))
        (br $l)))
      (block $done (loop $l
        (i32.store8 $s (local.get $q) (i32.add (i32.const 48) (i32.rem_u (i32.div_u (local.get $num) (local.get $d)) (i32.const 10))))
        (local.set $q (i32.add (local.get $q) (i32.const 1)))
        (br_if $done (i32.eq (local.get $d) (i32.const 1)))
        (local.set $d (i32.div_u (local.get $d) (i32.const 10)))
        (br $l)))))
    (local.get $start) (i32.sub (local.get $q) (local.get $start)))
  ;; result<_, failure> / result<T, failure> written at a fresh 24-byte area
  (func $ok (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 24)))
    (i32.store8 $s (local.get $r) (i32.const 0))
    (call $reset)
    (local.get $r))
  (func $fail (param $p i32) (param $n i32) (param $case i32) (result i32) (local $r i32)
    (local.set $r (call $alloc (i32.const 24)))
    (i32.store8 $s (local.get $r) (i32.const 1))
    (i32.store8 $s offset=4 (local.get $r) (local.get $case))
    (i32.store $s offset=8 (local.get $r) (local.get $p))
    (i32.store $s offset=12 (local.get $r) (local.get $n))
    (call $reset)
    (local.get $r))
  (func $inside (param $p i32) (param $n i32) (result i32)
    (i64.le_u (i64.add (i64.extend_i32_u (local.get $p)) (i64.extend_i32_u (local.get $n)))
              (i64.shl (i64.extend_i32_u (memory.size $u)) (i64.const 16))))

  (func (export "init") (result i32) (local $v i32)
    (local.set $v (call $abi))
    (if (i32.ne (local.get $v) (i32.const 1))
      (then (return (call $fail (call $text {t_abi} (local.get $v) (i32.const 1)) (i32.const 0)))))
    (local.set $v (call $init))
    (if (local.get $v)
      (then (return (call $fail (call $text {t_init} (local.get $v) (i32.const 1)) (i32.const 0)))))
    (call $ok))
  (func (export "start") (result i32) (local $v i32)
    (local.set $v (call $start))
    (if (local.get $v)
      (then (return (call $fail (call $text {t_start} (local.get $v) (i32.const 1)) (i32.const 0)))))
    (call $ok))
  (func $outside (result i32)
    (call $fail (call $text {t_outside} (i32.const 0) (i32.const 0)) (i32.const 0)))

  (func (export "mid-process") (param $b i32) (param $bt i32) (param $tokens i32) (param $n i32) (result i32)
    (local $res i32) (local $nb i32) (local $bp i32) (local $out i32) (local $i i32) (local $src i32) (local $dst i32)
    (local $mask i32) (local $mask_bytes i32) (local $nff i32) (local $ffp i32) (local $lists i32) (local $j i32)
    (local $len i32) (local $tp i32) (local $copy i32) (local $r i32)
    (if (i32.gt_u (local.get $n) (global.get $in_cap)) (then
      (global.set $in_cap (select (local.get $n) (i32.const 64) (i32.gt_u (local.get $n) (i32.const 64))))
      (global.set $in_ptr (call $input (global.get $in_cap)))))
    (memory.copy $u $s (global.get $in_ptr) (local.get $tokens) (i32.shl (local.get $n) (i32.const 2)))
    (local.set $res (call $mid (local.get $b) (local.get $bt) (local.get $n)))
    (if (i32.eqz (local.get $res))
      (then (return (call $fail (call $text {t_null} (i32.const 0) (i32.const 0)) (i32.const 0)))))
    (if (i32.eqz (call $inside (local.get $res) (i32.const 8))) (then (return (call $outside))))
    (local.set $nb (i32.load $u (local.get $res)))
    (local.set $bp (i32.load $u offset=4 (local.get $res)))
    (if (i32.eqz (call $inside (local.get $bp) (i32.shl (local.get $nb) (i32.const 4)))) (then (return (call $outside))))
    (local.set $mask_bytes (i32.shl (i32.shr_u (i32.add (call $h_vocab-size) (i32.const 31)) (i32.const 5)) (i32.const 2)))
    (local.set $out (call $alloc (i32.mul (local.get $nb) (i32.const 24))))
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $i) (local.get $nb)))
      (local.set $src (i32.add (local.get $bp) (i32.shl (local.get $i) (i32.const 4))))
      (local.set $dst (i32.add (local.get $out) (i32.mul (local.get $i) (i32.const 24))))
      (i32.store $s (local.get $dst) (i32.load $u (local.get $src)))
      (local.set $mask (i32.load $u offset=4 (local.get $src)))
      (i32.store8 $s offset=4 (local.get $dst) (i32.ne (local.get $mask) (i32.const 0)))
      (if (local.get $mask) (then
        (if (i32.eqz (call $inside (local.get $mask) (local.get $mask_bytes))) (then (return (call $outside))))
        (call $enc (local.get $mask) (local.get $mask_bytes))
        (local.set $len) (local.set $r)
        (i32.store $s offset=8 (local.get $dst) (local.get $r))
        (i32.store $s offset=12 (local.get $dst) (local.get $len))))
      (local.set $nff (i32.load $u offset=8 (local.get $src)))
      (local.set $ffp (i32.load $u offset=12 (local.get $src)))
      (if (i32.eqz (call $inside (local.get $ffp) (i32.shl (local.get $nff) (i32.const 3)))) (then (return (call $outside))))
      (local.set $lists (call $alloc (i32.shl (local.get $nff) (i32.const 3))))
      (local.set $j (i32.const 0))
      (block $fdone (loop $fl
        (br_if $fdone (i32.ge_u (local.get $j) (local.get $nff)))
        (local.set $len (i32.load $u (i32.add (local.get $ffp) (i32.shl (local.get $j) (i32.const 3)))))
        (local.set $tp (i32.load $u offset=4 (i32.add (local.get $ffp) (i32.shl (local.get $j) (i32.const 3)))))
        (if (i32.eqz (call $inside (local.get $tp) (i32.shl (local.get $len) (i32.const 2)))) (then (return (call $outside))))
        (local.set $copy (call $to_scratch (local.get $tp) (i32.shl (local.get $len) (i32.const 2))))
        (i32.store $s (i32.add (local.get $lists) (i32.shl (local.get $j) (i32.const 3))) (local.get $copy))
        (i32.store $s offset=4 (i32.add (local.get $lists) (i32.shl (local.get $j) (i32.const 3))) (local.get $len))
        (local.set $j (i32.add (local.get $j) (i32.const 1)))
        (br $fl)))
      (i32.store $s offset=16 (local.get $dst) (local.get $lists))
      (i32.store $s offset=20 (local.get $dst) (local.get $nff))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $l)))
    ;; ok(branches(list))
    (local.set $r (call $ok))
    (i32.store8 $s offset=4 (local.get $r) (i32.const 0))
    (i32.store $s offset=8 (local.get $r) (local.get $out))
    (i32.store $s offset=12 (local.get $r) (local.get $nb))
    (local.get $r))

  ;; the state: how many globals, the exported mutable globals (4 bytes each), the whole memory
  (func (export "save") (result i32) (local $p i32) (local $q i32) (local $mp i32) (local $mn i32) (local $r i32)
    (local.set $p (call $alloc (i32.const {global_bytes_x2})))
    (local.set $q (call $put (local.get $p) (i32.const {n_globals})))
    {save_globals}
    (call $enc (i32.const 0) (i32.shl (memory.size $u) (i32.const 16)))
    (local.set $mn) (local.set $mp)
    (local.set $r (call $ok))
    ;; the globals' bytes go right before the memory's: move them next to it
    (memory.copy $s $s (i32.sub (local.get $mp) (i32.sub (local.get $q) (local.get $p))) (local.get $p)
                 (i32.sub (local.get $q) (local.get $p)))
    (i32.store $s offset=4 (local.get $r) (i32.sub (local.get $mp) (i32.sub (local.get $q) (local.get $p))))
    (i32.store $s offset=8 (local.get $r) (i32.add (local.get $mn) (i32.sub (local.get $q) (local.get $p))))
    (local.get $r))
  (func (export "restore") (param $p i32) (param $n i32) (result i32) (local $end i32) (local $size i32) (local $v i32) (local $c i32)
    (local $k i32)
    (local.set $end (i32.add (local.get $p) (local.get $n)))
    (local.set $p (i32.add (local.get $p) (i32.const 1)))
    {restore_globals}
    (local.set $size (call $dec_len (local.get $p) (i32.sub (local.get $end) (local.get $p))))
    (local.set $k (i32.shr_u (i32.add (local.get $size) (i32.const 0xFFFF)) (i32.const 16)))
    (if (i32.gt_u (local.get $k) (memory.size $u)) (then
      (if (i32.eq (memory.grow $u (i32.sub (local.get $k) (memory.size $u))) (i32.const -1))
        (then (return (call $fail (call $text {t_state} (i32.const 0) (i32.const 0)) (i32.const 2)))))))
    (drop (call $dec (local.get $p) (i32.sub (local.get $end) (local.get $p)) (i32.const 0) (local.get $size)))
    (call $ok))
)
'''

_MEM = r'''
(core module $Mem
  (memory (export "memory") {user_limits})
  (memory $s (export "scratch") 1)
  (global $heap (mut i32) (i32.const 256))
  (func (export "reset") (global.set $heap (i32.const 256)))
  (func (export "realloc") (param i32 i32 i32 i32) (result i32) (local $p i32) (local $end i32)
    (local.set $p (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (local.set $end (i32.add (local.get $p) (local.get 3)))
    (if (i32.gt_u (local.get $end) (i32.shl (memory.size $s) (i32.const 16)))
      (then (if (i32.eq (memory.grow $s (i32.sub (i32.shr_u (i32.add (local.get $end) (i32.const 0xFFFF)) (i32.const 16))
                                                  (memory.size $s)))
                        (i32.const -1))
              (then unreachable))))
    (global.set $heap (local.get $end))
    (local.get $p))
)
'''

_COMPONENT = r'''
(component
  (import "rudder:controller/host@1.0.0" (instance $host {host_types}))
  {mem}
  (core instance $mem (instantiate $Mem))
  {lowered}
  (core instance $hostv (export "vocab-size" (func $vocab-size)))
  {shim}
  (core instance $shim (instantiate $Shim (with "mem" (instance $mem)) (with "host" (instance {host_instance}))))
  (core module $User {user})
  (core instance $user (instantiate $User (with "rudder" (instance $shim)) (with "mem" (instance $mem))))
  {hooks}
  (core instance $hooks (instantiate $Hooks (with "mem" (instance $mem)) (with "user" (instance $user))
                                            (with "host" (instance $hostv))))
  (type $failure (variant (case "refused" string) (case "exception" string) (case "out-of-memory" string)))
  (export $f "failure" (type $failure))
  (type $branch (record (field "backtrack" u32) (field "mask" (option string)) (field "ff" (list (list u32)))))
  (export $br "branch" (type $branch))
  (type $hand-off (record (field "controller" string) (field "arg" string)))
  (export $ho "hand-off" (type $hand-off))
  (type $step (variant (case "branches" (list $br)) (case "hand-off" $ho)))
  (export $st "step" (type $step))
  (func (export "init") (result (result (error $f))) (canon lift (core func $hooks "init") {opts}))
  (func (export "start") (result (result (error $f))) (canon lift (core func $hooks "start") {opts}))
  (func (export "mid-process") (param "branch-idx" u32) (param "backtrack" u32) (param "tokens" (list u32))
    (result (result $st (error $f))) (canon lift (core func $hooks "mid-process") {opts}))
  (func (export "save") (result (result string (error $f))) (canon lift (core func $hooks "save") {opts}))
  (func (export "restore") (param "state" string) (result (result (error $f)))
    (canon lift (core func $hooks "restore") {opts}))
)
'''


# The failure texts of Hooks, in its scratch memory below the heap (which starts at 256).
_TEXTS = {"t_init": "rudder_init returned ", "t_start": "rudder_start returned ", "t_null": "a null result pointer",
          "t_outside": "an answer outside memory", "t_state": "the controller's state is over its memory limit",
          "t_abi": "the controller was built for ABI version "}


def _texts() -> dict:
    at, out = 16, {"texts": "".join(_TEXTS.values())}
    for key, text in _TEXTS.items():
        out[key] = f"(i32.const {at}) (i32.const {len(text)})"
        at += len(text)
    assert at <= 256
    return out


def _component_wat(wat: str) -> str:
    m = _MEMORY.search(wat)
    if m is None:
        raise ValueError("the module must define its memory as (memory (export \"memory\") ...)")
    limits = m.group(1).strip()
    user = wat[wat.index("(module") + len("(module"):wat.rindex(")")]
    user = user.replace(m.group(0), "", 1)
    user = f'(import "mem" "memory" (memory {limits}))\n' + user
    globals_ = _GLOBAL.findall(wat)
    opts = '(memory (core memory $mem "scratch")) (realloc (core func $mem "realloc"))'
    lowered = "\n  ".join(f'(core func ${n} (canon lower (func $host "{n}") {opts}))' for n in _LOWERED)
    host_imports = "\n  ".join(f'(import "host" "{n}" (func $h_{n} {sig}))' for n, sig in _LOWERED.items())
    host_instance = " ".join(f'(export "{n}" (func ${n}))' for n in _LOWERED)
    global_imports = "\n  ".join(f'(import "user" "{g}" (global $g{i} (mut i32)))' for i, g in enumerate(globals_))
    save_globals = "\n    ".join(
        f"(local.set $q (call $put (local.get $q) (i32.shr_u (global.get $g{i}) (i32.const {8 * k}))))"
        for i in range(len(globals_)) for k in range(4))
    restore_globals = "\n    ".join(
        f"""(local.set $v (i32.const 0))
    (local.set $k (i32.const 0))
    (block $done{i} (loop $l{i}
      (br_if $done{i} (i32.eq (local.get $k) (i32.const 4)))
      (local.set $c (i32.load8_u $s (local.get $p)))
      (if (i32.ge_u (local.get $c) (i32.const 0x80)) (then
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (local.set $c (i32.or (i32.shl (i32.and (local.get $c) (i32.const 0x1F)) (i32.const 6))
                              (i32.and (i32.load8_u $s (local.get $p)) (i32.const 0x3F))))))
      (local.set $v (i32.or (local.get $v) (i32.shl (local.get $c) (i32.shl (local.get $k) (i32.const 3)))))
      (local.set $p (i32.add (local.get $p) (i32.const 1)))
      (local.set $k (i32.add (local.get $k) (i32.const 1)))
      (br $l{i})))
    (global.set $g{i} (local.get $v))""" for i in range(len(globals_)))
    fill = dict(user_limits=limits, helpers=_HELPERS)
    return _COMPONENT.format(
        host_types=_HOST_TYPES, mem=_MEM.format(**fill), lowered=lowered,
        shim=_SHIM.format(host_imports=host_imports, **fill), host_instance=host_instance, user=user,
        hooks=_HOOKS.format(global_imports=global_imports, global_bytes_x2=8 + 8 * len(globals_), n_globals=len(globals_),
                            save_globals=save_globals, restore_globals=restore_globals, **_texts(), **fill),
        opts=opts)


@functools.cache
def component_of(wat: str) -> bytes:
    """The component that runs the core module `wat` through the component ABI (see above)."""
    return bytes(wasmtime.wat2wasm(_component_wat(wat)))


def memory_of(ctl) -> bytes | memoryview:
    """The guest memory of a Controller, white-box: a core module's as it is, a component's (one
    made by component_of) as its `save` gives it."""
    inst = ctl._inst
    if hasattr(inst, "u8"):
        return inst.u8
    from rudder.controller.component import save

    state = save(inst, 1000, "trap").decode("utf-8").encode("latin-1")
    return state[1 + 4 * state[0]:]


@dataclass(frozen=True)
class Shape:
    """A controller shape as the tests see it: `wasm(wat)` gives the controller the runtime loads,
    `hook(name)` the name an error message gives the core hook `name` in this shape."""

    name: str

    def wasm(self, wat: str) -> bytes:
        return wasm_of(wat) if self.name == "core" else component_of(wat)

    def hook(self, name: str) -> str:
        if self.name == "core":
            return name
        return {"rudder_init": "init", "rudder_start": "start", "rudder_mid_process": "mid-process",
                "rudder_input": "mid-process", "rudder_abi_version": "init"}.get(name, name)

    def side(self, rt):
        """The runtime's side for this shape (white-box: its cache, its init, its engine)."""
        return rt._core if self.name == "core" else rt._component_shape()

    def __str__(self) -> str:
        return self.name


CORE = Shape("core")
COMPONENT = Shape("component")
SHAPES = [CORE, COMPONENT]
