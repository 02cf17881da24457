"""What bounds prompt lookup's speedup on the extraction task: drafting rules replayed offline.

    .venv/bin/python benchmarks/lookup_replay.py [--tokens 120] [--reps 9] [--json FILE]

1. Decode speculative.py's extraction task (its prompt and schema, the `json` controller, greedy)
   plainly, recording which output tokens were the controller's fast-forwards.
2. Time a target forward by its rows (a decode step feeding R tokens at the task's context, the
   logits of all R: a verification of R - 1 drafted tokens), and the task's prefill.
3. Replay drafting rules over the recorded output. At each step a rule drafts what prompt lookup
   proposes over the sequence so far (engine/drafts.py); the controller's fast-forwards ride along
   while the draft is on the recorded path; verification accepts the longest prefix that agrees
   with the recorded output (greedy). Each step costs the measured forward of its rows.

Rules: the engine's (`_Adaptive` of engine/speculative.py: its acceptance estimate and linear
ROW_COST model, k <= 8), fixed k, the engine's estimate with the measured costs in its rate, and
an oracle drafter that proposes the recorded output itself (k = 8): what any drafter could reach
with these forwards. Not replayed: a controller mask that refuses a proposal (the engine then
ends the draft there), the host's work per step. Plain decoding is replayed with the controller's
fast-forwards riding in the forward after the token before them; the engine spends a forward of
its own on each run of them (the answer comes while that forward runs: ~5 of ~104 here), so
`request x` errs low.

`request x` is (prefill + plain steps) / (prefill + the rule's steps), modelled with the measured
times; speculative.py measures the real thing.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from rudder import LLM, SamplingParams  # noqa: E402
from rudder.engine import branching  # noqa: E402
from rudder.engine.drafts import PromptLookup  # noqa: E402
from rudder.engine.model_runner import ModelRunner  # noqa: E402
from rudder.engine.speculative import NOMINAL_T_DRAFT, _Adaptive  # noqa: E402
from rudder.engine.step import ScheduledSeq  # noqa: E402
from speculative import EXTRACT_PROMPT, SCHEMA  # noqa: E402

MAX_ROWS = 25  # k = 8 proposals plus up to 16 fast-forwarded tokens (engine/speculative.py FORCED_ROOM)


def record(llm: LLM, tokens: int) -> tuple[list[int], list[int], list[bool], float]:
    """(prompt ids, output ids, whether each output token was a fast-forward, seconds of the
    request's first step: prefill)."""
    appended = []
    original = branching.Steering.append

    def append(self, seq, toks, logprobs=None, sampled=0):
        if not appended:
            appended.append(list(seq.token_ids))  # the prompt, as fed
        appended.append((list(toks), sampled))
        return original(self, seq, toks, logprobs, sampled)

    branching.Steering.append = append
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        out = llm.generate([EXTRACT_PROMPT], params, chat=True, controller="json", controller_arg=json.dumps(SCHEMA))[0]
    finally:
        branching.Steering.append = original
    forced = []
    for toks, sampled in appended[1:]:
        forced += [False] * sampled + [True] * (len(toks) - sampled)
    first = []
    for _ in range(3):
        t = time.perf_counter()
        # (without the controller: its first fast-forward would fill max_tokens=1 before any forward)
        llm.generate([EXTRACT_PROMPT], SamplingParams(max_tokens=1, temperature=0.0), chat=True)
        first.append(time.perf_counter() - t)
    return appended[0], out.token_ids, forced[:len(out.token_ids)], statistics.median(first)


def forward_costs(llm: LLM, context: int, reps: int) -> list[float]:
    """Seconds of a forward feeding R tokens after `context` cached ones, logits for all R; [0] unused."""
    block = 16
    longest = context + MAX_ROWS
    runner = ModelRunner(llm.model, (longest + block - 1) // block + 1, block)
    table = list(range((longest + block - 1) // block))
    seq = types.SimpleNamespace(token_ids=[100 + i % 1000 for i in range(longest)], num_cached=0)
    runner.run([ScheduledSeq(seq, context, list(range(context)), table, True)])
    times = {r: [] for r in range(1, MAX_ROWS + 1)}
    for rep in range(reps + 2):
        for r in times:  # row counts interleaved, so the machine's drift hits them alike
            seq.num_cached = context
            t = time.perf_counter()
            runner.run([ScheduledSeq(seq, r, list(range(context, context + r)), table, True, logit_rows=r)])
            if rep >= 2:
                times[r].append(time.perf_counter() - t)
    return [0.0] + [statistics.median(times[r]) for r in range(1, MAX_ROWS + 1)]


class Engine:
    """The engine's rule: _Adaptive's acceptance estimate and k choice (its linear row model)."""

    def __init__(self, t_plain: float):
        self.ad, self.t = _Adaptive(), t_plain

    def k(self, k_max: int) -> int:
        return self.ad.choose_k(k_max, self.t, NOMINAL_T_DRAFT["lookup"])

    def observe(self, accepted: int, rejected: bool) -> None:
        self.ad.observe(accepted, rejected)


class Measured(Engine):
    """The same acceptance estimate, k chosen on the measured forward times instead."""

    def __init__(self, costs: list[float]):
        super().__init__(costs[1])
        self.costs = costs

    def k(self, k_max: int) -> int:
        a = self.ad.alpha
        best, best_rate = 0, 1.0 / self.costs[1]
        for k in range(1, k_max + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / self.costs[1 + k]
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class Fixed:
    def __init__(self, k: int):
        self.fixed = k

    def k(self, k_max: int) -> int:
        return min(self.fixed, k_max)

    def observe(self, accepted: int, rejected: bool) -> None:
        pass


def replay(prompt, out, forced, rule, k_max: int, costs: list[float], oracle: bool = False) -> dict:
    lookup = PromptLookup()
    n = len(out)
    i = 0  # the controller's first fast-forward joins the prompt; the prefill gives the next token
    while i < n and forced[i]:
        i += 1
    i += 1
    forwards = rows = 0
    seconds = 0.0
    while i < n and forced[i]:
        i += 1
    while i < n:
        k = rule.k(k_max)
        draft, proposals, used, last_forced = [], None, 0, False
        while len(draft) < MAX_ROWS - 1:
            j = i + len(draft)
            on_path = out[i:j] == draft
            if j < n and forced[j] and on_path:  # the controller forces it: free, known
                draft.append(out[j])
                proposals, last_forced = None, True
                continue
            if used >= k:
                break
            if oracle:
                proposals = out[j:j + 1] if on_path and j < n else []
            elif not proposals:
                proposals = lookup.continuation(prompt + out[:i] + draft, k_max, after_forced=last_forced)
            if not proposals:
                break
            draft.append(proposals.pop(0))
            last_forced = False
            used += 1
        accepted = 0
        while accepted < len(draft) and i + accepted < n and draft[accepted] == out[i + accepted]:
            accepted += 1
        proposed_ok = sum(1 for x in range(i, i + accepted) if not forced[x])
        rule.observe(proposed_ok, accepted < len(draft))
        forwards += 1
        rows += 1 + len(draft)
        seconds += costs[min(1 + len(draft), MAX_ROWS)]
        i += accepted + 1
        while i < n and forced[i]:
            i += 1
    return {"forwards": forwards, "rows": rows, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--reps", type=int, default=9, help="timings per row count")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=max(1, min(2, torch.get_num_threads())))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2", dtype=args.dtype)
    prompt, out, forced, first = record(llm, args.tokens)
    costs = forward_costs(llm, len(prompt) + len(out) // 2, args.reps)
    plain = replay(prompt, out, forced, Fixed(0), 0, costs)
    rules = [("engine (k<=8)", Engine(costs[1]), 8, False), ("engine, measured costs", Measured(costs), 8, False),
             ("fixed k=4", Fixed(4), 4, False), ("fixed k=8", Fixed(8), 8, False),
             ("fixed k=16", Fixed(16), 16, False), ("oracle drafter, k=8", Fixed(8), 8, True)]
    when = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    print(f"lookup replay: extraction, {len(prompt)} prompt + {len(out)} output tokens ({sum(forced)} fast-forwarded), "
          f"SmolLM2 {llm.dtype}, {torch.get_num_threads()} threads; {when}")
    print("forward ms by rows: " + " ".join(f"{r}:{1e3 * costs[r]:.1f}" for r in (1, 2, 3, 5, 7, 9, 13, 17, 25)))
    print(f"prefill + first step {1e3 * first:.0f} ms; plain: {plain['forwards']} forwards, "
          f"{1e3 * plain['seconds']:.0f} ms")
    print(f"{'rule':24} {'forwards':>8} {'rows':>5} {'decode ms':>9} {'decode x':>8} {'request x':>9}")
    table = []
    for name, rule, k_max, oracle in rules:
        r = replay(prompt, out, forced, rule, k_max, costs, oracle)
        r |= {"rule": name, "decode_x": plain["seconds"] / r["seconds"],
              "request_x": (first + plain["seconds"]) / (first + r["seconds"])}
        table.append(r)
        print(f"{name:24} {r['forwards']:8d} {r['rows']:5d} {1e3 * r['seconds']:9.0f} {r['decode_x']:7.2f}x "
              f"{r['request_x']:8.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.platform(), "date": when, "dtype": llm.dtype,
                                         "prompt_tokens": len(prompt), "output_tokens": len(out),
                                         "forced_tokens": sum(forced), "first_s": first, "forward_s": costs,
                                         "plain": plain, "table": table}, indent=2))


if __name__ == "__main__":
    main()
