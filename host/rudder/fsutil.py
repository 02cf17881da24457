"""Crash-safe file writing for the model cache.

A conversion writes several hundred MB; if it is interrupted, a later run must never load a
half-written file. So every file is written under a temporary name and renamed into place
(rename is atomic on one file system), and a folder counts as complete only once a marker
file, written last, says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

MARKER_NAME = ".rudder-complete.json"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; cache files should get the usual permissions. Read once at
# import (os.umask can only be read by setting it, which is not thread-safe later).
_FILE_MODE = 0o666 & ~_current_umask()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it to `path` if the block succeeds.

    The temporary file is in the same folder so that the final rename stays on one file
    system (and is therefore atomic). On error it is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # After the block: writers may have recreated the file (safetensors does).
        os.chmod(tmp_path, _FILE_MODE)
        # Flush to disk before the rename, so that after a power cut the new name never
        # points at missing data (the rename alone only protects against a killed process).
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, obj: object) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_marker(folder: Path) -> dict | None:
    """The marker's contents, or None if the folder was never completed (or it is corrupt)."""
    try:
        data = json.loads((Path(folder) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(folder: Path, info: dict) -> None:
    write_json_atomic(Path(folder) / MARKER_NAME, info)


def clear_marker(folder: Path) -> None:
    """Mark a folder incomplete before rewriting it, so a crash midway forces a redo."""
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / MARKER_NAME).unlink()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock, so two processes don't convert the same model at once.

    Uses flock where available; elsewhere (Windows) it degrades to no locking, which is
    still safe thanks to atomic renames, only wasteful.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sha256_file(path: Path, on_chunk: Callable[[int], object] | None = None) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks; `on_chunk(n)` reports progress."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return h.hexdigest()
