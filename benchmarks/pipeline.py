"""Single process vs a 2-stage pipeline, at equal total cores, on SmolLM2 (or --model).

    .venv/bin/python benchmarks/pipeline.py [--batches 1 4 8] [--micro-batches 1 2 4] [--stages 2]
                                            [--layout 18 12] [--rounds 3] [--decode-tokens 32]
                                            [--latency-pairs 12] [--latency-burst 16]
                                            [--latency-temperatures 0 0.8]
                                            [--json benchmarks/results/pipeline.json]

Single process: one process with all the cores' torch threads. Pipeline: S processes with
cores/S threads each (rank 0 is also the coordinator); a step that runs alone (M = 1) gives each
stage all the cores in turn. Decode only (the prefill is done first and
not timed): B greedy sequences, EOS ignored; tokens/s counts all sequences; ms/step is the median
time of one engine step for B = 1 (the per-token latency a single request sees). The bubble is
measured as 1 - (mean over stages of the time spent computing / the decode wall time), next to
the GPipe formula (S-1)/(S-1+M).

The latency overhead of one request (M = 1) is measured apart, paired: the single-process engine
and the pipeline are both kept up and take turns decoding short bursts of one request
(`--latency-pairs` bursts each, ABBA order). This host's speed drifts by 10-30 % within minutes,
far more than the overhead, so only differences between neighbouring bursts are compared; the
table gives their median and a bootstrap 95 % interval of it. It is measured for a greedy request
and for a sampled one (temperature 0.8, top-p 0.95, seeded), whose last stage does more work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))

from rudder import LLM, SamplingParams  # noqa: E402 (before torch: it sets OpenMP's spin for the stages)

import torch  # noqa: E402

TEXT = ("The history of navigation is the story of people learning to read the sea and the sky. "
        "Early sailors steered by the sun, the stars and the shape of the coast. ") * 10


def decode(llm: LLM, batch: int, prompt_tokens: int, decode_tokens: int, temperature: float = 0.0) -> dict:
    engine = llm.engine
    ids = llm.tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=temperature, top_p=0.95, seed=1, ignore_eos=True)
    span = len(ids) - prompt_tokens
    reqs = [engine.add_request(ids[(i * 5) % span: (i * 5) % span + prompt_tokens], params) for i in range(batch)]
    while not all(r.seqs[0].num_output >= 1 for r in reqs):  # prefill, untimed
        engine.step()
    runner = engine.runner
    busy0 = getattr(runner, "busy_s", 0.0)
    steps, tokens = [], 0
    start = time.perf_counter()
    while not all(r.finished for r in reqs):
        t0 = time.perf_counter()
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    for r in reqs:
        engine.forget(r)
    return {"tok_s": tokens / wall, "ms_per_step": 1000 * statistics.median(steps), "wall_s": wall,
            "rank0_busy_s": getattr(runner, "busy_s", 0.0) - busy0}


def run_single(model: str, batch: int, args, threads: int | None = None) -> dict:
    torch.set_num_threads(threads or args.cores)
    llm = LLM(model, kv_cache_tokens=batch * (args.prompt_tokens + args.decode_tokens + 64), max_seqs=batch)
    decode(llm, batch, args.prompt_tokens, 4)  # warm up
    return decode(llm, batch, args.prompt_tokens, args.decode_tokens)


def run_pipeline(model: str, batch: int, stages: int, micro: int, args) -> dict:
    llm = LLM(model, pipeline_stages=args.layout or stages, micro_batches=micro,
              pipeline_threads=args.cores // stages,
              kv_cache_tokens=batch * (args.prompt_tokens + args.decode_tokens + 64), max_seqs=batch)
    runner = llm.engine.runner
    try:
        decode(llm, batch, args.prompt_tokens, 4)  # warm up
        # The stages' busy times cover everything from their first step: measure from a fresh
        # pipeline would cost a start-up per row, so take the decode window's share instead.
        out = decode(llm, batch, args.prompt_tokens, args.decode_tokens)
    finally:
        llm.close()
    # Stage busy fractions: rank 0 from the decode window; the others over their whole life,
    # which the timed decode dominates (prefill and warm-up are short next to it).
    fractions = [out["rank0_busy_s"] / out["wall_s"]]
    fractions += [s["busy_s"] / s["wall_s"] for _, s in sorted(runner.stats.items())]
    out["stage_busy"] = fractions
    out["bubble"] = 1 - statistics.mean(fractions)
    out["bubble_formula"] = (stages - 1) / (stages - 1 + micro)
    return out


def paired_latency(args, temperature: float) -> dict:
    """Per-token latency of one request: single process (all cores) vs the pipeline, in alternating
    bursts of `--latency-burst` decode steps; returns the medians and the paired differences."""
    kv = args.prompt_tokens + args.latency_burst + 64
    single = LLM(args.model, kv_cache_tokens=kv, max_seqs=1)
    pipe = LLM(args.model, pipeline_stages=args.layout or args.stages, micro_batches=1,
               pipeline_threads=args.cores // args.stages, kv_cache_tokens=kv, max_seqs=1)
    times: dict[str, list[float]] = {"single": [], "pipeline": []}
    try:
        def burst(name: str) -> float:
            torch.set_num_threads(args.cores)  # the pipeline's rank 0 changes it per step
            return decode(single if name == "single" else pipe, 1, args.prompt_tokens, args.latency_burst,
                          temperature)["ms_per_step"]

        burst("single"), burst("pipeline")  # warm up
        for i in range(args.latency_pairs):
            for name in (("single", "pipeline") if i % 2 == 0 else ("pipeline", "single")):
                times[name].append(burst(name))
    finally:
        pipe.close()
        torch.set_num_threads(args.cores)
    diffs = [p - s for s, p in zip(times["single"], times["pipeline"])]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    return {"single_ms": statistics.median(times["single"]), "pipeline_ms": statistics.median(times["pipeline"]),
            "overhead_ms": statistics.median(diffs), "overhead_ci95": [boot[50], boot[1949]], "pairs": len(diffs),
            "temperature": temperature,
            "burst_steps": args.latency_burst, "single_bursts": times["single"], "pipeline_bursts": times["pipeline"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 128])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--layout", type=int, nargs="+", help="layers per stage (default: an even split)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="measure each configuration this many times, interleaved")
    ap.add_argument("--latency-pairs", type=int, default=12,
                    help="bursts each for the paired latency measurement (0: skip it)")
    ap.add_argument("--latency-burst", type=int, default=16, help="decode steps per latency burst")
    ap.add_argument("--latency-temperatures", type=float, nargs="+", default=[0.0, 0.8],
                    help="the request's temperature in the latency measurement (0: greedy; > 0: seeded top-p 0.95)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.layout:
        args.stages = len(args.layout)
    rows = []
    print(f"{args.model}, {args.cores} cores; single process: {args.cores} threads; "
          f"{args.stages} stages: {args.cores // args.stages} thread(s) each; layout {args.layout or 'even'}")
    print(f"{'batch':>5} {'mode':>16} {'tok/s':>8} {'vs single':>9} {'ms/step':>8} {'bubble':>7} {'formula':>7}  stage busy")
    for batch in args.batches:
        # The configurations of a batch size are measured `--rounds` times, interleaved (this host
        # drifts by 10-30 % within minutes); each row is the median over the rounds.
        configs = [("single", lambda: run_single(args.model, batch, args))]
        if batch == 1:  # one stage's compute budget: the whole model on one stage's threads
            configs.append((f"single {args.cores // args.stages} thr",
                            lambda: run_single(args.model, batch, args, threads=args.cores // args.stages)))
        for micro in args.micro_batches:
            if micro <= batch and (micro > 1 or batch == 1):
                configs.append((f"{args.stages} stages M={micro}",
                                lambda m=micro: run_pipeline(args.model, batch, args.stages, m, args)))
        runs = {mode: [] for mode, _ in configs}
        for _ in range(args.rounds):
            for mode, measure in configs:
                runs[mode].append(measure())
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "ms_per_step")}
               for mode, rs in runs.items()}
        single = med["single"]
        for mode, rs in runs.items():
            m = med[mode]
            row = {"batch": batch, "mode": mode, **m, "rounds": rs}
            line = f"{batch:>5} {mode:>16} {m['tok_s']:>8.1f} {m['tok_s'] / single['tok_s']:>9.2f} {m['ms_per_step']:>8.1f}"
            if "bubble" in rs[0]:
                row["bubble"] = statistics.median(r["bubble"] for r in rs)
                busy = [statistics.median(r["stage_busy"][i] for r in rs) for i in range(args.stages)]
                line += f" {row['bubble']:>7.2f} {rs[0]['bubble_formula']:>7.2f}  {' '.join(f'{f:.2f}' for f in busy)}"
            rows.append(row)
            print(line)
        if f"{args.stages} stages M=1" in med:
            pipe, one = med[f"{args.stages} stages M=1"], med[f"single {args.cores // args.stages} thr"]
            print(f"      latency overhead per step: {pipe['ms_per_step'] - single['ms_per_step']:+.1f} ms vs single "
                  f"({args.cores} thr), {pipe['ms_per_step'] - one['ms_per_step']:+.1f} ms vs single "
                  f"({args.cores // args.stages} thr)")
    torch.set_num_threads(args.cores)
    latency = []
    for temperature in args.latency_temperatures if args.latency_pairs else []:
        run = paired_latency(args, temperature)
        latency.append(run)
        lo, hi = run["overhead_ci95"]
        kind = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        print(f"\none request, {kind}, paired ({run['pairs']} bursts of {args.latency_burst} steps each way): "
              f"single {run['single_ms']:.1f} ms/step, {args.stages} stages {run['pipeline_ms']:.1f} ms/step; "
              f"overhead {run['overhead_ms']:+.2f} ms/step (95 % CI {lo:+.2f} .. {hi:+.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "cores": args.cores, "stages": args.stages,
                                         "rows": rows, "latency": latency}, indent=2))


if __name__ == "__main__":
    main()
