"""Does the suite bite? Apply deliberate one-line breakages of the product, one at a time, run
the tests that should catch each, and report which did. Not a test (pytest does not collect it):

    .venv/bin/python tests/mutation_check.py [--only NAME ...] [--json benchmarks/results/mutations.json]

Each mutation replaces one exact line of the product (the script refuses to run one whose line
is gone: the product changed and the mutation must be updated), runs its tests with `-x`,
restores the file, and counts the mutation caught when the tests fail or hang past the timeout.
A surviving mutation is a hole in the suite. Run it on a quiet tree: it edits product files
while it runs (and always puts them back).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: list[str]


MUTATIONS = [
    Mutation("the Branch ff-list choice", "host/rudder/engine/branching.py",
             "            if ff[0] == token:", "            if ff[-1] == token:",
             ["tests/test_branches.py", "tests/test_controllers.py"]),
    Mutation("the attention cascade's shared end", "host/rudder/native/attention.c",
             "            shared[n++] = min64(blocks * s->block_size, ctx) / TILE * TILE;",
             "            shared[n++] = min64(blocks * s->block_size, ctx) / TILE * TILE + TILE;",
             ["tests/test_native_attention.py", "tests/test_prefix_cache.py"]),
    Mutation("the pool closing a job's claims", "host/rudder/native/parallel.c",
             "        __atomic_store_n(&job.claim, (uint64_t)gen << 32 | UINT32_MAX, __ATOMIC_RELEASE);",
             "        /* (not closed) */",
             ["tests/test_native_parallel.py"]),
    Mutation("the pool backing off after a lone late helper", "host/rudder/native/parallel.c",
             "            if (next_backoff > BACKOFF_MIN_NS || now - last_late < LATE_WINDOW_NS) {",
             "            if (1) {",
             ["tests/test_native_parallel.py"]),
    Mutation("the paired cache's value pairs (each key's value in the other's place)",
             "host/rudder/native/attention.c",
             "                vc[head + (o / 2 * d + i) * 2 + o % 2] = (uint16_t)half_at(call->qkv, 1, src + i);",
             "                vc[head + (o / 2 * d + i) * 2 + 1 - o % 2] = (uint16_t)half_at(call->qkv, 1, src + i);",
             ["tests/test_native_attention.py"]),
    Mutation("the attention state's rows", "host/rudder/native/attention.c",
             "#define STATE_ROWS (MAX_GROUP * MAX_REP) /* query rows (a running max and total each) per item */",
             "#define STATE_ROWS (STATE_VECS / 4) /* query rows (a running max and total each) per item */",
             ["tests/test_native_attention.py"]),
    Mutation("the mask bit order", "host/rudder/native/mask.c",
             "            x[j] = ((bits >> j) & 1u) ? x[j] : neg_inf;",
             "            x[j] = ((bits >> (31 - j)) & 1u) ? x[j] : neg_inf;",
             ["tests/test_sampler.py", "tests/test_engine.py"]),
    Mutation("the backtrack count", "host/rudder/engine/branching.py",
             "            self.bm.pop(seq.seq_id, n)\n            seq.num_cached -= n",
             "            self.bm.pop(seq.seq_id, max(n - 1, 0))\n            seq.num_cached -= n",
             ["tests/test_branches.py"]),
    Mutation("the fork copy", "host/rudder/controller/snapshot.py",
             "    ctypes.memmove(dst.base, src.base, head)", "    ctypes.memmove(dst.base, src.base, 0)",
             ["tests/test_sandbox.py", "tests/test_controllers.py"]),
    Mutation("the epoch re-arm", "host/rudder/native/deadline.c",
             "    d->set_deadline(context, 1);", "    d->set_deadline(context, (uint64_t)1 << 62);",
             ["tests/test_hostile.py", "tests/test_deadlines.py"]),
    Mutation("the memory limit", "host/rudder/controller/store.py",
             "        lib.wasmtime_store_limiter(ptr, int(memory_limit), TABLE_ELEMENTS, instances, tables, memories)",
             "        lib.wasmtime_store_limiter(ptr, -1, TABLE_ELEMENTS, instances, tables, memories)",
             ["tests/test_hostile.py", "tests/test_wasm_engine.py"]),
    Mutation("the JSON string escape", "guest-sdk/rudder_json.c",
             "        if (c == '\"' || c == '\\\\') {", "        if (c == '\"') {",
             ["tests/test_json_keywords.py", "tests/test_json_schema.py"]),
    Mutation("the regex class negation", "guest-sdk/rudder_regex.c",
             "        negate = true;", "        negate = false;",
             ["tests/test_regex.py"]),
    Mutation("the stop string check", "host/rudder/engine/output.py",
             "            if hits:", "            if False and hits:",
             ["tests/test_engine.py", "tests/test_server.py"]),
    Mutation("the 429 path", "host/rudder/server/admission.py",
             "        if self._free.locked() and self.waiting >= self.max_queue:",
             "        if False and self._free.locked() and self.waiting >= self.max_queue:",
             ["tests/test_server.py", "tests/test_server_flags.py"]),
    Mutation("the result decoder's bounds check", "host/rudder/controller/result.py",
             "        if mask_ptr + self.mask_bytes > size:", "        if mask_ptr > size:",
             ["tests/test_hostile.py"]),
    Mutation("the progress budget", "host/rudder/engine/budget.py",
             "        if seq.steps > allowed:", "        if seq.steps > 100 * allowed:",
             ["tests/test_tenants.py"]),
    Mutation("the inverse CDF's draw kept below the total", "host/rudder/engine/sampler.py",
             "    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))",
             "    target = u * total",
             ["tests/test_sampler.py"]),
    Mutation("the min-p step", "host/rudder/engine/sampler.py",
             "        if p.min_p > 0:\n", "        if p.min_p > 0 and False:\n",
             ["tests/test_sampler.py", "tests/test_spec_exactness.py"]),
    Mutation("verification's top-p", "host/rudder/engine/speculative.py",
             "    w = sampling_weights(row.unsqueeze(0), [params])[0]",
             "    w = sampling_weights(row.unsqueeze(0), [__import__('dataclasses').replace(params, top_p=1.0)])[0]",
             ["tests/test_spec_exactness.py"]),
    Mutation("a frequency penalty's strength", "host/rudder/engine/sampler.py",
             "                    add(i, out, np.full(len(out), -p.frequency_penalty, dtype=np.float32))",
             "                    add(i, out, np.full(len(out), -p.frequency_penalty / 2, dtype=np.float32))",
             ["tests/test_sampler.py"]),
    Mutation("admission past the step's token budget", "host/rudder/engine/scheduler.py",
             "            n = min(seq.num_pending, self._prompt_room)\n            self._put(",
             "            n = seq.num_pending\n            self._put(",
             ["tests/test_engine.py"]),
]


def run(m: Mutation, timeout: float) -> dict:
    path = ROOT / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return {"name": m.name, "status": "stale", "detail": f"{m.path}: the line to mutate is not there once"}
    env = dict(os.environ)
    env.setdefault("RUDDER_HOME", str(ROOT / ".cache" / "rudder"))
    t0 = time.monotonic()
    try:
        path.write_text(original.replace(m.old, m.new))
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                                  cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
            failed = re.findall(r"^FAILED (\S+)", done.stdout, re.M) + re.findall(r"^ERROR (\S+)", done.stdout, re.M)
            caught = done.returncode != 0
            detail = ", ".join(failed) or (done.stdout.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            caught, detail = True, f"the tests hung past {timeout:g} s"
    finally:
        path.write_text(original)
    return {"name": m.name, "status": "caught" if caught else "SURVIVED", "detail": detail,
            "seconds": round(time.monotonic() - t0, 1)}


def _interrupt_on_term(signum, frame):
    raise KeyboardInterrupt  # so that run()'s `finally` puts the product file back


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _interrupt_on_term)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="names (substrings) of the mutations to run")
    ap.add_argument("--timeout", type=float, default=150,
                    help="seconds per mutation; a hang past it counts as caught (a broken deadline hangs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    results = []
    for m in chosen:
        r = run(m, args.timeout)
        results.append(r)
        print(f"{r['status']:>9}  {m.name:<36} {r.get('seconds', '')!s:>7}  {r['detail'][:150]}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["status"] == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
