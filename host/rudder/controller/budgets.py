"""The sandbox's memory budgets, server-wide: guest memory of live instances, and the post-init
snapshots kept for loaded modules. Both are counted in bytes, not in numbers of things, since
one module or one instance can be a few KiB or many MiB."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict, deque

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
    dirtied much memory cost init time, never unbounded memory.

    Modules are held weakly: a module that nothing else keeps (the registry's and the runtime's
    bounded LRUs, a running request) is dropped, compiled code and snapshot together. Held
    strongly, a module whose snapshot was small stayed for as long as the budget had room, and
    one whose snapshot was empty (an init that writes nothing) for good: every distinct module
    ever loaded, each with its compiled code and its mappings."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._bytes = 0
        # key -> (weak reference to the module, its snapshot's bytes); a key is never reused
        self._lru: "OrderedDict[int, tuple[weakref.ref, int]]" = OrderedDict()
        self._keys = itertools.count()
        self._dead: deque = deque()  # keys of modules collected since, counted out under the lock
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        with self._lock:
            self._reap()
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            self._reap()
            return len(self._lru)

    def used(self, cmod) -> None:
        with self._lock:
            self._reap()
            key = getattr(cmod, "snapshot_key", None)
            if key in self._lru:
                self._lru.move_to_end(key)

    def add(self, cmod, snap) -> None:
        """Keep `snap` as `cmod`'s snapshot, dropping older ones while over budget (never the
        newest: a snapshot larger than the budget still serves the request that made it)."""
        with self._lock:
            self._reap()
            self._forget_locked(cmod)
            key = next(self._keys)
            cmod.snapshot, cmod.snapshot_key = snap, key
            dead = self._dead  # (the callback must not hold the cache)
            self._lru[key] = (weakref.ref(cmod, lambda _, key=key: dead.append(key)), snap.stored_bytes)
            self._bytes += snap.stored_bytes
            while self._bytes > self.budget and len(self._lru) > 1:
                _, (ref, nbytes) = self._lru.popitem(last=False)
                self._bytes -= nbytes
                old = ref()
                if old is not None:
                    old.snapshot = None  # its pages go back to the OS with it (snapshot.py)

    def forget(self, cmod) -> None:
        with self._lock:
            self._forget_locked(cmod)

    def _forget_locked(self, cmod) -> None:
        entry = self._lru.pop(getattr(cmod, "snapshot_key", None), None)
        if entry is not None:
            self._bytes -= entry[1]

    def _reap(self) -> None:
        """Count out the snapshots of modules collected since (the lock is held)."""
        while self._dead:
            entry = self._lru.pop(self._dead.popleft(), None)
            if entry is not None:
                self._bytes -= entry[1]
