"""Copying an instance's state: the post-init snapshot every request starts from, and forks.

The state of a controller is its linear memory plus its exported mutable globals (a C
guest's stack pointer is not exported, but it is back at its initial value whenever no
call is running, which is the only time we copy).

Fresh guest memory is the module's data image followed by zeros, and writing a page that
was never touched costs a page fault (~2 us), far more than copying it. So a snapshot keeps
only the 4 KiB pages that differ from a fresh instance, and a fork copies eagerly only the
part of memory that is kept resident between instances (see runtime.py) and, past it, only
the 64 KiB chunks that are not all zero.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .instance import Instance

__all__ = ["Snapshot", "take_snapshot", "restore_snapshot", "clone_state"]

PAGE = 4096
CHUNK = 65536


@dataclass(frozen=True)
class Snapshot:
    size: int                        # linear memory size in bytes
    runs: tuple[tuple[int, bytes], ...]  # (offset, bytes) that differ from a fresh instance
    globals: tuple[bytes, ...]       # raw wasmtime_val_t of each exported mutable global
    image_size: int                  # memory size of a fresh instance (its data image)

    @property
    def stored_bytes(self) -> int:
        return sum(len(b) for _, b in self.runs)


def _runs(changed: np.ndarray, unit: int) -> list[tuple[int, int]]:
    """Coalesce a boolean per-unit array into (start byte, end byte) runs."""
    idx = np.flatnonzero(changed)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate(([idx[0]], idx[breaks + 1]))
    ends = np.concatenate((idx[breaks], [idx[-1]])) + 1
    return [(int(s) * unit, int(e) * unit) for s, e in zip(starts, ends)]


def take_snapshot(inst: Instance, fresh: Instance) -> Snapshot:
    """Snapshot `inst` as differences from `fresh`, a new instance of the same module."""
    inst.check_growth()  # calls don't update the size (see Instance.call_func)
    size = inst.size
    ref = np.zeros(size, dtype=np.uint8)
    ref[:fresh.size] = fresh.u8[:min(fresh.size, size)]
    mem = inst.u8
    changed = (mem.reshape(-1, PAGE) != ref.reshape(-1, PAGE)).any(axis=1)
    runs = tuple((s, mem[s:e].tobytes()) for s, e in _runs(changed, PAGE))
    return Snapshot(size, runs, tuple(inst.get_globals()), fresh.size)


def restore_snapshot(inst: Instance, snap: Snapshot) -> None:
    """Make a fresh instance's state equal to the snapshot."""
    inst.grow_to(snap.size)
    base = inst.base
    for offset, data in snap.runs:
        ctypes.memmove(base + offset, data, len(data))
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
