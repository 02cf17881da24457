"""Soak: two `rudder serve` replicas on one PostgreSQL, many clients uploading, tagging and
running, while one replica is SIGKILLed and restarted twice and PostgreSQL restarts once.

    .venv/bin/python benchmarks/replicas_soak.py [--minutes 3] [--clients 16] [--model tiny:1]
                                                 [--json benchmarks/results/replicas_soak.json]

Starts a throwaway PostgreSQL cluster on loopback (tests/pg_util.py), API keys in it for four
tenants, and two replicas (`--state-url`). `--clients` threads, each acting for one tenant
through a replica picked at random per request (as a load balancer would, sending a request the
replica refuses to connect to the other one), upload new modules,
move their own tags among the modules they uploaded, and run requests naming those tags. At 1/4
and 3/4 of the time replica B is SIGKILLed and started again; at 1/2 PostgreSQL is stopped for
3 s and started again. After the load: the latency of a tag deletion and of a key revocation
reaching the other replica (10 rounds each, polled every 5 ms), then the check, straight from
the database: every acknowledged upload is there, whole; every tag names the module of its last
acknowledged move (or of a later move whose answer was lost to a kill or a 503); no request hung
(each has a 60 s timeout); every other failure was a request cut by a kill or a 503 that says
why; replica A logged the database going and coming back. Exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "tests"))

from controller_wat import controller_wat, wasm_of  # noqa: E402
from pg_util import PostgresCluster  # noqa: E402

from rudder.server.postgres_store import PostgresStore  # noqa: E402

TENANTS = [f"tenant-{i}" for i in range(4)]
REQUEST_TIMEOUT_S = 60


def module(i: int) -> bytes:
    return bytes(wasm_of(controller_wat(extra=f'(data (i32.const 0x300) "soak module {i}")')))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    def __init__(self, name: str, url: str, model: str, folder: Path):
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "rudder.cli", "serve", "--model", model, "--port", str(self.port),
                     "--state-url", url, "--max-modules", "100000"]
        self.log = open(folder / f"replica-{name}.log", "ab")
        self.proc = None

    def start(self) -> float:
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class Client(threading.Thread):
    def __init__(self, k: int, replicas, keys: dict, stop: threading.Event, next_index, seed: int):
        super().__init__(daemon=True)
        self.k, self.replicas, self.stop_event, self.next_index = k, replicas, stop, next_index
        self.tenant = TENANTS[k % len(TENANTS)]
        self.headers = {"Authorization": f"Bearer {keys[self.tenant]}"}
        self.rng = random.Random(seed)
        self.acked_modules: dict[str, bytes] = {}
        self.tags: dict[str, dict] = {}  # tag -> {"acked": module id or None, "maybe": set of module ids}
        self.outcomes: collections.Counter = collections.Counter()
        self.hangs = 0
        self.unexplained: list[str] = []
        self.latencies: dict[str, list[float]] = collections.defaultdict(list)

    def request(self, what: str, method: str, path: str, **kw):
        first = self.rng.randrange(len(self.replicas))
        t0 = time.monotonic()
        for replica in (self.replicas[first], self.replicas[1 - first]):
            try:
                r = httpx.request(method, replica.base + path, headers=self.headers, timeout=REQUEST_TIMEOUT_S, **kw)
                break
            except httpx.ConnectError:  # not listening (killed, restarting): the load balancer tries the other
                self.outcomes[f"{what} refused, sent to the other replica"] += 1
            except httpx.TimeoutException:
                self.hangs += 1
                self.outcomes[f"{what} timeout"] += 1
                return None
            except httpx.TransportError:  # the replica died while answering: the outcome is unknown
                self.outcomes[f"{what} cut by a kill"] += 1
                return None
        else:
            return None
        self.latencies[what].append(time.monotonic() - t0)
        error = r.json().get("error", {}) if r.status_code != 200 else {}
        self.outcomes[f"{what} {r.status_code}{' ' + str(error.get('code')) if error else ''}"] += 1
        if r.status_code != 200:
            if r.status_code != 503 or error.get("code") not in ("registry_unavailable", "compile_busy"):
                self.unexplained.append(f"{what} {r.status_code} {r.text[:200]}")
        return r

    def run(self) -> None:
        while not self.stop_event.is_set():
            action = self.rng.choices(["upload", "tag", "run"], [3, 3, 4])[0]
            if action == "upload" or not self.acked_modules:
                wasm = module(self.next_index())
                r = self.request("upload", "POST", "/v1/controllers", content=wasm)
                if r is not None and r.status_code == 200:
                    self.acked_modules[r.json()["module_id"]] = wasm
            elif action == "tag" or not self.tags:
                name = f"c{self.k}-t{self.rng.randrange(3)}"
                mid = self.rng.choice(list(self.acked_modules))
                state = self.tags.setdefault(name, {"acked": None, "maybe": set()})
                r = self.request("tag", "POST", "/v1/controllers/tags", json={"tag": name, "module_id": mid})
                if r is not None and r.status_code == 200:
                    state["acked"], state["maybe"] = mid, set()
                else:  # lost to a kill or a 503: it may or may not have been committed
                    state["maybe"].add(mid)
            else:
                name = self.rng.choice([t for t, s in self.tags.items() if s["acked"]] or [None])
                if name is None:
                    continue
                self.request("run", "POST", "/v1/run", json={"controller": name, "prompt": "x", "max_tokens": 8,
                                                             "stream": False, "ignore_eos": True})


def propagation(replicas, store: PostgresStore, keys_admin: str, rounds: int = 10) -> dict:
    """Seconds from a change's acknowledgement on replica A to replica B acting on it."""
    a, b = replicas
    admin = {"Authorization": f"Bearer {keys_admin}"}
    tag_s, key_s = [], []
    with httpx.Client(timeout=30) as c:
        mid = c.post(a.base + "/v1/controllers", content=module(10 ** 8), headers=admin).json()["module_id"]
        run = {"prompt": "x", "max_tokens": 1, "stream": False}
        for i in range(rounds):
            name = f"probe-{i}"
            assert c.post(a.base + "/v1/controllers/tags", json={"tag": name, "module_id": mid},
                          headers=admin).status_code == 200
            while c.post(b.base + "/v1/run", json={**run, "controller": name}, headers=admin).status_code != 200:
                time.sleep(0.005)
            assert c.delete(a.base + f"/v1/controllers/tags/{name}", headers=admin).status_code == 200
            t0 = time.monotonic()
            while c.post(b.base + "/v1/run", json={**run, "controller": name}, headers=admin).status_code != 404:
                time.sleep(0.005)
            tag_s.append(time.monotonic() - t0)

            key = f"sk-probe-{i}-{random.random()}"
            key_id = store.add_key(key, "user", "probe")
            while c.get(b.base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code != 200:
                time.sleep(0.005)
            store.revoke_key(key_id)
            t0 = time.monotonic()
            while c.get(b.base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code != 401:
                time.sleep(0.005)
            key_s.append(time.monotonic() - t0)
    return {"tag_delete_s": sorted(tag_s), "key_revoke_s": sorted(key_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", default="tiny:1")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="rudder-soak-"))
    events: list[str] = []
    t_start = time.monotonic()

    def note(text: str) -> None:
        line = f"[{time.monotonic() - t_start:7.1f} s] {text}"
        events.append(line)
        print(line, flush=True)

    with PostgresCluster() as pg:
        url = pg.new_database()
        store = PostgresStore(url, listen=False)
        keys = {t: f"sk-{t}-{random.random()}" for t in [*TENANTS, "ops"]}
        for t in TENANTS:
            store.add_key(keys[t], "user", t)
        store.add_key(keys["ops"], "admin", "ops")
        replicas = [Replica("a", url, args.model, folder), Replica("b", url, args.model, folder)]
        try:
            for r in replicas:
                note(f"replica {r.name} up in {r.start():.1f} s")
            stop, counter, lock = threading.Event(), itertools.count(), threading.Lock()

            def next_index() -> int:
                with lock:
                    return next(counter)

            clients = [Client(k, replicas, keys, stop, next_index, seed=k) for k in range(args.clients)]
            for c in clients:
                c.start()
            note(f"{args.clients} clients running for {args.minutes:g} min")
            duration = args.minutes * 60
            plan = [(duration / 4, "kill-b"), (duration / 2, "restart-pg"), (3 * duration / 4, "kill-b"),
                    (duration, "end")]
            for at, what in plan:
                time.sleep(max(0.0, at - (time.monotonic() - t_start)))
                if what == "kill-b":
                    replicas[1].kill()
                    note("replica b SIGKILLed")
                    note(f"replica b up again in {replicas[1].start():.1f} s")
                elif what == "restart-pg":
                    pg.stop("fast")
                    note("PostgreSQL stopped")
                    time.sleep(3)
                    pg.start()
                    note("PostgreSQL started")
            stop.set()
            for c in clients:
                c.join(REQUEST_TIMEOUT_S + 10)
            note("load stopped")
            lat = propagation(replicas, store, keys["ops"])
            note(f"tag deletion reaching replica b: median {lat['tag_delete_s'][5] * 1000:.0f} ms, "
                 f"max {lat['tag_delete_s'][-1] * 1000:.0f} ms; key revocation: median "
                 f"{lat['key_revoke_s'][5] * 1000:.0f} ms, max {lat['key_revoke_s'][-1] * 1000:.0f} ms")

            # -- the check, from the database ---------------------------------------------------------
            listed = {m["module_id"] for m in store.modules()}
            acked = {mid: wasm for c in clients for mid, wasm in c.acked_modules.items()}
            lost = [mid for mid in acked if mid not in listed]
            broken = [mid for mid in acked if mid in listed and store.module_bytes(mid) != acked[mid]]
            tags = {t["tag"]: t["module_id"] for t in store.tags()}
            wrong_tags = []
            for c in clients:
                for name, state in c.tags.items():
                    allowed = {state["acked"], *state["maybe"]} - {None}
                    if state["acked"] is not None and tags.get(name) not in allowed:
                        wrong_tags.append((name, tags.get(name), state))
            outcomes = sum((c.outcomes for c in clients), collections.Counter())
            hangs = sum(c.hangs for c in clients)
            unexplained = [u for c in clients for u in c.unexplained]
            note(f"the replicas' logs are in {folder}")
            logs = {r.name: (folder / f"replica-{r.name}.log").read_text(errors="replace") for r in replicas}
            said = {name: [ln for ln in text.splitlines() if "registry database" in ln] for name, text in logs.items()}
            lat_all = collections.defaultdict(list)
            for c in clients:
                for what, values in c.latencies.items():
                    lat_all[what].extend(values)
            percentiles = {what: {"n": len(v), "p50_ms": round(sorted(v)[len(v) // 2] * 1000, 1),
                                  "p99_ms": round(sorted(v)[int(len(v) * 0.99)] * 1000, 1),
                                  "max_ms": round(max(v) * 1000, 1)} for what, v in lat_all.items() if v}
            acked_tags = sum(1 for c in clients for s in c.tags.values() if s["acked"])
            summary = {
                "minutes": args.minutes, "clients": args.clients, "model": args.model,
                "acknowledged_uploads": len(acked), "modules_in_database": len(listed),
                "acknowledged_tags": acked_tags, "lost_uploads": len(lost), "broken_uploads": len(broken),
                "wrong_tags": len(wrong_tags), "hangs": hangs, "unexplained_failures": unexplained[:20],
                "outcomes": dict(sorted(outcomes.items())), "latency": percentiles, "propagation": lat,
                "events": events, "replica_log_lines": said,
            }
            # Replica a, never killed, saw the database go and come back.
            ok = not lost and not broken and not wrong_tags and hangs == 0 and not unexplained and \
                any("unreachable" in ln for ln in said["a"]) and any("is back after" in ln for ln in said["a"])
            summary["ok"] = ok
            print(json.dumps({k: v for k, v in summary.items() if k not in ("events",)}, indent=1))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(summary, indent=1))
            return 0 if ok else 1
        finally:
            for r in replicas:
                r.stop()
            store.close()


if __name__ == "__main__":
    sys.exit(main())
