"""The default draft model of speculative decoding, `int8` (the target dynamically quantized),
on the tiny random-weight model: offline, no SmolLM2 (test_speculative.py drafts with the
target's first layer; `rudder generate --speculative draft` is in test_cli.py)."""

from __future__ import annotations

import torch

from rudder import LLM, SamplingParams


def test_the_default_draft_is_the_quantized_model_and_greedy_is_unchanged():
    llm = LLM("tiny")
    assert llm.engine.config.draft_model == "int8"
    greedy = dict(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = ["hello", "a b c a b c"]
    plain = llm.generate(prompts, SamplingParams(**greedy))
    spec = llm.generate(prompts, SamplingParams(**greedy, speculative="draft"))
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids   # verification keeps greedy output exact
        assert s.speculative["drafted"] > 0 and 0 < s.speculative["accepted"] <= s.speculative["drafted"]
        assert s.speculative["target_forwards"] < len(s.token_ids)   # drafts saved target passes
    draft = llm.engine.spec._draft_model.model
    target = llm.model
    quantized = [m for m in draft.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert len(quantized) > target.cfg.num_layers   # each layer's projections and the LM head
    assert all(m.weight().dtype == torch.qint8 for m in quantized)
    assert not [m for m in draft.modules() if type(m) is torch.nn.Linear]   # no float layer left
    assert draft.embed_tokens is target.embed_tokens   # shared, not copied
