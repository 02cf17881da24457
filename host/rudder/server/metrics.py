"""Counters for GET /metrics, in Prometheus' text format (written by hand: a few lines, no
dependency). Each counter is written by one thread (failures by both, under a lock); plain int/float adds."""

from __future__ import annotations

import collections
import threading
import time

_WINDOW_S = 10.0  # tokens/s is measured over this much recent time


class Metrics:
    def __init__(self):
        self.requests: collections.Counter = collections.Counter()   # (endpoint, status) -> count
        self.failures: collections.Counter = collections.Counter()   # error kind -> count
        self.cancelled = 0
        self.tokens_total = 0
        self.prompt_tokens = 0
        self.sampled_tokens = 0
        self.ff_tokens = 0
        self.controller_s = 0.0
        self.forward_s = 0.0
        self.uploads = 0
        self._recent: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self._lock = threading.Lock()  # for what both threads count

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] += 1

    def add_tokens(self, n: int) -> None:
        if n:
            self.tokens_total += n
            self._recent.append((time.monotonic(), n))

    def finished(self, result) -> None:
        u = result.usage
        self.prompt_tokens += result.prompt_tokens
        self.sampled_tokens += u.sampled_tokens
        self.ff_tokens += u.ff_tokens
        self.controller_s += u.controller_s
        self.forward_s += u.forward_s

    def tokens_per_second(self) -> float:
        cutoff = time.monotonic() - _WINDOW_S
        recent = list(self._recent)  # a copy: the engine thread appends meanwhile
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for t, n in recent if t >= cutoff) / _WINDOW_S

    def render(self, gauges: dict[str, float]) -> str:
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP rudder_{name} {help_}")
            lines.append(f"# TYPE rudder_{name} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"rudder_{name}{label} {value}")

        metric("requests_total", "counter", "HTTP requests by endpoint and status.",
               [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
        metric("failures_total", "counter", "Failed generations by kind (controller error kinds, engine_error...).",
               [({"kind": k}, n) for k, n in sorted(self.failures.items())])
        metric("cancelled_total", "counter", "Requests cancelled (client gone).", [({}, self.cancelled)])
        metric("tokens_total", "counter", "Tokens generated (sampled and fast-forwarded).", [({}, self.tokens_total)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
        metric("sampled_tokens_total", "counter", "Sampled tokens of finished requests.", [({}, self.sampled_tokens)])
        metric("ff_tokens_total", "counter", "Fast-forwarded tokens of finished requests.", [({}, self.ff_tokens)])
        metric("controller_seconds_total", "counter", "Time in controllers' mid_process (finished requests).",
               [({}, round(self.controller_s, 6))])
        metric("forward_seconds_total", "counter", "Forward-pass time attributed to finished requests.",
               [({}, round(self.forward_s, 6))])
        metric("uploads_total", "counter", "Controller modules uploaded.", [({}, self.uploads)])
        metric("tokens_per_second", "gauge", f"Tokens generated per second over the last {_WINDOW_S:g} s.",
               [({}, round(self.tokens_per_second(), 3))])
        for name, (help_, value) in gauges.items():
            metric(name, "gauge", help_, [({}, value)])
        return "\n".join(lines) + "\n"
