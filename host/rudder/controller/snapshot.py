"""Copying an instance's state: the post-init snapshot every request starts from, and forks.

The state of a controller is its linear memory plus its exported mutable globals (a C
guest's stack pointer is not exported, but it is back at its initial value whenever no
call is running, which is the only time we copy).

Fresh guest memory is the module's data image followed by zeros, and writing a page that
was never touched costs a page fault, far more than copying it. So a snapshot keeps
only the 4 KiB pages that differ from a fresh instance, and a fork copies eagerly only the
part of memory that is kept resident between instances (see engines.py) and, past it, only
the 64 KiB chunks that are not all zero.

A snapshot's bytes live in an anonymous mmap of their own, never in the malloc heap: snapshots
are large (a module whose init dirtied 8 MiB keeps 8 MiB) and come and go with the snapshot
cache, and glibc, whose mmap threshold rises to 32 MiB once a large block is freed, would put
them in its arenas, where freed ones became holes that kept the server's RSS growing
(benchmarks/soak.py saw it: benchmarks/RESULTS.md). For the same reason a
snapshot is diffed chunk by chunk, with small temporaries, not with copies of the whole memory.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np

from .instance import Instance

__all__ = ["Snapshot", "take_snapshot", "restore_snapshot", "clone_state", "outside_heap"]

PAGE = 4096
CHUNK = 65536
DIFF_CHUNK = 1 << 20  # bytes of memory compared at a time when taking a snapshot


@dataclass(frozen=True, eq=False)  # eq=False: `data` is an array; a snapshot is equal to itself only
class Snapshot:
    size: int                        # linear memory size in bytes
    runs: tuple[tuple[int, int], ...]  # (offset, length) that differ from a fresh instance, in order
    data: np.ndarray                 # the runs' bytes, one after another (over an anonymous mmap)
    globals: tuple[bytes, ...]       # raw wasmtime_val_t of each exported mutable global
    image_size: int                  # memory size of a fresh instance (its data image)

    @property
    def stored_bytes(self) -> int:
        return int(self.data.size)


def outside_heap(nbytes: int) -> np.ndarray:
    """`nbytes` of writable memory in an anonymous private mmap of its own, unmapped when the
    last view of it goes (so freeing it gives the pages back to the OS at once)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=np.uint8)


def _runs(changed: np.ndarray, unit: int) -> list[tuple[int, int]]:
    """Coalesce a boolean per-unit array into (start byte, end byte) runs."""
    idx = np.flatnonzero(changed)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate(([idx[0]], idx[breaks + 1]))
    ends = np.concatenate((idx[breaks], [idx[-1]])) + 1
    return [(int(s) * unit, int(e) * unit) for s, e in zip(starts, ends)]


def _changed_pages(mem: np.ndarray, ref: np.ndarray, size: int) -> np.ndarray:
    """Per 4 KiB page of `mem[:size]`: whether it differs from `ref` (a fresh instance's
    memory; zeros past its end). Compared DIFF_CHUNK bytes at a time (small temporaries)."""
    changed = np.zeros(size // PAGE, dtype=bool)
    for start in range(0, size, DIFF_CHUNK):
        end = min(size, start + DIFF_CHUNK)
        pages = slice(start // PAGE, end // PAGE)
        words = mem[start:end].view(np.uint64).reshape(-1, PAGE // 8)
        ref_end = min(end, ref.size)
        if ref_end <= start:
            changed[pages] = words.any(axis=1)
            continue
        if ref_end == end:
            fresh = ref[start:end]
        else:
            fresh = np.zeros(end - start, dtype=np.uint8)
            fresh[:ref_end - start] = ref[start:ref_end]
        changed[pages] = (words != fresh.view(np.uint64).reshape(-1, PAGE // 8)).any(axis=1)
    return changed


def take_snapshot(inst: Instance, fresh: Instance) -> Snapshot:
    """Snapshot `inst` as differences from `fresh`, a new instance of the same module."""
    inst.check_growth()  # calls don't update the size (see Instance.call_func)
    size = inst.size
    mem = inst.u8
    spans = _runs(_changed_pages(mem, fresh.u8[:min(fresh.size, size)], size), PAGE)
    data = outside_heap(sum(e - s for s, e in spans))
    runs, pos = [], 0
    for s, e in spans:
        data[pos:pos + e - s] = mem[s:e]
        runs.append((s, e - s))
        pos += e - s
    return Snapshot(size, tuple(runs), data, tuple(inst.get_globals()), fresh.size)


def restore_snapshot(inst: Instance, snap: Snapshot) -> None:
    """Make a fresh instance's state equal to the snapshot."""
    inst.grow_to(snap.size)
    base = inst.base
    src = snap.data.ctypes.data if snap.data.size else 0
    pos = 0
    for offset, length in snap.runs:
        ctypes.memmove(base + offset, src + pos, length)
        pos += length
    if snap.globals:
        inst.set_globals(list(snap.globals))


def clone_state(src: Instance, dst: Instance, eager_bytes: int) -> None:
    """Copy `src`'s memory and globals into `dst`, a fresh instance of the same module.

    The first `eager_bytes` (at least the data image) are copied whole; past them `dst` is
    all zeros, so only non-zero chunks need copying."""
    src.check_growth()  # calls don't update the size (see Instance.call_func)
    size = src.size
    dst.grow_to(size)
    head = min(size, max(eager_bytes, dst_image_size(dst)))
    ctypes.memmove(dst.base, src.base, head)
    if size > head:
        tail = src.u8[head:size]
        nonzero = tail.view(np.uint64).reshape(-1, CHUNK // 8).any(axis=1)
        for s, e in _runs(nonzero, CHUNK):
            ctypes.memmove(dst.base + head + s, src.base + head + s, e - s)
    if src.globals:
        dst.set_globals(src.get_globals())


def dst_image_size(inst: Instance) -> int:
    """Bytes of a fresh instance's memory that may be non-zero (its data image)."""
    snap = inst.cmod.snapshot
    return snap.image_size if snap is not None else inst.size
