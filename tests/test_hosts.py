"""Two hosts for real: two network namespaces joined by a veth pair, each with its own address
(198.18.0.0/15, the range set aside for such tests), PostgreSQL listening in the first.

- A `rudder serve` replica in each namespace on the one database: an upload and a tag made
  through one are served by the other.
- A 2-stage pipeline under `torchrun --nnodes 2`, one stage per namespace: the same output as one
  process, and a stage killed mid-request ends it with an error and later requests with a 503.

Creating namespaces needs root (CI has it); without root these tests are skipped, saying so.
Nothing here reaches an address but the namespaces' own."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from pg_util import PostgresCluster
from rudder.cli import app
from serve_util import REPO, sse_events
from test_auth_registry import module

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it creates network namespaces joined by "
                                                             "a veth pair (ip netns), as CI's root can"),
              pytest.mark.timeout(300)]  # servers and a pipeline start in each test (~20 s when the host is idle)

ADDRESS = {"a": "198.18.0.1", "b": "198.18.0.2"}
PG_PORT, HTTP_PORT, MASTER_PORT = 5432, 8000, 29500
CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """The two namespaces ("a", "b"), and the processes started in them."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = {h: f"rudder-{tag}-{h}" for h in "ab"}
        self.procs: list[subprocess.Popen] = []
        veth = {h: f"rdv{tag}{h}" for h in "ab"}
        for h in "ab":
            _ip("netns", "add", self.ns[h])
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for h in "ab":
            _ip("link", "set", veth[h], "netns", self.ns[h])
            _ip("-n", self.ns[h], "addr", "add", f"{ADDRESS[h]}/24", "dev", veth[h])
            _ip("-n", self.ns[h], "link", "set", veth[h], "up")
            _ip("-n", self.ns[h], "link", "set", "lo", "up")

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def start(self, host: str, args: list[str], log) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "host"), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([*self.prefix(host), sys.executable, *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def call(self, host: str, fn, *args):
        """`fn(*args)` on a thread of its own inside `host`'s namespace (setns moves only the
        calling thread), so its sockets are that host's."""
        out = {}

        def target():
            try:
                fd = os.open(f"/var/run/netns/{self.ns[host]}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns")
                finally:
                    os.close(fd)
                out["value"] = fn(*args)
            except BaseException as e:  # re-raised on the test's thread
                out["error"] = e

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for p in [*psutil.Process(proc.pid).children(recursive=True), proc]:
                    with contextlib.suppress(psutil.Error, ProcessLookupError):
                        p.kill()
                proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        for h in "ab":
            subprocess.run(["ip", "netns", "del", self.ns[h]], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    try:
        with PostgresCluster(host=ADDRESS["a"], port=PG_PORT, prefix=h.prefix("a")) as pg:
            h.pg = pg
            yield h
    finally:
        h.close()


def _up(url: str, proc: subprocess.Popen, log, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, _tail(log)
        assert time.monotonic() < deadline, "the server did not come up:\n" + _tail(log)
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def _tail(log) -> str:
    log.flush()
    with open(log.name, errors="replace") as f:
        return f.read()[-3000:]


def test_replicas_in_two_namespaces_share_one_database(hosts):
    url = hosts.pg.new_database()
    logs = {h: tempfile.NamedTemporaryFile(prefix=f"rudder-host-{h}-", suffix=".log") for h in "ab"}
    procs = {h: hosts.start(h, ["-m", "rudder.cli", "serve", "--model", "tiny:1", "--host", ADDRESS[h], "--port",
                                str(HTTP_PORT), "--state-url", url], logs[h]) for h in "ab"}
    base = {h: f"http://{ADDRESS[h]}:{HTTP_PORT}" for h in "ab"}
    try:
        for h in "ab":
            hosts.call(h, _up, base[h], procs[h], logs[h])

        def client_on_b():
            with httpx.Client(timeout=60) as c:
                # Through host a (over the veth): upload and tag.
                mid = c.post(base["a"] + "/v1/controllers", content=module(600)).json()["module_id"]
                tag = c.post(base["a"] + "/v1/controllers/tags", json={"tag": "across", "module_id": mid})
                assert tag.status_code == 200, tag.text
                # Served by host b, which learnt of the tag from the database.
                deadline = time.monotonic() + 30
                while True:
                    r = c.post(base["b"] + "/v1/run", json={"controller": "across", "prompt": "x", "max_tokens": 3,
                                                            "stream": False, "ignore_eos": True})
                    if r.status_code == 200 or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
                listed = {m["module_id"]: m for m in c.get(base["b"] + "/v1/controllers").json()["data"]}
                assert listed[mid]["tags"] == ["across"]

        hosts.call("b", client_on_b)
        # Each replica reached the database from its own address.
        clients = hosts.pg.psql("SELECT DISTINCT client_addr FROM pg_stat_activity WHERE application_name = 'rudder'")
        assert set(clients.split()) == {ADDRESS["a"] + "/32", ADDRESS["b"] + "/32"} or \
            set(clients.split()) == {ADDRESS["a"], ADDRESS["b"]}, clients
    finally:
        for proc in procs.values():
            hosts.stop(proc)


MODEL = "tiny:4"


def test_pipeline_stages_in_two_namespaces(hosts):
    """`rudder serve --pipeline-stages 2` under `torchrun --nnodes 2`: rank 0 (HTTP, stage 0) in
    host a, rank 1 in host b. Greedy output equals one process's; SIGKILL of rank 1 during a
    request ends that request with an engine error and the next with a 503."""
    want = CliRunner().invoke(app, ["generate", "-m", MODEL, "-t", "0", "-n", "8", "hello"]).stdout.rstrip("\n")
    logs = {h: tempfile.NamedTemporaryFile(prefix=f"rudder-stage-{h}-", suffix=".log") for h in "ab"}
    agents = {h: hosts.start(h, ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                 "--node-rank", str("ab".index(h)), "--master-addr", ADDRESS["a"], "--master-port",
                                 str(MASTER_PORT), "-m", "rudder.cli", "serve", "-m", MODEL, "--pipeline-stages", "2",
                                 "--host", ADDRESS["a"], "--port", str(HTTP_PORT + 1)], logs[h]) for h in "ab"}
    url = f"http://{ADDRESS['a']}:{HTTP_PORT + 1}"
    try:
        hosts.call("a", _up, url, agents["a"], logs["a"])

        def same_output():
            r = httpx.post(url + "/v1/run", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                  "stream": False}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text

        hosts.call("a", same_output)
        [stage] = [p for p in psutil.Process(agents["b"].pid).children(recursive=True) if "rudder.cli" in p.cmdline()]

        def killed_mid_request():
            with httpx.Client(base_url=url, timeout=60) as c:
                with c.stream("POST", "/v1/run", json={"prompt": "hello", "max_tokens": 1000, "ignore_eos": True,
                                                       "temperature": 0}) as stream:
                    events = sse_events(stream)
                    assert next(events)["type"] == "step"
                    stage.send_signal(signal.SIGKILL)
                    killed = time.monotonic()
                    ends = [e for e in events if e != "[DONE]" and e["type"] in ("error", "done")]
                    ended = time.monotonic() - killed
                failure = ends[-1]["error"] if "error" in ends[-1] else ends[-1]["choices"][0]
                # Behaviour, not speed: the lost connection is seen at once, not at the 60 s timeout.
                assert ended < 20, ended
                r = c.post("/v1/run", json={"prompt": "hello", "max_tokens": 4, "stream": False})
                assert r.status_code == 503 and r.json()["error"]["type"] == "engine_error", r.text
                assert "pipeline failed" in r.json()["error"]["message"]
                assert c.get("/healthz").json()["status"] == "failed"
                return failure

        failure = hosts.call("a", killed_mid_request)
        assert "pipeline failed" in str(failure), failure
    finally:
        for proc in agents.values():
            hosts.stop(proc)
