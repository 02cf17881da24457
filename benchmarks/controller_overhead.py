"""Host-side cost of WebAssembly controllers: per-step overhead, request start, module load.

    .venv/bin/python benchmarks/controller_overhead.py [--calls 20000] [--smollm2]
                                                       [--json benchmarks/results/controller_overhead.json]

Rows:
- mid_process: a no-op controller that returns a full-vocabulary mask; what is timed is the
  host's share of a step: write the new token, call into the guest (epoch deadline armed),
  read and validate the result, build the Branch (applying the mask is the engine's job).
  `raw call` is the bare unchecked wasm call for reference. At V=49152 (SmolLM2's size) and a
  synthetic V=128000.
- start: a request on a cached, initialised module (new Store + instantiate + snapshot
  restore + rudder_start). `start+table` is a controller whose rudder_init copies the token
  table in (as real constraint controllers do), so its snapshot holds it; with --smollm2 the
  table is SmolLM2's (1.3 MB), else the synthetic vocabulary's.
- fork: copy a live controller (memory + globals) into a new instance.
- load: compile, in-memory cache hit, on-disk cache hit (a new runtime, deserialize).
- step total: the whole host share of a sequence-step with that controller: mid_process plus
  applying its mask to a row of logits (Sampler.apply_masks). `apply` alone is listed too.
- languages (--languages): the same controllers written in C (core modules), Python and
  JavaScript (components, docs/components.md), same run, same vocabulary: start (a request on
  a cached, initialised controller), a trivial step (`fork` with argument 1: sample, no mask),
  a JSON-mask step (C: the `json` controller; Python/JS: `json_then_stop`, which hands the span
  to it) walking a fixed document token by token, fork (copy a live controller holding a
  200-token sequence: a component's fork cost grows with its saved state), and RSS per
  live instance (20 started, RSS delta / 20). Goals: start <= 10 ms, trivial step <= 50 us,
  JSON step <= C's + 50 us, RSS <= 8 MiB per instance.
- with --e2e: SmolLM2 greedy decode tokens/s with the full-mask controller on every sequence vs
  no controller (batch 1 and 4, A/B per step, in each precision of --e2e-dtypes): the
  controller runs during the forward pass, so the ratio shows what is left of its cost; the
  interval is a bootstrap 95 % one of the ratio of the arms' medians (steps resampled).

The machine is shared and noisy: medians over many calls, and compare within one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "host"))
sys.path.insert(0, str(ROOT / "tests"))

from controller_wat import controller_wat, full_mask_wat, wasm_of  # noqa: E402
import torch  # noqa: E402

from rudder import SamplingParams  # noqa: E402
from rudder.controller import ControllerRuntime  # noqa: E402
from rudder.engine.sampler import Sampler  # noqa: E402
from rudder.tokenizer import Tokenizer  # noqa: E402


def _stats(seconds: list[float]) -> dict:
    us = np.asarray(seconds) * 1e6
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "n": len(us)}


def _timed(fn, n: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def measure_overhead(tokenizer, calls: int = 20000) -> dict:
    """Per-step host overhead of a no-op full-mask controller (median/p99 in us)."""
    with ControllerRuntime(tokenizer, cache_dir=False) as rt:
        ctl = rt.start(rt.load(wasm_of(full_mask_wat())), "")
        [b] = ctl.mid_process(0, 0, [1, 2, 3])
        assert b.mask is not None and b.mask.shape == ((tokenizer.vocab_size + 31) // 32,)
        tokens = [5]
        step = _stats(_timed(lambda: ctl.mid_process(0, 0, tokens), calls))
        inst = ctl._inst
        ticks = ctl._ticks

        def raw():
            inst.vals_i32[8] = 0
            inst.call("rudder_mid_process", 3, ticks, 25)

        raw_stats = _stats(_timed(raw, calls))

        sampler = Sampler(tokenizer.vocab_size)
        logits = torch.randn(1, tokenizer.vocab_size)
        apply = _stats(_timed(lambda: sampler.apply_masks(logits, [b.mask]), calls))
        # A mask of random bits: no whole-word shortcut in the kernel (the worst case).
        noise = np.random.default_rng(0).integers(0, 2**32, b.mask.shape, dtype=np.uint64).astype(np.uint32)
        noise[-1] &= b.mask[-1]
        apply_random = _stats(_timed(lambda: sampler.apply_masks(logits, [noise]), calls))

        def whole_step():
            [branch] = ctl.mid_process(0, 0, tokens)
            sampler.apply_masks(logits, [branch.mask])

        total = _stats(_timed(whole_step, calls))
        ctl.close()
    return {"vocab_size": tokenizer.vocab_size, "mid_process": step, "raw_call": raw_stats, "apply": apply,
            "apply_random": apply_random, "step_total": total}


def _ratio_ci(plain: list[float], ctl: list[float], n: int = 2000) -> tuple[float, float]:
    """A bootstrap 95 % interval of median(plain) / median(ctl)."""
    rng = np.random.default_rng(0)
    p, c = np.asarray(plain), np.asarray(ctl)
    ratios = (np.median(rng.choice(p, (n, p.size)), axis=1) / np.median(rng.choice(c, (n, c.size)), axis=1))
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def measure_e2e(batches=(1, 4), steps: int = 240, dtypes=("auto",)) -> list[dict]:
    """SmolLM2 greedy decode with the full-mask controller on every sequence vs none.

    Whole runs that alternate still drift apart by several % on this shared machine, so the
    A/B is per step: the same B sequences decode, and before each step a coin decides whether
    their controllers take part (a controller skipped for a while just gets the tokens it missed
    on its next call). Median step time per arm."""
    import random

    from rudder import LLM

    wasm = wasm_of(full_mask_wat())
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    prompts = ["The history of sailing ships", "A rudder is", "Write a poem about the sea", "Ships and boats"]
    coin = random.Random(0)
    rows = []
    for dtype in dtypes:  # auto: bf16 where the CPU has native bf16 (rudder/precision.py)
        llm = LLM("smollm2", dtype=dtype)
        rows += _e2e_rows(llm, wasm, params, prompts, coin, batches, steps)
        llm.close()
    return rows


def _e2e_rows(llm, wasm, params, prompts, coin, batches, steps) -> list[dict]:
    rows = []
    for batch in batches:
        reqs = [llm.engine.add_request(p, params, llm.start_controller(wasm)) for p in prompts[:batch]]
        seqs = [r.seqs[0] for r in reqs]
        cursors = [s.cursor for s in seqs]  # (a sequence's controller lives in its cursor)
        for _ in range(3):  # prefill and warm-up
            llm.engine.step()
        arms = {"plain": [], "controller": []}
        for _ in range(steps):
            arm = coin.choice(list(arms))
            for seq, cursor in zip(seqs, cursors):
                seq.cursor = cursor if arm == "controller" else None
            t0 = time.perf_counter()
            llm.engine.step()
            arms[arm].append(time.perf_counter() - t0)
        for seq, cursor in zip(seqs, cursors):
            seq.cursor = cursor
        for r in reqs:
            llm.engine.cancel(r.request_id)
        p, c = float(np.median(arms["plain"])), float(np.median(arms["controller"]))
        rows.append({"dtype": llm.dtype, "batch": batch, "plain_ms_per_step": 1e3 * p,
                     "controller_ms_per_step": 1e3 * c, "plain_tok_s": batch / p, "controller_tok_s": batch / c,
                     "ratio": p / c, "ratio_ci95": _ratio_ci(arms["plain"], arms["controller"]),
                     "steps": {k: len(v) for k, v in arms.items()}})
    return rows


def _table_wat() -> str:
    """A controller whose rudder_init copies the token table into its memory."""
    return controller_wat(
        memory='(memory (export "memory") 2)',
        init="""(local $len i32)
          (local.set $len (call $token_table_len))
          (drop (memory.grow (i32.add (i32.shr_u (local.get $len) (i32.const 16)) (i32.const 1))))
          (drop (call $token_table_read (i32.const 0x10000) (local.get $len)))
          (i32.const 0)""")


def measure_start(tokenizer, n: int = 300) -> dict:
    """Request start on a cached, initialised module; fork of a live controller."""
    out = {}
    with ControllerRuntime(tokenizer, cache_dir=False) as rt:
        for name, wat in (("start", full_mask_wat()), ("start+table", _table_wat())):
            module = rt.load(wasm_of(wat))
            rt.start(module, "").close()  # first use runs rudder_init

            def start():
                rt.start(module, "").close()

            out[name] = _stats(_timed(start, n, warmup=20))
            out[name]["snapshot_bytes"] = module.snapshot.stored_bytes
            parent = rt.start(module, "")
            parent.mid_process(0, 0, [1])
            out[name.replace("start", "fork")] = _stats(_timed(lambda: parent.fork().close(), n, warmup=20))
            parent.close()
        out["pooling"] = rt.pooling
    return out


def measure_load(tokenizer, n: int = 50) -> dict:
    """Module load: compile (no cache), in-memory hit, on-disk hit in a fresh runtime."""
    wasm = wasm_of(_table_wat())
    with tempfile.TemporaryDirectory() as cache:
        with ControllerRuntime(tokenizer, cache_dir=cache) as rt:
            t0 = time.perf_counter()
            rt.load(wasm)
            compile_s = time.perf_counter() - t0
            memory = _stats(_timed(lambda: rt.load(wasm), n, warmup=5))
        with ControllerRuntime(tokenizer, cache_dir=cache) as rt:
            def from_disk():
                rt.cache._memory.clear()
                rt.load(wasm)

            disk = _stats(_timed(from_disk, n, warmup=1))
            assert rt.cache.stats["compiled"] == 0
    return {"wasm_bytes": len(wasm), "compile_ms": compile_s * 1e3, "memory_hit": memory, "disk_hit": disk}


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
DOCUMENT = '{"name":"Ada Lovelace","age":36,"tags":["mathematician","writer","analyst"]}'


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure_languages(tokenizer, calls: int = 2000) -> list[dict]:
    """C vs Python vs JavaScript controllers in one runtime (see the module docstring)."""
    from component_util import example

    from rudder.controller.build import builtin_controller

    sources = {"C": {"trivial": builtin_controller("fork").read_bytes(), "json": builtin_controller("json").read_bytes()},
               "Python": {"trivial": example("fork"), "json": example("json_then_stop")},
               "JS": {"trivial": example("js/fork"), "json": example("js/json_then_stop")}}
    doc = tokenizer.encode(DOCUMENT)
    schema = json.dumps(PERSON)
    rows = []
    with ControllerRuntime(tokenizer) as rt:
        for lang, wasm in sources.items():
            trivial, jsonc = rt.load(wasm["trivial"]), rt.load(wasm["json"])
            rt.start(trivial, "1").close()  # init runs once per module
            start = _stats(_timed(lambda: rt.start(trivial, "1").close(), 60, warmup=5))
            ctl = rt.start(trivial, "1")
            ctl.mid_process(0, 0, list(range(1, 101)))  # a 100-token prompt ...
            for t in range(100):
                ctl.mid_process(0, 0, [t])               # ... and 100 generated: what a fork copies
            fork = _stats(_timed(lambda: ctl.fork().close(), 40, warmup=3))
            step = _stats(_timed(lambda: ctl.mid_process(0, 0, [5]), calls))
            ctl.close()

            def walk():
                c = rt.start(jsonc, schema)
                c.mid_process(0, 0, [1, 2])  # the prompt (Python/JS: the hand-off starts here)
                times = []
                for tok in doc:
                    t0 = time.perf_counter()
                    answer = c.mid_process(0, 0, [tok])
                    times.append(time.perf_counter() - t0)
                    if not answer:
                        break
                c.close()
                return times

            walk()
            json_times = [t for _ in range(8) for t in walk()]
            live = []
            before = _rss()
            for _ in range(20):
                c = rt.start(trivial, "1")
                c.mid_process(0, 0, [1, 2, 3])
                live.append(c)
            rss = (_rss() - before) / len(live)
            for c in live:
                c.close()
            rows.append({"language": lang, "start": start, "trivial_step": step, "json_step": _stats(json_times),
                         "fork": fork, "rss_per_instance_mib": rss / (1 << 20),
                         "wasm_bytes": len(wasm["trivial"])})
    return rows


def print_languages(rows: list[dict]) -> None:
    print(f"{'language':<9} {'start ms':>9} {'trivial step us':>16} {'JSON step us':>13} {'fork ms':>8} "
          f"{'RSS/instance MiB':>17} {'module MB':>10}")
    for r in rows:
        print(f"{r['language']:<9} {r['start']['median_us'] / 1e3:>9.2f} {r['trivial_step']['median_us']:>16.1f} "
              f"{r['json_step']['median_us']:>13.1f} {r['fork']['median_us'] / 1e3:>8.2f} "
              f"{r['rss_per_instance_mib']:>17.2f} {r['wasm_bytes'] / 1e6:>10.1f}")


def print_table(results: dict) -> None:
    print(f"{'what':<38} {'median':>10} {'p99':>10}")
    for row in results["overhead"]:
        v = row["vocab_size"]
        for key, label in (("mid_process", "mid_process (call+read+validate)"), ("raw_call", "raw wasm call")):
            s = row[key]
            print(f"{label + f' V={v}':<38} {s['median_us']:>8.2f}us {s['p99_us']:>8.2f}us")
        for key, label in (("apply", "mask apply to logits"), ("apply_random", "random-bits mask apply"),
                           ("step_total", "step total (mid_process+apply)")):
            s = row[key]
            print(f"{label + f' V={v}':<38} {s['median_us']:>8.2f}us {s['p99_us']:>8.2f}us")
    st = results["start"]
    for key in ("start", "fork", "start+table", "fork+table"):
        s = st[key]
        extra = f"  (snapshot {s['snapshot_bytes'] / 1024:.0f} KiB)" if "snapshot_bytes" in s else ""
        print(f"{key + ' V=' + str(results['start_vocab']):<38} {s['median_us']:>8.1f}us {s['p99_us']:>8.1f}us{extra}")
    ld = results["load"]
    print(f"{'load: compile':<38} {ld['compile_ms'] * 1e3:>8.0f}us")
    print(f"{'load: in-memory cache hit':<38} {ld['memory_hit']['median_us']:>8.1f}us {ld['memory_hit']['p99_us']:>8.1f}us")
    print(f"{'load: on-disk cache hit':<38} {ld['disk_hit']['median_us']:>8.1f}us {ld['disk_hit']['p99_us']:>8.1f}us")
    print(f"(pooling allocator: {st['pooling']})")
    for row in results.get("e2e", []):
        lo, hi = row["ratio_ci95"]
        print(f"{'decode ' + row['dtype'] + ' B=' + str(row['batch']) + ' full-mask ctl vs none':<38} "
              f"{row['controller_tok_s']:>7.1f} vs {row['plain_tok_s']:.1f} tok/s = {row['ratio']:.3f}x "
              f"[{lo:.3f}, {hi:.3f}]")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="mid_process calls per measurement")
    ap.add_argument("--smollm2", action="store_true", help="start rows with SmolLM2's tokenizer "
                    "(needs the model in $RUDDER_HOME); else a synthetic 49152-token vocabulary")
    ap.add_argument("--e2e", action="store_true", help="also time SmolLM2 decode with and without a controller")
    ap.add_argument("--e2e-dtypes", default="auto", help="the model's precisions for --e2e, comma-separated "
                    "(auto, fp32, bf16, int8)")
    ap.add_argument("--threads", type=int, help="torch threads for --e2e (default: torch's)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    rows = ap.add_mutually_exclusive_group()
    rows.add_argument("--languages", action="store_true", help="only the C / Python / JavaScript rows")
    rows.add_argument("--no-languages", action="store_true", help="skip the C / Python / JavaScript rows")
    args = ap.parse_args(argv)

    vocab_49k = Tokenizer.byte_level(vocab_size=49152)
    vocab_128k = Tokenizer.byte_level(vocab_size=128000)
    start_tok = vocab_49k
    if args.smollm2:
        from rudder.model_files import model_dir

        start_tok = Tokenizer.from_folder(model_dir())
    if args.languages:
        tok = start_tok if args.smollm2 else vocab_49k
        results = {"machine": platform.platform(), "vocab": "smollm2" if args.smollm2 else tok.vocab_size,
                   "languages": measure_languages(tok, min(args.calls, 5000))}
        print_languages(results["languages"])
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2))
        return results
    results = {
        "machine": platform.platform(),
        "overhead": [measure_overhead(vocab_49k, args.calls), measure_overhead(vocab_128k, args.calls)],
        "start_vocab": "smollm2" if args.smollm2 else start_tok.vocab_size,
        "start": measure_start(start_tok),
        "load": measure_load(start_tok),
    }
    if args.e2e:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        results["e2e"] = measure_e2e(dtypes=[d for d in args.e2e_dtypes.split(",") if d])
    print_table(results)  # before the languages rows, which take minutes and may fail on their own
    sys.stdout.flush()
    if not args.no_languages:
        results["languages"] = measure_languages(start_tok, min(args.calls, 5000))
        print_languages(results["languages"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
