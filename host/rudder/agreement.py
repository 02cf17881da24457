"""How much a weight precision changes what the model computes, against fp32 (docs/performance.md).

`compare(reference, other, tokenizer)`: for each of a fixed set of prompts, the reference's greedy
continuation (`n_tokens` tokens); then both models score prompt + continuation in one forward
(teacher forcing: the same inputs on both sides, so one early disagreement does not decide all
the rest, as it would in free-running text). Reported: the largest logit difference over those
positions, and the share of the reference's greedy tokens that the other model's argmax picks
too (`agreement`). `benchmarks/decode.py` prints it per precision; tests/test_precision.py keeps
bounds on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .engine.block_manager import BlockManager
from .engine.llm_engine import Engine
from .engine.model_runner import ModelRunner
from .engine.sequence import SamplingParams
from .engine.step import ScheduledSeq

__all__ = ["PROMPTS", "greedy", "scored_logits", "compare"]

#: Fixed prompts: chat turns and plain text, prose, code, arithmetic, other languages.
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain in two sentences why ships have rudders."}],
    [{"role": "user", "content": "List three fruits that are red."}],
    "def quicksort(xs):\n",
    "In 1969, the first humans",
    "Q: What is 12 + 30?\nA:",
    "Translate to French: I like green apples.",
]


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):
        return tokenizer.encode(tokenizer.apply_chat_template(prompt))
    return tokenizer.encode(prompt)


def greedy(model, tokenizer, prompts, n_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly `n_tokens` tokens (EOS ignored)."""
    engine = Engine(model, tokenizer, kv_cache_tokens=len(prompts) * 512, max_seqs=len(prompts))
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(prompt_ids(tokenizer, p), params) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    return [engine.completions(r)[0].token_ids for r in reqs]


@torch.inference_mode()
def scored_logits(model, tokens: list[int], rows: int) -> torch.Tensor:
    """fp32 logits [rows, vocab] predicting the last `rows` tokens of `tokens`, in one forward."""
    fed = tokens[:-1]
    block = 16
    blocks = (len(fed) + block - 1) // block
    runner = ModelRunner(model, blocks, block)
    bm = BlockManager(blocks, block)
    bm.add(0)
    slots = bm.append(0, len(fed))
    seq = SimpleNamespace(token_ids=fed, num_cached=0)
    return runner.run([ScheduledSeq(seq, len(fed), slots, bm.tables[0], True, logit_rows=rows)])


def compare(reference, other, tokenizer, n_tokens: int = 32, prompts=PROMPTS,
            continuations: list[list[int]] | None = None) -> dict:
    """`other` against `reference` over `prompts` (see the module docstring); `continuations`:
    the reference's greedy tokens, if already computed."""
    if continuations is None:
        continuations = greedy(reference, tokenizer, prompts, n_tokens)
    agree = total = 0
    max_diff = 0.0
    for prompt, cont in zip(prompts, continuations):
        tokens = prompt_ids(tokenizer, prompt) + list(cont)
        ref = scored_logits(reference, tokens, len(cont))
        got = scored_logits(other, tokens, len(cont))
        max_diff = max(max_diff, (got - ref).abs().max().item())
        agree += int((got.argmax(-1) == torch.tensor(cont)).sum())
        total += len(cont)
    return {"max_logit_diff": max_diff, "agreement": agree / total, "tokens": total}
