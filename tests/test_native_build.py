"""How the native library is built (rudder/native/__init__.py): the sources compiled one per
process and linked against the system's C library, with zig's own full link as the fallback;
both forms of the library (extension module, plain) link the same objects. A process that loaded
it prints a native backtrace on a fatal signal when RUDDER_CRASH_REPORT is set."""

from __future__ import annotations

import os
import platform
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rudder import native


class Calls(list):
    """The `zig cc` argument lists, in order."""
    fail_fast_link = False


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """`zig cc` replaced by a recorder that writes its output; the library under tmp_path."""
    monkeypatch.setenv("RUDDER_HOME", str(tmp_path))
    made = Calls()

    def zig(args: list[str], out: Path) -> Path:
        made.append(args)
        if "-nostdlib" in args and made.fail_fast_link:
            raise RuntimeError("ld.lld: error: undefined symbol: __fixdfti")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"built")
        return out

    monkeypatch.setattr(native, "_zig", zig)
    return made


def test_each_source_compiles_once_and_both_forms_link_the_same_objects(calls):
    native._build()
    compiled = [args[-1] for args in calls if args[0] == "-c"]
    assert sorted(Path(c).name for c in compiled) == sorted(s.name for s in native.SOURCES)
    assert Path(compiled[0]).name == "attention.c"  # the slowest starts first
    link = calls[-1]
    assert link[:2] == ["-shared", "-nostdlib"] and "-Wl,-z,defs" in link and link[-3:] == ["-lc", "-lm", "-lpthread"]
    calls.clear()
    native._build_module()
    # only the binding's C file is compiled now; the link takes the plain library's objects too
    assert [Path(args[-1]).suffix for args in calls if args[0] == "-c"] == [".c"] and len(calls) == 2
    link = calls[-1]
    objects = [a for a in link if a.endswith(".o")]
    assert len(objects) == len(native.SOURCES) + 1
    assert "-Wl,-z,defs" not in link  # the module's Python symbols come from the interpreter


def test_a_failed_fast_link_falls_back_to_zigs_own(calls):
    calls.fail_fast_link = True
    out = native._build()
    assert out.read_bytes() == b"built"
    fast, full = calls[-2], calls[-1]
    assert "-nostdlib" in fast and "-nostdlib" not in full and full[0] == "-shared" and full[-1] == "-lpthread"


TRAP = """
import wasmtime
engine = wasmtime.Engine()
store = wasmtime.Store(engine)
module = wasmtime.Module(engine, '(module (memory 1) (func (export "f") (result i32) (i32.load (i32.const 0x7fffff00))))')
f = wasmtime.Instance(store, module, []).exports(store)["f"]
for _ in range(3):  # out of bounds: a SIGSEGV that wasmtime's handler turns into a trap
    try:
        f(store)
    except wasmtime.Trap:
        print("trapped", flush=True)
"""


@pytest.mark.skipif("platform.machine() not in ('x86_64', 'AMD64')", reason="x86 instruction sets")
def test_the_kernels_compile_for_other_x86_cpus(tmp_path):
    """The library is built with -mcpu=native, so each machine compiles only its own branches of
    the sources' instruction-set #ifdefs: here, for a CPU with AVX-512 but no bf16 (Skylake-X,
    Cascade Lake: common servers) and one with AVX2 only. A branch that does not compile there
    would leave such a machine without the native kernels (it would run the torch path, slowly)."""
    env = dict(os.environ, ZIG_GLOBAL_CACHE_DIR=str(tmp_path), ZIG_LOCAL_CACHE_DIR=str(tmp_path))
    runs = [(cpu, subprocess.Popen([sys.executable, "-m", "ziglang", "cc", "-O0", f"-mcpu={cpu}", "-fPIC",
                                    "-Werror=implicit-function-declaration", "-c", str(src), "-o",
                                    str(tmp_path / f"{cpu}-{src.stem}.o")],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for cpu in ("skylake_avx512", "x86_64_v3") for src in native.SOURCES
            if re.search(r"__AVX|__AMX", src.read_text())]  # (the sources with such branches)
    assert len(runs) >= 4
    for cpu, proc in runs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"-mcpu={cpu}: {out}"



@pytest.mark.skipif("not sys.platform.startswith('linux') or native.library() is None", reason="Linux, native library")
@pytest.mark.parametrize("how", ["fault", "sent", "wasmtime first"])
def test_a_fatal_signal_prints_the_native_backtrace_then_the_python_one(how):
    """RUDDER_CRASH_REPORT=1 (the tests set it): a segfault in C code prints the crashing
    thread's C frames, then faulthandler's Python traceback, and the process still dies of the
    signal; so does a SIGSEGV sent by another process. Guest traps (wasmtime's own SIGSEGVs) are
    not crashes, whichever handler came first; where wasmtime's did, there is no report."""
    # (A sent signal goes to this thread: os.kill's, for the whole process, may land on another of
    # its threads, whose report then has no Python frame of crash(); a clean clone's run saw that.)
    crash = ("import ctypes; ctypes.string_at(0)" if how != "sent"
             else "import signal, threading; signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)")
    load = "from rudder import native; assert native.library() is not None\n"
    code = (TRAP + load if how == "wasmtime first" else load + TRAP) + f"def crash():\n    {crash}\ncrash()"
    no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731 (no core file in the tree)
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          env={**os.environ, "RUDDER_CRASH_REPORT": "1"}, timeout=60, preexec_fn=no_core)
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert done.stdout.split() == ["trapped"] * 3
    assert "Fatal Python error: Segmentation fault" in done.stderr and "in crash" in done.stderr
    if how == "wasmtime first":
        assert "native backtrace" not in done.stderr
        return
    assert done.stderr.count("native backtrace") == 1, done.stderr  # the crash's; no trap's
    native_at = done.stderr.index("native backtrace of the crashing thread")
    assert done.stderr.index("Fatal Python error: Segmentation fault") > native_at
    frames = done.stderr[native_at:].splitlines()[1:4]
    assert all(re.search(r"\[0x[0-9a-f]+\]$", f) for f in frames), done.stderr  # library(+offset) [address]
