"""Where rudder keeps what it builds and downloads: one root, `$RUDDER_HOME` (default
`~/.cache/rudder`), with a folder per kind of cache. Everything that writes to disk asks here."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["rudder_home", "models_dir", "wasm_cache_dir", "zig_cache_dir", "controllers_dir", "native_dir"]


def rudder_home() -> Path:
    """Cache root: `$RUDDER_HOME`, else `~/.cache/rudder`."""
    return Path(os.environ.get("RUDDER_HOME") or "~/.cache/rudder").expanduser()


def models_dir() -> Path:
    """Converted models (`rudder fetch-model`)."""
    return rudder_home() / "models"


def wasm_cache_dir() -> Path:
    """Compiled controller modules, by sha256 (controller/module_cache.py)."""
    return rudder_home() / "wasm-cache"


def zig_cache_dir() -> Path:
    """zig's own build cache (controllers and the native library)."""
    return rudder_home() / "zig-cache"


def controllers_dir() -> Path:
    """Built-in controllers built from controllers/*.c (controller/build.py)."""
    return rudder_home() / "controllers"


def native_dir() -> Path:
    """The native library of the per-token path (rudder/native)."""
    return rudder_home() / "native"
