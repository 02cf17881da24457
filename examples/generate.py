"""Batched generation and streaming with the Python API (SmolLM2, fetched on first use).

    .venv/bin/python examples/generate.py
"""

from rudder import LLM, SamplingParams

llm = LLM("smollm2")

questions = ["Name a colour.", "Name a fruit.", "What is 2 + 2?"]
for question, out in zip(questions, llm.generate(questions, SamplingParams(max_tokens=20, temperature=0), chat=True)):
    print(f"{question} -> {out.text!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")

print("\nStreaming:")
for delta in llm.stream("Write one sentence about the sea.", SamplingParams(max_tokens=60, seed=1), chat=True):
    print(delta.text, end="", flush=True)
print()
