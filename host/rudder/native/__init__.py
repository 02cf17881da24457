"""Native code for the per-token path - the mask kernel, the sandbox's epoch ticker and the
model's kernels - compiled once per machine with zig cc (the `ziglang` package, which also
builds controllers) and called through cffi.

`mask_kernel()` returns the kernel, or None when it cannot be built (no zig, an odd platform;
the reason is in `unavailable_reason`): callers then use their numpy path. `deadline.c` is the
sandbox's CPU-time deadline (controller/store.py); without it deadlines are wall-clock.
`sample_kernels()` gives sampling's passes over a row (sample.c). `model_kernels()` gives the
model's kernels (attention.c, linear.c, norm.c, decoder.c; model.py and
packed_linear.py call them through `rudder.kernels`), with helper threads of their own that the
caller never waits for unless they took work (parallel.c), or None.

The library is built as a Python extension module where Python's headers are at hand (cffi's
API mode: a cheaper call), else as a plain shared library opened with cffi's ABI mode (through
libffi); RUDDER_NATIVE_ABI=1 picks the latter. `binding` says which.

RUDDER_CRASH_REPORT=1: a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE) in a process that loaded
the library first prints the crashing thread's native backtrace to stderr (crash.c).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import io
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import cffi

SOURCES = [Path(__file__).with_name(name)
           for name in ("mask.c", "ticker.c", "deadline.c", "parallel.c", "attention.c", "linear.c", "norm.c", "decoder.c",
                        "sample.c", "crash.c")]
HEADERS = [Path(__file__).with_name("kernels.h")]
_CDEF = """
void rudder_apply_mask(float *logits, const uint32_t *words, size_t n_tokens);
int rudder_crash_report_install(void);
typedef struct rudder_ticker rudder_ticker;
rudder_ticker *rudder_ticker_start(void *engine, void *increment, long period_ns);
void rudder_ticker_stop(rudder_ticker *t);
typedef struct rudder_deadline {
    int64_t cpu_limit_ns; int64_t cpu_budget_ns; int64_t wall_start_ns; int64_t wall_limit_ns; int64_t tick_ns;
    int32_t expired; void *error_new; void *set_deadline; void *call;
} rudder_deadline;
void *rudder_guarded_call(rudder_deadline *d, void *context, const void *func, void *args, size_t n, void **trap,
                          int64_t cpu_budget_ns, int64_t wall_budget_ns);
void rudder_deadline_arm(rudder_deadline *d, int64_t cpu_budget_ns, int64_t wall_budget_ns);
int64_t rudder_deadline_left_ns(rudder_deadline *d);
void *rudder_deadline_callback(void *context, void *data, uint64_t *delta, uint8_t *kind);
typedef struct rudder_step {
    rudder_deadline *deadline; void *context; const void *func; int32_t *args; void **trap;
    const void *memory; void *memory_size; uint8_t *base; uint64_t size; uint32_t in_ptr;
    uint32_t mask_words, tail_bits; int64_t cpu_budget_ns, wall_budget_ns;
    void *error; int32_t result;
} rudder_step;
int64_t rudder_step_call(rudder_step *s, int32_t branch_idx, int32_t backtrack, int32_t n, uint32_t token);
typedef struct rudder_attn_step {
    int64_t tokens; const int64_t *positions; const int64_t *slots; const int64_t *seq_of; const int64_t *tables;
    int64_t width, block_size; const float *cos, *sin; int64_t heads, kv_heads, head_dim;
    int32_t x_bf16, cache_bf16, kv_paired, threads; float scale;
} rudder_attn_step;
"""
# The model's kernels take tensors' data pointers as integers: uintptr_t is passed exactly like
# a pointer on every ABI we build for, and cffi converts a Python int to it without a cast
# object per argument (these are called ~200 times per decode step).
_CDEF_MODEL = """
int rudder_linear_init(void);
void rudder_parallel_for(void *fn, void *ctx, int64_t n, int threads);
void rudder_parallel_stats(int64_t *out);
int64_t rudder_attention_cascade_rows(void);
int rudder_attention(const rudder_attn_step *s, uintptr_t qkv, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out);
void rudder_linear_bf16(uintptr_t x, int64_t m, int64_t k, uintptr_t w, uintptr_t bias, int64_t n, uintptr_t out,
                        int32_t out_bf16, int32_t op, int32_t threads);
void rudder_linear_i8(uintptr_t x, int32_t x_bf16, int64_t m, int64_t k, uintptr_t w, uintptr_t wscale, uintptr_t wsum,
                      uintptr_t bias, int64_t n, uintptr_t out, int32_t out_bf16, int32_t op, int32_t threads);
typedef struct rudder_dense {
    uintptr_t w, scale, sum, bias; int64_t n; int32_t int8;
} rudder_dense;
typedef struct rudder_layer {
    uintptr_t norm1, norm2; rudder_dense qkv, o, gate_up, down;
} rudder_layer;
int rudder_decoder(const rudder_layer *layers, int64_t n_layers, const rudder_attn_step *step, uintptr_t x,
                   int64_t hidden, float eps, uintptr_t kv, int64_t layer_stride, int32_t threads);
void rudder_rms_norm(uintptr_t x, int32_t x_bf16, uintptr_t weight, int32_t w_bf16, uintptr_t out, int32_t out_bf16,
                     int64_t m, int64_t k, float eps);
void rudder_softmax_row(uintptr_t x, int64_t n, float inv_t, uintptr_t out);
int64_t rudder_draw_row(uintptr_t w, int64_t n, float u);
void rudder_cut_row(uintptr_t w, int64_t n, int64_t top_k, float top_p, float min_p);
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)
ffi.cdef(_CDEF_MODEL)
unavailable_reason: str | None = None
binding: str | None = None  # once library() ran: "api" (an extension module) or "abi" (dlopen)
abi_reason: str | None = None  # why the extension module was not used, when binding is "abi"


def _cpu_fingerprint() -> str:
    """The kernel is built for this CPU (-mcpu=native): key the cache by what the CPU offers."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{platform.machine()}|{platform.system()}|{flags}".encode()).hexdigest()[:12]


def _zig(args: list[str], out: Path) -> Path:
    """Run `zig cc -O3 -mcpu=native -fPIC args -o out` (written under a temporary name, then
    renamed, so that concurrent builders never see half a file); returns out."""
    from ..paths import zig_cache_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ZIG_GLOBAL_CACHE_DIR=str(zig_cache_dir()), ZIG_LOCAL_CACHE_DIR=str(zig_cache_dir()))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [sys.executable, "-m", "ziglang", "cc", "-O3", "-mcpu=native", "-fPIC", *args, "-o", str(tmp_out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "zig cc failed")
        os.replace(tmp_out, out)
    return out


def _link(out: Path, extra: tuple[Path, list[str]] | None = None) -> Path:
    """The library at `out`: the sources (and `extra`, a C file and its flags) compiled one per
    process, at once - a single `zig cc` of all of them runs on one core - and linked. Both forms
    of the library link the same objects."""
    from ..paths import native_dir

    folder = native_dir() / f"objects-{_key()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    objects = [folder / f"{src.stem}.o" for src in SOURCES]
    jobs = [(["-c", str(src)], obj) for src, obj in zip(SOURCES, objects) if not obj.is_file()]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if extra is not None:
            objects.append(Path(tmp) / f"{extra[0].stem}.o")
            jobs.append((["-c", *extra[1], str(extra[0])], objects[-1]))
        # attention.c (its specialised kernels) takes longer than the rest together: first
        jobs.sort(key=lambda job: Path(job[0][-1]).name != "attention.c")
        if jobs:
            with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
                list(pool.map(lambda job: _zig(*job), jobs))
        objects = list(map(str, objects))
        # Linked against the system's C library, which the Python process has loaded anyway:
        # zig's own link first builds its libc stubs and compiler-rt (seconds, on first use).
        # -z defs makes a symbol that only compiler-rt has a link error here rather than a failed
        # dlopen (not for the extension module, whose Python symbols the interpreter provides;
        # it fails to load then, and library() takes the plain library).
        defs = ["-Wl,-z,defs"] if extra is None else []
        try:
            return _zig(["-shared", "-nostdlib", *defs, *objects, "-lc", "-lm", "-lpthread"], out)
        except RuntimeError:  # no C library's development files, or a compiler-rt symbol
            return _zig(["-shared", *objects, "-lpthread"], out)


def _key(*extra: str) -> str:
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    return hashlib.sha256(source + "|".join((_cpu_fingerprint(), *extra)).encode()).hexdigest()[:16]


def _build() -> Path:
    """The plain shared library, for cffi's ABI mode (dlopen)."""
    from ..paths import native_dir

    suffix = ".dll" if sys.platform == "win32" else ".dylib" if sys.platform == "darwin" else ".so"
    out = native_dir() / f"rudder-native-{_key()}{suffix}"
    return out if out.is_file() else _link(out)


def _build_module() -> Path:
    """The library as a Python extension module, for cffi's API mode: a call costs a fraction of
    one through libffi, and the per-token step makes one per sequence and step. Needs Python's
    headers."""
    from ..paths import native_dir

    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise RuntimeError(f"no Python.h in {include}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = _key(sys.version, cffi.__version__, include)
    out = native_dir() / f"{_MODULE}-{key}" / f"{_MODULE}{suffix}"
    if out.is_file():
        return out
    api = cffi.FFI()
    api.cdef(_CDEF)
    api.cdef(_CDEF_MODEL)
    api.set_source(_MODULE, _CDEF + _CDEF_MODEL)   # (the cdefs are the sources' own declarations)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_file = Path(tmp) / f"{_MODULE}.c"
        with contextlib.redirect_stdout(io.StringIO()):   # ("generating ...")
            api.emit_c_code(str(c_file))
        return _link(out, (c_file, ["-I", include]))


_MODULE = "_rudder_native"


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def library():
    """The native library (built on first use), or None. `ffi` is then the library's own: make
    cdata for it with `native.ffi` after this call."""
    global unavailable_reason, ffi, binding, abi_reason
    if os.environ.get("RUDDER_NO_NATIVE"):
        unavailable_reason = "disabled by RUDDER_NO_NATIVE"
        return None
    abi_reason = "RUDDER_NATIVE_ABI is set"
    lib = None
    if not os.environ.get("RUDDER_NATIVE_ABI"):
        try:
            module = _load_module(_build_module())
            lib, ffi, binding, abi_reason = module.lib, module.ffi, "api", None
        except Exception as e:  # noqa: BLE001 - no headers, an odd platform: the ABI-mode library instead
            abi_reason = f"extension module unavailable: {e}"
    if lib is None:
        try:
            lib, binding = ffi.dlopen(str(_build())), "abi"
        except Exception as e:  # any failure: the pure-Python paths still work
            unavailable_reason = f"native library unavailable: {e}"
            return None
    if os.environ.get("RUDDER_CRASH_REPORT"):  # (native/crash.c; the tests set it)
        lib.rudder_crash_report_install()
    return lib


@functools.cache
def model_kernels():
    """The native library, set up for the model's kernels, or None."""
    lib = library()
    if lib is None:
        return None
    global _amx
    if not os.environ.get("RUDDER_NO_AMX"):
        _amx = bool(lib.rudder_linear_init())  # AMX tiles, where the CPU and the OS offer them
    return lib


_amx = False


def amx_usable() -> bool:
    """Whether the model's kernels use AMX tiles (known once model_kernels() has run)."""
    return _amx


def mask_kernel():
    """`rudder_apply_mask(float *logits, const uint32_t *words, size_t n)`, or None."""
    lib = library()
    return None if lib is None else lib.rudder_apply_mask


def sample_kernels():
    """The library with sample.c's `rudder_softmax_row`, `rudder_cut_row` and `rudder_draw_row`, or None."""
    return library()


class NativeTicker:
    """Advances a wasmtime engine's epoch every `period_s` from a native thread (no GIL)."""

    def __init__(self, engine_ptr: int, increment_fn_ptr: int, period_s: float):
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable_reason)
        handle = lib.rudder_ticker_start(ffi.cast("void *", engine_ptr), ffi.cast("void *", increment_fn_ptr),
                                         int(period_s * 1e9))
        if handle == ffi.NULL:
            raise RuntimeError("could not start the native ticker thread")
        self._lib, self._handle = lib, handle

    def stop(self) -> None:
        if self._handle is not None:
            self._lib.rudder_ticker_stop(self._handle)
            self._handle = None
