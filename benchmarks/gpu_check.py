"""The engine's paths on a CUDA device, with the tiny random-weight model (issue 18: "where a GPU
is at hand, run ... with device='cuda'"): greedy agreement with the CPU in each precision,
batched == one at a time, a mask controller, seeded sampling, both speculative modes against
plain decoding, and decode speed (host-bound with a model this small).

    PYTHONPATH=host python3 benchmarks/gpu_check.py

The tiny model needs no files, so it runs where SmolLM2's (98 MB and more) cannot be copied.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import numpy as np
import torch
from rudder import LLM, SamplingParams
from rudder.branch import Branch

print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Rudders steer"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

def agree(a, b):
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids))
    return same / sum(len(p.token_ids) for p in a)

cpu = LLM("tiny", dtype="fp32", kv_cache_tokens=4096, block_size=8)
ref = cpu.generate(PROMPTS, GREEDY)
for dtype in ("fp32", "bf16", "auto"):
    try:
        gpu = LLM("tiny", device="cuda", dtype=dtype, kv_cache_tokens=4096, block_size=8)
        got = gpu.generate(PROMPTS, GREEDY)
        solo = [gpu.generate([p], GREEDY)[0] for p in PROMPTS]
        print(f"cuda {dtype} ({gpu.dtype}): greedy agreement with cpu fp32 {agree(ref, got):.3f}; "
              f"batched == one at a time: {[a.token_ids for a in got] == [b.token_ids for b in solo]}", flush=True)
    except Exception as e:
        print(f"cuda {dtype}: FAILED {type(e).__name__}: {e}", flush=True)

gpu = LLM("tiny", device="cuda", dtype="fp32", kv_cache_tokens=4096, block_size=8)
V = gpu.model.cfg.vocab_size
allowed = [ord(c) + 3 for c in "xyz"]
words = np.zeros((V + 31) // 32, np.uint32)
for t in allowed:
    words[t >> 5] |= np.uint32(1 << (t & 31))

class XYZ:
    def mid_process(self, b, back, toks): return [Branch(mask=words)]
    def fork(self): return XYZ()
    def close(self): pass

out = gpu.generate(["hi"] * 4, SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True),
                   controllers=[XYZ() for _ in range(4)])
print("cuda mask controller: all in xyz:", all(set(o.text) <= set("xyz") and len(o.token_ids) == 16 for o in out), flush=True)
s1 = gpu.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True))
s2 = gpu.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True))
print("cuda seeded sampling repeats:", [a.token_ids for a in s1] == [b.token_ids for b in s2], flush=True)
for mode in ("lookup", "draft"):
    try:
        g = LLM("tiny", device="cuda", dtype="fp32", kv_cache_tokens=4096, block_size=8,
                **({"draft_model": "layers:1"} if mode == "draft" else {}))
        plain = g.generate(PROMPTS, GREEDY)
        spec = g.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, speculative=mode))
        print(f"cuda speculative {mode}: same as plain {[a.token_ids for a in plain] == [b.token_ids for b in spec]}; "
              f"{[o.speculative['tokens_per_target_forward'] for o in spec]}", flush=True)
    except Exception as e:
        print(f"cuda speculative {mode}: FAILED {type(e).__name__}: {e}", flush=True)
for batch in (1, 16):
    ps = (PROMPTS * 4)[:batch]
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    gpu.generate(ps, p)
    torch.cuda.synchronize(); t = time.perf_counter()
    o = gpu.generate(ps, p)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"cuda tiny fp32 B={batch}: {sum(len(x.token_ids) for x in o) / dt:.0f} tok/s (host-bound: a tiny model)", flush=True)

# KV memory from the device and prefix caching (issue 30): the default cache is sized from the
# GPU's free memory; a shared prompt is computed once, and greedy tokens are the same without it.
sized = LLM("tiny", device="cuda", dtype="bf16")
print(f"cuda default KV cache: {sized.engine.config.kv_cache_tokens} tokens "
      f"({torch.cuda.mem_get_info()[0] / 2 ** 30:.1f} GiB free after allocating it)", flush=True)
shared = "You are a helpful assistant. " * 60
asks = [shared + q for q in ("Name a colour.", "Name a fish.", "Name a tree.", "Name a city.")]
runs = {}
for caching in (True, False):
    llm = LLM("tiny", device="cuda", dtype="fp32", kv_cache_tokens=8192, block_size=16, prefix_caching=caching)
    first = llm.generate(asks[:1], GREEDY)
    rest = llm.generate(asks[1:], GREEDY)
    runs[caching] = ([o.token_ids for o in first + rest], [o.cached_tokens for o in rest])
print(f"cuda prefix cache: same tokens on and off {runs[True][0] == runs[False][0]}; cached prompt tokens "
      f"on {runs[True][1]}, off {runs[False][1]}", flush=True)
