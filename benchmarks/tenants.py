"""A plain greedy request beside neighbours with slow controllers: does it slow down?

    .venv/bin/python benchmarks/tenants.py [--model smollm2] [--neighbours 1 4 8] [--ms 5 15 24]
                                           [--tokens 48] [--rounds 3] [--dtype auto]
                                           [--model-threads shared|all|N]
                                           [--json benchmarks/results/tenants.json]

For each (k neighbours, m ms per step): one engine runs a plain greedy request of `--tokens`
tokens beside k requests whose Wasm controller computes for about m ms of CPU per step (a busy
loop calibrated here, under the 25 ms deadline), and, paired with it, the same engine runs the
same plain request beside k neighbours without a controller (the same batch size). The plain
request's tokens/s beside the slow neighbours over its tokens/s beside the plain ones is the
ratio; the goal is >= 0.9. Rounds alternate the two (ABBA), and the ratio is the median of the
paired ratios with a bootstrap 95 % interval. The plain request's text must be the same in both.
The slow neighbours' own tokens/s (all of them together) and how many of them failed (a legal
controller must never be ended, e.g. by its wall-clock cap) are printed beside it. The engine
runs as `rudder serve` does by default (`--model-threads shared`: a core kept for controllers);
`--model-threads all` measures the single-user setting, whose plain request runs on every core
beside plain neighbours and gives one back to busy controllers.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "tests"))

from controller_wat import busy_wat, wasm_of  # noqa: E402

from rudder import LLM, SamplingParams  # noqa: E402
from rudder.controller import Limits  # noqa: E402

# The neighbours' deadline: their busy loop is calibrated on an idle host, and under the run's load
# the same loop takes more CPU time (measured up to ~29 ms a step for the 24 ms loop: the column
# "their CPU ms/step"), which the default 25 ms would end; ended neighbours would no longer load
# the host. Deadlines themselves are tested in tests/test_deadlines.py.
NEIGHBOUR_LIMITS = Limits(mid_process_ms=50)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEIGHBOUR_PROMPT = "List the planets of the solar system and one fact about each."


def calibrate(llm: LLM, ms: float) -> int:
    """Loop count of busy_wat whose step takes about `ms` of CPU here."""
    rt = llm.runtime
    module = rt.load(wasm_of(busy_wat()))
    n = 100_000
    while True:
        ctl = rt.start(module, struct.pack("<I", n), {"mid_process_ms": 1000})
        t0 = time.thread_time()
        for _ in range(3):
            ctl.mid_process(0, 0, [1])
        cpu = (time.thread_time() - t0) / 3
        ctl.close()
        if cpu > 0.002:
            return max(1, int(n * ms / 1000 / cpu))
        n *= 4


def run(llm: LLM, k: int, loops: int | None, tokens: int) -> tuple[float, list[int], float, int, float]:
    """The plain request's tokens/s beside k neighbours (with a busy controller, or none), the
    neighbours' tokens/s together over the same time, how many of them failed, and the most CPU
    ms per step one of their controllers took (the whole request's mean)."""
    eng = llm.engine
    plain = eng.add_request(llm.prompt_text(PROMPT, True), SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                         ignore_eos=True))
    others = []
    module = llm.runtime.load(wasm_of(busy_wat())) if loops is not None else None
    for _ in range(k):
        ctl = llm.runtime.start(module, struct.pack("<I", loops)) if module is not None else None
        others.append(eng.add_request(llm.prompt_text(NEIGHBOUR_PROMPT, True),
                                      SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True), ctl))
    first = last = None
    while not plain.finished:
        for d in eng.step():
            if d.request_id == plain.request_id and d.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
    out = plain.seqs[0].output_ids
    theirs = sum(len(r.seqs[0].output_ids) for r in others)
    errors = [r.error or next((s.error for s in r.seqs if s.error), "") for r in others
              if r.finished and any(s.finish_reason == "error" for s in r.seqs)]
    failed = len(errors)
    if errors:
        print(f"    (a slow neighbour failed: {errors[0][:200]})", flush=True)
    cpu_ms = [1e3 * r.usage.controller_s / r.usage.sampled_tokens for r in others if r.usage.sampled_tokens]
    for r in [plain, *others]:
        eng.cancel(r.request_id)
        eng.forget(r)
    return (len(out) - 1) / (last - first), out, theirs / (last - first), failed, \
        float(np.max(cpu_ms)) if cpu_ms else 0.0


def interval(ratios: np.ndarray, rng) -> tuple[float, float]:
    medians = np.median(rng.choice(ratios, size=(4000, len(ratios))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="the model's weight precision (auto, fp32, bf16, int8)")
    ap.add_argument("--neighbours", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ms", type=float, nargs="+", default=[5, 15, 24])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model-threads", default="shared",
                    help="the engine's model_threads: shared (rudder serve's default: one core kept for "
                         "controllers), all (every core, one given back while controllers keep it busy), or N")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    threads = {"all": None, "shared": "shared"}.get(args.model_threads) or int(args.model_threads)
    llm = LLM(args.model, dtype=args.dtype, model_threads=threads, controller_limits=NEIGHBOUR_LIMITS)
    print(f"model_threads={args.model_threads}: the model's kernels on at most "
          f"{llm.engine.config.model_threads or 'all'} thread(s)", flush=True)
    loops = {ms: calibrate(llm, ms) for ms in args.ms}
    run(llm, 1, None, 8)  # warm up
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'neighbours':>10} {'ms/step':>8} {'plain beside plain':>19} {'beside slow':>12} {'ratio':>7}   95 % interval"
          f"   {'slow ones tok/s':>15} {'failed':>6} {'their CPU ms/step':>17}")
    for k in args.neighbours:
        for ms in args.ms:
            base, slow, ratios, theirs, failed, cpu = [], [], [], [], 0, []
            for i in range(args.rounds):
                pair = {}
                for side in (("base", "slow") if i % 2 == 0 else ("slow", "base")):
                    pair[side] = run(llm, k, loops[ms] if side == "slow" else None, args.tokens)
                if pair["base"][1] != pair["slow"][1]:
                    raise SystemExit(f"the plain request's tokens differ beside slow neighbours (k={k}, {ms} ms)")
                base.append(pair["base"][0])
                slow.append(pair["slow"][0])
                theirs.append(pair["slow"][2])
                failed += pair["slow"][3]
                cpu.append(pair["slow"][4])
                ratios.append(pair["slow"][0] / pair["base"][0])
            low, high = interval(np.array(ratios), rng)
            row = {"neighbours": k, "ms": ms, "plain_tok_s": float(np.median(base)), "beside_slow_tok_s":
                   float(np.median(slow)), "ratio": float(np.median(ratios)), "low": low, "high": high,
                   "slow_neighbours_tok_s": float(np.median(theirs)), "slow_neighbours_failed": failed,
                   "slow_neighbours_cpu_ms_per_step": float(np.max(cpu))}
            rows.append(row)
            print(f"{k:>10} {ms:>8g} {row['plain_tok_s']:>19.1f} {row['beside_slow_tok_s']:>12.1f} "
                  f"{row['ratio']:>7.2f}   [{low:.2f}, {high:.2f}]   {row['slow_neighbours_tok_s']:>15.1f} {failed:>6} "
                  f"{row['slow_neighbours_cpu_ms_per_step']:>17.1f}",
                  flush=True)
    llm.close()
    result = {"model": args.model, "tokens": args.tokens, "rounds": args.rounds, "model_threads": args.model_threads,
              "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
