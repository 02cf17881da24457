"""What a speculative verification forward costs by its number of rows: one sequence with
--context tokens cached feeds R new tokens (R = 1: a plain decode step; R = k + 1: a draft of k
tokens verified) and takes logits for all of them. speculative.py's gain is bounded by
(tokens per target forward) / (cost of that forward against R = 1), so this table says which k
can pay on this CPU and precision.

    .venv/bin/python benchmarks/verify_rows.py [--dtype bf16] [--contexts 40 600] [--rows 1 2 3 5 9]
                                               [--reps 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))

from rudder.engine.model_runner import ModelRunner  # noqa: E402
from rudder.engine.step import ScheduledSeq  # noqa: E402
from rudder.loading import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", type=int, nargs="+", default=[40, 600])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    model, _ = load_model(args.model, "cpu", dtype=args.dtype)
    block = 16
    longest = max(args.contexts) + max(args.rows)
    runner = ModelRunner(model, (longest + block - 1) // block + 1, block)
    table = list(range((longest + block - 1) // block))
    rows_out = []
    for ctx in args.contexts:
        seq = types.SimpleNamespace(token_ids=[100 + i % 1000 for i in range(longest)], num_cached=0)
        runner.run([ScheduledSeq(seq, ctx, list(range(ctx)), table, True)])  # the context, cached
        base = None
        for r in args.rows:
            times = []
            for rep in range(args.reps + 3):  # (the first 3 untimed: caches and thread pools warm up)
                seq.num_cached = ctx  # the same positions each time: the cache holds the context
                t0 = time.perf_counter()
                runner.run([ScheduledSeq(seq, r, list(range(ctx, ctx + r)), table, True, logit_rows=r)])
                if rep >= 3:
                    times.append(time.perf_counter() - t0)
            ms = 1000 * statistics.median(times)
            base = ms if r == 1 else base
            rows_out.append({"context": ctx, "rows": r, "ms": ms, "vs_one_row": ms / base if base else None})

    precision = getattr(model, "precision", args.dtype)
    print(f"verification forward by rows: {args.model} {precision}, {torch.get_num_threads()} threads, "
          f"median of {args.reps}; {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print("context | rows |    ms | vs 1 row | per extra row")
    for row in rows_out:
        extra = (row["vs_one_row"] - 1) / (row["rows"] - 1) if row["rows"] > 1 else 0.0
        print(f"{row['context']:7} | {row['rows']:4} | {row['ms']:5.1f} | {row['vs_one_row']:7.2f}x | {extra:13.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.platform(), "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                                         "dtype": precision, "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": rows_out}, indent=2))


if __name__ == "__main__":
    main()
