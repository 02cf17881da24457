"""The registry on PostgreSQL (`PostgresStore`, `rudder serve --state-url`), against a real
PostgreSQL cluster started for these tests (tests/pg_util.py): the store's contract on both
stores; schema versions and migration; tag moves and key revocations reaching other replicas by
notification; the database going away (503s, running requests unharmed) and coming back;
replicas sharing uploads, tags and keys; two replicas racing for tags; SIGKILL during uploads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import re
import threading
import time
from typing import Callable

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from pg_util import pg_cluster, pg_url  # noqa: F401 (fixtures)
from zygote import run_cli
from rudder.cli import app
from rudder.server.auth import KeyRing
from rudder.server.postgres_store import MIGRATIONS, SCHEMA_VERSION, PostgresStore
from rudder.server.store import LocalStore, StoreUnavailable, TagOwned
from serve_util import ServeProcess, sse_events
from controller_wat import busy_wat, wasm_of
from test_auth_registry import _uploads_killed_at_random, module


def eventually(check, timeout: float = 30.0, what: str | Callable[[], str] = "the condition"):
    """Poll `check()` until it is truthy (its value) or fail after `timeout` (generous: a loaded
    machine; what these tests assert is that it happens, not how fast). `what` names the
    condition in the failure; a callable is asked then, to tell the state at that moment."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what() if callable(what) else what} did not happen within {timeout:g} s"
        time.sleep(0.05)


def blob(i: int, size: int = 1000) -> tuple[str, bytes]:
    data = (f"module {i} ".encode() * (size // 8 + 1))[:size]
    return hashlib.sha256(data).hexdigest(), data


# -- the store's contract, on both stores ---------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgres"])
def stores(request, tmp_path):
    """Two handles on one store, as two replicas hold them."""
    if request.param == "sqlite":
        def make():
            return LocalStore(tmp_path)
    else:
        url = request.getfixturevalue("pg_url")

        def make():
            return PostgresStore(url)
    a, b = make(), make()
    yield a, b
    a.close()
    b.close()


def test_modules_round_trip(stores):
    a, b = stores
    mid, data = blob(1)
    with pytest.raises(ValueError, match="sha256"):
        a.put_module(mid, data + b"x", "t1")
    assert a.put_module(mid, data, "t1", compiled_size=7) is True
    assert a.put_module(mid, data, "t1") is False and b.put_module(mid, data, "t2") is True  # content-addressed
    assert b.module_bytes(mid) == data and b.has_module(mid) and b.module_bytes("0" * 64) is None
    big = os.urandom(16 << 20)  # the size of a Python or JavaScript component
    big_id = hashlib.sha256(big).hexdigest()
    a.put_module(big_id, big, "t1")
    assert b.module_bytes(big_id) == big
    listed = {m["module_id"]: m for m in b.modules()}
    assert listed[mid]["uploaded_by"] == ["t1", "t2"] and listed[mid]["wasm_size"] == len(data)
    assert listed[mid]["compiled_size"] == 7 and listed[big_id]["wasm_size"] == len(big)
    assert (b.count_modules(), b.uploads("t1"), b.uploads("t2"), b.uploads("t3")) == (2, 2, 1, 0)
    assert b.delete_module(big_id) is True and b.delete_module(big_id) is False
    assert a.module_bytes(big_id) is None and a.uploads("t1") == 1


def test_tags_compare_and_set(stores):
    a, b = stores
    m1, d1 = blob(1)
    m2, d2 = blob(2)
    a.put_module(m1, d1, "ta")
    a.put_module(m2, d2, "ta")
    t = a.set_tag("x", m1, "ta", 0, only_if_owner="ta")
    assert (t["owner"], t["module_id"], t["max_backtrack"], t["updated_by"]) == ("ta", m1, 0, "ta")
    with pytest.raises(TagOwned) as e:
        b.set_tag("x", m2, "tb", None, only_if_owner="tb")
    assert e.value.owner == "ta"
    moved = b.set_tag("x", m2, "ops", 3, only_if_owner=None)  # an admin: the tag keeps its first owner
    assert (moved["owner"], moved["module_id"], moved["max_backtrack"], moved["updated_by"]) == ("ta", m2, 3, "ops")
    assert moved["created_at"] == t["created_at"] and a.tag("x")["module_id"] == m2
    with pytest.raises(KeyError):
        a.set_tag("y", "f" * 64, "ta", None, only_if_owner="ta")
    with pytest.raises(ValueError, match="tagged"):
        b.delete_module(m2)
    with pytest.raises(TagOwned):
        b.delete_tag("x", only_if_owner="tb")
    assert [t["tag"] for t in b.tags()] == ["x"]
    assert a.delete_tag("x", only_if_owner="ta") is True and b.delete_tag("x", None) is False
    assert a.tag("x") is None and b.delete_module(m2) is True


def test_racing_replicas_give_each_tag_one_owner(stores):
    """Eight tenants over two handles race to create the same 20 tags: each tag has one owner,
    every other attempt was refused naming that owner, and nothing half-done is left."""
    a, b = stores
    mid, data = blob(3)
    a.put_module(mid, data, "t0")
    results: dict[str, list] = {f"race{i}": [] for i in range(20)}

    def tenant(k: int):
        store = (a, b)[k % 2]
        for name in results:
            try:
                store.set_tag(name, mid, f"t{k}", None, only_if_owner=f"t{k}")
                results[name].append(("won", f"t{k}"))
            except TagOwned as e:
                results[name].append(("lost", e.owner))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(tenant, range(8)))
    tags = {t["tag"]: t["owner"] for t in a.tags()}
    for name, outcomes in results.items():
        winners = [who for what, who in outcomes if what == "won"]
        assert len(outcomes) == 8 and len(winners) == 1, (name, outcomes)
        assert tags[name] == winners[0] and all(who == winners[0] for _, who in outcomes)


# -- PostgreSQL: schema, notifications, keys, outages ---------------------------------------------

def test_schema_is_created_once_migrated_and_versioned(pg_cluster):
    url = pg_cluster.new_database()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # replicas starting together
        opened = list(pool.map(lambda _: PostgresStore(url, listen=False), range(4)))
    for store in opened:
        store.close()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM rudder_schema").fetchall() == [(SCHEMA_VERSION,)]

    # A database left at version 1 by an older rudder: migrated on start, its rows kept.
    old = pg_cluster.new_database()
    mid, data = blob(5)
    with psycopg.connect(old, autocommit=True) as conn:
        conn.execute(MIGRATIONS[0])
        conn.execute("CREATE TABLE rudder_schema (version integer NOT NULL); INSERT INTO rudder_schema VALUES (1)")
        conn.execute("INSERT INTO modules VALUES (%s, %s, %s, 0, 0)", (mid, data, len(data)))
    store = PostgresStore(old, listen=False)
    try:
        assert store.module_bytes(mid) == data and store.active_keys() == []
    finally:
        store.close()
    with psycopg.connect(old, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM rudder_schema").fetchone()[0] == SCHEMA_VERSION
        conn.execute("UPDATE rudder_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(ValueError, match=f"version {SCHEMA_VERSION + 1}.*upgrade rudder"):
        PostgresStore(old, listen=False)


def test_tag_moves_reach_other_replicas_by_notification(pg_url):
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        m1, d1 = blob(1)
        m2, d2 = blob(2)
        a.put_module(m1, d1, "t")
        a.put_module(m2, d2, "t")
        eventually(lambda: b._listening, what="b listening")
        generation = b._generation
        a.set_tag("x", m1, "t", None, only_if_owner="t")
        eventually(lambda: b._generation > generation, what="the notification reaching b")
        assert b.tag("x")["module_id"] == m1 and b.tag("nope") is None
        # Served from b's cache: no query per request (the pool is unusable and it still answers).
        real, b.pool.connection = b.pool.connection, None
        assert b.tag("x")["module_id"] == m1 and b.tag("nope") is None
        b.pool.connection = real
        a.set_tag("x", m2, "t", None, only_if_owner="t")
        eventually(lambda: b.tag("x")["module_id"] == m2, what="the move reaching b")
        a.set_tag("nope", m1, "t", None, only_if_owner="t")  # a cached absence is forgotten too
        eventually(lambda: b.tag("nope") is not None, what="the new tag reaching b")
        a.delete_tag("x", None)
        eventually(lambda: b.tag("x") is None, what="the deletion reaching b")
    finally:
        a.close()
        b.close()


def test_keys_added_and_revoked_reach_every_replica(pg_url):
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    ring = KeyRing()
    try:
        b.watch_keys(ring.use_stored)
        assert not ring  # no keys anywhere: an open server, as without keys
        key_id = a.add_key("sk-one", "user", "team-a", name="laptop")
        a.add_key("sk-two", "admin", "ops")
        eventually(lambda: len(ring) == 2, what="the new keys reaching b")
        assert ring and ring.check("sk-one").tenant == "team-a" and ring.check("sk-two").admin
        with pytest.raises(ValueError, match="already"):
            a.add_key("sk-one", "user", "team-b")
        assert a.revoke_key(key_id) is True and a.revoke_key(key_id) is False
        with pytest.raises(KeyError):
            a.revoke_key("000000000000")
        eventually(lambda: ring.check("sk-one") is None, what="the revocation reaching b")
        assert ring.check("sk-two") is not None
        a.revoke_key(a.keys()[1]["key_id"])
        eventually(lambda: len(ring) == 0, what="the last revocation reaching b")
        assert ring and ring.check("sk-two") is None  # every key refused: the server does not fall open
        rows = {k["name"]: k for k in a.keys()}
        assert rows["laptop"]["revoked_at"] is not None and "digest" not in rows["laptop"]
    finally:
        a.close()
        b.close()


def test_database_down_is_503_then_back(pg_cluster):
    url = pg_cluster.new_database()
    store = PostgresStore(url)
    mid, data = blob(9)
    try:
        store.put_module(mid, data, "t")
        store.set_tag("x", mid, "t", None, None)
        eventually(lambda: store._listening and store.tag("x"), what="the listener")
        pg_cluster.stop("fast")
        # While the database is gone the cache is not trusted: a tag may move meanwhile.
        eventually(lambda: not store._listening, what="the listener noticing")
        for call in (store.tags, store.modules, lambda: store.tag("x"), lambda: store.module_bytes(mid),
                     lambda: store.put_module(*blob(10), "t")):
            with pytest.raises(StoreUnavailable) as e:
                call()
            assert e.value.status == 503 and e.value.code == "registry_unavailable"
            assert "database is unavailable" in str(e.value) and e.value.headers["Retry-After"]
    finally:
        pg_cluster.start()
    try:
        eventually(lambda: _answers(store.tags), what="the store coming back")
        assert store.module_bytes(mid) == data and store.tag("x")["module_id"] == mid
        eventually(lambda: store._listening, what="the listener coming back")
    finally:
        store.close()


def _answers(call) -> bool:
    try:
        call()
        return True
    except StoreUnavailable:
        return False


def test_an_unreachable_or_wrong_url_is_one_line(monkeypatch):
    from pg_util import free_port

    from rudder.server import postgres_store

    monkeypatch.setattr(postgres_store, "CONNECT_TIMEOUT_S", 0.3)  # (the message is the same after 3 s)
    cli = CliRunner()
    for url, words in [(f"postgresql://postgres@127.0.0.1:{free_port()}/x", "database is unavailable"),
                       ("postgresql://h/x?nonsense=1", "not a PostgreSQL URL")]:
        result = cli.invoke(app, ["keys", "list", "--state-url", url])
        assert result.exit_code == 1 and words in result.output and "Traceback" not in result.output, result.output
    # (a process of its own: `serve` sets up logging for the process it runs in)
    run = run_cli(["serve", "--state-dir", "/tmp", "--state-url", "postgresql://h/x", "--model", "tiny"], timeout=120)
    assert run.returncode == 1 and "not both" in run.stderr and "Traceback" not in run.stderr, run.stderr


# -- replicas: `rudder serve --state-url` ---------------------------------------------------------

SERVERS = pytest.mark.timeout(300)  # tests that start `rudder serve` processes (~5-15 s when the host is idle)

KEYS = {"ops": ("sk-ops-000000", "admin"), "team-a": ("sk-team-a-000000", "user"),
        "team-b": ("sk-team-b-000000", "user")}


def bearer(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant][0]}"}


@pytest.fixture(scope="module")
def replicas(pg_cluster):
    """Two `rudder serve` processes on one database, with keys added by `rudder keys add`."""
    url = pg_cluster.new_database()
    cli = CliRunner()
    for tenant, (key, role) in KEYS.items():
        result = cli.invoke(app, ["keys", "add", "--tenant", tenant, "--role", role, "--key", key,
                                  "--state-url", url])
        assert result.exit_code == 0, result.output
    a = ServeProcess("--state-url", url, model="tiny:1", forked=True)
    b = ServeProcess("--state-url", url, model="tiny:1", forked=True)
    with a, b:
        yield a, b, url


RUN = {"prompt": "x", "max_tokens": 3, "stream": False, "ignore_eos": True}


@SERVERS
def test_replicas_share_uploads_tags_and_keys(replicas):
    a, b, url = replicas
    with httpx.Client(timeout=60) as c:
        assert c.get(a.url + "/v1/controllers/tags").status_code == 401  # keys from the database
        mid = c.post(a.url + "/v1/controllers", content=module(300), headers=bearer("team-a")).json()["module_id"]
        r = c.post(b.url + "/v1/run", json={**RUN, "controller": mid}, headers=bearer("team-b"))
        assert r.status_code == 200, r.text  # loaded from the database on first use
        r = c.post(b.url + "/v1/controllers/tags", json={"tag": "shared", "module_id": mid}, headers=bearer("team-a"))
        assert r.status_code == 200 and r.json()["owner"] == "team-a"
        eventually(lambda: c.post(a.url + "/v1/run", json={**RUN, "controller": "shared"},
                                  headers=bearer("team-b")).status_code == 200, what="the tag reaching a")
        r = c.post(a.url + "/v1/controllers/tags", json={"tag": "shared", "module_id": mid}, headers=bearer("team-b"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "tag_owned" and "team-a" in r.text
        listed = {m["module_id"]: m for m in c.get(a.url + "/v1/controllers", headers=bearer("ops")).json()["data"]}
        assert listed[mid]["uploaded_by"] == ["team-a"] and listed[mid]["tags"] == ["shared"]

        # A key revoked with `rudder keys revoke` is refused by both replicas.
        key = "sk-temp-000000"
        out = CliRunner().invoke(app, ["keys", "add", "--tenant", "team-c", "--key", key, "--state-url", url])
        key_id = out.output.strip()
        for s in (a, b):
            eventually(lambda s=s: c.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
                       == 200, what="the new key reaching a replica")
        out = CliRunner().invoke(app, ["keys", "revoke", key_id, "--state-url", url])
        assert out.exit_code == 0 and f"revoked {key_id}" in out.output
        for s in (a, b):
            eventually(lambda s=s: c.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
                       == 401, what="the revocation reaching a replica")
        listing = CliRunner().invoke(app, ["keys", "list", "--all", "--state-url", url]).output
        assert f"{key_id}  user   team-c" in listing and "revoked" in listing and key not in listing

        # A key rudder makes: printed once with its id, then accepted.
        made, made_id = CliRunner().invoke(app, ["keys", "add", "--tenant", "team-d", "--state-url", url]
                                           ).output.split()
        assert made.startswith("rk-") and len(made) > 30 and len(made_id) == 12
        eventually(lambda: c.get(a.url + "/v1/models", headers={"Authorization": f"Bearer {made}"}).status_code
                   == 200, what="the made key reaching a replica")


@SERVERS
def test_two_replicas_racing_for_tags(replicas):
    a, b, _ = replicas
    with httpx.Client(timeout=60) as c:
        mid = c.post(a.url + "/v1/controllers", content=module(301), headers=bearer("ops")).json()["module_id"]
    names = [f"race{i}" for i in range(15)]
    outcomes: dict[str, list] = {n: [] for n in names}

    def race(server, tenant):
        with httpx.Client(base_url=server.url, headers=bearer(tenant), timeout=60) as c:
            for n in names:
                r = c.post("/v1/controllers/tags", json={"tag": n, "module_id": mid})
                outcomes[n].append((tenant, r.status_code, r.json()))

    threads = [threading.Thread(target=race, args=(a, "team-a")), threading.Thread(target=race, args=(b, "team-b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with httpx.Client(timeout=60) as c:
        owners = {t["tag"]: t["owner"] for t in c.get(b.url + "/v1/controllers/tags", headers=bearer("ops")).json()["tags"]}
    for n, results in outcomes.items():
        won = [tenant for tenant, status, _ in results if status == 200]
        lost = [body for _, status, body in results if status != 200]
        assert len(won) == 1 and owners[n] == won[0], results
        assert lost[0]["error"]["code"] == "tag_owned" and won[0] in lost[0]["error"]["message"]


@SERVERS
def test_sigkill_during_uploads_loses_nothing_on_postgres(pg_cluster):
    """As for the state directory (test_auth_registry.py): a server on PostgreSQL SIGKILLed at
    random moments while uploading and tagging; every acknowledged module and tag is there, whole,
    and nothing that was never sent."""
    url = pg_cluster.new_database()
    seen = _uploads_killed_at_random(["--state-url", url], 31, 6, 0)
    store = PostgresStore(url, listen=False)
    try:
        listed = {m["module_id"] for m in store.modules()}
        assert len(seen["modules"]) >= 6, "too few uploads got through to test anything"
        assert set(seen["modules"]) <= listed <= seen["attempted"]
        for mid in listed:
            assert hashlib.sha256(store.module_bytes(mid)).hexdigest() == mid
        tags = {t["tag"]: t["module_id"] for t in store.tags()}
        assert all(tags.get(tag) == mid for tag, mid in seen["tags"].items())
    finally:
        store.close()


def steady_spin(c: httpx.Client, ms: float) -> str:
    """The "steady" controller's argument for a spin of about `ms` of CPU time a step on this host
    (a fixed count took 11 ms on one machine and 27 ms, past the 25 ms deadline, on another): a
    short run's controller time per call scales a count. Its four bytes (little-endian) stay
    below 0x80, so the JSON string carries them as they are."""
    probe = 1 << 22
    r = c.post("/v1/run", json={**RUN, "controller": "steady", "controller_arg": probe.to_bytes(4, "little").decode()})
    assert r.status_code == 200, r.text
    per_call = r.json()["timings"]["controller_ms"] / (RUN["max_tokens"] + 1)
    want = int(probe * ms / max(per_call, 1e-3))
    high = min(want >> 24, 0x7F)
    count = (high << 24) | min((want - (high << 24)) >> 16, 0x7F) << 16
    return max(count, 1 << 16).to_bytes(4, "little").decode()


@SERVERS
def test_postgres_restart_under_load(pg_cluster):
    """PostgreSQL stops while a request streams and uploads go on: registry calls answer 503
    (registry_unavailable) and plain requests 200, the stream goes on stepping through it; once
    it is back the registry answers again, and every acknowledged upload is in it."""
    url = pg_cluster.new_database()
    acked, unexpected, stop = {}, [], threading.Event()
    with ServeProcess("--state-url", url, "--max-modules", "100000", "--max-tokens", "2000", model="tiny:1",
                      forked=True) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        # The running request's controller spins for as long as its argument says, every step.
        mid = c.post("/v1/controllers", content=bytes(wasm_of(busy_wat()))).json()["module_id"]
        assert c.post("/v1/controllers/tags", json={"tag": "steady", "module_id": mid}).status_code == 200
        spin = steady_spin(c, ms=10)

        def uploads():
            with httpx.Client(base_url=server.url, timeout=60) as u:
                i = 0
                while not stop.is_set():
                    i += 1
                    r = u.post("/v1/controllers", content=module(500 + i))
                    if r.status_code == 200:
                        acked[r.json()["module_id"]] = True
                    else:
                        if r.status_code != 503 or r.json()["error"]["code"] != "registry_unavailable":
                            unexpected.append(r.text)
                        time.sleep(0.1)

        loader = threading.Thread(target=uploads)
        loader.start()
        eventually(lambda: len(acked) >= 2, what="uploads")
        first_503 = None
        # The stream is read as it comes until the registry is back, then closed: it must outlast
        # the outage, whose length varies with the machine's load, so it asks for about all the
        # tokens the model's context holds (each step spins the controller for ~10 ms).
        with c.stream("POST", "/v1/run", json={"controller": "steady", "controller_arg": spin,
                                                "prompt": "x", "max_tokens": 2000, "ignore_eos": True}) as stream:
            assert stream.status_code == 200, stream.read()
            events = sse_events(stream)
            assert next(events)["type"] == "step"
            arrived: list[tuple[float, object]] = []

            def read():  # (until the stream is closed under it)
                with contextlib.suppress(httpx.HTTPError, httpx.StreamError):
                    for event in events:
                        arrived.append((time.time(), event))

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            pg_cluster.stop("fast")
            try:
                for call in (lambda: c.get("/v1/controllers/tags"), lambda: c.post("/v1/controllers", content=module(401)),
                             lambda: c.post("/v1/run", json={**RUN, "controller": "steady"})):
                    r = eventually(lambda: (lambda r: r if r.status_code == 503 else None)(call()),
                                   what="a 503 for a registry call")
                    assert r.json()["error"]["code"] == "registry_unavailable" and r.headers["Retry-After"]
                    first_503 = first_503 or time.time()
                assert c.post("/v1/run", json=RUN).status_code == 200  # no registry: served
                # Scraped all the same: the count is unknown meanwhile.
                assert re.search(r"^rudder_controller_modules\{[^}]*\} nan$", c.get("/metrics").text, re.M)
                assert c.post("/v1/run", json={**RUN, "controller": "force", "controller_arg": "hi"}).status_code == 200
            finally:
                pg_cluster.start()
            eventually(lambda: c.get("/v1/controllers/tags").status_code == 200, what="the registry coming back")
            back = time.time()
            eventually(lambda: arrived and arrived[-1][0] > back,
                       what=lambda: f"the stream's steps after the outage ({len(arrived)} events, the last "
                                    f"{arrived[-1][1] if arrived else None!r:.300})")
        reader.join(timeout=10)
        # It ran through the outage: steps all along, nothing but steps.
        assert all(isinstance(e, dict) and e["type"] == "step" for _, e in arrived), [e for _, e in arrived][-3:]
        assert any(first_503 < t < back for t, _ in arrived)
        time.sleep(0.3)
        stop.set()
        loader.join()
        listed = {m["module_id"] for m in c.get("/v1/controllers").json()["data"]}
        assert set(acked) <= listed and len(acked) >= 3 and not unexpected
        # (the listener logs it once it has taken the new connection, maybe after the first 200s)
        eventually(lambda: "is back after" in server.output(), what="the log's line on the registry's return")
        assert "registry database" in server.output()
