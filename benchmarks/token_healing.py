"""Token healing on SmolLM2 (docs/constraints.md, "Token healing"): how many prompt tokens it
takes back, what it changes, and what it costs.

1. At random cuts of English prose (this repository's README and docs), how many of the
   prompt's last tokens `healing.plan` takes back (tokenizer only).
2. Greedy continuations of prompts that end mid-word or with a space, without and with healing.
3. The cost: wall time of a short greedy request without and with healing, interleaved, and the
   tokens each forward pass was fed (with healing the prompt is prefilled without the tokens it
   takes back when the controller's first answer is in before the prefill).

    .venv/bin/python benchmarks/token_healing.py [--cuts 2000] [--tokens 16] [--reps 5]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from pathlib import Path

from rudder import LLM, SamplingParams
from rudder.healing import plan

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is ", "The Eiffel Tow", "The quick brown fox jumps over the la", "I love to eat ",
           '{"url": "https:', "Hello wor", "def fib(n):", "My email is john.doe@gmail"]


def taken_back(tok, cuts: int) -> dict[int, int]:
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    rng = random.Random(0)
    counts: collections.Counter = collections.Counter()
    for _ in range(cuts):
        healing = plan(tok, tok.encode(text[:rng.randrange(20, len(text))]))
        counts[healing.tokens if healing else 0] += 1
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuts", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = LLM("smollm2")
    tok = llm.tokenizer

    counts = taken_back(tok, args.cuts)
    print(f"tokens taken back at {args.cuts} random cuts: "
          + ", ".join(f"{k}: {n} ({100 * n / args.cuts:.1f}%)" for k, n in counts.items()))

    print("\nprompt | plain | healed (greedy, 8 tokens)")
    for prompt in PROMPTS:
        outs = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, token_healing=heal))[0].text
                for heal in (False, True)]
        print(f"{prompt!r} | {outs[0]!r} | {outs[1]!r}")

    fed: list[int] = []
    run = llm.engine.runner.run

    def counting(batch, *a):
        fed.append(sum(e.num_tokens for e in batch))
        return run(batch, *a)

    llm.engine.runner.run = counting
    times: dict[bool, list[float]] = {False: [], True: []}
    forwards: dict[bool, list[list[int]]] = {False: [], True: []}
    for _ in range(args.reps):
        for prompt in PROMPTS:
            for heal in (False, True):
                fed.clear()
                t0 = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=args.tokens, temperature=0, token_healing=heal,
                                                      ignore_eos=True))
                times[heal].append(time.perf_counter() - t0)
                forwards[heal].append(list(fed))
    ratios = [h / p for p, h in zip(times[False], times[True])]
    print(f"\nrequest of {args.tokens} tokens, median over {len(ratios)}: plain "
          f"{1e3 * statistics.median(times[False]):.1f} ms, healed {1e3 * statistics.median(times[True]):.1f} ms, "
          f"paired ratio {statistics.median(ratios):.3f}")
    healed = [(f, p) for f, p in zip(forwards[True], PROMPTS * args.reps) if plan(tok, tok.encode(p))]
    late = sum(f[0] == len(tok.encode(p)) for f, p in healed)
    print(f"forwards per request: plain {statistics.mean(map(len, forwards[False])):.2f}, healed "
          f"{statistics.mean(map(len, forwards[True])):.2f}; of {len(healed)} healed requests, {late} prefilled "
          "the whole prompt (the first answer came late) and re-fed a position")


if __name__ == "__main__":
    main()
