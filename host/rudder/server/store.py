"""Where the registry keeps what clients uploaded and named: modules by sha256, tags with their
owners, who uploaded what. Durable: an acknowledged upload or tag survives a restart or a
`kill -9` at any moment, and several server processes on one host share one store.

`RegistryStore` is the whole interface the registry needs. `LocalStore` implements it on one
host: module bytes as files under `<state dir>/modules/`, written to a temporary file, fsynced,
renamed and the folder fsynced before the call returns; tags, owners and metadata in SQLite
(stdlib `sqlite3`, WAL mode, synchronous=FULL). `PostgresStore` (postgres_store.py, `--state-url`)
implements it for replicas on several hosts: docs/deploy.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

from .errors import APIError

__all__ = ["LocalStore", "RegistryStore", "StoreUnavailable", "TagOwned"]

_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600  # a temporary file this old belongs to no live upload (another replica's would be fresh)


class TagOwned(Exception):
    """A tag belongs to another tenant (`owner`)."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.owner = owner


class StoreUnavailable(APIError):
    """The store cannot be reached (its database is down or restarting): a 503 the client may
    retry. Requests already running do not need the store."""

    def __init__(self, message: str):
        super().__init__("unavailable", message, code="registry_unavailable", headers={"Retry-After": "1"})


class RegistryStore(Protocol):
    def put_module(self, module_id: str, wasm: bytes, tenant: str, compiled_size: int = 0) -> bool:
        """Keep the module's bytes (durably, before returning) and record that `tenant` uploaded
        it; True when this tenant had not uploaded it before."""

    def module_bytes(self, module_id: str) -> bytes | None:
        """The bytes of a stored module (checked against its sha256), or None."""

    def modules(self) -> list[dict]:
        """Every stored module: module_id, wasm_size, compiled_size, created_at, uploaded_by (tenants)."""

    def has_module(self, module_id: str) -> bool: ...

    def count_modules(self) -> int: ...

    def uploads(self, tenant: str) -> int:
        """How many stored modules `tenant` uploaded."""

    def delete_module(self, module_id: str) -> bool:
        """Remove a module no tag names (its bytes and upload records); False if absent."""

    def tag(self, tag: str) -> dict | None:
        """tag, module_id, owner, max_backtrack, created_at, updated_at, or None."""

    def tags(self) -> list[dict]: ...

    def set_tag(self, tag: str, module_id: str, owner: str, max_backtrack: int | None,
                only_if_owner: str | None) -> dict:
        """Create or move a tag, atomically. With `only_if_owner`, a tag that exists and is owned
        by someone else raises TagOwned. The tag keeps its first owner when it moves."""

    def delete_tag(self, tag: str, only_if_owner: str | None) -> bool:
        """False if absent; TagOwned as for set_tag."""

    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS modules (
    module_id TEXT PRIMARY KEY, wasm_size INTEGER NOT NULL, compiled_size INTEGER NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS uploads (
    module_id TEXT NOT NULL REFERENCES modules(module_id) ON DELETE CASCADE, tenant TEXT NOT NULL,
    uploaded_at REAL NOT NULL, PRIMARY KEY (module_id, tenant));
CREATE TABLE IF NOT EXISTS tags (
    tag TEXT PRIMARY KEY, module_id TEXT NOT NULL REFERENCES modules(module_id), owner TEXT NOT NULL,
    max_backtrack INTEGER, created_at REAL NOT NULL, updated_at REAL NOT NULL, updated_by TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS uploads_by_tenant ON uploads(tenant);
"""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """Files + SQLite under one state directory; safe for several processes on one host."""

    def __init__(self, state_dir: str | Path):
        self.root = Path(state_dir)
        self.module_dir = self.root / "modules"
        self.module_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.root / "registry.sqlite3"
        self._local = threading.local()  # one connection per thread (sqlite3 objects are not shared)
        self._conn().executescript(_SCHEMA)  # IF NOT EXISTS: replicas may race here harmlessly
        self._remove_stale_temporaries()

    # -- plumbing -------------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.db_path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # a commit is on disk before we answer 200
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    @contextlib.contextmanager
    def _db(self):
        """A write transaction (BEGIN IMMEDIATE: replicas serialise their writes here)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _path(self, module_id: str) -> Path:
        return self.module_dir / f"{module_id}.wasm"

    def _remove_stale_temporaries(self) -> None:
        """Temporary files left by a killed upload. They are never read as modules (only
        `<sha256>.wasm` names are, and only after a hash check); this only frees the space."""
        cutoff = time.time() - _STALE_TMP_S
        for p in self.module_dir.glob(_TMP_PREFIX + "*"):
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()

    # -- modules --------------------------------------------------------------------------------

    def put_module(self, module_id: str, wasm: bytes, tenant: str, compiled_size: int = 0) -> bool:
        if hashlib.sha256(wasm).hexdigest() != module_id:
            raise ValueError("module_id is not the sha256 of the bytes")
        final = self._path(module_id)
        if not self._intact(final, module_id):
            tmp = self.module_dir / f"{_TMP_PREFIX}{module_id[:16]}-{os.getpid()}-{os.urandom(4).hex()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(wasm)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, final)  # atomic: the final name never shows a partial file
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            _fsync_dir(self.module_dir)  # the rename itself is durable
        now = time.time()
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO modules VALUES (?, ?, ?, ?)", (module_id, len(wasm), compiled_size, now))
            new = db.execute("INSERT OR IGNORE INTO uploads VALUES (?, ?, ?)", (module_id, tenant, now)).rowcount
        return bool(new)

    @staticmethod
    def _intact(path: Path, module_id: str) -> bool:
        try:
            return hashlib.sha256(path.read_bytes()).hexdigest() == module_id
        except OSError:
            return False

    def module_bytes(self, module_id: str) -> bytes | None:
        if not self.has_module(module_id):
            return None  # a file without its row (killed between the two) is not a module yet
        try:
            data = self._path(module_id).read_bytes()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == module_id else None

    def has_module(self, module_id: str) -> bool:
        row = self._conn().execute("SELECT 1 FROM modules WHERE module_id = ?", (module_id,)).fetchone()
        return row is not None

    def modules(self) -> list[dict]:
        rows = self._conn().execute(
            "SELECT m.module_id, m.wasm_size, m.compiled_size, m.created_at, group_concat(u.tenant) AS tenants "
            "FROM modules m "
            "LEFT JOIN uploads u USING (module_id) GROUP BY m.module_id ORDER BY m.created_at").fetchall()
        return [{"module_id": r["module_id"], "wasm_size": r["wasm_size"], "compiled_size": r["compiled_size"],
                 "created_at": r["created_at"],
                 "uploaded_by": sorted((r["tenants"] or "").split(",")) if r["tenants"] else []} for r in rows]

    def uploads(self, tenant: str) -> int:
        return self._conn().execute("SELECT count(*) FROM uploads WHERE tenant = ?", (tenant,)).fetchone()[0]

    def count_modules(self) -> int:
        return self._conn().execute("SELECT count(*) FROM modules").fetchone()[0]

    def delete_module(self, module_id: str) -> bool:
        with self._db() as db:
            if db.execute("SELECT 1 FROM tags WHERE module_id = ?", (module_id,)).fetchone():
                raise ValueError("the module is tagged")
            gone = db.execute("DELETE FROM modules WHERE module_id = ?", (module_id,)).rowcount
        if gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(module_id))
            _fsync_dir(self.module_dir)
        return bool(gone)

    # -- tags -----------------------------------------------------------------------------------

    @staticmethod
    def _tag_dict(row) -> dict:
        return {k: row[k] for k in ("tag", "module_id", "owner", "max_backtrack", "created_at", "updated_at",
                                    "updated_by")}

    def tag(self, tag: str) -> dict | None:
        row = self._conn().execute("SELECT * FROM tags WHERE tag = ?", (tag,)).fetchone()
        return None if row is None else self._tag_dict(row)

    def tags(self) -> list[dict]:
        return [self._tag_dict(r) for r in self._conn().execute("SELECT * FROM tags ORDER BY tag").fetchall()]

    def set_tag(self, tag: str, module_id: str, owner: str, max_backtrack: int | None,
                only_if_owner: str | None) -> dict:
        now = time.time()
        with self._db() as db:
            if not db.execute("SELECT 1 FROM modules WHERE module_id = ?", (module_id,)).fetchone():
                raise KeyError(module_id)
            row = db.execute("SELECT owner, created_at FROM tags WHERE tag = ?", (tag,)).fetchone()
            if row is not None and only_if_owner is not None and row["owner"] != only_if_owner:
                raise TagOwned(row["owner"])
            first_owner = row["owner"] if row is not None else owner
            created = row["created_at"] if row is not None else now
            db.execute("INSERT OR REPLACE INTO tags VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (tag, module_id, first_owner, max_backtrack, created, now, owner))
        return self.tag(tag)

    def delete_tag(self, tag: str, only_if_owner: str | None) -> bool:
        with self._db() as db:
            row = db.execute("SELECT owner FROM tags WHERE tag = ?", (tag,)).fetchone()
            if row is None:
                return False
            if only_if_owner is not None and row["owner"] != only_if_owner:
                raise TagOwned(row["owner"])
            db.execute("DELETE FROM tags WHERE tag = ?", (tag,))
        return True

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
