"""Who may do what, and nothing lost: API keys, roles and tenants over a real server; owned tags;
per-tenant limits; deletion; the durable registry across SIGKILL and restarts (`rudder serve`
processes); replicas sharing one state directory."""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from controller_wat import controller_wat, wasm_of
from rudder.server import ServerConfig
from rudder.server.auth import KeyRing, read_keys_file
from rudder.server.store import LocalStore
from serve_util import LiveServer, ServeProcess, sse_events

KEYS = {"admin": "sk-admin-0123456789", "a": "sk-team-a-abcdef", "b": "sk-team-b-ghijkl"}


def module(i: int) -> bytes:
    """A distinct, valid controller (every hook succeeds; it samples freely)."""
    return bytes(wasm_of(controller_wat(extra=f'(data (i32.const 0x300) "module {i}")')))


def auth(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


# -- keys -----------------------------------------------------------------------------------------

def test_keys_file_and_ring(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\nk1 admin ops\nk2   user  team-a\n")
    ring = KeyRing.from_sources(["k0"], f)
    assert len(ring) == 3
    assert (ring.check("k0").tenant, ring.check("k0").role) == ("default", "admin")
    assert ring.check("k2").tenant == "team-a" and not ring.check("k2").admin
    assert ring.check("k3") is None and ring.check("") is None and ring.check(None) is None
    assert ring.check("k1x") is None and ring.check("k") is None
    for text, words in [("k1 root ops\n", "role"), ("k1 admin\n", "KEY ROLE TENANT"), ("# nothing\n", "no keys")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=words) as e:
            read_keys_file(f)
        assert "k1" not in str(e.value)  # a key is never in a message
    with pytest.raises(ValueError, match="api-keys-file"):
        read_keys_file(tmp_path / "missing")


@pytest.fixture(scope="module")
def keyed():
    ring = KeyRing([(KEYS["admin"], "admin", "ops"), (KEYS["a"], "user", "team-a"), (KEYS["b"], "user", "team-b")])
    cfg = ServerConfig(model="tiny", api_keys=ring, max_tokens=2000, tenant_max_concurrent=1, tenant_max_modules=3)
    with LiveServer(cfg) as s:
        yield s


def test_every_v1_route_needs_a_key(keyed, caplog):
    routes = [(m, r.path) for r in keyed.app.routes if r.path.startswith("/v1") for m in getattr(r, "methods", ())]
    assert len(routes) >= 10
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=keyed.url) as c:
        for method, path in routes:
            url = path.replace("{module_id}", "0" * 64).replace("{tag}", "x")
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS['a']}"},
                            {"api-key": "wrong"}):
                r = c.request(method, url, headers=headers, json={})
                assert r.status_code == 401, (method, url, headers, r.text)
                err = r.json()["error"]
                assert err["type"] == "unauthorized" and err["code"] == "invalid_api_key" and err["message"]
                assert r.headers["www-authenticate"] == "Bearer"
            assert c.request(method, url, headers=auth("a"), json={}).status_code != 401
        assert c.get("/healthz").status_code == 200  # open
        assert c.get("/metrics").status_code == 401  # keys configured, no --public-metrics
        assert c.get("/metrics", headers=auth("b")).status_code == 200
        assert c.get("/v1/models", headers={"api-key": KEYS["b"]}).status_code == 200  # Azure/AICI style
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert not any(k in logged for k in KEYS.values())


def test_openai_client_with_and_without_a_key(keyed):
    bad = OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = OpenAI(base_url=keyed.url + "/v1", api_key=KEYS["a"], max_retries=0)
    out = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_tags_belong_to_their_tenant(keyed):
    with httpx.Client(base_url=keyed.url) as c:
        mid = c.post("/v1/controllers", content=module(1), headers=auth("a")).json()["module_id"]
        other = c.post("/v1/controllers", content=module(2), headers=auth("b")).json()["module_id"]
        r = c.post("/v1/controllers/tags", json={"tag": "mytool", "module_id": mid}, headers=auth("a"))
        assert r.status_code == 200 and r.json()["owner"] == "team-a"
        hijack = c.post("/v1/controllers/tags", json={"tag": "mytool", "module_id": other}, headers=auth("b"))
        assert hijack.status_code == 403 and hijack.json()["error"]["code"] == "tag_owned"
        assert "team-a" in hijack.json()["error"]["message"]
        assert c.delete("/v1/controllers/tags/mytool", headers=auth("b")).status_code == 403
        listed = {t["tag"]: t for t in c.get("/v1/controllers/tags", headers=auth("b")).json()["tags"]}
        assert listed["mytool"]["owner"] == "team-a" and listed["mytool"]["module_id"] == mid
        moved = c.post("/v1/controllers/tags", json={"tag": "mytool", "module_id": other}, headers=auth("admin"))
        assert moved.status_code == 200 and moved.json()["owner"] == "team-a"  # an admin may; the owner stays
        assert moved.json()["tags"][0]["updated_by"] == "ops"
        assert c.post("/v1/controllers/tags", json={"tag": "mytool", "module_id": mid},
                      headers=auth("a")).status_code == 200  # the owner moves it back
        r = c.post("/v1/run", json={"controller": "mytool", "prompt": "x", "max_tokens": 3, "stream": False},
                   headers=auth("b"))
        assert r.status_code == 200  # anyone may run a tag
        assert c.delete("/v1/controllers/tags/mytool", headers=auth("a")).status_code == 200
        assert c.delete("/v1/controllers/tags/mytool", headers=auth("a")).status_code == 404
        assert "mytool" not in {t["tag"] for t in c.get("/v1/controllers/tags", headers=auth("a")).json()["tags"]}
        assert c.delete("/v1/controllers/tags/json", headers=auth("admin")).status_code == 403  # built-in


def test_tenant_concurrency_limit_is_that_tenants_alone(keyed):
    body = {"prompt": "x", "max_tokens": 1900, "ignore_eos": True, "controller": "fork", "controller_arg": "4"}
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        with c.stream("POST", "/v1/run", json=body, headers=auth("a")) as r:
            events = sse_events(r)
            assert next(events)["type"] == "step"  # team-a's request runs
            second = c.post("/v1/run", json={"prompt": "y", "max_tokens": 2, "stream": False}, headers=auth("a"))
            other = c.post("/v1/run", json={"prompt": "y", "max_tokens": 2, "stream": False}, headers=auth("b"))
            admin = c.post("/v1/run", json={"prompt": "y", "max_tokens": 2, "stream": False},
                           headers=auth("admin"))
        assert second.status_code == 429 and second.headers["retry-after"]
        assert second.json()["error"]["code"] == "tenant_concurrency" and "team-a" in second.json()["error"]["message"]
        assert other.status_code == 200 and admin.status_code == 200
        deadline = time.monotonic() + 30
        while c.post("/v1/run", json={"prompt": "y", "max_tokens": 2, "stream": False},
                     headers=auth("a")).status_code != 200:  # the stream closed: team-a's place is back
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_tenant_module_quota_and_admin_removal(keyed):
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        ids = [c.post("/v1/controllers", content=module(i), headers=auth("b")) for i in (10, 11)]
        assert all(r.status_code == 200 for r in ids)  # with module(2) above: 3, team-b's quota
        over = c.post("/v1/controllers", content=module(12), headers=auth("b"))
        assert over.status_code == 403 and over.json()["error"]["code"] == "module_quota"
        assert c.post("/v1/controllers", content=module(10), headers=auth("b")).status_code == 200  # not new
        assert c.post("/v1/controllers", content=module(12), headers=auth("admin")).status_code == 200

        target = ids[0].json()["module_id"]
        assert c.delete(f"/v1/controllers/{target}", headers=auth("b")).status_code == 403  # admins only
        c.post("/v1/controllers/tags", json={"tag": "keep", "module_id": target}, headers=auth("b"))
        tagged = c.delete(f"/v1/controllers/{target}", headers=auth("admin"))
        assert tagged.status_code == 409 and tagged.json()["error"]["code"] == "module_tagged"
        c.delete("/v1/controllers/tags/keep", headers=auth("b"))
        with c.stream("POST", "/v1/run", json={"controller": target, "prompt": "x", "max_tokens": 1900,
                                               "ignore_eos": True}, headers=auth("b")) as r:
            events = sse_events(r)  # kept: dropping the iterator would close the connection
            assert next(events)["type"] == "step"
            busy = c.delete(f"/v1/controllers/{target}", headers=auth("admin"))
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "module_in_use"
        deadline = time.monotonic() + 30
        while (r := c.delete(f"/v1/controllers/{target}", headers=auth("admin"))).status_code == 409:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.status_code == 200
        assert c.post("/v1/run", json={"controller": target, "prompt": "x"}, headers=auth("b")).status_code == 404
        assert c.post("/v1/controllers", content=module(13), headers=auth("b")).status_code == 200  # quota freed
        pruned = c.post("/v1/controllers/prune", headers=auth("admin")).json()["deleted"]
        assert ids[1].json()["module_id"] in pruned
        remaining = {m["module_id"] for m in c.get("/v1/controllers", headers=auth("a")).json()["data"]}
        assert not remaining & set(pruned) and all(len(m) == 64 for m in remaining)


def test_restricted_registry_is_read_only(tmp_path):
    cfg = ServerConfig(model="tiny", restricted=True, state_dir=tmp_path)
    with LiveServer(cfg) as s, s.client() as c:
        force = next(t["module_id"] for t in c.get("/v1/controllers/tags").json()["tags"] if t["tag"] == "force")
        for r in (c.post("/v1/controllers", content=module(1)),
                  c.post("/v1/controllers/tags", json={"tag": "t", "module_id": force}),
                  c.delete("/v1/controllers/tags/t"), c.post("/v1/controllers/prune")):
            assert r.status_code == 403 and r.json()["error"]["code"] == "restricted"


# -- durability -----------------------------------------------------------------------------------

def test_upload_and_tag_survive_sigkill(tmp_path):
    state = tmp_path / "state"
    with ServeProcess("--state-dir", str(state), "--api-key", KEYS["admin"], model="tiny:1", forked=True) as server:
        with httpx.Client(base_url=server.url, headers=auth("admin"), timeout=60) as c:
            mid = c.post("/v1/controllers", content=module(100)).json()["module_id"]
            assert c.post("/v1/controllers/tags", json={"tag": "kept", "module_id": mid,
                                                        "max_backtrack": 0}).status_code == 200
        server.kill()  # SIGKILL right after the acknowledgements
        server.start()
        with httpx.Client(base_url=server.url, headers=auth("admin"), timeout=60) as c:
            tags = {t["tag"]: t for t in c.get("/v1/controllers/tags").json()["tags"]}
            assert tags["kept"]["module_id"] == mid and tags["kept"]["owner"] == "default"
            # (ignore_eos: the tiny random model samples EOS now and then, which ended a run early)
            r = c.post("/v1/run", json={"controller": "kept", "prompt": "x", "max_tokens": 4, "stream": False,
                                        "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def _uploads_killed_at_random(store: list[str], seed: int, kills: int, first: int) -> dict:
    """`kills` times: start a server on `store` (its --state-dir or --state-url), upload (and tag)
    modules as fast as it takes them, SIGKILL it at a random moment. What was acknowledged and
    what was attempted (tests/test_store_postgres.py runs it on PostgreSQL)."""
    rng = random.Random(seed)
    seen = {"modules": {}, "tags": {}, "attempted": set(), "rng": rng}
    counter = iter(range(first, first + 10 ** 6))
    server = ServeProcess(*store, "--max-modules", "100000", model="tiny:1", forked=True)
    for _ in range(kills):
        server.start()
        stop = threading.Event()

        def upload_loop(stop=stop):
            with httpx.Client(base_url=server.url, timeout=10) as c:
                while not stop.is_set():
                    i = next(counter)
                    wasm = module(1000 + i)
                    seen["attempted"].add(hashlib.sha256(wasm).hexdigest())
                    try:
                        r = c.post("/v1/controllers", content=wasm)
                        if r.status_code == 200:
                            seen["modules"][r.json()["module_id"]] = wasm
                            t = c.post("/v1/controllers/tags", json={"tag": f"t{i}", "module_id": r.json()["module_id"]})
                            if t.status_code == 200:
                                seen["tags"][f"t{i}"] = r.json()["module_id"]
                    except httpx.HTTPError:
                        return  # the server is gone

        threads = [threading.Thread(target=upload_loop) for _ in range(2)]
        acked = len(seen["modules"])
        for t in threads:
            t.start()
        # the random moment counts from the round's first acknowledged upload: how soon that comes
        # depends on the machine (a fixed window from the start let 5 of 20 rounds through on one)
        deadline = time.monotonic() + 30
        while len(seen["modules"]) == acked and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        server.kill()
        stop.set()
        for t in threads:
            t.join(30)
    seen["server"] = server
    return seen


def test_sigkill_during_uploads_never_loses_or_invents_a_module(tmp_path):
    """20 times (two state directories side by side, 10 kills each, to use both cores while a
    server starts): upload (and tag) modules as fast as the server takes them, SIGKILL it at a
    random moment; every acknowledged module and tag is in the store, whole; nothing else is
    listed; and a server on that state serves them."""
    import concurrent.futures

    from rudder.controller import ControllerRuntime
    from rudder.tokenizer import Tokenizer

    states = [tmp_path / "state-a", tmp_path / "state-b"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda k: _uploads_killed_at_random(["--state-dir", str(states[k])], 22 + k, 10,
                                                                  10 ** 7 * k), range(2)))
    runtime = ControllerRuntime(Tokenizer.byte_level(512), cache_dir=False)
    try:
        for state, seen in zip(states, runs):
            acked_modules, acked_tags = seen["modules"], seen["tags"]
            store = LocalStore(state)
            listed = {m["module_id"] for m in store.modules()}
            assert len(acked_modules) >= 10, "too few uploads got through to test anything"
            assert set(acked_modules) <= listed      # every acknowledged upload is there...
            assert listed <= seen["attempted"]       # ...and nothing that was never sent
            for mid in listed:
                data = store.module_bytes(mid)  # whole: checked against its sha256
                assert data is not None and hashlib.sha256(data).hexdigest() == mid
            tags = {t["tag"]: t["module_id"] for t in store.tags()}
            assert all(tags.get(tag) == mid for tag, mid in acked_tags.items())
            for mid in acked_modules:
                assert runtime.load(store.module_bytes(mid)).sha256 == mid
            store.close()
    finally:
        runtime.close()
    acked_modules, acked_tags = runs[0]["modules"], runs[0]["tags"]
    with runs[0]["server"] as server:  # and a server on that state serves them
        with httpx.Client(base_url=server.url, timeout=60) as c:
            some = runs[0]["rng"].choice(sorted(acked_tags))
            r = c.post("/v1/run", json={"controller": some, "prompt": "x", "max_tokens": 3, "stream": False})
            assert r.status_code == 200, r.text
            served = {m["module_id"] for m in c.get("/v1/controllers").json()["data"]}
            assert set(acked_modules) <= served


def test_replicas_share_uploads_and_tags(tmp_path):
    state = str(tmp_path / "state")
    with ServeProcess("--state-dir", state, model="tiny:1", forked=True) as a, \
            ServeProcess("--state-dir", state, model="tiny:1", forked=True) as b:
        with httpx.Client(timeout=60) as c:
            mid = c.post(a.url + "/v1/controllers", content=module(200)).json()["module_id"]
            run = {"prompt": "x", "max_tokens": 3, "stream": False}
            by_id = c.post(b.url + "/v1/run", json={**run, "controller": mid})  # loaded from the store on first use
            assert by_id.status_code == 200, by_id.text
            assert c.post(b.url + "/v1/controllers/tags", json={"tag": "shared", "module_id": mid}).status_code == 200
            assert c.post(a.url + "/v1/run", json={**run, "controller": "shared"}).status_code == 200
            assert "shared" in {t["tag"] for t in c.get(a.url + "/v1/controllers/tags").json()["tags"]}
            assert c.delete(a.url + "/v1/controllers/tags/shared").status_code == 200
            gone = c.post(b.url + "/v1/run", json={**run, "controller": "shared"})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "controller_not_found"
    assert a.output().count("no API keys") == 1  # said once, at start-up
