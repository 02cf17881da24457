"""The sandbox's memory budgets, server-wide: guest memory of live instances, and the post-init
snapshots kept for loaded modules. Both are counted in bytes, not in numbers of things, since
one module or one instance can be a few KiB or many MiB."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict

from .errors import ControllerError

__all__ = ["GuestMemory", "SnapshotCache"]


class GuestMemory:
    """Linear memory of every live instance (requests, forks, a module being initialised),
    against a budget. A new instance is admitted only if what it starts with fits (`admit`);
    an instance that grows past the budget during a call fails its own request (the host
    checks after each call); memory is given back when an instance's store is freed."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def admit(self, nbytes: int, what: str) -> None:
        """Raise ControllerError(limit, busy=True) if `nbytes` more would not fit now."""
        with self._lock:
            if self.used + nbytes > self.budget:
                raise ControllerError(
                    "limit", f"cannot {what}: the server's guest memory budget of {self.budget >> 20} MiB is in "
                    f"use ({self.used >> 20} MiB live, {max(1, nbytes >> 20)} MiB needed); retry later", busy=True)

    def add(self, delta: int) -> bool:
        """Count `delta` more bytes (negative: fewer); False when that leaves the budget exceeded."""
        with self._lock:
            self.used += delta
            self.peak = max(self.peak, self.used)
            return self.used <= self.budget


class SnapshotCache:
    """Post-init snapshots of loaded modules, bounded by their bytes, least recently used first
    out. A module whose snapshot was dropped runs rudder_init again on its next start (init is
    deterministic, so the snapshot comes back the same): many uploaded modules whose init
    dirtied much memory cost init time, never unbounded memory."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.bytes = 0
        self._lru: "OrderedDict[int, object]" = OrderedDict()  # id(cmod) -> cmod holding a snapshot
        self._lock = threading.Lock()

    def used(self, cmod) -> None:
        with self._lock:
            if id(cmod) in self._lru:
                self._lru.move_to_end(id(cmod))

    def add(self, cmod, snap) -> None:
        """Keep `snap` as `cmod`'s snapshot, dropping older ones while over budget (never the
        newest: a snapshot larger than the budget still serves the request that made it)."""
        with self._lock:
            cmod.snapshot = snap
            self._lru[id(cmod)] = cmod
            self.bytes += snap.stored_bytes
            dropped = 0
            while self.bytes > self.budget and len(self._lru) > 1:
                _, old = self._lru.popitem(last=False)
                self.bytes -= old.snapshot.stored_bytes
                dropped += old.snapshot.stored_bytes
                old.snapshot = None
        if dropped >= 1 << 20:
            _give_back_free_heap()

    def forget(self, cmod) -> None:
        with self._lock:
            if self._lru.pop(id(cmod), None) is not None:
                self.bytes -= cmod.snapshot.stored_bytes


_libc = None


def _give_back_free_heap() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim). Snapshots are large buffers;
    after many come and go, glibc's raised mmap threshold leaves them in the heap, and the
    freed space would stay in RSS for good. A no-op where there is no glibc."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else False
    if _libc:
        _libc.malloc_trim(0)
