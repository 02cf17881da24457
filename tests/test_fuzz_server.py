"""Fuzzing the whole path through a real `rudder serve` process: mutated modules (bit flips,
truncations, sections dropped, swapped or repeated) uploaded and run, and random Branch
records returned by a controller, while a plain greedy request runs beside them.

Each request must end with a 200 or a 400 that names its kind; the server must stay up and
healthy, and the neighbour must get exactly its idle-server text.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from controller_wat import controller_wat, wasm_of
from rudder.controller.build import builtin_controller
from rudder.controller.errors import KINDS

RUDDER = Path(sys.executable).with_name("rudder")
ACCEPTED_KINDS = KINDS | {"invalid_branch", "error"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    # The log goes to a file: a pipe nobody reads fills up and blocks the server.
    log = open(tmp_path_factory.mktemp("fuzz") / "server.log", "w+")
    proc = subprocess.Popen([str(RUDDER), "serve", "--model", "tiny", "--port", str(port)], env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        try:
            if client.get("/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)
    yield proc, client
    client.close()
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


NEIGHBOUR = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "stream": False}


def _neighbour_text(client) -> str:
    r = client.post("/v1/run", json=NEIGHBOUR)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _outcome(client, module_bytes: bytes, arg: str = "") -> str:
    """Upload and run a module: "ok", or the error kind of the answer."""
    up = client.post("/v1/controllers", content=module_bytes, headers={"content-type": "application/wasm"})
    if up.status_code != 200:
        assert up.status_code == 400, up.text
        return up.json()["error"]["kind"]
    run = client.post("/v1/run", json={"controller": up.json()["module_id"], "controller_arg": arg, "prompt": "hi",
                                       "max_tokens": 6, "temperature": 0, "stream": False})
    body = run.json()
    if run.status_code != 200:
        assert run.status_code in (400, 429), run.text
        return body["error"].get("kind", body["error"]["type"])
    return "ok"


# -- mutated modules ---------------------------------------------------------------------------


def _sections(wasm: bytes) -> list[bytes]:
    out, pos = [], 8
    while pos < len(wasm):
        start = pos
        pos += 1
        size = shift = 0
        while True:
            b = wasm[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        pos += size
        out.append(wasm[start:pos])
    return out


def mutate(wasm: bytes, rng: random.Random) -> bytes:
    how = rng.randrange(5)
    if how == 0:  # flip a few bits
        data = bytearray(wasm)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(8, len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if how == 1:  # truncate
        return wasm[:rng.randrange(8, len(wasm))]
    sections = _sections(wasm)
    i, j = rng.randrange(len(sections)), rng.randrange(len(sections))
    if how == 2:  # drop a section
        del sections[i]
    elif how == 3:  # swap two sections
        sections[i], sections[j] = sections[j], sections[i]
    else:  # repeat a section
        sections.insert(j, sections[i])
    return wasm[:8] + b"".join(sections)


def test_mutated_modules_fail_alone(server):
    proc, client = server
    idle = _neighbour_text(client)
    rng = random.Random(20261125)
    originals = [builtin_controller(name).read_bytes() for name in ("force", "choices", "backtrack")]
    kinds = set()
    for i in range(45):
        kind = _outcome(client, mutate(rng.choice(originals), rng), arg='["yes", "no"]')
        assert kind == "ok" or kind in ACCEPTED_KINDS, kind
        kinds.add(kind)
        assert proc.poll() is None, f"the server died on mutation {i}"
        if i % 9 == 0:
            assert _neighbour_text(client) == idle
    assert "bad_module" in kinds  # the mutations reached the checks, not just one outcome
    assert client.get("/healthz").json()["status"] == "ok"


# -- random Branch records -----------------------------------------------------------------------

# rudder_start decodes the argument (a result image built below, in hex: arguments travel as
# text) to 0x1000; every mid_process returns it. The image's pointers point into it.
ECHO = controller_wat(
    memory='(memory (export "memory") 4)',
    start="""(local $n i32) (local $i i32) (local $hi i32) (local $lo i32)
             (local.set $n (call $arg_read (i32.const 0x20000) (i32.const 0x10000)))
             (block $done (loop $l
               (br_if $done (i32.ge_u (i32.add (local.get $i) (i32.const 1)) (local.get $n)))
               (local.set $hi (i32.load8_u (i32.add (i32.const 0x20000) (local.get $i))))
               (local.set $lo (i32.load8_u (i32.add (i32.const 0x20001) (local.get $i))))
               (local.set $hi (select (i32.sub (local.get $hi) (i32.const 48)) (i32.sub (local.get $hi) (i32.const 87))
                                      (i32.le_u (local.get $hi) (i32.const 57))))
               (local.set $lo (select (i32.sub (local.get $lo) (i32.const 48)) (i32.sub (local.get $lo) (i32.const 87))
                                      (i32.le_u (local.get $lo) (i32.const 57))))
               (i32.store8 (i32.add (i32.const 0x1000) (i32.shr_u (local.get $i) (i32.const 1)))
                           (i32.or (i32.shl (local.get $hi) (i32.const 4)) (local.get $lo)))
               (local.set $i (i32.add (local.get $i) (i32.const 2)))
               (br $l)))
             (i32.const 0)""",
    mid="(i32.const 0x1000)")
BASE = 0x1000
VOCAB = 512


def random_result(rng: random.Random) -> bytes:
    """A rudder_result with 0-4 branches whose fields are mostly plausible and sometimes not."""
    n = rng.choice([0, 1, 1, 1, 2, 3, 4, 40])
    body = bytearray()
    header_at, branches_at = 0, 8
    records = bytearray()
    extra = bytearray()
    extra_at = 8 + 16 * min(n, 4)

    def place(blob: bytes) -> int:
        nonlocal extra
        where = extra_at + len(extra)
        extra += blob
        return BASE + where

    for _ in range(min(n, 4)):
        backtrack = rng.choice([0, 0, 0, 1, 2, 5, 10_000, 2**32 - 1])
        mask = 0
        if rng.random() < 0.5:
            words = [rng.getrandbits(32) if rng.random() < 0.3 else 0 for _ in range(VOCAB // 32)]
            mask = place(struct.pack(f"<{len(words)}I", *words)) if rng.random() < 0.9 else rng.getrandbits(32)
        lists = []
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            tokens = [rng.choice([rng.randrange(VOCAB), rng.randrange(VOCAB), VOCAB + 5]) for _ in range(rng.randint(0, 4))]
            lists.append((len(tokens), place(struct.pack(f"<{len(tokens)}I", *tokens)) if tokens else 0))
        ff = place(b"".join(struct.pack("<II", k, p) for k, p in lists)) if lists else 0
        records += struct.pack("<IIII", backtrack, mask, len(lists), ff)
    body += struct.pack("<II", n, BASE + branches_at if rng.random() < 0.95 else rng.getrandbits(32))
    body += records
    body += extra
    assert header_at == 0
    return bytes(body)


def test_random_branch_records_fail_alone(server):
    proc, client = server
    idle = _neighbour_text(client)
    up = client.post("/v1/controllers", content=bytes(wasm_of(ECHO)), headers={"content-type": "application/wasm"})
    assert up.status_code == 200, up.text
    module = up.json()["module_id"]
    rng = random.Random(7)
    outcomes = set()
    for i in range(60):
        arg = random_result(rng).hex()
        r = client.post("/v1/run", json={"controller": module, "controller_arg": arg, "prompt": "hi",
                                         "max_tokens": 6, "temperature": 0.7, "seed": i, "stream": False})
        body = r.json()
        if r.status_code == 200:
            outcomes.add("ok")
        else:
            assert r.status_code == 400, r.text
            assert body["error"].get("kind") in ACCEPTED_KINDS, body
            outcomes.add(body["error"]["kind"])
        assert proc.poll() is None, f"the server died on record {i}"
    assert _neighbour_text(client) == idle
    assert "ok" in outcomes and "invalid_result" in outcomes and len(outcomes) >= 3
