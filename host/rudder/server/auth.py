"""API keys, roles and tenants.

Each key belongs to a tenant and has a role: `admin` (may move or delete any tag, remove unused
modules) or `user`. Keys come from `--api-key KEY` (repeatable; admins of tenant "default"),
`RUDDER_API_KEY` (the same), `--api-keys-file`, one `KEY ROLE TENANT` per line, and with
`--state-url` the database (`rudder keys add/list/revoke`), reloaded whenever any replica changes
them. With keys,
every `/v1/*` route (and `/metrics`, unless `--public-metrics`) needs `Authorization: Bearer KEY`
(or `api-key: KEY`, as Azure's and AICI's clients send); a missing or wrong key is a 401. Without
keys every request is the one admin tenant "anonymous" (the server says so at start-up).

Keys are compared as sha256 digests with `hmac.compare_digest`, against every configured key
(no early exit), and are never logged. Once a server has had a key it requires one for good: the
database's last key revoked leaves every key refused, not the server open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ANONYMOUS", "AuthMiddleware", "KeyRing", "Principal", "ROLES"]

ROLES = ("admin", "user")
log = logging.getLogger("rudder.server")


@dataclass(frozen=True)
class Principal:
    """Who is asking: a tenant and its role."""

    tenant: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


ANONYMOUS = Principal("anonymous", "admin")  # a server without keys: as before keys existed


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    def __init__(self, entries: list[tuple[str, str, str]] = ()):
        """`entries`: (key, role, tenant)."""
        self._entries = []
        for key, role, tenant in entries:
            if role not in ROLES:
                raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
            if not key or not tenant:
                raise ValueError("a key and a tenant must not be empty")
            self._entries.append((digest(key), Principal(tenant, role)))
        self._stored: tuple = ()  # the database's keys, replaced whole on every change
        self._required = bool(self._entries)

    def use_stored(self, keys: list[tuple[bytes, str, str]]) -> None:
        """The database's active keys: (sha256 digest, role, tenant)."""
        self._stored = tuple((d, Principal(tenant, role)) for d, role, tenant in keys)
        if self._stored and not self._required:
            self._required = True
            log.info("API keys in the database: /v1 routes need one from now on")

    def __bool__(self) -> bool:
        return self._required

    def __len__(self) -> int:
        return len(self._entries) + len(self._stored)

    @classmethod
    def from_sources(cls, keys: list[str] = (), keys_file: str | Path | None = None) -> "KeyRing":
        """`--api-key`/`RUDDER_API_KEY` keys (admins of tenant "default") and a keys file."""
        entries = [(k, "admin", "default") for k in keys if k]
        if keys_file is not None:
            entries += read_keys_file(keys_file)
        return cls(entries)

    def check(self, presented: str | None) -> Principal | None:
        """The principal of a presented key, or None. Constant time in the key's content."""
        if not presented:
            return None
        wanted = digest(presented)
        found = None
        for stored, principal in (*self._entries, *self._stored):  # every entry, whatever matched earlier
            if hmac.compare_digest(stored, wanted):
                found = principal
        return found


def read_keys_file(path: str | Path) -> list[tuple[str, str, str]]:
    """`KEY ROLE TENANT` per line; blank lines and `#` comments skipped. A bad line is a
    ValueError naming the file and line (never the key)."""
    entries = []
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror or e}") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"{path}:{number}: expected KEY ROLE TENANT")
        key, role, tenant = parts
        if role not in ROLES:
            raise ValueError(f"{path}:{number}: role must be one of {', '.join(ROLES)}, not {role!r}")
        entries.append((key, role, tenant))
    if not entries:
        raise ValueError(f"{path}: no keys")
    return entries


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"api-key" and value:
            return value.decode("latin-1").strip()
    return None


class AuthMiddleware:
    """Plain ASGI: checks the key of every protected path before the app sees the request and
    puts the Principal in `scope["state"]["principal"]` (request.state.principal)."""

    def __init__(self, app, keys: KeyRing, public_metrics: bool = False):
        self.app = app
        self.keys = keys
        self.public_metrics = public_metrics

    def protected(self, path: str) -> bool:
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return path == "/metrics" and not self.public_metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        principal = ANONYMOUS
        if self.keys and self.protected(scope["path"]):
            key = presented_key(scope["headers"])
            principal = self.keys.check(key)
            if principal is None:
                message = ("this server needs an API key: send Authorization: Bearer KEY" if key is None
                           else "the API key is not valid")
                body = json.dumps({"error": {"message": message, "type": "unauthorized", "param": None,
                                             "code": "invalid_api_key"}}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        scope.setdefault("state", {})["principal"] = principal
        return await self.app(scope, receive, send)
