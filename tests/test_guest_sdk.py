"""The C guest SDK (guest-sdk/) and the controller build (rudder.controller.build).

What runs where:
- every SDK behaviour test (the probe: allocator, JSON strings, formatting, variables,
  tokenize/detokenize, UTF-8, the trie walk, masks, ff lists, forks, stop, misuse; JSON
  errors; the input buffer; debug builds; a bad token table; the trie walk on SmolLM2) runs
  in the product's sandbox, `rudder.controller.ControllerRuntime`;
- `MiniRuntime` below is a second, independent reading of the host side of docs/abi.md,
  written here in plain wasmtime-py (slow, strict). It proves nothing about the product by
  itself: tests/test_controllers.py runs controllers in both hosts and requires the same
  answers step by step, and `build_token_table` here must equal the product's table byte for
  byte, so that a misreading of the ABI in either shows up as a disagreement.
"""

from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import wasmtime

from rudder.branch import Branch
from rudder.controller import ControllerError as SandboxError
from rudder.controller import ControllerRuntime, Limits, build
from rudder.controller.build import BUILTIN_CONTROLLERS, BuildError, build_controller, builtin_controller, list_builtin
from rudder.controller.host_api import IMPORTS
from rudder.tokenizer import Tokenizer

ABI_EXPORTS = {
    "memory": None,
    "rudder_abi_version": ([], ["i32"]),
    "rudder_init": ([], ["i32"]),
    "rudder_start": ([], ["i32"]),
    "rudder_input": (["i32"], ["i32"]),
    "rudder_mid_process": (["i32", "i32", "i32"], ["i32"]),
}
ABI_IMPORTS = IMPORTS  # name -> (i32 params, i32 results), as docs/abi.md lists them
RTT1_MAGIC = 0x31545452


# ---------------------------------------------------------------------------- token table


def build_token_table(tokenizer: Tokenizer) -> bytes:
    """The RTT1 table of docs/abi.md (special tokens have no bytes and are not in the trie)."""
    vocab = tokenizer.vocab_size
    specials = tokenizer.special_token_ids
    table = [b"" if i in specials else b for i, b in enumerate(tokenizer.token_bytes)]
    offsets = np.zeros(vocab + 1, dtype="<u4")
    np.cumsum([len(b) for b in table], out=offsets[1:])
    root: dict = {}  # byte -> [token or None, children]
    for i, b in enumerate(table):
        level, node = root, None
        for byte in b:
            node = level.setdefault(byte, [None, {}])
            level = node[1]
        if node is not None and node[0] is None:
            node[0] = i
    nodes = [[0, 0]]

    def visit(children: dict) -> int:
        total = 0
        for byte in sorted(children):
            token, kids = children[byte]
            idx = len(nodes)
            nodes.append([byte | ((token + 1) << 8 if token is not None else 0), 0])
            size = 1 + visit(kids)
            nodes[idx][1] = size
            total += size
        return total

    nodes[0][1] = 1 + visit(root)
    data = b"".join(table)
    header = struct.pack("<4I", RTT1_MAGIC, vocab, len(nodes), len(data))
    pad = b"\0" * (-len(data) % 4)
    return header + offsets.tobytes() + np.array(nodes, dtype="<u4").tobytes() + data + pad


def tiny_bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE with a few merges, so tokens span several bytes (the trie is deep)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from rudder.tokenizer import byte_to_unicode

    b2u = byte_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in b2u.items()})
    words = [" very", " ver", " vast", " yes", " no", " Yes", " No", "YES", "NO", "ery", "es", "café",
             "Paris", " Paris", "Pa", "ris", "Hello", " world", "ABC", "AB", "HELLO", "ing", " the"]
    merges = []
    for w in words:
        u = "".join(b2u[b] for b in w.encode())
        cur = u[0]
        for ch in u[1:]:
            if cur + ch not in vocab:
                vocab[cur + ch] = len(vocab)
                merges.append((cur, ch))
            cur += ch
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(tok, eos_token_id=2, bos_token_id=1, vocab_size=len(vocab) + 5)


# ---------------------------------------------------------------------------- mini host


class ControllerError(RuntimeError):
    pass


@dataclass
class MiniBranch:
    """The mini host's own record of a Branch (the product's is rudder.branch.Branch)."""

    backtrack: int = 0
    mask: np.ndarray | None = None
    ff: list[list[int]] = field(default_factory=list)


@dataclass
class _Request:
    arg: bytes
    vars: dict = field(default_factory=dict)
    log: bytearray = field(default_factory=bytearray)


class _Instance:
    """One wasmtime instance with the `rudder` imports bound to a request."""

    def __init__(self, rt: "MiniRuntime", module: wasmtime.Module, request: _Request | None,
                 snapshot: bytes | None = None):
        self.rt, self.module, self.request = rt, module, request
        self.store = wasmtime.Store(rt.engine)
        self.store.set_limits(memory_size=rt.memory_limit)
        linker = wasmtime.Linker(rt.engine)
        i32 = wasmtime.ValType.i32()
        for name, (n_params, n_results) in ABI_IMPORTS.items():
            ty = wasmtime.FuncType([i32] * n_params, [i32] * n_results)
            linker.define_func("rudder", name, ty, getattr(self, "_imp_" + name))
        self.instance = linker.instantiate(self.store, module)
        ex = self.instance.exports(self.store)
        self.memory = ex["memory"]
        self.funcs = {name: ex[name] for name in ABI_EXPORTS if name != "memory"}
        if snapshot is not None:
            pages = len(snapshot) // 65536 - self.memory.size(self.store)
            if pages > 0:
                self.memory.grow(self.store, pages)
            self.memory.write(self.store, snapshot, 0)

    # -- memory access, bounds-checked like the real host
    def _check(self, ptr: int, n: int) -> int:
        ptr &= 0xFFFFFFFF
        if n < 0 or ptr + n > self.memory.data_len(self.store):
            raise wasmtime.Trap(f"pointer out of bounds: {ptr} + {n}")
        return ptr

    def read(self, ptr: int, n: int) -> bytes:
        ptr = self._check(ptr, n)
        return bytes(self.memory.read(self.store, ptr, ptr + n)) if n else b""

    def write(self, ptr: int, data: bytes) -> None:
        ptr = self._check(ptr, len(data))
        if data:
            self.memory.write(self.store, data, ptr)

    def u32s(self, ptr: int, n: int) -> list[int]:
        return list(struct.unpack(f"<{n}I", self.read(ptr, 4 * n)))

    def call(self, name: str, *args: int) -> int:
        try:
            return self.funcs[name](self.store, *args)
        except wasmtime.Trap as exc:
            raise ControllerError(f"{name} trapped: {exc}\nlog: {self.log_text()[-2000:]}") from None

    def log_text(self) -> str:
        return self.request.log.decode("utf-8", "replace") if self.request else self.rt.init_log.decode()

    def snapshot(self) -> bytes:
        return bytes(self.memory.read(self.store, 0, self.memory.data_len(self.store)))

    # -- imports
    def _imp_vocab_size(self):
        return self.rt.tokenizer.vocab_size

    def _imp_eos_token(self):
        return self.rt.tokenizer.eos_token_id

    def _imp_config(self, key):
        flags = (self.rt.max_forks > 1) | (self.rt.backtrack_allowed << 1)
        return {0: 1, 1: self.rt.max_forks, 2: self.rt.max_ff, 3: flags}.get(key, -1)

    def _imp_arg_len(self):
        return -1 if self.request is None else len(self.request.arg)

    def _imp_arg_read(self, dst, cap):
        data = b"" if self.request is None else self.request.arg[: max(cap, 0)]
        self.write(dst, data)
        return len(data)

    def _imp_tokenize(self, text, n, dst, cap):
        try:
            text = self.read(text, n).decode("utf-8")
        except UnicodeDecodeError:
            raise wasmtime.Trap("tokenize: text is not valid UTF-8") from None
        ids = self.rt.tokenizer.encode(text)
        self.write(dst, struct.pack(f"<{min(len(ids), cap)}I", *ids[: max(cap, 0)]))
        self.rt.tokenize_calls += 1
        return len(ids)

    def _imp_token_table_len(self):
        return len(self.rt.table)

    def _imp_token_table_read(self, dst, cap):
        data = self.rt.table[: max(cap, 0)]
        self.write(dst, data)
        return len(data)

    def _imp_log(self, ptr, n):
        (self.request.log if self.request else self.rt.init_log).extend(self.read(ptr, n))

    def _imp_var_get(self, key, key_len, dst, cap):
        value = self.request.vars.get(self.read(key, key_len))
        if value is None:
            return -1
        self.write(dst, value[: max(cap, 0)])
        return len(value)

    def _imp_var_set(self, key, key_len, val, val_len):
        self.request.vars[self.read(key, key_len)] = self.read(val, val_len)
        return 0


class MiniController:
    def __init__(self, inst: _Instance):
        self.inst = inst
        self.in_ptr = self.in_cap = 0

    def log_text(self) -> str:
        """The request's log (shared by its forks)."""
        return self.inst.log_text()

    def mid_process(self, branch_idx: int, backtrack: int, tokens: list[int]) -> list[MiniBranch]:
        inst, n = self.inst, len(tokens)
        if n > self.in_cap or self.in_ptr == 0:
            ptr = inst.call("rudder_input", n) & 0xFFFFFFFF
            assert ptr != 0 and ptr % 4 == 0, f"rudder_input returned {ptr}"
            self.in_ptr, self.in_cap = ptr, n
        inst.write(self.in_ptr, struct.pack(f"<{n}I", *tokens))
        res = inst.call("rudder_mid_process", branch_idx, backtrack, n) & 0xFFFFFFFF
        if res == 0:
            raise ControllerError(f"rudder_mid_process failed\nlog: {self.log_text()[-2000:]}")
        n_branches, branches = inst.u32s(res, 2)
        words = (self.inst.rt.tokenizer.vocab_size + 31) // 32
        out = []
        for i in range(n_branches):
            bt, mask, n_ff, ff = inst.u32s(branches + 16 * i, 4)
            lists = []
            for j in range(n_ff):
                n_tok, toks = inst.u32s(ff + 8 * j, 2)
                lists.append(inst.u32s(toks, n_tok))
            m = np.frombuffer(inst.read(mask, 4 * words), dtype="<u4").copy() if mask else None
            out.append(MiniBranch(bt, m, lists))
        return out

    def fork(self) -> "MiniController":
        inst = self.inst
        ctl = MiniController(_Instance(inst.rt, inst.module, inst.request, inst.snapshot()))
        ctl.in_ptr, ctl.in_cap = self.in_ptr, self.in_cap
        return ctl

    def close(self) -> None:
        pass


class MiniModule:
    def __init__(self, module: wasmtime.Module, snapshot: bytes):
        self.module, self.snapshot = module, snapshot


class MiniRuntime:
    """The host side of the ABI, in plain wasmtime-py: `load(wasm)` -> module,
    `start(module, arg)` -> controller with `mid_process`, `fork`, `close`."""

    def __init__(self, tokenizer: Tokenizer, max_forks: int = 16, max_ff: int = 4096,
                 backtrack_allowed: bool = True, memory_limit: int = 64 << 20):
        self.tokenizer = tokenizer
        self.max_forks, self.max_ff, self.memory_limit = max_forks, max_ff, memory_limit
        self.backtrack_allowed = backtrack_allowed
        self.engine = wasmtime.Engine()
        self.table = build_token_table(tokenizer)
        self.init_log = bytearray()
        self.tokenize_calls = 0

    def load(self, wasm: Path | bytes) -> MiniModule:
        data = Path(wasm).read_bytes() if isinstance(wasm, (str, Path)) else wasm
        module = wasmtime.Module(self.engine, data)
        for imp in module.imports:
            if imp.module != "rudder" or imp.name not in ABI_IMPORTS:
                raise ControllerError(f"module imports {imp.module}.{imp.name}")
        inst = _Instance(self, module, None)
        if inst.call("rudder_abi_version") != 1:
            raise ControllerError("wrong ABI version")
        if inst.call("rudder_init") != 0:
            raise ControllerError(f"rudder_init failed\nlog: {self.init_log.decode(errors='replace')}")
        return MiniModule(module, inst.snapshot())

    def start(self, module: MiniModule, arg: str | bytes = b"") -> MiniController:
        request = _Request(arg.encode() if isinstance(arg, str) else arg)
        inst = _Instance(self, module.module, request, module.snapshot)
        if inst.call("rudder_start") != 0:
            raise ControllerError(f"rudder_start failed\nlog: {request.log.decode(errors='replace')}")
        return MiniController(inst)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.byte_level(512)


# Steps take well under the 25 ms deadline, but this machine's cores are shared: allow more.
SLACK = Limits(mid_process_ms=2000, init_ms=10_000)


def sandbox(tok: Tokenizer) -> ControllerRuntime:
    """The product's sandbox for `tok` (no disk cache: these modules are throwaway)."""
    return ControllerRuntime(tok, SLACK)


class fails_with:
    """A sandbox failure (ControllerError) whose message or log tail contains `text`; the
    error is `.error` after the block."""

    def __init__(self, text: str):
        self.text = text
        self.error = None

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        assert typ is not None, f"no failure (expected {self.text!r})"
        if not issubclass(typ, SandboxError):
            return False
        full = f"{exc}\n{exc.log_tail}"
        assert self.text in full, full
        self.error = exc
        return True


def probe_module(tmp_path: Path, source: str, debug: bool = False) -> Path:
    src = tmp_path / "probe.c"
    src.write_text(source)
    return build_controller([src], tmp_path / "probe.wasm", debug=debug)


def _valtypes(types) -> list[str]:
    return [str(t) for t in types]


# ---------------------------------------------------------------------------- build


@pytest.mark.parametrize("debug", [False, True], ids=["release", "debug"])
def test_builtin_modules_have_exactly_the_abi_surface(debug):
    engine = wasmtime.Engine()
    assert set(BUILTIN_CONTROLLERS) >= {"force", "choices", "uppercase", "fork", "backtrack"}
    for name in BUILTIN_CONTROLLERS:
        path = builtin_controller(name, debug=debug)
        module = wasmtime.Module.from_file(engine, str(path))
        exports = {e.name: e.type for e in module.exports}
        assert set(exports) == set(ABI_EXPORTS), name
        assert isinstance(exports["memory"], wasmtime.MemoryType)
        for fname, sig in ABI_EXPORTS.items():
            if sig is None:
                continue
            params, results = sig
            ty = exports[fname]
            assert _valtypes(ty.params) == params and _valtypes(ty.results) == results, (name, fname)
        for imp in module.imports:
            assert imp.module == "rudder", (name, imp.module, imp.name)
            n_params, n_results = ABI_IMPORTS[imp.name]
            assert len(imp.type.params) == n_params and len(imp.type.results) == n_results
            assert all(str(t) == "i32" for t in [*imp.type.params, *imp.type.results])


def test_release_modules_are_small():
    # The constraint controllers carry engines: regex; json = JSON Schema + regex (for
    # pattern/format); grammar = regex + Earley parser + JSON Schema (for %json); triggers = all.
    limits = {"grammar": 240_000, "json": 160_000, "triggers": 240_000}
    for name in BUILTIN_CONTROLLERS:
        assert builtin_controller(name).stat().st_size < limits.get(name, 40_000), name


def test_build_error_is_clear(tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text('#include "rudder.h"\nvoid controller_step(const rudder_step *s, rudder_out *o) { oops }\n')
    with pytest.raises(BuildError) as info:
        build_controller([bad], tmp_path / "bad.wasm")
    summary = str(info.value).splitlines()[0]
    assert "bad.wasm" in summary and "bad.c" in summary and "error" in summary
    assert "oops" in str(info.value)  # the compiler's own output follows
    assert not (tmp_path / "bad.wasm").exists()
    assert not list(tmp_path.glob(".bad.wasm.*"))  # no temporary left behind


def test_link_error_names_the_missing_callback(tmp_path):
    src = tmp_path / "empty.c"
    src.write_text('#include "rudder.h"\n')
    with pytest.raises(BuildError, match="controller_step"):
        build_controller([src], tmp_path / "empty.wasm")


def test_missing_source_and_unknown_builtin(tmp_path):
    with pytest.raises(BuildError, match="not found"):
        build_controller([tmp_path / "nope.c"], tmp_path / "x.wasm")
    with pytest.raises(BuildError, match="unknown built-in controller 'nope'"):
        builtin_controller("nope")


def test_builtin_cache(tmp_path, monkeypatch):
    zig_cache = build.zig_cache_dir()  # zig's own cache (content-addressed) stays the session's: only ours is new
    monkeypatch.setattr(build, "zig_cache_dir", lambda: zig_cache)
    monkeypatch.setenv("RUDDER_HOME", str(tmp_path / "home"))
    ctl = tmp_path / "controllers"
    ctl.mkdir()
    (ctl / "force.c").write_text((build.CONTROLLERS_DIR / "force.c").read_text())
    monkeypatch.setattr(build, "CONTROLLERS_DIR", ctl)
    monkeypatch.setattr(build, "BUILTIN_CONTROLLERS", ("force",))
    first = builtin_controller("force")
    assert first.parent == tmp_path / "home" / "controllers" and first.name.startswith("force-")
    stamp = first.stat().st_mtime_ns

    calls = []
    real_run = build.subprocess.run
    monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    assert builtin_controller("force") == first and first.stat().st_mtime_ns == stamp
    assert calls == []  # served from the cache
    (ctl / "force.c").write_text((ctl / "force.c").read_text() + "\n/* changed */\n")
    second = builtin_controller("force")
    assert second != first and second.is_file() and len(calls) == 1
    assert builtin_controller("force", debug=True) not in (first, second)


def test_list_builtin():
    names = dict(list_builtin())
    assert set(names) == set(BUILTIN_CONTROLLERS)
    for name, text in names.items():
        assert text and "\n" not in text and not text.startswith(("/*", name + ":")), (name, text)
    assert "choices" in names["choices"] or "strings" in names["choices"]


def test_compile_command_flags(tmp_path):
    rel = build.compile_command([tmp_path / "x.c"], tmp_path / "x.wasm")
    dbg = build.compile_command([tmp_path / "x.c"], tmp_path / "x.wasm", debug=True)
    assert "-O3" in rel and "-nostdlib" in rel and "wasm32-freestanding" in rel
    assert "-O1" in dbg and "-g" in dbg and "-fsanitize-trap=undefined" in dbg
    bare = build.compile_command([tmp_path / "x.c"], tmp_path / "x.wasm", include_sdk=False)
    assert str(build.SDK_DIR) not in " ".join(bare)


# ---------------------------------------------------------------------------- SDK behaviour

PROBE = r"""
#include "rudder.h"

static uint32_t lower_push(void *self, uint32_t s, uint8_t b) {
    (void)self;
    return (b >= 'a' && b <= 'z') ? s + 1 : RUDDER_DEAD;
}
static bool even_allow(void *self, uint32_t s, uint32_t tok) {
    (void)self;
    return (s & 1) == 0 || tok % 7 == 0;   /* even length, or an id that is a multiple of 7 */
}

static int check_alloc(void) {
    /* many sizes, interleaved frees, realloc keeps contents, memory grows past 1 MiB */
    uint8_t *blocks[64] = {0};
    uint32_t sizes[64];
    uint32_t seed = 12345;
    for (int round = 0; round < 2000; round++) {
        seed = seed * 1103515245u + 12345u;
        int i = (int)((seed >> 16) % 64);
        if (blocks[i]) {
            for (uint32_t k = 0; k < sizes[i]; k++)
                if (blocks[i][k] != (uint8_t)(i + k)) return 1;
            if (seed & 1) { rudder_free(blocks[i]); blocks[i] = NULL; continue; }
            uint32_t n = sizes[i] < 1000000 ? sizes[i] * 2 + 1 : sizes[i] / 3;   /* grow or shrink */
            uint8_t *p = rudder_realloc(blocks[i], n);
            if (!p) return 2;
            for (uint32_t k = 0; k < sizes[i] && k < n; k++)
                if (p[k] != (uint8_t)(i + k)) return 3;
            for (uint32_t k = 0; k < n; k++) p[k] = (uint8_t)(i + k);
            blocks[i] = p; sizes[i] = n;
        } else {
            uint32_t n = (seed >> 8) % ((seed & 2) ? 300000u : 100u);
            uint8_t *p = rudder_alloc(n);
            if (!p || ((uintptr_t)p & 7)) return 4;
            for (uint32_t k = 0; k < n; k++) p[k] = (uint8_t)(i + k);
            blocks[i] = p; sizes[i] = n;
        }
    }
    if (rudder_alloc(0x7fffffff) != NULL) return 5;
    if (rudder_alloc(200u << 20) != NULL) return 6;   /* past the host's memory limit */
    uint8_t big1[5000], big2[5000];
    for (int k = 0; k < 5000; k++) big1[k] = big2[k] = (uint8_t)k;
    if (memcmp(big1, big2, 5000) != 0 || strlen("hello") != 5) return 7;
    big2[4999] ^= 1;
    if (memcmp(big1, big2, 5000) <= 0 || memcmp(big2, big1, 5000) >= 0) return 8;
    return 0;
}

int controller_init(void) {
    int r = check_alloc();
    if (r)
        rudder_logf("alloc check failed: %d\n", r);
    return r;
}

int controller_start(const char *arg, uint32_t len) {
    uint32_t n;
    const char *err;
    rudder_str *s = rudder_json_strings(arg, len, &n, &err);
    if (!s) { rudder_logf("json error: %s\n", err); return 0; }
    rudder_logf("json %u:", n);
    for (uint32_t i = 0; i < n; i++) rudder_logf(" [%.*s]", (int)s[i].len, (const char *)s[i].ptr);
    rudder_log("\n");
    rudder_free(s);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    uint32_t m = 0;
    rudder_logf("step %u idx %u bt %u app %u seq %u prompt %u\n", step->index, step->branch_idx,
                step->backtrack, step->n_tokens, step->n_seq, step->n_prompt);
    if (step->index == 0) {
        rudder_logf("fmt %d %i %u %x %c %s %.*s %lld %% %q|\n", -42, 7, 4000000000u, 0xbeefu, 'Z',
                    "str", 3, "abcdef", -1234567890123ll);
        uint32_t got = 0;
        rudder_var_set("k", "value", 5);
        int32_t r = rudder_var_get("k", &got, 4);
        rudder_logf("var %d %.*s unset %d\n", r, 4, (const char *)&got, rudder_var_get("nope", NULL, 0));
        uint32_t v;
        rudder_logf("uint %d %d %d %d\n", rudder_parse_uint(" 42 ", 4, &v) && v == 42,
                    rudder_parse_uint("4294967296", 10, &v), rudder_parse_uint("", 0, &v),
                    rudder_parse_uint("1x", 2, &v));
        uint32_t n;
        uint32_t *toks = rudder_tokenize_str("hello world", &n);
        uint8_t buf[64];
        uint32_t nb = rudder_detokenize(toks, n, buf, sizeof buf);
        rudder_logf("tok %u -> %.*s\n", n, (int)nb, (const char *)buf);
        rudder_free(toks);
        static const char *u8[] = {"ok", "caf\xc3\xa9", "\xc3", "\xe0\x80\x80", "\xed\xa0\x80",
                                   "\xf4\x90\x80\x80", "\xf0\x9f\x98\x80", "\x80", "\xc3\xa9\xc3"};
        rudder_log("utf8");
        for (uint32_t i = 0; i < sizeof u8 / sizeof *u8; i++)
            rudder_logf(" %d", rudder_utf8_valid(u8[i], (uint32_t)strlen(u8[i])));
        rudder_logf(" bad %d\n", rudder_tokenize("\xff", 1, &n) == NULL && n == 0);
        m = 1;
    }
    if (step->index == 1) {   /* lowercase tokens */
        uint32_t *mask = rudder_out_mask(out);
        rudder_logf("count %u\n", rudder_trie_fill_mask(mask, &(rudder_recognizer){.push = lower_push}, 0));
        rudder_out_sample(out, mask);
        return;
    }
    if (step->index == 2) {   /* lowercase tokens of even length, ff lists, a second branch */
        uint32_t *mask = rudder_out_mask(out);
        rudder_recognizer r = {.push = lower_push, .allow = even_allow};
        rudder_logf("count %u\n", rudder_trie_fill_mask(mask, &r, 0));
        rudder_branch *b = rudder_out_sample(out, mask);
        uint32_t list[3] = {7, 8, 9};
        rudder_out_ff_list(out, b, list, 3);
        list[0] = 10;
        rudder_out_ff_list(out, b, list, 2);
        rudder_mask_set_all(rudder_out_mask(out));
        rudder_out_ff(out, list, 1)->backtrack = 2;
        return;
    }
    if (step->index == 3) {
        rudder_out_backtrack(out, 1);
        uint32_t *mask = rudder_out_mask(out);
        rudder_mask_set_all(mask);
        rudder_logf("all %u words %u\n", rudder_mask_count(mask), rudder_mask_words());
        rudder_out_sample(out, mask)->backtrack = 3;
        return;
    }
    if (step->index == 4) {
        rudder_out_sample(out, NULL);
        rudder_out_stop(out);
        return;
    }
    if (step->index == 5) {
        uint32_t t[1] = {5};
        rudder_out_ff_list(out, rudder_out_sample(out, NULL), t, 1);   /* needs a mask */
        return;
    }
    (void)m;
    rudder_out_sample(out, NULL);
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    return probe_module(tmp_path_factory.mktemp("probe"), PROBE)


@pytest.mark.parametrize("tok_name", ["byte", "bpe"])
def test_sdk_probe(probe, tok_name, byte_tok):
    """The SDK's helpers, step by step, in the product's sandbox."""
    tok = byte_tok if tok_name == "byte" else tiny_bpe_tokenizer()
    rt = sandbox(tok)
    module = rt.load(probe)
    ctl = rt.start(module, '["a", "b\\"c\\\\", "\\u00e9\\ud83d\\ude00", ""]')
    assert "json 4: [a] [b\"c\\] [é😀] []" in ctl.log_text()
    prompt = tok.encode("hi")
    assert ctl.mid_process(0, 0, prompt) == [Branch()]
    log = ctl.log_text()
    assert "step 0 idx 0 bt 0 app 2 seq 2 prompt 2" in log
    assert "fmt -42 7 4000000000 beef Z str abc -1234567890123 % %q|" in log
    assert "var 5 valu unset -1" in log
    assert "uint 1 0 0 0" in log
    assert f"tok {len(tok.encode('hello world'))} -> hello world" in log
    samples = [b"ok", "café".encode(), b"\xc3", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
               "😀".encode(), b"\x80", b"\xc3\xa9\xc3"]

    def valid(b):
        try:
            return int(bool(b.decode("utf-8")) or 1)
        except UnicodeDecodeError:
            return 0

    assert "utf8 " + " ".join(str(valid(b)) for b in samples) + " bad 1" in log

    # step 1: the trie walk equals a Python reference
    [b] = ctl.mid_process(0, 0, [100])
    lower = set(b"abcdefghijklmnopqrstuvwxyz")
    specials = tok.special_token_ids
    expect = {i for i, t in enumerate(tok.token_bytes) if t and i not in specials and set(t) <= lower}
    # duplicates: only the smallest id with given bytes is in the trie
    first_of = {}
    for i in sorted(expect):
        first_of.setdefault(tok.token_bytes[i], i)
    expect = set(first_of.values())
    got = set(np.flatnonzero(np.unpackbits(b.mask.view(np.uint8), bitorder="little")))
    assert got == expect and f"count {len(expect)}" in ctl.log_text()
    # step 2: allow() filters on the state after the token and the token id; ff lists; two branches
    b0, b1 = ctl.mid_process(0, 0, [101])
    got = set(np.flatnonzero(np.unpackbits(b0.mask.view(np.uint8), bitorder="little")))
    assert got == {i for i in expect if len(tok.token_bytes[i]) % 2 == 0 or i % 7 == 0}
    assert b0.ff == [[7, 8, 9], [10, 8]] and b0.backtrack == 0
    assert b1 == Branch(2, None, [[10]])
    # the fork sees branch 1, the original branch 0
    other = ctl.fork()
    [bb, bs] = other.mid_process(1, 2, [10])
    assert "step 3 idx 1 bt 2 app 1 seq 3 prompt 2" in other.log_text()
    assert bb == Branch(1, None, [[]]) and bs.backtrack == 3
    assert f"all {tok.vocab_size} words {(tok.vocab_size + 31) // 32}" in other.log_text()
    bits = np.unpackbits(bs.mask.view(np.uint8), bitorder="little")
    assert bits[: tok.vocab_size].all() and not bits[tok.vocab_size:].any()
    assert len(ctl.mid_process(0, 0, [7, 8, 9])) == 2
    assert "step 3 idx 0 bt 0 app 3 seq 7 prompt 2" in ctl.log_text()
    # step 4 stops; step 5 is an SDK-detected misuse -> failure with a clear log
    assert ctl.mid_process(0, 3, []) == []
    assert "step 4 idx 0 bt 3 app 0 seq 4 prompt 2" in ctl.log_text()
    with fails_with("rudder_out_ff_list needs a masked branch"):
        ctl.mid_process(0, 0, [5])
    for c in (ctl, other):
        c.close()
    rt.close()


@pytest.mark.parametrize("arg", ['"x"', "[", '["a" "b"]', '["\\q"]', '["\\ud800"]', '["a"] x', '["a\nb"]'])
def test_json_errors(probe, byte_tok, arg):
    with sandbox(byte_tok) as rt:
        ctl = rt.start(rt.load(probe), arg)
        assert "json error: " in ctl.log_text() and " at byte " in ctl.log_text()
        assert "json " not in ctl.log_text().replace("json error: ", "")  # no list was parsed


def test_input_buffer_grows_and_backtrack_into_prompt(probe, byte_tok):
    """A 3000-token prompt makes the host ask the SDK for a bigger input buffer, and the SDK
    sees every token; backtracking past the start of the sequence is the SDK's "invalid step"."""
    with sandbox(byte_tok) as rt:
        ctl = rt.start(rt.load(probe), "[]")
        rng = random.Random(0)
        prompt = [rng.randrange(3, 259) for _ in range(3000)]
        ctl.mid_process(0, 0, prompt[:10])
        ctl.mid_process(0, 0, prompt[10:])   # 2990 tokens: more than the first buffer holds
        assert "seq 10 prompt 10" in ctl.log_text() and "app 2990 seq 3000 prompt 10" in ctl.log_text()
        assert ctl._in_cap >= 2990  # white-box: the host asked rudder_input for more room
        with fails_with("invalid step"):
            ctl.mid_process(0, 5000, [])


def test_debug_build_traps_on_undefined_behaviour(tmp_path, byte_tok):
    src = r"""
    #include "rudder.h"
    static volatile int32_t big = 0x7fffffff;
    void controller_step(const rudder_step *s, rudder_out *o) { (void)o; big += (int32_t)s->n_tokens; }
    """
    with sandbox(byte_tok) as rt:
        release = rt.start(rt.load(probe_module(tmp_path, src)))
        assert release.mid_process(0, 0, [5]) == []  # wraps silently (no branch: it stops)
        debug = rt.start(rt.load(probe_module(tmp_path, src, debug=True)))
        with fails_with("trapped") as failure:
            debug.mid_process(0, 0, [5])
        assert failure.error.kind == "trap"


def test_bad_token_table_fails_init(probe, byte_tok):
    """The SDK checks the table the host hands it (here truncated, white-box) and fails init."""
    with sandbox(byte_tok) as rt:
        rt._shared._table = bytes(rt._shared.token_table[:-8])
        module = rt.load(probe)
        with fails_with("bad token table") as failure:
            rt.start(module, "[]")
        assert failure.error.kind == "init"


@pytest.mark.model
def test_trie_walk_on_smollm2(probe, smollm2_tokenizer):
    """The real vocabulary (49152 tokens, 313 partial UTF-8 ones): same answer as Python."""
    tok = smollm2_tokenizer
    rt = sandbox(tok)
    ctl = rt.start(rt.load(probe), "[]")
    ctl.mid_process(0, 0, tok.encode("hi"))
    [b] = ctl.mid_process(0, 0, [100])
    lower = set(b"abcdefghijklmnopqrstuvwxyz")
    first_of: dict[bytes, int] = {}
    for i, t in enumerate(tok.token_bytes):
        if t and i not in tok.special_token_ids and set(t) <= lower:
            first_of.setdefault(t, i)
    got = set(np.flatnonzero(np.unpackbits(b.mask.view(np.uint8), bitorder="little")))
    assert got == set(first_of.values())
    rt.close()


@pytest.mark.parametrize("tok_name", ["byte", "bpe", pytest.param("smollm2", marks=pytest.mark.model)])
def test_token_table_matches_an_independent_reading(tok_name, byte_tok, request):
    """The product's RTT1 table (rudder.controller.token_table) is byte for byte the one this
    file builds from docs/abi.md on its own."""
    from rudder.controller.token_table import build_token_table as product_table

    tok = {"byte": lambda: byte_tok, "bpe": tiny_bpe_tokenizer,
           "smollm2": lambda: request.getfixturevalue("smollm2_tokenizer")}[tok_name]()
    assert product_table(tok) == build_token_table(tok)


def test_environment_cache_dir_is_project_owned(tmp_path, monkeypatch):
    monkeypatch.setenv("RUDDER_HOME", str(tmp_path / "h"))
    assert build.zig_cache_dir() == tmp_path / "h" / "zig-cache"
    assert os.fspath(build.SDK_DIR).endswith("guest-sdk") and (build.SDK_DIR / "rudder.h").is_file()
