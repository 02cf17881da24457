"""A/B a benchmark between two checkouts in one run: before vs after a change, paired.

    .venv/bin/python benchmarks/ab.py --base ../rudder-before [--rounds 6] [--keys 'rows.*.rudder.*,*median_us'] \\
        -- decode.py --batches 1 4 --no-transformers --rounds 1

Runs `<checkout>/benchmarks/<script> ARGS --json FILE` for the base checkout and this one in
turns (ABBA order, `--rounds` pairs), each with its own `host/` on the path, and compares every
numeric value of the JSON they write (or those matching `--keys`, shell-style patterns over the
dotted paths): the median of each side, the median of the paired ratios new/base, and a
bootstrap 95 % interval of that median. This machine is shared and noisy: a difference counts
when its interval excludes 1.0.

When the base checkout's script is older and takes other flags, `--base-args '...'` gives the
base side its own arguments, and `--base-map OLD=NEW` renames its JSON paths (a substring
replacement, e.g. `'.rudder.=.rudder fp32.'`) so that the same values are compared:

    .venv/bin/python benchmarks/ab.py --base ../before --base-args '--batches 1 16 --no-transformers' \
        --base-map '.rudder.=.rudder fp32.' --keys '*.rudder fp32.*' \
        -- decode.py --batches 1 16 --dtypes fp32 --peer none --no-transformers --no-agreement
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value by dotted path (list items by index, or by their "batch")."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            label = item.get("batch", i) if isinstance(item, dict) else i
            out.update(flatten(item, f"{prefix}{label}."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix[:-1]] = float(value)
    return out


def run_once(checkout: Path, script: str, args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(checkout / "benchmarks" / script), *args, "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout)
        if done.returncode != 0:
            raise SystemExit(f"{checkout}: {script} failed:\n{done.stderr[-2000:]}")
        return flatten(json.loads(out.read_text()))


def interval(ratios: np.ndarray, rng: np.random.Generator, n: int = 4000) -> tuple[float, float]:
    picks = rng.choice(ratios, size=(n, len(ratios)), replace=True)
    medians = np.median(picks, axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree of main)")
    ap.add_argument("--rounds", type=int, default=6, help="pairs of runs (ABBA order)")
    ap.add_argument("--keys", default="*", help="comma-separated patterns over the JSON's dotted paths")
    ap.add_argument("--json", type=Path, help="also write the comparison here")
    ap.add_argument("--base-args", help="the base side's own arguments (one shell-quoted string)")
    ap.add_argument("--base-map", action="append", default=[], help="OLD=NEW: rename the base side's JSON paths")
    ap.add_argument("script", help="a script of benchmarks/, then -- and its arguments")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    sides = {"base": args.base.resolve(), "new": HERE}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    side_args = {"base": shlex.split(args.base_args) if args.base_args is not None else args.args, "new": args.args}
    renames = [m.split("=", 1) for m in args.base_map]
    for i in range(args.rounds):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        for side in order:
            values = run_once(sides[side], args.script, side_args[side])
            if side == "base":
                for old, new in renames:
                    values = {k.replace(old, new): v for k, v in values.items()}
            runs[side].append(values)
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    keys = sorted(k for k in runs["new"][0] if k in runs["base"][0] and any(fnmatch.fnmatch(k, p) for p in args.keys.split(",")))
    rng = np.random.default_rng(0)
    rows = []
    print(f"{args.script} {' '.join(args.args)}: base {sides['base']} vs new {sides['new']}, {args.rounds} pairs")
    print(f"{'value':<48} {'base':>10} {'new':>10} {'new/base':>9}   95 % interval")
    for key in keys:
        a = np.array([r[key] for r in runs["base"]])
        b = np.array([r[key] for r in runs["new"]])
        if not (a != 0).all():
            continue
        ratios = b / a
        low, high = interval(ratios, rng)
        rows.append({"key": key, "base": float(np.median(a)), "new": float(np.median(b)),
                     "ratio": float(np.median(ratios)), "low": low, "high": high})
        print(f"{key:<48} {np.median(a):>10.4g} {np.median(b):>10.4g} {np.median(ratios):>9.3f}   [{low:.3f}, {high:.3f}]")
    result = {"script": args.script, "args": args.args, "rounds": args.rounds, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
