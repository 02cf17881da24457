"""What tracing a request costs per step (`trace=True`, `"trace": true` over HTTP).

    .venv/bin/python benchmarks/trace_cost.py [--steps 240] [--batches 1,4] [--temperature 0]
                                              [--dtype auto] [--json benchmarks/results/trace_cost.json]
    PYTHONPATH=host python3 benchmarks/trace_cost.py --model tiny --device cuda --batches 1,16

SmolLM2 (or --model) decodes B sequences, each with a controller that answers a full-vocabulary mask every
step (the most a step's record copies and counts). Before each step a coin decides whether the
requests are traced for that step (the A/B of controller_overhead.py --e2e: whole runs drift
apart by several % on a shared machine): a traced step copies each mask, and the sampler
computes the log-softmax and top-k of each row (greedy rows then leave the argmax-only path).
Rows: median ms per step in each arm, the difference per step and per sequence, and the ratio
of the medians with a bootstrap 95 % interval. Then the server's share: turning one record
into its JSON event (TraceStep.as_dict with the model's tokenizer), median us.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from controller_overhead import _ratio_ci  # noqa: E402
from controller_wat import full_mask_wat, wasm_of  # noqa: E402

from rudder import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The history of sailing ships", "A rudder is", "Write a poem about the sea", "Ships and boats"]


def measure(llm, batch: int, steps: int, temperature: float, coin: random.Random, cuda: bool) -> tuple[dict, list]:
    wasm = wasm_of(full_mask_wat())
    params = SamplingParams(max_tokens=steps + 8, temperature=temperature, seed=0, ignore_eos=True)
    reqs = [llm.engine.add_request(p, params, llm.start_controller(wasm)) for p in PROMPTS[:batch]]
    for _ in range(3):  # prefill and warm-up
        llm.engine.step()
    arms = {"plain": [], "traced": []}
    records = []
    for _ in range(steps):
        arm = coin.choice(list(arms))
        for r in reqs:
            r.trace = [] if arm == "traced" else None
        t0 = time.perf_counter()
        llm.engine.step()
        if cuda:  # the step's GPU work is part of it
            torch.cuda.synchronize()
        arms[arm].append(time.perf_counter() - t0)
        for r in reqs:
            records += r.trace or []
    for r in reqs:
        llm.engine.cancel(r.request_id)
        llm.engine.forget(r)
    p, t = float(np.median(arms["plain"])), float(np.median(arms["traced"]))
    return {"batch": batch, "temperature": temperature, "plain_ms_per_step": 1e3 * p, "traced_ms_per_step": 1e3 * t,
            "extra_us_per_step": 1e6 * (t - p), "extra_us_per_sequence_step": 1e6 * (t - p) / batch,
            "ratio": p / t, "ratio_ci95": _ratio_ci(arms["plain"], arms["traced"]),
            "steps": {k: len(v) for k, v in arms.items()}}, records


def measure_events(tokenizer, records: list, n: int = 2000) -> dict:
    picked = (records * (n // max(len(records), 1) + 1))[:n]
    times = []
    for rec in picked:
        t0 = time.perf_counter()
        json.dumps(rec.as_dict(tokenizer))
        times.append(time.perf_counter() - t0)
    return {"as_dict_json_median_us": 1e6 * float(np.median(times)), "n": len(times)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    coin = random.Random(0)
    rows, records = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        row, recs = measure(llm, batch, args.steps, args.temperature, coin, args.device.startswith("cuda"))
        rows.append(row)
        records += recs
    results = {"model": args.model, "device": args.device, "dtype": llm.dtype, "rows": rows, "events": measure_events(llm.tokenizer, records)}
    llm.close()
    for r in rows:
        lo, hi = r["ratio_ci95"]
        print(f"{args.model} {args.device} {results['dtype']} B={r['batch']} T={r['temperature']:g}: plain {r['plain_ms_per_step']:.2f} ms/step, "
              f"traced {r['traced_ms_per_step']:.2f} ms/step: +{r['extra_us_per_step']:.0f} us a step "
              f"(+{r['extra_us_per_sequence_step']:.0f} us a sequence), plain/traced {r['ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"one record as its JSON event: {results['events']['as_dict_json_median_us']:.1f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
