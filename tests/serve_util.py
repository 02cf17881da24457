"""A real rudder server on loopback for the tests (uvicorn in a thread, a free port), and an
SSE reader."""

from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn

from rudder.server import ServerConfig, create_app


class LiveServer:
    def __init__(self, config: ServerConfig):
        self.app = create_app(config)
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

    def metrics(self) -> dict[str, float]:
        """/metrics as {name{labels}: value}."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


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
