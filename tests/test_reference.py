"""Our decoder against transformers on the same GGUF: last-position logits within 2e-4 of
transformers' (fp32; measured here: at most 9.1e-5 over the 8 prompts, on logits up to ~30),
greedy output token for token. Our model runs in fp32 here, whatever `auto` picks on this machine
(the other precisions are measured against our fp32 in test_precision.py).

transformers reads the original GGUF itself (its own dequantisation and RoPE handling), so this
checks our conversion, our model and our paged attention together."""

import pytest
import torch

from rudder import SamplingParams
from rudder.engine import Engine
from rudder.loading import load_model

pytestmark = pytest.mark.model

MAX_LOGIT_DIFF = 2e-4  # twice the largest difference measured (9.1e-5): float32 rounding, not a bug

PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):\n",
    "In 1969, the first humans",
    "Translate to French: I like green apples.",
    "Q: What is 12 + 30?\nA:",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Les rudders des bateaux",
    "🙂 emoji and 数字 123456",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf_dir):
    import accelerate  # noqa: F401 - transformers' GGUF loader needs it (the `test` extra has both)
    import transformers

    folder, name = smollm2_gguf_dir
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


class Fp32:
    """The engine over SmolLM2 in fp32, with LLM.generate's loop."""

    def __init__(self):
        model, self.tokenizer = load_model("smollm2", dtype="fp32")
        self.engine = Engine(model, self.tokenizer)

    def generate(self, prompts, params):
        reqs = [self.engine.add_request(p, params) for p in prompts]
        while not all(r.finished for r in reqs):
            self.engine.step()
        return [self.engine.completions(r)[0] for r in reqs]


@pytest.fixture(scope="module")
def llm():
    return Fp32()


def test_prompt_logits_match(llm, hf_model):
    engine = llm.engine
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        req = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))
        logits = {}
        run = engine.runner.run
        engine.runner.run = lambda batch, *args: logits.setdefault("x", run(batch, *args))
        try:
            engine.step()
        finally:
            engine.runner.run = run
        engine.forget(req)
        diff = (logits["x"][0] - ref).abs().max().item()
        assert diff < MAX_LOGIT_DIFF, f"{prompt!r}: max logit difference {diff}"


def test_greedy_output_matches_token_for_token(llm, hf_model):
    n = 24
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)  # batched: also exercises ragged batching
    for prompt, got in zip(PROMPTS, ours):
        ids = llm.tokenizer.encode(prompt)
        assert got.token_ids == hf_greedy(hf_model, ids, n), prompt


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """Plain argmax with transformers' KV cache (no logits processors, EOS not special)."""
    out, past, feed = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            step = hf_model(input_ids=feed, cache=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            feed = torch.tensor([[out[-1]]])
    return out
