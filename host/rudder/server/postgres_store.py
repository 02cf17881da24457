"""The registry on PostgreSQL, shared by replicas on any number of hosts (`rudder serve
--state-url postgresql://...`): modules (their bytes in the database, content-addressed), who
uploaded them, tags with compare-and-set ownership, and the API keys (`rudder keys`).

Durable as PostgreSQL's commit is: every write is one transaction, committed before the call
returns, so an acknowledged upload, tag or key survives a replica's SIGKILL or a database
restart. The schema is created and migrated on start (`rudder_schema` holds its version) under
an advisory lock, so replicas starting together migrate once.

Replicas learn of changes by LISTEN/NOTIFY on one channel: a tag move or deletion clears every
replica's tag cache, a key change reloads every replica's keys, within a round trip. Requests
read tags from that cache, not from the database. While a replica's listening connection is
down its cache is not trusted (tags are read from the database), and a registry call that
cannot reach the database raises `StoreUnavailable` (a 503); running requests never touch the
database and go on streaming.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from typing import Callable

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from .auth import digest as key_digest
from .store import StoreUnavailable, TagOwned

__all__ = ["PostgresStore", "SCHEMA_VERSION"]

log = logging.getLogger("rudder.server")
# The pool warns at every failed reconnection; the listener says once when the database goes
# and once when it is back.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

CHANNEL = "rudder_registry"
MIGRATION_LOCK = 0x72756464  # the advisory lock replicas take to migrate one at a time
# How long a registry call waits for the database before its 503: short, so that a client
# retrying elsewhere is not held up; the pool reconnects in the background meanwhile.
CONNECT_TIMEOUT_S = 3
DOWN_TIMEOUT_S = 0.1  # the wait while the listener finds the database gone: 503s come at once
TAG_CACHE_MAX = 4096  # names cached at most (any request may name any tag)

# Each entry moves the schema one version on; a database is at version len(MIGRATIONS) once migrated.
MIGRATIONS = [
    """
    CREATE TABLE modules (
        module_id text PRIMARY KEY, wasm bytea NOT NULL, wasm_size integer NOT NULL,
        compiled_size integer NOT NULL, created_at double precision NOT NULL);
    -- Module bytes are already compressed code: stored out of line as they are.
    ALTER TABLE modules ALTER COLUMN wasm SET STORAGE EXTERNAL;
    CREATE TABLE uploads (
        module_id text NOT NULL REFERENCES modules ON DELETE CASCADE, tenant text NOT NULL,
        uploaded_at double precision NOT NULL, PRIMARY KEY (module_id, tenant));
    CREATE INDEX uploads_by_tenant ON uploads (tenant);
    CREATE TABLE tags (
        tag text PRIMARY KEY, module_id text NOT NULL REFERENCES modules, owner text NOT NULL,
        max_backtrack integer, created_at double precision NOT NULL, updated_at double precision NOT NULL,
        updated_by text NOT NULL);
    CREATE INDEX tags_by_module ON tags (module_id);
    """,
    """
    CREATE TABLE api_keys (
        key_id text PRIMARY KEY, digest bytea NOT NULL UNIQUE,
        role text NOT NULL CHECK (role IN ('admin', 'user')), tenant text NOT NULL,
        name text NOT NULL DEFAULT '', created_at double precision NOT NULL, revoked_at double precision);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
_TAG_COLUMNS = "tag, module_id, owner, max_backtrack, created_at, updated_at, updated_by"


def _connect_kwargs() -> dict:
    # TCP keepalives: a database host that vanishes without closing the connection is noticed
    # within seconds, not at the kernel's two-hour default.
    return {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
            "keepalives_count": 2, "application_name": "rudder"}


def redact(url: str) -> str:
    """The URL without its password (for logs and messages)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://..."
    host, port, db = info.get("host", ""), info.get("port", ""), info.get("dbname", "")
    user = info.get("user")
    return f"postgresql://{user + '@' if user else ''}{host}{':' + port if port else ''}/{db}"


def _unavailable(e: BaseException) -> StoreUnavailable:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return StoreUnavailable(f"the registry's database is unavailable ({first}); retry in a moment")


class PostgresStore:
    """`RegistryStore` on PostgreSQL (see the module's docstring)."""

    def __init__(self, url: str, max_connections: int = 8, listen: bool = True):
        self.url = url
        self.where = redact(url)
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as e:
            raise ValueError(f"--state-url: not a PostgreSQL URL ({e})") from None
        self.max_connections = max_connections
        self.pool = self._new_pool()
        self._tags: dict[str, dict | None] = {}
        self._generation = 0  # bumped by every change a notification announces
        self._cache_lock = threading.Lock()
        self._listening = False  # the cache may be trusted only while notifications arrive
        self._down = False  # the listener lost the database and has not reached it again
        self._on_keys: list[Callable[[list[tuple[bytes, str, str]]], None]] = []
        self._stop = threading.Event()
        try:
            self._migrate()
        except BaseException:
            self.pool.close()
            raise
        self._listener = None
        if listen:
            self._listener = threading.Thread(target=self._listen, daemon=True, name="rudder-registry-listen")
            self._listener.start()

    # -- plumbing -------------------------------------------------------------------------------

    def _new_pool(self) -> ConnectionPool:
        pool = ConnectionPool(self.url, min_size=1, max_size=self.max_connections,
                              kwargs={"autocommit": True, **_connect_kwargs()}, check=ConnectionPool.check_connection,
                              timeout=CONNECT_TIMEOUT_S, open=False, name="rudder-registry")
        pool.open(wait=False)
        return pool

    @contextlib.contextmanager
    def _conn(self):
        """A pooled connection; losing the database is `StoreUnavailable`."""
        try:
            with self.pool.connection(timeout=DOWN_TIMEOUT_S if self._down else CONNECT_TIMEOUT_S) as conn:
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            raise _unavailable(e) from None

    def _migrate(self) -> None:
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS rudder_schema (version integer NOT NULL)")
            row = conn.execute("SELECT version FROM rudder_schema").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise ValueError(f"the database {self.where} has rudder's schema version {version}; this rudder "
                                 f"knows versions up to {SCHEMA_VERSION} (upgrade rudder)")
            for number in range(version, SCHEMA_VERSION):
                conn.execute(MIGRATIONS[number])
            if row is None:
                conn.execute("INSERT INTO rudder_schema VALUES (%s)", (SCHEMA_VERSION,))
            elif version != SCHEMA_VERSION:
                conn.execute("UPDATE rudder_schema SET version = %s", (SCHEMA_VERSION,))
            if version != SCHEMA_VERSION:
                log.info("registry database %s: schema version %d -> %d", self.where, version, SCHEMA_VERSION)

    @staticmethod
    def _notify(conn, what: str) -> None:
        """Sent on commit of the surrounding transaction, to every listening replica."""
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, what))

    # -- notifications --------------------------------------------------------------------------

    def _listen(self) -> None:
        down_since = None
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, **_connect_kwargs()) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if down_since is not None:
                        # A new pool connects now; the old one would wait out its reconnection backoff.
                        old, self.pool = self.pool, self._new_pool()
                        old.close(timeout=0)
                    self._down = False
                    self._changed(keys=True)  # whatever happened while we were not listening
                    self._listening = True
                    if down_since is not None:
                        log.warning("registry database %s is back after %.1f s", self.where,
                                    time.monotonic() - down_since)
                        down_since = None
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._changed(keys=note.payload == "keys")
            except (psycopg.Error, StoreUnavailable) as e:
                if self._stop.is_set():
                    return
                self._down = True
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("registry database %s unreachable: %s (registry calls answer 503 until it is back; "
                                "running requests go on)", self.where, (str(e).strip().splitlines() or [""])[0])
            self._listening = False
            self._changed(keys=False)
            self._stop.wait(0.5)

    def _changed(self, keys: bool) -> None:
        with self._cache_lock:
            self._generation += 1
            self._tags.clear()
        if keys and self._on_keys:
            active = self.active_keys()
            for callback in self._on_keys:
                callback(active)

    def watch_keys(self, callback: Callable[[list[tuple[bytes, str, str]]], None]) -> None:
        """Call `callback(active keys)` now and whenever the keys change on any replica."""
        self._on_keys.append(callback)
        callback(self.active_keys())

    # -- modules --------------------------------------------------------------------------------

    def put_module(self, module_id: str, wasm: bytes, tenant: str, compiled_size: int = 0) -> bool:
        if hashlib.sha256(wasm).hexdigest() != module_id:
            raise ValueError("module_id is not the sha256 of the bytes")
        now = time.time()
        with self._conn() as conn, conn.transaction():
            if conn.execute("SELECT 1 FROM modules WHERE module_id = %s", (module_id,)).fetchone() is None:
                conn.execute("INSERT INTO modules VALUES (%s, %b, %s, %s, %s) ON CONFLICT DO NOTHING",
                             (module_id, wasm, len(wasm), compiled_size, now))
            new = conn.execute("INSERT INTO uploads VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                               (module_id, tenant, now)).rowcount
        return bool(new)

    def module_bytes(self, module_id: str) -> bytes | None:
        with self._conn() as conn:
            row = conn.execute("SELECT wasm FROM modules WHERE module_id = %s", (module_id,), binary=True).fetchone()
        if row is None:
            return None
        data = bytes(row[0])
        return data if hashlib.sha256(data).hexdigest() == module_id else None

    def has_module(self, module_id: str) -> bool:
        with self._conn() as conn:
            return conn.execute("SELECT 1 FROM modules WHERE module_id = %s", (module_id,)).fetchone() is not None

    def modules(self) -> list[dict]:
        with self._conn() as conn:
            rows = conn.cursor(row_factory=dict_row).execute(
                "SELECT m.module_id, m.wasm_size, m.compiled_size, m.created_at, "
                "coalesce(array_agg(u.tenant ORDER BY u.tenant) FILTER (WHERE u.tenant IS NOT NULL), '{}') AS tenants "
                "FROM modules m LEFT JOIN uploads u USING (module_id) GROUP BY m.module_id "
                "ORDER BY m.created_at").fetchall()
        return [{"module_id": r["module_id"], "wasm_size": r["wasm_size"], "compiled_size": r["compiled_size"],
                 "created_at": r["created_at"], "uploaded_by": list(r["tenants"])} for r in rows]

    def uploads(self, tenant: str) -> int:
        with self._conn() as conn:
            return conn.execute("SELECT count(*) FROM uploads WHERE tenant = %s", (tenant,)).fetchone()[0]

    def count_modules(self) -> int:
        with self._conn() as conn:
            return conn.execute("SELECT count(*) FROM modules").fetchone()[0]

    def delete_module(self, module_id: str) -> bool:
        try:
            with self._conn() as conn, conn.transaction():
                # The tags' foreign key refuses it when a tag names the module, even one another
                # replica has just committed.
                return conn.execute("DELETE FROM modules WHERE module_id = %s", (module_id,)).rowcount > 0
        except pg_errors.ForeignKeyViolation:
            raise ValueError("the module is tagged") from None

    # -- tags -----------------------------------------------------------------------------------

    def tag(self, tag: str) -> dict | None:
        with self._cache_lock:
            if self._listening and tag in self._tags:
                return self._tags[tag]
            generation = self._generation
        with self._conn() as conn:
            row = conn.cursor(row_factory=dict_row).execute(
                f"SELECT {_TAG_COLUMNS} FROM tags WHERE tag = %s", (tag,)).fetchone()
        with self._cache_lock:
            # Kept only if no change was announced meanwhile (the row read may predate it).
            if self._listening and generation == self._generation:
                if len(self._tags) >= TAG_CACHE_MAX:
                    self._tags.clear()
                self._tags[tag] = row
        return row

    def tags(self) -> list[dict]:
        with self._conn() as conn:
            return conn.cursor(row_factory=dict_row).execute(f"SELECT {_TAG_COLUMNS} FROM tags ORDER BY tag").fetchall()

    def set_tag(self, tag: str, module_id: str, owner: str, max_backtrack: int | None,
                only_if_owner: str | None) -> dict:
        now = time.time()
        try:
            with self._conn() as conn, conn.transaction():
                # One statement: the row is locked from the conflict to the update, so two
                # replicas cannot both pass the ownership check.
                row = conn.cursor(row_factory=dict_row).execute(
                    f"INSERT INTO tags ({_TAG_COLUMNS}) VALUES (%(tag)s, %(module)s, %(owner)s, %(bt)s, %(now)s, "
                    "%(now)s, %(owner)s) ON CONFLICT (tag) DO UPDATE SET module_id = EXCLUDED.module_id, "
                    "max_backtrack = EXCLUDED.max_backtrack, updated_at = EXCLUDED.updated_at, "
                    "updated_by = EXCLUDED.updated_by WHERE %(only)s::text IS NULL OR tags.owner = %(only)s::text "
                    f"RETURNING {_TAG_COLUMNS}",
                    {"tag": tag, "module": module_id, "owner": owner, "bt": max_backtrack, "now": now,
                     "only": only_if_owner}).fetchone()
                if row is None:
                    current = conn.execute("SELECT owner FROM tags WHERE tag = %s", (tag,)).fetchone()
                    raise TagOwned(current[0])
                self._notify(conn, "tags")
        except pg_errors.ForeignKeyViolation:
            raise KeyError(module_id) from None
        self._changed(keys=False)  # this replica at once, without waiting for its own notification
        return row

    def delete_tag(self, tag: str, only_if_owner: str | None) -> bool:
        with self._conn() as conn, conn.transaction():
            row = conn.execute("SELECT owner FROM tags WHERE tag = %s FOR UPDATE", (tag,)).fetchone()
            if row is None:
                return False
            if only_if_owner is not None and row[0] != only_if_owner:
                raise TagOwned(row[0])
            conn.execute("DELETE FROM tags WHERE tag = %s", (tag,))
            self._notify(conn, "tags")
        self._changed(keys=False)
        return True

    # -- API keys ---------------------------------------------------------------------------------

    def add_key(self, key: str, role: str, tenant: str, name: str = "") -> str:
        """Store a key's sha256 (never the key) with its role and tenant; returns its id."""
        digest = key_digest(key)
        key_id = digest.hex()[:12]
        try:
            with self._conn() as conn, conn.transaction():
                conn.execute("INSERT INTO api_keys VALUES (%s, %s, %s, %s, %s, %s, NULL)",
                             (key_id, digest, role, tenant, name, time.time()))
                self._notify(conn, "keys")
        except pg_errors.UniqueViolation:
            raise ValueError("that key is already stored") from None
        except pg_errors.CheckViolation:
            raise ValueError(f"role must be admin or user, not {role!r}") from None
        return key_id

    def keys(self) -> list[dict]:
        with self._conn() as conn:
            return conn.cursor(row_factory=dict_row).execute(
                "SELECT key_id, role, tenant, name, created_at, revoked_at FROM api_keys ORDER BY created_at").fetchall()

    def revoke_key(self, key_id: str) -> bool:
        """Revoke by id; False if it was revoked already; KeyError if there is no such key."""
        with self._conn() as conn, conn.transaction():
            row = conn.execute("SELECT revoked_at FROM api_keys WHERE key_id = %s FOR UPDATE", (key_id,)).fetchone()
            if row is None:
                raise KeyError(key_id)
            if row[0] is not None:
                return False
            conn.execute("UPDATE api_keys SET revoked_at = %s WHERE key_id = %s", (time.time(), key_id))
            self._notify(conn, "keys")
        return True

    def active_keys(self) -> list[tuple[bytes, str, str]]:
        """(sha256 digest, role, tenant) of every key not revoked."""
        with self._conn() as conn:
            rows = conn.execute("SELECT digest, role, tenant FROM api_keys WHERE revoked_at IS NULL").fetchall()
        return [(bytes(d), role, tenant) for d, role, tenant in rows]

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
        self.pool.close()
