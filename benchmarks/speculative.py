"""Speculative decoding vs plain decoding on SmolLM2 (greedy, batch 1), in one run.

    .venv/bin/python benchmarks/speculative.py [--reps 3] [--tokens 120] [--modes lookup,draft]
                                               [--draft-model int8] [--dtype auto] [--threads N]
                                               [--json benchmarks/results/speculative.json]

Tasks:
- (a) extract: a JSON-schema extraction of facts from a document in the prompt, under the `json`
  controller (the schema) when this checkout has it, else unconstrained (the table says which).
- (b) chat: free text.
For each task and repetition, plain and each speculative mode run back to back (the order
rotates per repetition), so machine noise hits them alike; tokens/s is output tokens over the
request's wall time (prefill included), speedup is plain's time over the mode's (median of the
per-repetition ratios; `95% CI`: a bootstrap interval of that median, the JSON also has their
smallest and largest), `cpu x` the same ratio of the
process's CPU time (steadier than wall time on a machine shared with other jobs), `decode x` the
ratio after taking off each repetition's time to the first token (the same prompt with
max_tokens=1 and no controller: prefill, which speculation cannot shorten, and the first step). The target
runs in --dtype (default auto: bf16 where the CPU has native bf16); the draft model
(--draft-model int8) is the target quantised. Greedy output must be identical to plain: the `same` column checks it.
`--draft-speed` adds the draft candidates' decode time per token next to the target's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))

import torch  # noqa: E402

from ab import interval  # noqa: E402  (the bootstrap interval of a median ratio)
from rudder import LLM, SamplingParams  # noqa: E402

DOCUMENT = """\
Northwind Marine Instruments was founded in 1987 in Bergen, Norway, by the engineer Ingrid Solberg.
The company makes navigation equipment for small ships: its best-known products are the
Tidewatch depth sounder, the Polaris chart plotter and the Gullwing autopilot. In 2023 Northwind
employed 412 people and reported revenue of 58 million euros. Its headquarters moved to
Haugesund in 2011, and the current chief executive is Marius Dahl, who joined from a shipyard in
Stavanger. Customers can reach the sales office at sales@northwind-marine.example or by phone
on +47 52 70 11 00."""

SCHEMA = {
    "type": "object",
    "properties": {
        "company": {"type": "string"},
        "founded": {"type": "integer"},
        "founder": {"type": "string"},
        "headquarters": {"type": "string"},
        "ceo": {"type": "string"},
        "employees": {"type": "integer"},
        "products": {"type": "array", "items": {"type": "string"}},
        "email": {"type": "string"},
    },
    "required": ["company", "founded", "founder", "headquarters", "ceo", "employees", "products", "email"],
    "additionalProperties": False,
}

EXTRACT_PROMPT = (f"Read the document and extract the facts as JSON with the keys company, founded, founder, "
                  f"headquarters, ceo, employees, products and email.\n\nDocument:\n{DOCUMENT}\n\nJSON:")
CHAT_PROMPT = "Tell me a short story about a lighthouse keeper who finds a message in a bottle."


def has_controller(name: str) -> bool:
    return (ROOT / "controllers" / f"{name}.c").is_file()


def run_once(llm, prompt, mode, tokens, k, controller, arg):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, speculative=mode, spec_k=k)
    t, c = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], params, chat=True, controller=controller, controller_arg=arg)[0]
    return time.perf_counter() - t, time.process_time() - c, out


def bench_task(llm, name, prompt, controller, arg, modes, reps, tokens, k):
    rows = {m: {"seconds": [], "tokens": [], "stats": [], "same": True, "ratio": [], "cpu_ratio": [],
                "decode_ratio": [], "errors": []}
            for m in [None, *modes]}
    order = [None, *modes]
    run_once(llm, prompt, None, 8, k, controller, arg)  # warm-up (controller build, caches)
    for m in modes:
        run_once(llm, prompt, m, 8, k, controller, arg)
    for rep in range(reps):
        rot = order[rep % len(order):] + order[: rep % len(order)]
        outs = {}
        # prefill + the first token (without the controller, whose first fast-forward would fill
        # max_tokens=1 before any forward)
        first, _, _ = run_once(llm, prompt, None, 1, k, None, "")
        for m in rot:
            seconds, cpu, out = run_once(llm, prompt, m, tokens, k, controller, arg)
            outs[m] = (seconds, out, cpu)
            r = rows[m]
            r["seconds"].append(seconds)
            r["tokens"].append(len(out.token_ids))
            if out.finish_reason == "error":  # e.g. a controller deadline on a loaded host: said, not hidden
                r["errors"].append(out.error)
            if out.speculative:
                r["stats"].append(out.speculative)
        for m in modes:
            rows[m]["same"] &= outs[m][1].token_ids == outs[None][1].token_ids
            rows[m]["ratio"].append(outs[None][0] / outs[m][0])
            rows[m]["cpu_ratio"].append(outs[None][2] / outs[m][2])
            rows[m]["decode_ratio"].append((outs[None][0] - first) / max(outs[m][0] - first, 1e-9))
        if rep == 0:
            print(f"  [{name}] {outs[None][1].text[:160]!r}", flush=True)
    table = []
    for m, r in rows.items():
        st = r["stats"]
        drafted = sum(s["drafted"] for s in st)
        table.append({
            "task": name, "mode": m or "plain", "controller": controller or "-",
            "tokens": int(np.mean(r["tokens"])),
            "tokens_per_s": float(np.sum(r["tokens"]) / np.sum(r["seconds"])),
            "speedup": float(np.median(r["ratio"])) if r["ratio"] else 1.0,
            "speedup_range": [float(min(r["ratio"])), float(max(r["ratio"]))] if r["ratio"] else [1.0, 1.0],
            "speedup_ci": (list(interval(np.asarray(r["ratio"]), np.random.default_rng(0))) if r["ratio"]
                           else [1.0, 1.0]),
            "cpu_speedup": float(np.median(r["cpu_ratio"])) if r["cpu_ratio"] else 1.0,
            "decode_speedup": float(np.median(r["decode_ratio"])) if r["decode_ratio"] else 1.0,
            "acceptance": (sum(s["accepted"] for s in st) / drafted) if drafted else None,
            "tokens_per_target_forward": (float(np.sum(r["tokens"]) / sum(s["target_forwards"] for s in st))
                                          if st else 1.0),
            "same_as_plain": r["same"] if m else True,
            "errors": r["errors"],
        })
    return table


def draft_speed(llm, specs, n=40):
    """ms per decoded token (batch 1) of the target and of each draft candidate, same prompt."""
    from rudder.engine.drafts import DraftModel, build_draft_model

    ids = llm.tokenizer.encode(CHAT_PROMPT)
    out = []
    for spec in ["target", *specs]:
        model = llm.model if spec == "target" else build_draft_model(spec, llm.model)
        dm = DraftModel(model, 64, 16)
        tokens = list(ids)
        dm.logits([(0, tokens)])
        t = time.perf_counter()
        for _ in range(n):
            tokens.append(int(dm.logits([(0, tokens)])[0].argmax()))
        out.append({"model": spec, "ms_per_token": (time.perf_counter() - t) / n * 1e3})
        dm.drop(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--spec-k", type=int, default=8)
    ap.add_argument("--modes", default="lookup,draft")
    ap.add_argument("--draft-model", default="int8")
    ap.add_argument("--tasks", default="extract,chat")
    ap.add_argument("--draft-speed", action="store_true", help="also time the draft candidates per token")
    ap.add_argument("--dtype", default="auto", help="the target's weight precision (auto, fp32, bf16, int8)")
    ap.add_argument("--threads", type=int, default=max(1, min(2, torch.get_num_threads())), help="torch threads")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    llm = LLM("smollm2", draft_model=args.draft_model, dtype=args.dtype)

    table = []
    if "extract" in args.tasks:
        ctl = "json" if has_controller("json") else None
        table += bench_task(llm, "(a) extract", EXTRACT_PROMPT, ctl, json.dumps(SCHEMA) if ctl else "", modes,
                            args.reps, args.tokens, args.spec_k)
    if "chat" in args.tasks:
        table += bench_task(llm, "(b) chat", CHAT_PROMPT, None, "", modes, args.reps, args.tokens, args.spec_k)

    when = time.strftime("%Y-%m-%d %H:%M")
    print(f"\nspeculative decoding, SmolLM2-135M {llm.dtype}, greedy, batch 1, {args.tokens} tokens, k<={args.spec_k}, "
          f"draft model {args.draft_model}, {args.reps} reps, torch threads {torch.get_num_threads()}; {when}")
    print(f"{'task':12} {'mode':7} {'controller':10} {'tokens':>6} {'tok/s':>7} {'speedup':>7} {'95% CI':>11} "
          f"{'cpu x':>6} {'decode x':>8} {'accept':>7} {'tok/fwd':>7} same")
    for r in table:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"{r['task']:12} {r['mode']:7} {r['controller']:10} {r['tokens']:6d} {r['tokens_per_s']:7.1f} "
              f"{r['speedup']:6.2f}x {r['speedup_ci'][0]:5.2f}-{r['speedup_ci'][1]:4.2f}x "
              f"{r['cpu_speedup']:5.2f}x {r['decode_speedup']:7.2f}x {acc:>7} {r['tokens_per_target_forward']:7.2f} "
              f"{r['same_as_plain']}"
              + (f"  errors: {len(r['errors'])} ({r['errors'][0]})" if r["errors"] else ""))
    speeds = []
    if args.draft_speed:
        speeds = draft_speed(llm, ["int8", "layers:10", "layers:6"])
        print("\ndecode ms/token, batch 1:")
        for s in speeds:
            print(f"  {s['model']:10} {s['ms_per_token']:7.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.platform(), "date": when, "dtype": llm.dtype,
                                         "args": vars(args) | {"json": str(args.json)},
                                         "table": table, "draft_speed": speeds}, indent=2))


if __name__ == "__main__":
    main()
