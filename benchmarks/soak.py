"""Soak: many hostile requests of mixed kinds against one server, bounded in time.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--concurrency 8] [--model tiny]
                                        [--minutes 20] [--json benchmarks/results/soak.json]

Starts `rudder serve` (a process of its own, with a fresh state folder), warms it up with
`--warmup` requests of the same mix (filling the bounded caches), notes its RSS and guest memory, then
sends `--requests` requests drawn from tests/hostile_wat.py (runaway loops, traps, memory and
growth bombs, livelocks, fork bombs, tokenize loops, refusals, garbage results), modules whose
rudder_init dirties 8 MiB (each one new, so snapshots pile up unless bounded), mutated module
uploads, and plain greedy requests, `--concurrency` at a time. Every 25 requests /healthz must
answer ok. At the end it checks: the server never died, every answer was a 200 or an error that
names its kind, RSS is within 10 % of RSS after warm-up, and guest memory is back to its idle
value. Exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "tests"))

from controller_wat import wasm_of  # noqa: E402
from hostile_wat import HOSTILE, dirty_init_wat  # noqa: E402
from test_fuzz_server import mutate  # noqa: E402

from rudder.controller.build import builtin_controller  # noqa: E402

RUDDER = Path(sys.executable).with_name("rudder")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _kind(body: dict) -> str:
    err = body.get("error", {})
    return err.get("kind") or err.get("code") or err.get("type") or "?"


class Soak:
    def __init__(self, url: str, rng: random.Random):
        self.url, self.rng = url, rng
        self.client = httpx.Client(base_url=url, timeout=120)
        self.modules: dict[str, str] = {}
        self.outcomes: dict[str, dict[str, int]] = {}
        self.bad: list[str] = []
        self.mark = 0

    def upload(self, wasm: bytes) -> tuple[int, dict]:
        r = self.client.post("/v1/controllers", content=wasm, headers={"content-type": "application/wasm"})
        return r.status_code, r.json()

    def module(self, name: str, wat: str) -> str:
        if name not in self.modules:
            status, body = self.upload(bytes(wasm_of(wat)))
            assert status == 200, body
            self.modules[name] = body["module_id"]
        return self.modules[name]

    def one(self, i: int) -> None:
        try:
            self._one()
        except httpx.HTTPError as e:  # a request with no answer (a hang, a dropped connection) is a failure
            self.bad.append(f"request {i}: {type(e).__name__}: {e}")

    def _one(self) -> None:
        pick = self.rng.random()
        if pick < 0.2:
            kind, outcome = "plain", self.run(None)
        elif pick < 0.3:
            self.mark += 1
            status, body = self.upload(bytes(wasm_of(dirty_init_wat(8, self.mark % 250 + 1))))
            kind, outcome = "dirty init", self.run(body["module_id"]) if status == 200 else _kind(body)
        elif pick < 0.4:
            original = builtin_controller(self.rng.choice(["force", "choices"])).read_bytes()
            status, body = self.upload(mutate(original, self.rng))
            kind = "mutated module"
            outcome = self.run(body["module_id"], '["a", "b"]') if status == 200 else _kind(body)
        else:
            kind = self.rng.choice(sorted(HOSTILE))
            outcome = self.run(self.module(kind, HOSTILE[kind][0]))
        self.outcomes.setdefault(kind, {}).setdefault(outcome, 0)
        self.outcomes[kind][outcome] += 1

    def run(self, module: str | None, arg: str = "") -> str:
        body = {"prompt": "The weather today", "max_tokens": 12, "temperature": 0, "stream": False}
        if module is not None:
            body.update(controller=module, controller_arg=arg)
        r = self.client.post("/v1/run", json=body)
        if r.status_code == 200:
            return "ok"
        err = r.json().get("error", {})
        if r.status_code not in (400, 429) or not (err.get("kind") or err.get("type")):
            self.bad.append(f"{r.status_code}: {r.text[:200]}")
        return err.get("kind") or err.get("type")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--minutes", type=float, default=20, help="stop sending after this long")
    ap.add_argument("--warmup", type=int, default=300, help="requests of the same mix before RSS is noted")
    ap.add_argument("--serve-args", default="--guest-memory-mb 1024 --snapshot-memory-mb 128 --max-modules 4096",
                    help="extra `rudder serve` flags")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    port = _free_port()
    # The server's log goes to a file: a pipe nobody reads fills up and blocks the server's logging.
    log = tempfile.NamedTemporaryFile("w+", prefix="rudder-soak-", suffix=".log", delete=False)
    state = tempfile.mkdtemp(prefix="rudder-soak-state-")  # never the user's own registry
    server = subprocess.Popen([str(RUDDER), "serve", "--model", args.model, "--port", str(port), "--state-dir", state,
                               *args.serve_args.split()], stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    soak = Soak(url, random.Random(1))
    proc = psutil.Process(server.pid)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server did not start: {Path(log.name).read_text()[-2000:]}")
            try:
                if soak.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        for name, (wat, _) in HOSTILE.items():  # warm up: every module loaded and run once
            soak.run(soak.module(name, wat))
        # Warm-up: the same mix, long enough to fill what is bounded by design (the snapshot
        # cache, the 64 loaded modules, the warm pool slots); RSS must not grow past it.
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(soak.one, range(-args.warmup, 0)))
        soak.outcomes.clear()
        soak.bad.clear()
        rss0 = proc.memory_info().rss
        metrics0 = soak.client.get("/metrics").text
        guest0 = _metric(metrics0, "rudder_guest_memory_bytes")
        t0, done, unhealthy = time.monotonic(), 0, 0
        stop = t0 + 60 * args.minutes
        with ThreadPoolExecutor(args.concurrency) as pool:
            while done < args.requests and time.monotonic() < stop:
                batch = min(25, args.requests - done)
                list(pool.map(soak.one, range(done, done + batch)))
                done += batch
                if server.poll() is not None:
                    break
                health = soak.client.get("/healthz")
                unhealthy += health.status_code != 200 or health.json().get("status") != "ok"
                print(f"{done} requests, {time.monotonic() - t0:.0f} s, RSS {proc.memory_info().rss >> 20} MiB",
                      file=sys.stderr, flush=True)
        alive = server.poll() is None
        guest1 = None
        settle = time.monotonic() + 10  # an instance is freed when its last late call returns
        while alive and time.monotonic() < settle:
            guest1 = _metric(soak.client.get("/metrics").text, "rudder_guest_memory_bytes")
            if guest1 == guest0:
                break
            time.sleep(0.2)
        rss1 = proc.memory_info().rss if alive else 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(state, ignore_errors=True)
    print(f"server log: {log.name}", file=sys.stderr)
    result = {"requests": done, "seconds": round(time.monotonic() - t0, 1), "server_alive": alive,
              "unhealthy_checks": unhealthy, "bad_answers": soak.bad[:20], "rss_after_warmup_mib": rss0 >> 20,
              "rss_after_mib": rss1 >> 20, "rss_ratio": round(rss1 / rss0, 3) if rss0 else None,
              "guest_memory_idle": guest0, "guest_memory_after": guest1, "outcomes": soak.outcomes}
    ok = (alive and not unhealthy and not soak.bad and rss1 <= 1.10 * rss0
          and (guest0 is None or guest1 == guest0))
    result["passed"] = ok
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
