"""Compiled-module cache: in memory (by sha256) and on disk (serialized native code).

Compiling a controller takes Cranelift ~0.3-0.5 s for a 125 KiB module; deserializing the
compiled form takes well under a millisecond. So compiled modules are written under the cache
folder, named by the sha256 of the wasm bytes *and* a fingerprint of everything that makes
compiled code incompatible (wasmtime version, engine settings, CPU architecture). wasmtime
re-checks compatibility when deserializing; a file that fails is recompiled and replaced.

Trust: a cache file is native code that runs in this process. The folder is created private
(0700) and lives under $RUDDER_HOME, which is as trusted as the installed code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Generic, TypeVar

import wasmtime

from ..fsutil import atomic_path
from ..paths import wasm_cache_dir
from .errors import ControllerError

__all__ = ["ModuleCache", "compile_module"]

T = TypeVar("T")


def compile_module(engine: wasmtime.Engine, wasm: bytes) -> wasmtime.Module:
    try:
        return wasmtime.Module(engine, wasm)
    except wasmtime.WasmtimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines()
                 if ln.strip() and ln.strip() not in ("Caused by:", "failed to parse WebAssembly module")]
        detail = lines[-1] if lines else "unknown error"  # the innermost cause is the precise one
        detail = re.sub(r"^\d+: ", "", detail)  # wasmtime numbers the causes of an error chain
        raise ControllerError("bad_module", f"invalid WebAssembly module: {detail}") from None


class ModuleCache(Generic[T]):
    """Maps sha256 -> a loaded module object (in memory, LRU) and sha256 -> compiled code
    (on disk). `T` is what the runtime builds from a wasmtime.Module (its ControllerModule)."""

    def __init__(self, engine: wasmtime.Engine, fingerprint: str, cache_dir: Path | None,
                 max_in_memory: int = 64):
        self.engine = engine
        self.fingerprint = fingerprint
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.max_in_memory = max_in_memory
        self._memory: "OrderedDict[str, T]" = OrderedDict()
        self._lock = threading.Lock()
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
        so a disk hit skips re-inspecting the module's types through wasmtime-py, which
        costs ~0.4 ms. It is as trusted as the compiled code next to it."""
        path = self.path(sha)
        if path is None:
            return None
        meta_path = path.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
            module = wasmtime.Module.deserialize_file(self.engine, str(path))
            size = path.stat().st_size
        except (wasmtime.WasmtimeError, OSError, ValueError):
            return None  # absent, stale or corrupt: the caller recompiles and replaces it
        if not isinstance(meta, dict):
            return None
        self.stats["disk_hits"] += 1
        return module, size, meta

    def compile(self, wasm: bytes) -> wasmtime.Module:
        module = compile_module(self.engine, wasm)
        self.stats["compiled"] += 1
        return module

    def store(self, sha: str, module: wasmtime.Module, meta: dict) -> int:
        """Write a module that passed its checks to disk; returns its compiled size."""
        try:
            blob = module.serialize()
        except wasmtime.WasmtimeError:
            return 0
        path = self.path(sha)
        if path is not None:
            try:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                # metadata first: a .cwasm file is only ever visible with its metadata
                with atomic_path(path.with_suffix(".json")) as tmp:
                    tmp.write_text(json.dumps(meta))
                with atomic_path(path) as tmp:
                    tmp.write_bytes(blob)
            except OSError:
                pass  # the cache is an optimization: never fail a load over it
        return len(blob)


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
