"""Prefill and decode throughput of the engine on SmolLM2, against transformers in the same run.

    .venv/bin/python benchmarks/decode.py [--batches 1 4 16] [--prompt-tokens 100] [--decode-tokens 32]
                                          [--json benchmarks/results/decode.json] [--no-transformers]

Prefill: B prompts of the same length in one forward pass. Decode: B sequences, greedy, one token
each per step, EOS ignored; tokens/s counts all sequences. transformers runs the same prompts with
its own KV cache (a manual greedy loop, so both sides time only model work plus sampling).
The two alternate for --rounds rounds and each reports its median round: this machine is shared
and noisy, so compare the ratio within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))

from rudder import SamplingParams  # noqa: E402
from rudder.engine import Engine  # noqa: E402
from rudder import load_model  # noqa: E402

TEXT = ("The history of navigation is the story of people learning to read the sea and the sky. "
        "Early sailors steered by the sun, the stars and the shape of the coast; later the compass, "
        "the sextant and the chronometer made long voyages safe. ") * 20


def prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    return [ids[i * 7: i * 7 + length] for i in range(batch)]


def bench_rudder(model, tokenizer, batch: int, prompt_tokens: int, decode_tokens: int) -> dict:
    engine = Engine(model, tokenizer, kv_cache_tokens=batch * (prompt_tokens + decode_tokens + 64),
                    max_batch_tokens=batch * prompt_tokens, max_seqs=batch)
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    for p in prompts(tokenizer, batch, prompt_tokens):
        engine.add_request(p, params)
    t0 = time.perf_counter()
    engine.step()  # the whole prefill (and the first sampled token of each sequence)
    prefill = time.perf_counter() - t0
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return {"prefill_tok_s": batch * prompt_tokens / prefill,
            "decode_tok_s": batch * len(steps) / sum(steps),
            "decode_ms_per_step": 1000 * statistics.median(steps)}


def bench_transformers(hf, tokenizer, batch: int, prompt_tokens: int, decode_tokens: int) -> dict:
    from transformers import DynamicCache

    ids = torch.tensor(prompts(tokenizer, batch, prompt_tokens))
    with torch.inference_mode():
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(decode_tokens):
            t0 = time.perf_counter()
            out = hf(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
    return {"prefill_tok_s": batch * prompt_tokens / prefill,
            "decode_tok_s": batch * len(steps) / sum(steps),
            "decode_ms_per_step": 1000 * statistics.median(steps)}


def median_run(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also save the results here")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    model, tokenizer = load_model("smollm2")
    hf = None
    if not args.no_transformers:
        try:
            from transformers import LlamaForCausalLM

            from rudder.model_files import fetch_model

            hf = LlamaForCausalLM.from_pretrained(fetch_model(progress=False), dtype=torch.float32).eval()
        except ImportError:
            print("transformers not installed: comparing nothing (pip install -e '.[ref]')")

    rows = []
    for batch in args.batches:
        runs = {"rudder": [], "transformers": []}
        bench_rudder(model, tokenizer, batch, args.prompt_tokens, 4)  # warm-up
        if hf is not None:
            bench_transformers(hf, tokenizer, batch, args.prompt_tokens, 4)
        for _ in range(args.rounds):
            runs["rudder"].append(bench_rudder(model, tokenizer, batch, args.prompt_tokens, args.decode_tokens))
            if hf is not None:
                runs["transformers"].append(bench_transformers(hf, tokenizer, batch, args.prompt_tokens,
                                                               args.decode_tokens))
        rows.append({"batch": batch, **{name: median_run(r) for name, r in runs.items() if r}})

    head = f"{'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {'ms/step':>8}"
    if hf is not None:
        head += f" | {'HF prefill':>10} | {'HF decode':>9} | {'HF ms/step':>10} | {'decode x':>8}"
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, prompt {args.prompt_tokens} tokens, "
          f"decode {args.decode_tokens} tokens")
    print(head)
    print("-" * len(head))
    for row in rows:
        r = row["rudder"]
        line = f"{row['batch']:>5} | {r['prefill_tok_s']:>13.0f} | {r['decode_tok_s']:>12.1f} | {r['decode_ms_per_step']:>8.1f}"
        if "transformers" in row:
            t = row["transformers"]
            line += (f" | {t['prefill_tok_s']:>10.0f} | {t['decode_tok_s']:>9.1f} | {t['decode_ms_per_step']:>10.1f}"
                     f" | {r['decode_tok_s'] / t['decode_tok_s']:>7.2f}x")
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
