"""Load on the HTTP server: N concurrent streaming clients with mixed controllers, on loopback.

    .venv/bin/python benchmarks/serve_load.py [--model smollm2] [--clients 8] [--requests 3]
        [--max-tokens 32] [--time-limit 300] [--json benchmarks/results/serve_load.json]

Starts `rudder serve` as a subprocess on 127.0.0.1 (a free port), warms it up with one request
of each kind, then each client sends `--requests` streaming requests one after another, cycling
through the mix (no controller, fork 2, force, choices, backtrack, and json/regex when those
built-ins exist; every fourth request goes through /v1/chat/completions). Bounded: the run stops
at `--time-limit` seconds (unfinished requests count as errors).

Reported: generated tokens/s (all clients), time to first token (first event carrying tokens)
and inter-token latency (gap between token-carrying events) p50/p99, errors (goal: 0), and the
server's RSS after warm-up and after the load (goal: back within 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

MIX = [
    ("none", None, ""),
    ("fork", "fork", "2"),
    ("force", "force", "Once upon a time"),
    ("choices", "choices", '["yes", "no", "maybe"]'),
    ("backtrack", "backtrack", " very"),
    ("json", "json", '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'),
    ("regex", "regex", "[A-Z][a-z]+ [0-9]{1,3}"),
]
PROMPTS = ["Tell me about the sea.", "Is the sky blue?", "Describe a very big ship.", "Name a person and a number."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model: str, port: int, clients: int, max_tokens: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "host") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "rudder.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(clients), "--max-queue", str(clients), "--max-tokens", str(max(max_tokens, 64))]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + proc.stderr.read()[-3000:])
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def request_for(kind: tuple, i: int, max_tokens: int) -> tuple[str, dict]:
    name, controller, arg = kind
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 4 == 3 and controller not in ("fork", "choices", "backtrack", "force"):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": True, "seed": i, "stream_options": {"include_usage": True}}
        if name == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(arg)}}
        elif name == "regex":
            body["rudder"] = {"regex": arg}
        return "/v1/chat/completions", body
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "seed": i,
            "temperature": 0.8}
    if controller is not None:
        body.update(controller=controller, controller_arg=arg)
    return "/v1/run", body


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
                error = ev["error"].get("type", "error") + ": " + ev["error"].get("message", "")[:120]
            if path == "/v1/run":
                n = sum(len(d["token_ids"]) for d in ev.get("deltas", []))
            else:  # OpenAI chunks carry text, not tokens: count chunks that carry some
                n = sum(1 for ch in ev.get("choices", []) if ch.get("delta", {}).get("content"))
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
            if n:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                if path == "/v1/run":
                    tokens += n
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 100):
        ap.error("--clients 1..64, --requests 1..100")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, port, args.clients, args.max_tokens)
    try:
        wait_ready(url, proc)
        tags = httpx.get(url + "/v1/controllers/tags").json()["tags"]
        kinds = [k for k in MIX if k[1] is None or k[1] in tags]
        # warm-up: every kind once (module init, token table, allocator pools), then measure RSS
        warm, _ = asyncio.run(load(url, len(kinds), 1, kinds, 8, args.time_limit))
        rss_before = rss_mb(proc.pid)
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

    ok = [r for r in results if not r.get("error")]
    errors = [r for r in results if r.get("error")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    pct = lambda xs, q: float(np.percentile(xs, q) * 1000) if xs else float("nan")  # noqa: E731
    row = {"model": args.model, "clients": args.clients, "requests": len(results), "kinds": [k[0] for k in kinds],
           "wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
           "ttft_p50_ms": round(pct(ttft, 50), 1), "ttft_p99_ms": round(pct(ttft, 99), 1),
           "itl_p50_ms": round(pct(gaps, 50), 1), "itl_p99_ms": round(pct(gaps, 99), 1),
           "errors": len(errors), "warmup_errors": sum(1 for r in warm if r.get("error")),
           "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
           "rss_change_pct": round(100 * (rss_after - rss_before) / rss_before, 1),
           "kv_blocks_free_after": next((line.split()[-1] for line in metrics.splitlines()
                                         if line.startswith("rudder_kv_blocks_free")), "?")}
    print(f"serve_load: {args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, "
          f"model {args.model}, mix {', '.join(row['kinds'])}")
    print("| metric | value |\n| --- | --- |")
    for key in ("wall_s", "tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "errors", "warmup_errors", "rss_before_mb", "rss_after_mb", "rss_change_pct", "kv_blocks_free_after"):
        print(f"| {key} | {row[key]} |")
    for r in errors[:5]:
        print(f"error ({r['kind']}): {r['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
