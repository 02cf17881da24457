"""Sampling's cost per step: the CPU's native passes (native/sample.c) against torch's own way
(the GPU's: x / T, softmax, the top-k / top-p / min-p cuts, cumsum, searchsorted), in one run.

    .venv/bin/python benchmarks/sampling.py [--rows 16] [--steps 200] [--threads 1] [--json FILE]

Each case samples `--rows` rows of SmolLM2's 49152-token vocabulary at temperature 0.8: peaked
rows (a few likely tokens over a spread tail, as a language model's) under temperature alone,
top_p 0.95, top_k 50 and min_p 0.05, and flat rows (every token about as likely) under top_p 0.9,
where no short list of likely tokens holds the nucleus. The logits are copied in before each
timed step (the sampler writes its masks into them); the copy is not timed. Reported: the median
and p90 milliseconds a step per way, and torch's over native's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))

from rudder.engine import sampler as S  # noqa: E402
from rudder.engine.sequence import SamplingParams  # noqa: E402

VOCAB = 49152
CASES = [("temperature", {}, True), ("top_p 0.95", {"top_p": 0.95}, True), ("top_k 50", {"top_k": 50}, True),
         ("min_p 0.05", {"min_p": 0.05}, True), ("flat, top_p 0.9", {"top_p": 0.9}, False)]


def logits(rows: int, peaked: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, VOCAB, generator=gen) * (2.0 if peaked else 0.5)
    if peaked:
        x[:, :5] += 12.0
    return x


def torch_way(x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> torch.Tensor:
    """The Sampler's way before sample.c (the GPU's now): the weights, then an in-place cumsum."""
    cdf = S._torch_weights(x, params).cumsum_(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(torch.tensor(u) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def native_way(out: torch.Tensor, x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> torch.Tensor:
    """The Sampler's way now: the weights into a buffer kept across steps, then the draw."""
    return S.draw(S.sampling_weights(x, params, out), u)


def time_way(fn, x: torch.Tensor, steps: int) -> list[float]:
    buf, out = x.clone(), []
    for i in range(steps + 5):
        buf.copy_(x)
        t = time.perf_counter()
        fn(buf)
        if i >= 5:
            out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (the engine's sampling runs on its own)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if S._native(torch.zeros(1, 16)) is None:
        sys.exit("sampling.py: the native library is not built here (rudder.native.unavailable_reason)")
    out = torch.empty(args.rows, VOCAB)
    u = np.random.default_rng(1).random(args.rows).tolist()
    print(f"sampling.py: {args.rows} rows x {VOCAB}, temperature 0.8, {args.steps} steps, torch threads {args.threads}\n")
    print("| case | torch ms (median / p90) | native ms (median / p90) | torch / native |\n| --- | ---: | ---: | ---: |")
    rows = []
    for name, cut, peaked in CASES:
        x = logits(args.rows, peaked)
        params = [SamplingParams(temperature=0.8, **cut)] * args.rows
        a = time_way(lambda b: torch_way(b, params, u), x, args.steps)
        b = time_way(lambda b: native_way(out, b, params, u), x, args.steps)
        q = {k: (statistics.median(v), sorted(v)[int(0.9 * len(v))]) for k, v in (("torch", a), ("native", b))}
        ratio = q["torch"][0] / q["native"][0]
        print(f"| {name} | {q['torch'][0]:.2f} / {q['torch'][1]:.2f} | {q['native'][0]:.2f} / {q['native'][1]:.2f} "
              f"| {ratio:.1f}x |")
        rows.append({"case": name, "torch_median_ms": q["torch"][0], "torch_p90_ms": q["torch"][1],
                     "native_median_ms": q["native"][0], "native_p90_ms": q["native"][1], "ratio": ratio})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": args.rows, "threads": args.threads, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
