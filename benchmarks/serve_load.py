"""Load on the HTTP server: N concurrent streaming clients, half of them constrained, on loopback.

    .venv/bin/python benchmarks/serve_load.py [--model smollm2] [--clients 32] [--requests 2]
        [--max-tokens 32] [--time-limit 600] [--json benchmarks/results/serve_load.json]

Starts `rudder serve` as a subprocess on 127.0.0.1 (a free port, a fresh state directory), warms
it up with one request of each kind, then each client sends `--requests` streaming requests one
after another, cycling through the mix: unconstrained (chat, a legacy completion, /v1/run with
fork 2, /v1/run with the backtrack controller) and constrained (response_format json_schema,
guided_regex, structured_outputs choice, a required tool call). Bounded: the run stops at
`--time-limit` seconds (unfinished requests count as errors).

Reported: time to first token, inter-token latency, end-to-end and queue time percentiles (p50,
p90, p99) from the server's own Prometheus histograms over the measured run (bucket counts after
minus before, interpolated as histogram_quantile does), the same TTFT/ITL as the clients saw them,
generated tokens/s, errors (goal: 0), and the server's RSS after warm-up and after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))

from rudder.server.metrics import LATENCY_BUCKETS, quantile  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
# (name, constrained, endpoint, extra body)
MIX = [
    ("chat", False, "/v1/chat/completions", {}),
    ("json_schema", True, "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}),
    ("completion", False, "/v1/completions", {}),
    ("guided_regex", True, "/v1/chat/completions", {"guided_regex": "[A-Z][a-z]{2,9} [0-9]{1,3}"}),
    ("run fork 2", False, "/v1/run", {"controller": "fork", "controller_arg": "2"}),
    ("choice", True, "/v1/chat/completions", {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("run backtrack", False, "/v1/run", {"controller": "backtrack", "controller_arg": " very"}),
    ("tool call", True, "/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required"}),
]
PROMPTS = ["Tell me about the sea.", "Is the sky blue?", "Describe a very big ship.", "Name a person and a number."]
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
              "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model: str, port: int, clients: int, max_tokens: int, state_dir: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "host") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "rudder.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(clients), "--max-queue", str(clients), "--max-tokens", str(max(max_tokens, 64)),
           "--state-dir", state_dir]
    log = open(Path(state_dir) / "server.log", "w+")  # a file: an unread pipe would block the server when full
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + (Path(proc.args[proc.args.index("--state-dir") + 1]) / "server.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def request_for(kind: tuple, i: int, max_tokens: int) -> tuple[str, dict]:
    name, _, path, extra = kind
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"max_tokens": max_tokens, "seed": i, "temperature": 0.8, "stream": True, **extra}
    if path == "/v1/completions":
        body.update(prompt=prompt, stream_options={"include_usage": True})
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        if path != "/v1/run":
            body["stream_options"] = {"include_usage": True}
    return path, body


async def one(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """Stream one request; returns its timings, token count and error (if any)."""
    t0 = time.perf_counter()
    first, last, gaps, tokens, error = None, None, [], 0, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev and ev.get("type") != "step":
                err = ev["error"]
                error = err.get("type", "error") + ": " + str(err.get("message", ""))[:120]
            if path == "/v1/run":
                n = sum(len(d["token_ids"]) for d in ev.get("deltas", []))
                tokens += n
            else:  # OpenAI chunks carry text, not tokens: count chunks that carry some
                n = sum(1 for ch in ev.get("choices", []) if ch.get("text") or (ch.get("delta") or {}).get("content")
                        or (ch.get("delta") or {}).get("tool_calls"))
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
            if n:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
    return {"ttft": first, "gaps": gaps, "tokens": tokens, "error": error}


async def client_loop(url: str, cid: int, kinds: list, n: int, max_tokens: int, results: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300)) as client:
        for k in range(n):
            i = cid * n + k
            path, body = request_for(kinds[i % len(kinds)], i, max_tokens)
            try:
                res = await one(client, path, body)
            except (httpx.HTTPError, ValueError) as e:
                res = {"error": f"{type(e).__name__}: {e}"}
            res["kind"] = kinds[i % len(kinds)][0]
            results.append(res)


async def load(url: str, clients: int, n: int, kinds: list, max_tokens: int, time_limit: float) -> tuple[list, float]:
    results: list = []
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(client_loop(url, c, kinds, n, max_tokens, results)) for c in range(clients)]
    done, pending = await asyncio.wait(tasks, timeout=time_limit)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    missing = clients * n - len(results)
    results.extend({"error": "time limit", "kind": "?"} for _ in range(missing))
    return results, time.perf_counter() - t0


def histogram_counts(metrics: str, name: str) -> list[float]:
    """Cumulative bucket counts of rudder_<name> (bounds LATENCY_BUCKETS, then +Inf)."""
    counts = {}
    for line in metrics.splitlines():
        m = re.match(rf'rudder_{name}_bucket{{.*le="([^"]+)".*}} (\S+)$', line)
        if m:
            counts[m.group(1)] = float(m.group(2))
    return [counts.get(str(b), 0.0) for b in LATENCY_BUCKETS] + [counts.get("+Inf", 0.0)]


def server_percentiles(before: str, after: str) -> dict:
    """p50/p90/p99 in ms of each histogram over the run (after minus before)."""
    out = {}
    for key, name in HISTOGRAMS.items():
        delta = [a - b for a, b in zip(histogram_counts(after, name), histogram_counts(before, name))]
        for q in (50, 90, 99):
            out[f"{key}_p{q}_ms"] = round(quantile(q / 100, LATENCY_BUCKETS, delta) * 1000, 1)
        out[f"{key}_count"] = int(delta[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=600)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 100):
        ap.error("--clients 1..64, --requests 1..100")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tempfile.TemporaryDirectory(prefix="serve-load-")
    proc = start_server(args.model, port, args.clients, args.max_tokens, state.name)
    try:
        wait_ready(url, proc)
        kinds = MIX
        # warm-up: every kind once (module init, token table, allocator pools), then measure RSS
        warm, _ = asyncio.run(load(url, len(kinds), 1, kinds, 8, args.time_limit))
        rss_before = rss_mb(proc.pid)
        metrics_before = httpx.get(url + "/metrics").text
        results, wall = asyncio.run(load(url, args.clients, args.requests, kinds, args.max_tokens, args.time_limit))
        time.sleep(1.0)
        rss_after = rss_mb(proc.pid)
        metrics = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        state.cleanup()

    ok = [r for r in results if not r.get("error")]
    errors = [r for r in results if r.get("error")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    pct = lambda xs, q: float(np.percentile(xs, q) * 1000) if xs else float("nan")  # noqa: E731
    row = {"model": args.model, "clients": args.clients, "requests": len(results), "kinds": [k[0] for k in kinds],
           "constrained": sum(1 for i in range(len(results)) if MIX[i % len(MIX)][1]),
           "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
           **server_percentiles(metrics_before, metrics),
           "client_ttft_p50_ms": round(pct(ttft, 50), 1), "client_ttft_p99_ms": round(pct(ttft, 99), 1),
           "client_itl_p50_ms": round(pct(gaps, 50), 1), "client_itl_p99_ms": round(pct(gaps, 99), 1),
           "errors": len(errors), "warmup_errors": sum(1 for r in warm if r.get("error")),
           "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
           "rss_change_pct": round(100 * (rss_after - rss_before) / rss_before, 1),
           "kv_cache_usage_after": next((line.split()[-1] for line in metrics.splitlines()
                                         if line.startswith("rudder_kv_cache_usage_ratio")), "?")}
    print(f"serve_load: {args.clients} concurrent streams x {args.requests} requests ({row['constrained']} of "
          f"{len(results)} constrained), max_tokens {args.max_tokens}, model {args.model}")
    print(f"mix: {', '.join(row['kinds'])}")
    print("\n| from the server's histograms | p50 ms | p90 ms | p99 ms | count |\n| --- | --- | --- | --- | --- |")
    for key, label in (("ttft", "time to first token"), ("itl", "inter-token latency"), ("e2e", "end to end"),
                       ("queue", "queue time")):
        print(f"| {label} | {row[key + '_p50_ms']} | {row[key + '_p90_ms']} | {row[key + '_p99_ms']} | "
              f"{row[key + '_count']} |")
    print("\n| metric | value |\n| --- | --- |")
    for key in ("wall_s", "tokens", "tokens_per_s", "client_ttft_p50_ms", "client_ttft_p99_ms", "client_itl_p50_ms",
                "client_itl_p99_ms", "errors", "warmup_errors", "rss_before_mb", "rss_after_mb", "rss_change_pct",
                "kv_cache_usage_after"):
        print(f"| {key} | {row[key]} |")
    for r in errors[:5]:
        print(f"error ({r['kind']}): {r['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
