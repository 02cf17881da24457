"""Hostile tenants over a real HTTP server (tiny model): every hostile controller of
tests/hostile_wat.py fails only its own request, with its kind, while a greedy neighbour returns
byte for byte its idle-server text; a slow neighbour never changes it either; snapshots and live
guest memory stay within the server's budgets (a request that does not fit gets 429 with
Retry-After), and guest memory is back to zero when the requests are done."""

from __future__ import annotations

import concurrent.futures
import contextlib
import struct
import time

import httpx
import pytest

from controller_wat import busy_wat, wasm_of
from hostile_wat import HOSTILE, dirty_init_wat
from rudder.server import ServerConfig
from serve_util import LiveServer, sse_events

MiB = 1 << 20
NEIGHBOUR = {"prompt": "A greedy neighbour writes", "max_tokens": 40, "temperature": 0, "stream": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = ServerConfig(model="tiny", max_tokens=2000, max_concurrent=16, max_queue=32, max_upload_bytes=4 * MiB,
                       state_dir=tmp_path_factory.mktemp("state"),
                       engine_options={"guest_memory_bytes": 160 * MiB, "snapshot_bytes": 24 * MiB})
    with LiveServer(cfg) as s:
        yield s


def upload(c, wat: str) -> str:
    r = c.post("/v1/controllers", content=bytes(wasm_of(wat)), headers={"content-type": "application/wasm"})
    assert r.status_code == 200, r.text
    return r.json()["module_id"]


def run(c, module: str | None, arg: str = "", **kw) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 12, "temperature": 0, "stream": False, **kw}
    if module is not None:
        body.update(controller=module, controller_arg=arg)
    return c.post("/v1/run", json=body)


def neighbour(c) -> str:
    r = c.post("/v1/run", json=NEIGHBOUR)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_every_hostile_controller_fails_alone_beside_a_greedy_neighbour(server):
    with server.client() as c:
        idle = neighbour(c)
        modules = {name: upload(c, wat) for name, (wat, _) in HOSTILE.items()}
        with concurrent.futures.ThreadPoolExecutor(len(HOSTILE) + 1) as pool:
            near = pool.submit(neighbour, c)
            runs = {name: pool.submit(run, c, module) for name, module in modules.items()}
            assert near.result() == idle
            for name, fut in runs.items():
                r = fut.result()
                kind = "ok" if r.status_code == 200 else r.json()["error"].get("kind", r.json()["error"]["type"])
                assert kind in HOSTILE[name][1], (name, r.status_code, r.text[:300])
        assert c.get("/healthz").json()["status"] == "ok"
    assert idle_again(server)


def idle_again(server, timeout: float = 10.0) -> bool:
    """Guest memory back to zero (an instance is freed when the last reference to its memory
    goes: a late controller's call, an answer's mask, may outlive its request by a moment)."""
    deadline = time.monotonic() + timeout
    while server.metrics()["rudder_guest_memory_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return server.metrics()["rudder_guest_memory_bytes"] == 0


def test_a_slow_neighbour_changes_nothing(server):
    with server.client() as c:
        idle = neighbour(c)
        slow = upload(c, busy_wat())
        loops = struct.pack("<I", 0x003F3F3F).decode("ascii")  # ~4 M iterations: a busy step of several ms
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            others = [pool.submit(run, c, slow, loops, max_tokens=30) for _ in range(3)]
            assert pool.submit(neighbour, c).result() == idle
            for o in others:
                assert o.result().status_code == 200, o.result().text


def test_snapshots_stay_within_their_budget(server):
    """Eight modules whose init dirties 8 MiB each, against a 24 MiB snapshot budget, while a
    greedy neighbour runs: the oldest snapshots are dropped, and the neighbour's text is its
    idle text."""
    with server.client() as c:
        idle = neighbour(c)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            near = pool.submit(lambda: [neighbour(c) for _ in range(3)])
            first = upload(c, dirty_init_wat(8, 1))
            for mark in range(1, 8):
                module = upload(c, dirty_init_wat(8, mark))
                assert run(c, module).status_code == 200
                assert server.metrics()["rudder_snapshot_bytes"] <= 32 * MiB  # 24 MiB budget + the newest
            assert near.result() == [idle] * 3
        assert run(c, first).status_code == 200  # dropped long ago: re-initialised, same answer
    assert server.metrics()["rudder_snapshot_budget_bytes"] == 24 * MiB


def test_live_guest_memory_is_bounded_with_429(server):
    """Controllers that hold ~48 MiB each against a 160 MiB budget, beside a greedy neighbour:
    three long streams fit and run; while they hold their memory, three more requests get 429 with
    Retry-After (never an OOM); the neighbour's text is its idle text; once the streams are gone a
    request runs again and memory goes back to zero. (The streams are held open on purpose: six
    short requests fired at once may simply not overlap on a fast host.)"""
    with server.client() as c, contextlib.ExitStack() as held:
        idle = neighbour(c)
        big = upload(c, dirty_init_wat(48, 9))
        assert run(c, big).status_code == 200  # its snapshot exists before the burst
        streams = []  # kept: dropping a half-read event generator closes its connection (a cancel)
        for _ in range(3):
            body = {"prompt": "hi", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
                    "controller": big, "controller_arg": ""}
            r = held.enter_context(c.stream("POST", "/v1/run", json=body))
            assert r.status_code == 200
            streams.append(sse_events(r))
            next(streams[-1])  # admitted and decoding: its instance holds its memory until the stream ends
        assert server.metrics()["rudder_guest_memory_bytes"] >= 3 * 48 * MiB
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            near = pool.submit(neighbour, c)  # no controller: no guest memory, never refused for it
            answers = list(pool.map(lambda _: run(c, big, max_tokens=60), range(3)))
            assert near.result() == idle
        for a in answers:
            assert a.status_code == 429, a.text[:300]
            assert a.headers.get("retry-after") and a.json()["error"]["kind"] == "limit"
            assert "guest memory budget" in a.json()["error"]["message"]
    with server.client() as c:
        assert idle_again(server)
        assert run(c, big).status_code == 200
    assert idle_again(server)
    assert server.metrics()["rudder_guest_memory_budget_bytes"] == 160 * MiB


def test_growth_bombs_under_concurrency(server):
    """Growth bombs reach 64 MiB each: together they meet the 160 MiB budget. Each ends with a
    200 or with oom/limit; the neighbour is untouched; memory comes back."""
    with server.client() as c:
        idle = neighbour(c)
        bomb = upload(c, HOSTILE["growth bomb"][0])
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            bombs = [pool.submit(run, c, bomb, max_tokens=20) for _ in range(5)]
            assert pool.submit(neighbour, c).result() == idle
            kinds = ["ok" if b.result().status_code == 200 else b.result().json()["error"]["kind"] for b in bombs]
        assert set(kinds) <= {"ok", "oom", "limit"} and set(kinds) & {"oom", "limit"}, kinds
    assert idle_again(server)
