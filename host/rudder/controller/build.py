"""Build controllers: C sources + the guest SDK -> a wasm32 module, with zig's clang.

`build_controller` compiles any sources; `builtin_controller(name)` builds one of the
controllers shipped in `controllers/` on first use and caches the module under
`$RUDDER_HOME/controllers/`, keyed by a hash of everything that goes into it (sources, SDK,
flags, zig version), so it is rebuilt only when one of those changes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..paths import controllers_dir, zig_cache_dir

__all__ = [
    "BUILTIN_CONTROLLERS",
    "BuildError",
    "CONTROLLERS_DIR",
    "SDK_DIR",
    "build_controller",
    "builtin_controller",
    "compile_command",
    "list_builtin",
]

_REPO = Path(__file__).resolve().parents[3]
SDK_DIR = _REPO / "guest-sdk"
CONTROLLERS_DIR = _REPO / "controllers"

#: Names of the controllers in `controllers/` (one `<name>.c` each).
BUILTIN_CONTROLLERS: tuple[str, ...] = tuple(sorted(p.stem for p in CONTROLLERS_DIR.glob("*.c")))

_COMMON_FLAGS = ["-target", "wasm32-freestanding", "-nostdlib", "-Wl,--no-entry", "-Wl,-z,stack-size=65536"]
# Release keeps the name section (function names in trap backtraces) but no DWARF.
_RELEASE_FLAGS = ["-O3", "-g0"]
# Without -O, zig turns on UBSan, whose runtime does not exist here: make it trap instead.
_DEBUG_FLAGS = ["-O1", "-g", "-fsanitize=undefined", "-fsanitize-trap=undefined"]
_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """Compiling a controller failed. `str()` is a one-line summary, then the compiler output."""

    def __init__(self, summary: str, output: str = ""):
        self.summary = summary
        self.output = output.strip()
        super().__init__(summary + ("\n" + self.output if self.output else ""))


def sdk_sources() -> list[Path]:
    return sorted(SDK_DIR.glob("*.c"))


def compile_command(sources: list[Path], output: Path, debug: bool = False, include_sdk: bool = True) -> list[str]:
    """The compiler command line `build_controller` runs."""
    cmd = [sys.executable, "-m", "ziglang", "cc", *_COMMON_FLAGS, *(_DEBUG_FLAGS if debug else _RELEASE_FLAGS)]
    if include_sdk:
        cmd += ["-I", str(SDK_DIR), *map(str, sdk_sources())]
    return [*cmd, *map(str, sources), "-o", str(output)]


def _summary(stderr: str) -> str:
    """The first diagnostic line of clang/wasm-ld output, shortened."""
    for line in stderr.splitlines():
        if re.search(r"\berror\b", line):
            return line.strip()[:300]
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[0][:300] if lines else "no compiler output"


def build_controller(sources: list[Path], output: Path, debug: bool = False, include_sdk: bool = True) -> Path:
    """Compile C `sources` (plus the guest SDK) into the wasm module `output`.

    `debug` builds with -O1, DWARF and trapping UBSan. The module is written under a temporary
    name and renamed into place, so readers never see half a file. Raises BuildError.
    """
    sources = [Path(s) for s in sources]
    output = Path(output)
    if not sources:
        raise BuildError("no source files given")
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise BuildError(f"source file not found: {', '.join(missing)}")
    output.parent.mkdir(parents=True, exist_ok=True)
    # Build inside a private temporary folder next to `output`, under the final file name
    # (the linker records it as the module's name, which shows in trap backtraces).
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    tmp_path = tmp_dir / output.name
    cache = zig_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(cache), "ZIG_LOCAL_CACHE_DIR": str(cache)}
    cmd = compile_command(sources, tmp_path, debug=debug, include_sdk=include_sdk)
    try:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise BuildError(f"building {output.name} timed out after {_TIMEOUT_S} s") from exc
        if proc.returncode != 0:
            if "No module named ziglang" in proc.stderr:
                raise BuildError("zig is not installed: pip install ziglang", proc.stderr)
            names = ", ".join(s.name for s in sources)
            raise BuildError(f"building {output.name} from {names} failed: {_summary(proc.stderr)}",
                             proc.stderr + proc.stdout)
        if tmp_path.stat().st_size == 0:
            raise BuildError(f"building {output.name} produced an empty file", proc.stderr)
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, output)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return output


@functools.cache  # (importlib.metadata reads the installed distributions each call)
def _zig_version() -> str:
    try:
        from importlib.metadata import version

        return version("ziglang")
    except Exception:  # noqa: BLE001 - not installed: the build itself will say so
        return "unknown"


def _source_path(name: str) -> Path:
    if name not in BUILTIN_CONTROLLERS:
        known = ", ".join(BUILTIN_CONTROLLERS) or "none"
        raise BuildError(f"unknown built-in controller {name!r} (known: {known})")
    return CONTROLLERS_DIR / f"{name}.c"


_keys: dict[tuple, str] = {}  # build keys by their inputs' (path, mtime, size)


def _build_key(source: Path, debug: bool) -> str:
    """A hash of what the module is built from. Every request for a built-in controller asks for
    it, so it is kept while its files' modification times and sizes stay the same (hashing the
    sources each time cost a request milliseconds)."""
    inputs = [source, *sorted(SDK_DIR.glob("*.[ch]"))]
    stamp = (debug, *((str(p), st.st_mtime_ns, st.st_size) for p in inputs for st in [p.stat()]))
    key = _keys.get(stamp)
    if key is None:
        h = hashlib.sha256()
        h.update(f"rudder-build-1 zig={_zig_version()} debug={debug}\n".encode())
        h.update(" ".join(_COMMON_FLAGS + (_DEBUG_FLAGS if debug else _RELEASE_FLAGS)).encode())
        for path in inputs:
            data = path.read_bytes()
            h.update(f"\n{path.name} {len(data)}\n".encode())
            h.update(data)
        key = _keys[stamp] = h.hexdigest()[:16]
    return key


def builtin_controller(name: str, debug: bool = False) -> Path:
    """Path to the built module of `controllers/<name>.c`, building it when its sources (or the
    SDK, flags, zig) changed. Concurrent callers may both build; the rename makes that safe."""
    source = _source_path(name)
    suffix = "-debug" if debug else ""
    path = controllers_dir() / f"{name}-{_build_key(source, debug)}{suffix}.wasm"
    if path.is_file() and path.stat().st_size > 0:
        return path
    return build_controller([source], path, debug=debug)


def list_builtin() -> list[tuple[str, str]]:
    """`(name, description)` of every built-in controller; the description is the first line
    of the file's leading comment."""
    out = []
    for name in BUILTIN_CONTROLLERS:
        first = ""
        for line in (CONTROLLERS_DIR / f"{name}.c").read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line:
                first = line
                break
        text = re.sub(r"^(/\*+|//+)\s*", "", first)
        text = re.sub(r"\s*\*+/$", "", text).strip()
        prefix = f"{name}:"
        if text.lower().startswith(prefix):
            text = text[len(prefix):].strip()
        out.append((name, text))
    return out
