"""Fast-forward under a JSON Schema: how much of an extraction the schema writes by itself.

    .venv/bin/python benchmarks/ff.py [--docs 4] [--max-tokens 120] [--json benchmarks/results/ff.json]

SmolLM2 extracts a small record (with a nested object) from short documents, greedy, under the
`json` controller twice: with fast-forward (the default) and with `"x-rudder-ff": false`
(every token sampled under a mask). Per mode: tokens generated, tokens fast-forwarded (forced
by the schema: keys, quotes, colons, commas, closing brackets), forward passes (one per decoding
step; ff tokens ride along in the next step's pass), passes saved, wall time. The ff counts come
from replaying each output through the controller (the same decisions, without the model).
Both modes run once untimed first: the first pass over new sequence lengths is much slower.
The machine is shared and noisy: compare the two modes within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))

from rudder import LLM, SamplingParams  # noqa: E402
from rudder.controller.build import builtin_controller  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 40},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "occupation", "address", "married"],
    "additionalProperties": False,   # extra keys are allowed by default (JSON Schema): close both objects
}

DOCS = [
    "Maria Keller, 34, works as a nurse in Zurich, Switzerland. She married Tom last spring.",
    "John Okafor is a 52-year-old carpenter from Lagos, Nigeria. He has never been married.",
    "At 27, Aiko Tanaka teaches mathematics in Osaka, Japan; she is single.",
    "Pierre Dubois (61) is a retired pilot living in Lyon, France, with his wife Claire.",
    "Sofia Rossi, a 45-year-old architect in Milan, Italy, is married with two children.",
    "Lars Nilsson, 38, fishes for a living near Bergen in Norway. He is not married.",
]


def replay(llm, schema: str, prompt_ids: list[int], out_ids: list[int]) -> tuple[int, int]:
    """(forward passes, ff tokens) of one output: drive the controller through its tokens."""
    ctl = llm.start_controller("json", schema)
    try:
        branches = ctl.mid_process(0, 0, prompt_ids)
        pos = steps = ff = 0
        while branches and pos < len(out_ids):
            [b] = branches
            steps += 1
            if b.mask is None:
                take = list(b.ff[0])
                ff += len(take)
            else:
                t = out_ids[pos]
                take = next((list(lst) for lst in b.ff if lst[0] == t), [t])
                ff += len(take) - 1
            take = take[: len(out_ids) - pos]   # (max_tokens may cut a list)
            assert out_ids[pos:pos + len(take)] == take, "replay diverged"
            pos += len(take)
            branches = ctl.mid_process(0, 0, take)
        return steps, ff
    finally:
        ctl.close()


def run_mode(llm, docs, ff: bool, max_tokens: int) -> dict:
    schema = json.dumps({**SCHEMA, "x-rudder-ff": ff})
    prompts = [f"Extract the person as JSON (name, age, occupation, address with city and country, married).\n\n{d}"
               for d in docs]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, chat=True, controller="json", controller_arg=schema)[0] for p in prompts]
    wall = time.perf_counter() - t0
    tokens = passes = ff_tokens = valid = 0
    for out in outs:
        if out.error:
            raise SystemExit(f"generation failed: {out.error}")
        steps, n_ff = replay(llm, schema, [0], out.token_ids)   # (json ignores the prompt)
        tokens += len(out.token_ids)
        passes += steps
        ff_tokens += n_ff
        try:
            json.loads(out.text)
            valid += out.finish_reason != "length"
        except ValueError:
            pass
    return {"ff": ff, "docs": len(docs), "valid_json": valid, "tokens": tokens, "ff_tokens": ff_tokens,
            "ff_fraction": ff_tokens / max(tokens, 1), "forward_passes": passes, "passes_saved": tokens - passes,
            "wall_s": wall, "s_per_doc": wall / len(docs), "example": outs[0].text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--json", type=Path, help="save the rows here")
    args = ap.parse_args()
    builtin_controller("json")   # build outside the timing
    llm = LLM("smollm2")
    docs = DOCS[: args.docs]
    for ff in (True, False):   # warm-up: the first pass over new lengths is slow (kernel setup)
        run_mode(llm, docs, ff, args.max_tokens)
    rows = [run_mode(llm, docs, ff, args.max_tokens) for ff in (True, False)]
    print(f"{'mode':<14}{'valid':>6}{'tokens':>8}{'ff tok':>8}{'ff %':>7}{'passes':>8}{'saved':>7}{'wall s':>8}{'s/doc':>7}")
    for r in rows:
        print(f"{'ff' if r['ff'] else 'no ff (mask)':<14}{r['valid_json']:>6}{r['tokens']:>8}{r['ff_tokens']:>8}"
              f"{100 * r['ff_fraction']:>6.1f}%{r['forward_passes']:>8}{r['passes_saved']:>7}{r['wall_s']:>8.2f}{r['s_per_doc']:>7.2f}")
    print(f"speed-up (wall): x{rows[1]['wall_s'] / rows[0]['wall_s']:.2f}")
    print("example:", rows[0]["example"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"schema": SCHEMA, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
