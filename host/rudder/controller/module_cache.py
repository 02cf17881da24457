"""Compiled-module cache: in memory (by sha256) and on disk (serialized native code).

Compiling a controller takes Cranelift far longer than deserializing its compiled form
(benchmarks/RESULTS.md, "Numbers the code's design rests on"). So compiled modules are written under the cache
folder, named by the sha256 of the wasm bytes *and* a fingerprint of everything that makes
compiled code incompatible (wasmtime version, engine settings, CPU architecture). wasmtime
re-checks compatibility when deserializing; a file that fails is recompiled and replaced.

Compiling happens in a worker process (compiler.py): it writes the serialized code to a
temporary file under the cache folder, which is loaded from there and, once the module passed
its checks, renamed into place (never serialized a second time).

Trust: a cache file is native code that runs in this process. The folder is created private
(0700) and lives under $RUDDER_HOME, which is as trusted as the installed code.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Generic, TypeVar

import wasmtime

from ..fsutil import atomic_path
from ..paths import wasm_cache_dir
from .compiler import Compiler, innermost
from .errors import ControllerError

__all__ = ["ModuleCache"]

T = TypeVar("T")
_STALE_S = 24 * 3600  # a worker's file left by a process killed mid-compile is removed after this


class ModuleCache(Generic[T]):
    """Maps sha256 -> a loaded module object (in memory, LRU) and sha256 -> compiled code
    (on disk). `T` is what the runtime builds from a wasmtime.Module (its ControllerModule).
    `compiler` compiles with the engine's `settings` (compile_worker.py); `component`: this
    cache holds components (wasmtime.component.Component) instead of core modules."""

    def __init__(self, engine: wasmtime.Engine, fingerprint: str, cache_dir: Path | None, *,
                 compiler: Compiler, settings: dict, component: bool = False, max_in_memory: int = 64):
        self.engine = engine
        self.fingerprint = fingerprint
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.compiler = compiler
        self.settings = settings
        self.component = component
        self.max_in_memory = max_in_memory
        self._memory: "OrderedDict[str, T]" = OrderedDict()
        self._lock = threading.Lock()
        # freshly compiled modules -> (their file until stored, or None; compiled size)
        self._fresh: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._swept = False
        self.stats = {"memory_hits": 0, "disk_hits": 0, "compiled": 0}

    def get(self, sha: str) -> T | None:
        with self._lock:
            item = self._memory.get(sha)
            if item is not None:
                self._memory.move_to_end(sha)
                self.stats["memory_hits"] += 1
            return item

    def put(self, sha: str, item: T) -> T:
        """Remember `item`; if another thread got there first, keep and return theirs."""
        with self._lock:
            have = self._memory.get(sha)
            if have is not None:
                return have
            self._memory[sha] = item
            while len(self._memory) > self.max_in_memory:
                self._memory.popitem(last=False)
            return item

    def path(self, sha: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{sha}.{self.fingerprint}.cwasm"

    def from_disk(self, sha: str) -> tuple[wasmtime.Module, int, dict] | None:
        """(module, compiled size, metadata) from the disk cache, or None.

        The metadata is what the load-time checks found (written only after they passed),
        so a disk hit skips re-inspecting the module's types through wasmtime-py, which is
        slow. It is as trusted as the compiled code next to it."""
        path = self.path(sha)
        if path is None:
            return None
        meta_path = path.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
            module = self._deserialize(path, mapped=True)
            size = path.stat().st_size
        except (wasmtime.WasmtimeError, OSError, ValueError):
            return None  # absent, stale or corrupt: the caller recompiles and replaces it
        if not isinstance(meta, dict):
            return None
        self.stats["disk_hits"] += 1
        return module, size, meta

    def compile(self, wasm: bytes):
        """Compile in a worker within the compiler's limits (ControllerError if refused) and
        load the code; `store` later keeps it on disk."""
        work = self._work_dir()
        path, size = self.compiler.compile(wasm, self.settings, self.component, work)
        try:
            # read, not mapped: a mapped file that someone truncates in place kills the process (SIGBUS)
            module = self._deserialize(path.read_bytes())
        except BaseException as e:
            path.unlink(missing_ok=True)
            if isinstance(e, wasmtime.WasmtimeError):  # what this engine cannot hold (e.g. more tables than its pool)
                what = "component" if self.component else "module"
                raise ControllerError("bad_module", f"invalid WebAssembly {what}: {innermost(str(e))}") from None
            raise
        if work is None:
            path.unlink(missing_ok=True)  # the mapping keeps the code; nothing will store it
            path = None
        else:
            weakref.finalize(module, _discard, path)  # a module that fails its checks leaves no file
        self._fresh[module] = (path, size)
        self.stats["compiled"] += 1
        return module

    def store(self, sha: str, module, meta: dict) -> int:
        """Keep a freshly compiled module that passed its checks on disk (its metadata first: a
        .cwasm file is only ever visible with its metadata); returns its compiled size."""
        fresh, size = self._fresh.pop(module)
        path = self.path(sha)
        if path is not None and fresh is not None:
            try:
                with atomic_path(path.with_suffix(".json")) as tmp:
                    tmp.write_text(json.dumps(meta))
                os.replace(fresh, path)
            except OSError:
                pass  # the cache is an optimization: never fail a load over it
        return size

    def _deserialize(self, source: Path | bytes, mapped: bool = False):
        """Compiled code from a file mapped in (`source` a path) or from bytes."""
        if self.component:
            from wasmtime import component

            kind = component.Component
        else:
            kind = wasmtime.Module
        return kind.deserialize_file(self.engine, str(source)) if mapped else kind.deserialize(self.engine, source)

    def _work_dir(self) -> Path | None:
        """Where workers write compiled code: beside the cache files (a rename stores it), else
        (None) the system's temporary folder. Files older than a day there were left by a
        process killed mid-compile: the first compile of each cache removes them."""
        if self.cache_dir is None:
            return None
        work = self.cache_dir / "tmp"
        try:
            work.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
        if not self._swept:
            self._swept = True
            _sweep(work)
        return work


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)


def _sweep(folder: Path) -> None:
    cutoff = time.time() - _STALE_S
    try:
        for f in folder.iterdir():
            if f.stat().st_mtime < cutoff:
                f.unlink(missing_ok=True)
    except OSError:
        pass


def fingerprint(*parts: object) -> str:
    text = "|".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return wasm_cache_dir()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_wasm(source) -> bytes:
    """Bytes of a module given as bytes or as a path."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        try:
            return Path(source).read_bytes()
        except OSError as e:
            raise ControllerError("bad_module", f"cannot read controller module {source}: "
                                  f"{e.strerror or e}") from None
    raise TypeError(f"a controller module is bytes or a path, not {type(source).__name__}")
