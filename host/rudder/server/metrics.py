"""GET /metrics in Prometheus' text format (written by hand: a few lines, no dependency).

Counters and gauges, and latency histograms: time to first token, inter-token latency (the gap
between consecutive steps that gave a request tokens), end-to-end latency and queue time (from
arrival until the engine took the request: waiting for a place plus starting its controller).
Every sample carries a `model_name` label, as vLLM's do. Counters are plain int/float adds by one
thread each; what both threads write (failures, histograms) takes a lock."""

from __future__ import annotations

import bisect
import collections
import threading
import time

_WINDOW_S = 10.0  # tokens/s is measured over this much recent time

# Bucket bounds in seconds (Prometheus' `le`), from a fast CPU step to a slow queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value
            self.count += 1

    def snapshot(self) -> tuple[list[int], float, int]:
        with self._lock:
            return list(self.counts), self.sum, self.count


def quantile(q: float, bounds, cumulative: list[float]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket that holds the
    q-th observation. `cumulative`: counts at each bound, then +Inf."""
    total = cumulative[-1]
    if total == 0:
        return float("nan")
    rank = q * total
    for i, c in enumerate(cumulative):
        if c >= rank:
            if i == len(bounds):  # in +Inf: the highest finite bound is all we know
                return bounds[-1]
            lo = bounds[i - 1] if i > 0 else 0.0
            below = cumulative[i - 1] if i > 0 else 0.0
            inside = c - below
            return lo + (bounds[i] - lo) * ((rank - below) / inside if inside else 1.0)
    return bounds[-1]


class Metrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.requests: collections.Counter = collections.Counter()   # (endpoint, status) -> count
        self.failures: collections.Counter = collections.Counter()   # error kind -> count
        self.cancelled = 0
        self.tokens_total = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of those, the prefix cache's
        self.sampled_tokens = 0
        self.ff_tokens = 0
        self.controller_s = 0.0
        self.forward_s = 0.0
        self.uploads = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.queue = Histogram()
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
        self.cached_tokens += u.cached_tokens
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

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        lines = []
        model = {"model_name": self.model_name}

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP rudder_{name} {help_}")
            lines.append(f"# TYPE rudder_{name} {kind}")
            for labels, value in samples:
                lines.append(f"rudder_{name}{_labels({**model, **labels})} {value}")

        def histogram(name, help_, h: Histogram):
            counts, total, n = h.snapshot()
            lines.append(f"# HELP rudder_{name} {help_}")
            lines.append(f"# TYPE rudder_{name} histogram")
            running = 0
            for bound, c in zip((*h.bounds, "+Inf"), counts):
                running += c
                lines.append(f"rudder_{name}_bucket{_labels({**model, 'le': bound})} {running}")
            lines.append(f"rudder_{name}_sum{_labels(model)} {round(total, 6)}")
            lines.append(f"rudder_{name}_count{_labels(model)} {n}")

        metric("requests_total", "counter", "HTTP requests by endpoint and status.",
               [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
        metric("failures_total", "counter", "Failed generations by kind (controller error kinds, engine_error...).",
               [({"kind": k}, n) for k, n in sorted(self.failures.items())])
        metric("cancelled_total", "counter", "Requests cancelled (client gone).", [({}, self.cancelled)])
        metric("tokens_total", "counter", "Tokens generated (sampled and fast-forwarded).", [({}, self.tokens_total)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
        metric("prefix_cache_hits_total", "counter", "Prompt tokens of finished requests whose KV came from the "
               "prefix cache.", [({}, self.cached_tokens)])
        metric("prefix_cache_hit_rate", "gauge", "Share of finished requests' prompt tokens found in the prefix cache.",
               [({}, round(self.cached_tokens / self.prompt_tokens, 6) if self.prompt_tokens else 0.0)])
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
        histogram("time_to_first_token_seconds", "From arrival to the first step that gave the request tokens.",
                  self.ttft)
        histogram("inter_token_latency_seconds", "Between consecutive steps that gave a request tokens.", self.itl)
        histogram("e2e_request_latency_seconds", "From arrival to the end of the request.", self.e2e)
        histogram("request_queue_time_seconds", "From arrival until the engine took the request (waiting for a "
                  "place, starting its controller).", self.queue)
        return "\n".join(lines) + "\n"


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
