"""Decode and prefill speed on SmolLM2: rudder in each weight precision against transformers and
llama.cpp, in one run, and how much each precision changes the logits.

    .venv/bin/python benchmarks/decode.py [--dtypes fp32,bf16,int8] [--batches 1 4 16] [--peer llama.cpp|none]
                                          [--no-transformers] [--threads N] [--rounds 5]
                                          [--json benchmarks/results/decode.json]

Prefill: B prompts of --prompt-tokens tokens in one forward pass. Decode: B sequences, greedy, one
token each per step, EOS ignored; tok/s counts all sequences. transformers (fp32, its own KV cache,
a manual greedy loop) and llama.cpp (`--peer llama.cpp`: the original Q4_1 GGUF through
llama-cpp-python's low-level API, B sequences in one batch per step, argmax in numpy) time the
same prompts, so every side times model work plus picking the token. The contestants take turns
for --rounds rounds (rotating who goes first) and each reports its median round: this machine is
shared and noisy, so compare the ratios within one run.

Goals (issue 18), from the same rounds: rudder's batch-1 decode against llama.cpp's, and its
batch-16 throughput against llama.cpp's batch 1, as the median of the per-round ratios with
their range (round r of one against round r of the other: the rounds of a batch size run back
to back, those of two batch sizes minutes apart); bf16's greedy agreement with fp32.

llama.cpp is compared by default (`--peer none` leaves it out) but never built here: install it
with the `bench` extra (a source build, ~11 min on 2 cores); without it the table says "not
installed". Its AMX matmul path crashed on our AMX host
(a segfault in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36), so it runs with llama.cpp's
extra buffer types off (`use_extra_bufts = false`), i.e. its AVX-512 path.

Agreement (rudder.agreement): each precision against fp32 over fixed prompts, teacher-forced on
fp32's greedy continuations: the largest logit difference and the share of fp32's greedy tokens
whose argmax it matches; llama.cpp the same way, from its own logits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))

import rudder  # noqa: E402, F401  (first: it sets OpenMP's spinning before torch loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from rudder import SamplingParams  # noqa: E402
from rudder.agreement import PROMPTS, compare, greedy, prompt_ids  # noqa: E402
from rudder.engine import Engine  # noqa: E402
from rudder.loading import load_model  # noqa: E402

TEXT = ("The history of navigation is the story of people learning to read the sea and the sky. "
        "Early sailors steered by the sun, the stars and the shape of the coast; later the compass, "
        "the sextant and the chronometer made long voyages safe. ") * 20


def prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    return [ids[i * 7: i * 7 + length] for i in range(batch)]


def timed(prefill_s: float, steps: list[float], batch: int, prompt_tokens: int) -> dict:
    return {"prefill_tok_s": batch * prompt_tokens / prefill_s,
            "decode_tok_s": batch * len(steps) / sum(steps),
            "decode_ms_per_step": 1000 * statistics.median(steps)}


class Rudder:
    def __init__(self, model, tokenizer, dtype: str):
        self.model, self.tokenizer, self.name = model, tokenizer, f"rudder {dtype}"

    def run(self, ids: list[list[int]], decode_tokens: int) -> dict:
        batch, length = len(ids), len(ids[0])
        engine = Engine(self.model, self.tokenizer, kv_cache_tokens=batch * (length + decode_tokens + 64),
                        max_batch_tokens=batch * length, max_seqs=batch)
        params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
        for p in ids:
            engine.add_request(p, params)
        t0 = time.perf_counter()
        engine.step()  # the whole prefill (and the first sampled token of each sequence)
        prefill = time.perf_counter() - t0
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return timed(prefill, steps, batch, length)


class Transformers:
    name = "transformers fp32"

    def __init__(self):
        from transformers import LlamaForCausalLM

        from rudder.model_files import fetch_model

        self.hf = LlamaForCausalLM.from_pretrained(fetch_model(progress=False), dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, ids: list[list[int]], decode_tokens: int) -> dict:
        from transformers import DynamicCache

        x = torch.tensor(ids)
        t0 = time.perf_counter()
        out = self.hf(input_ids=x, past_key_values=DynamicCache(), use_cache=True)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(decode_tokens):
            t0 = time.perf_counter()
            out = self.hf(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
        return timed(prefill, steps, len(ids), x.shape[1])


class LlamaCpp:
    """llama.cpp on the model's original GGUF (Q4_1 layers, Q8_0 embeddings and head)."""

    name = "llama.cpp Q4_1"

    def __init__(self, threads: int, max_seqs: int, n_ctx: int):
        import logging

        import llama_cpp.llama_cpp as C  # noqa: N812

        from rudder.model_files import gguf_path

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its loader logs every tensor

        self.C = C
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        mp.use_extra_bufts = False  # its AMX path segfaults here (module docstring)
        self.model = C.llama_model_load_from_file(str(gguf_path()).encode(), mp)
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 2048, 512, max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = C.llama_init_from_model(self.model, cp)
        self.vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.batch = C.llama_batch_init(2048, 0, max_seqs)
        self.version = getattr(__import__("llama_cpp"), "__version__", "?")

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Feed (token, position, sequence, wants logits) in one batch; the logits asked for."""
        C, b = self.C, self.batch
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if C.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                for i, e in enumerate(entries) if e[3]]

    def _clear(self) -> None:
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)

    def run(self, ids: list[list[int]], decode_tokens: int) -> dict:
        self._clear()
        length = len(ids[0])
        feed = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(ids) for pos, t in enumerate(p)]
        t0 = time.perf_counter()
        rows = []
        for i in range(0, len(feed), 2048):
            rows += self._decode(feed[i:i + 2048])
        tokens = [int(r.argmax()) for r in rows]
        prefill = time.perf_counter() - t0
        steps = []
        for step in range(decode_tokens):
            t0 = time.perf_counter()
            rows = self._decode([(t, length + step, s, True) for s, t in enumerate(tokens)])
            tokens = [int(r.argmax()) for r in rows]
            steps.append(time.perf_counter() - t0)
        return timed(prefill, steps, len(ids), length)

    def scored_logits(self, tokens: list[int], rows: int) -> torch.Tensor:
        """fp32 logits predicting the last `rows` tokens (as rudder.agreement.scored_logits)."""
        self._clear()
        fed = tokens[:-1]
        out = self._decode([(t, pos, 0, pos >= len(fed) - rows) for pos, t in enumerate(fed)])
        return torch.from_numpy(np.stack(out)).float()


def peer_agreement(peer, reference, tokenizer, continuations) -> dict:
    agree = total = 0
    max_diff = 0.0
    from rudder.agreement import scored_logits

    for prompt, cont in zip(PROMPTS, continuations):
        tokens = prompt_ids(tokenizer, prompt) + list(cont)
        ref = scored_logits(reference, tokens, len(cont))
        got = peer.scored_logits(tokens, len(cont))
        max_diff = max(max_diff, (got - ref).abs().max().item())
        agree += int((got.argmax(-1) == torch.tensor(cont)).sum())
        total += len(cont)
    return {"max_logit_diff": max_diff, "agreement": agree / total, "tokens": total}


def _ratios(a: list[dict], b: list[dict]) -> list[float]:
    return [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(a, b)]


def goals_of(rows: list[dict], rudders: list[str], llama, agreement: dict) -> list[dict]:
    """Issue 18's goals from this run's rounds (module docstring)."""
    goals = []

    def add(what, values, goal, unit="x"):
        goals.append({"what": what, "value": statistics.median(values), "low": min(values), "high": max(values),
                      "goal": goal, "unit": unit, "met": statistics.median(values) >= goal, "rounds": values})

    by_batch = {row["batch"]: row["rounds"] for row in rows}
    if llama is not None and 1 in by_batch:
        base = by_batch[1][llama.name]
        for name in rudders:
            add(f"{name} B=1 decode / llama.cpp B=1", _ratios(by_batch[1][name], base), 0.8)
        if 16 in by_batch:
            for name in rudders:
                add(f"{name} B=16 throughput / llama.cpp B=1", _ratios(by_batch[16][name], base), 2.0)
    if "rudder bf16" in agreement:
        a = 100 * agreement["rudder bf16"]["agreement"]
        add("rudder bf16 greedy agreement with fp32", [a], 95, "%")
    return goals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16,int8", help="rudder's weight precisions, comma-separated")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--peer", default="llama.cpp", choices=["llama.cpp", "none"],
                    help="the peer timed next to rudder (default llama.cpp, when installed)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also save the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [d for d in args.dtypes.split(",") if d]

    models, tokenizer = {}, None
    for dtype in dict.fromkeys(["fp32", *dtypes]):
        models[dtype], tokenizer = load_model("smollm2", dtype=dtype)
    contestants = [Rudder(models[d], tokenizer, d) for d in dtypes]
    notes = []
    if not args.no_transformers:
        try:
            contestants.append(Transformers())
        except ImportError:
            notes.append("transformers: not installed (pip install -e '.[ref]')")
    llama = None
    if args.peer == "llama.cpp":
        try:
            llama = LlamaCpp(args.threads, max(args.batches),
                             max(args.batches) * (args.prompt_tokens + args.decode_tokens + 8) + 1024)
            contestants.append(llama)
        except ImportError:
            notes.append("llama.cpp: not installed (the `bench` extra builds llama-cpp-python from source)")

    rows = []
    for batch in args.batches:
        ids = prompts(tokenizer, batch, args.prompt_tokens)
        runs = {c.name: [] for c in contestants}
        for c in contestants:
            c.run(ids, 4)  # warm-up
        for r in range(args.rounds):
            order = contestants[r % len(contestants):] + contestants[:r % len(contestants)]
            for c in order:
                runs[c.name].append(c.run(ids, args.decode_tokens))
        rows.append({"batch": batch, **{name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                                         for name, rs in runs.items()}, "rounds": runs})
        print(f"batch {batch} done", file=sys.stderr, flush=True)

    agreement = {}
    if not args.no_agreement:
        continuations = greedy(models["fp32"], tokenizer, PROMPTS, args.agreement_tokens)
        for d in dtypes:
            agreement[f"rudder {d}"] = compare(models["fp32"], models[d], tokenizer, continuations=continuations)
        if llama is not None:
            agreement[llama.name] = peer_agreement(llama, models["fp32"], tokenizer, continuations)

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"\nSmolLM2-135M, {args.threads} threads, prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} "
          f"tokens, median of {args.rounds} rounds; {when}, {platform.node()}")
    for note in notes:
        print(note)
    base = next((row[llama.name]["decode_tok_s"] for row in rows if llama is not None and row["batch"] == 1), None)
    head = (f"{'batch':>5} | {'engine':<17} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {'ms/step':>8}"
            + (" | vs llama.cpp B=1" if base else ""))
    print(head)
    print("-" * len(head))
    for row in rows:
        for name in (c.name for c in contestants):
            r = row[name]
            line = (f"{row['batch']:>5} | {name:<17} | {r['prefill_tok_s']:>13.0f} | {r['decode_tok_s']:>12.1f} | "
                    f"{r['decode_ms_per_step']:>8.1f}")
            if base:
                line += f" | {r['decode_tok_s'] / base:>16.2f}x"
            print(line)
    goals = goals_of(rows, [c.name for c in contestants if isinstance(c, Rudder)], llama, agreement)
    if agreement:
        print(f"\nagreement with rudder fp32 ({len(PROMPTS)} prompts x {args.agreement_tokens} greedy tokens, "
              f"teacher-forced)")
        print(f"{'engine':<17} | {'max |logit diff|':>16} | {'top-1 agreement':>15}")
        for name, a in agreement.items():
            print(f"{name:<17} | {a['max_logit_diff']:>16.4f} | {100 * a['agreement']:>14.1f}%")
    if goals:
        print("\ngoals (median of the per-round ratios [min, max] over the rounds)")
        for g in goals:
            spread = f" [{g['low']:.2f}, {g['high']:.2f}]" if len(g["rounds"]) > 1 else ""
            print(f"  {g['what']:<48} {g['value']:>7.2f}{g['unit']}{spread} "
                  f"goal >= {g['goal']}{g['unit']}: {'met' if g['met'] else 'NOT met'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": when, "machine": platform.platform(), "threads": args.threads,
                                         "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "agreement": agreement, "goals": goals, "notes": notes}, indent=2))


if __name__ == "__main__":
    main()
