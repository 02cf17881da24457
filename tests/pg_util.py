"""A throwaway PostgreSQL cluster for the tests: `initdb` in a temporary folder, the server on a
loopback port (or a network namespace's address) and a unix socket in that folder, stopped and
removed at the end. PostgreSQL refuses to run as root, so under root (CI) the cluster belongs to
the unprivileged `postgres` user that Debian's package creates (`make setup` installs it)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} was not found: `make setup` installs Debian's postgresql package "
                           "(apt-get install -y postgresql)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PostgresCluster:
    """`prefix` runs the server's commands elsewhere (e.g. `ip netns exec NS`); `host` is the
    address it listens on."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, prefix: list[str] = ()):
        self.host = host
        self.port = port or free_port()
        self.prefix = list(prefix)
        self.root = Path(tempfile.mkdtemp(prefix="rudder-pg-"))
        self.data = self.root / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.root, "postgres")
        self._run([_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                   "-E", "UTF8", "--locale", "C"])
        if not host.startswith("127."):  # initdb trusts loopback only: also the peers on the host's own subnet
            with open(self.data / "pg_hba.conf", "a") as f:
                f.write("host all all samenet trust\n")
        self.running = False

    def _run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        run = subprocess.run([*self.prefix, *self.as_user, *args], capture_output=True, text=True, timeout=120)
        if check and run.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed:\n{run.stdout}{run.stderr}"
                               f"{self.log()[-2000:] if 'pg_ctl' in args[0] else ''}")
        return run

    def log(self) -> str:
        try:
            return (self.root / "log").read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> "PostgresCluster":
        # A throwaway cluster: no fsync (a `fast` stop's checkpoint would sync every file, for
        # seconds on a busy host), and a connection that never sends its start-up packet is dropped
        # well before pg_ctl's 60 s wait (a stop waits for such connections).
        options = (f"-p {self.port} -k {self.data} -c listen_addresses={self.host} -c max_connections=200"
                   " -c fsync=off -c authentication_timeout=10s")
        self._run([_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w",
                   "-t", "60", "start"])
        self.running = True
        return self

    def stop(self, mode: str = "fast") -> None:
        """`fast` ends every session (clients see their connections closed); `immediate` is a crash."""
        if self.running:
            self._run([_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"])
            self.running = False

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        run = subprocess.run([*self.prefix, "psql", "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1",
                              self.url(database), "-c", sql], capture_output=True, text=True, timeout=60)
        if run.returncode != 0:
            raise RuntimeError(f"psql: {run.stderr}")
        return run.stdout.strip()

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture(scope="module")
def pg_cluster():
    with PostgresCluster() as cluster:
        yield cluster


@pytest.fixture
def pg_url(pg_cluster) -> str:
    """A database of its own for the test, on the module's cluster."""
    return pg_cluster.new_database()
