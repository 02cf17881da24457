"""One layer's native attention call (native/attention.c) at SmolLM2's shape, bf16: the cases
the decode step meets, timed alone so that a change to the kernel can be A/B'd with
`benchmarks/ab.py`.

    .venv/bin/python benchmarks/attention.py [--calls 500] [--json FILE]

Cases: 16 decoding rows whose block tables share a 1024-token prefix (a cached system prompt:
the cascade) on 1 and 2 threads; one row at 1040 positions; 16 rows of their own at 40
positions. Random keys and values in a paged cache of 16-token blocks, in the layout a bf16
model's cache has (in pairs: engine/kv_cache.py); median and min of --calls calls, microseconds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
from rudder import kernels  # noqa: E402

HEADS, KV_HEADS, D, BLOCK = 9, 3, 64, 16


def to_pairs(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[slots, kv heads, d] caches in the paired layout: per block and KV head, keys
    [d/2][position][2], values [position/2][d][2]."""
    blocks = k.shape[0] // BLOCK
    keys = k.view(blocks, BLOCK, KV_HEADS, D // 2, 2).permute(0, 2, 3, 1, 4)
    values = v.view(blocks, BLOCK // 2, 2, KV_HEADS, D).permute(0, 3, 1, 4, 2)
    return (keys.reshape(blocks, KV_HEADS, BLOCK * D).contiguous(),
            values.reshape(blocks, KV_HEADS, BLOCK * D).contiguous())


def case(rows: int, context: int, shared: int, threads: int):
    """An attention call: `rows` sequences decoding at `context` + i, the first `shared`
    positions of their block tables the same blocks."""
    gen = torch.Generator().manual_seed(0)
    contexts = [context + i for i in range(rows)]
    width = (max(contexts) + BLOCK) // BLOCK + 1
    tables = torch.randperm(width * rows, generator=gen).reshape(rows, width).to(torch.int64)
    tables[1:, :shared // BLOCK] = tables[0, :shared // BLOCK]
    slots_n = width * rows * BLOCK
    k = torch.randn(slots_n, KV_HEADS, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(slots_n, KV_HEADS, D, generator=gen).to(torch.bfloat16)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(max(contexts) + 1, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    positions = torch.tensor(contexts, dtype=torch.int64)
    slots = torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i, p in enumerate(contexts)])
    # (a tree from before the paired layout times its standard one: benchmarks/ab.py's baseline)
    layout = {"paired": True} if "paired" in inspect.signature(kernels.AttentionStep).parameters else {}
    if layout:
        k, v = to_pairs(k, v)
    step = kernels.AttentionStep(positions, slots, torch.arange(rows), tables, BLOCK, ang.cos().contiguous(),
                                 ang.sin().contiguous(), HEADS, KV_HEADS, D, torch.bfloat16, torch.bfloat16,
                                 1 / math.sqrt(D), **layout)
    step.struct.threads = threads
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * D, generator=gen).to(torch.bfloat16)
    return lambda: kernels.attention(step, qkv, k, v)


CASES = {
    "16 rows, shared 1024-token prefix, 1 thread": (16, 1040, 1024, 1),
    "16 rows, shared 1024-token prefix, 2 threads": (16, 1040, 1024, 2),
    "1 row at 1040 positions": (1, 1040, 0, 1),
    "16 rows at 40 positions, nothing shared": (16, 40, 0, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("attention.py: the native kernels are not built here")
    out = {}
    print(f"{'case':48} | median us | min us")
    for name, spec in CASES.items():
        call = case(*spec)
        for _ in range(20):
            call()
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = {"median_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6}
        print(f"{name:48} | {out[name]['median_us']:9.1f} | {out[name]['min_us']:6.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
