"""A real rudder server on loopback for the tests (uvicorn in a thread, a free port, a state
directory of its own unless given one), `rudder serve` as a subprocess where process behaviour
matters, and an SSE reader."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from rudder.server import ServerConfig, create_app


REPO = Path(__file__).resolve().parents[1]

# Forces the argument's tokens, then takes the last two back and samples on to 8 tokens: a
# stream with a visible backtrack.
REWIND_C = r'''
#include "rudder.h"
static uint32_t *forced, n_forced;
int controller_start(const char *arg, uint32_t len) {
    forced = rudder_tokenize(arg, len, &n_forced);
    return forced && n_forced >= 2 ? 0 : 1;
}
void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index == 0) {
        rudder_out_ff(out, forced, n_forced);
        return;
    }
    if (step->index == 1) {
        rudder_log("rewind: taking 2 tokens back\n");
        rudder_out_sample(out, NULL)->backtrack = 2;
        return;
    }
    if (step->n_seq - step->n_prompt < 8)
        rudder_out_sample(out, NULL);
}
'''


def build_rewind(folder: Path) -> bytes:
    """REWIND_C built into a module (zig; cached by the build's inputs)."""
    from rudder.controller.build import build_controller

    (folder / "rewind.c").write_text(REWIND_C)
    return build_controller([folder / "rewind.c"], folder / "rewind.wasm").read_bytes()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, without the model_name label every sample has."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            out[name] = float(value)
    return out


class LiveServer:
    def __init__(self, config: ServerConfig, llm=None):
        """`llm`: a ready LLM to serve instead of loading `config.model` (it stays the caller's)."""
        if config.state_dir is None:  # never the user's $RUDDER_HOME/server
            self._state = tempfile.TemporaryDirectory(prefix="rudder-state-")
            config.state_dir = self._state.name
        self.config = config
        self.app = create_app(config, llm)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 300
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def metrics(self, **kw) -> dict[str, float]:
        """/metrics as {name{labels}: value} (model_name dropped)."""
        return parse_metrics(httpx.get(self.url + "/metrics", **kw).text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`rudder serve` in a process of its own (for kill -9, restarts, replicas). `forked=True`
    forks it from the tests' zygote (tests/zygote.py): the same CLI, without 1.3 s of imports."""

    def __init__(self, *args: str, model: str = "tiny", env: dict | None = None, forked: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["serve", "--model", model, "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "host"), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        self.forked = forked
        self.proc = None
        self.log = tempfile.NamedTemporaryFile(prefix="rudder-serve-", suffix=".log")

    def start(self, timeout: float = 240) -> "ServeProcess":
        if self.forked:
            from zygote import zygote

            self.proc = zygote().spawn(self.args, self.env, Path(self.log.name), Path(self.log.name))
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "rudder.cli", *self.args], env=self.env,
                                         stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rudder serve exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("rudder serve did not start:\n" + self.output()[-3000:])

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        died = self.proc is not None and self.proc.poll()
        self.stop()
        if exc[0] is not None:  # a failing test shows what the server said (pytest prints stderr)
            print(f"rudder serve (exit {died if died is not None else 'after the test'}):\n{self.output()[-4000:]}",
                  file=sys.stderr)


def sse_events(response: httpx.Response):
    """The JSON payloads of a Server-Sent Events response ("[DONE]" stays a string)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def apply_deltas(texts: dict[int, str], deltas: list[dict]) -> None:
    """What a client does with /v1/run deltas: delete `backtrack` characters, then append."""
    for d in deltas:
        text = texts.get(d["branch"], "")
        if d["backtrack"]:
            text = text[: len(text) - d["backtrack"]]
        texts[d["branch"]] = text + d["text"]
