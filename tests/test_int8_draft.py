"""The default draft model of speculative decoding, `int8` (the target with int8 weights),
on the tiny random-weight model: offline, no SmolLM2 (test_speculative.py drafts with the
target's first layer; `rudder generate --speculative draft` is in test_cli.py)."""

from __future__ import annotations

import pytest
from torch import nn

from rudder import LLM, SamplingParams
from rudder.packed_linear import Int8Linear


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
    quantized = [m for m in draft.modules() if isinstance(m, Int8Linear)]
    assert len(quantized) == 4 * target.cfg.num_layers + 1   # each layer's projections and the LM head
    assert isinstance(draft.lm_head, Int8Linear) and draft.lm_head is not target.lm_head
    assert not [m for m in draft.modules() if type(m) is nn.Linear]   # no float layer left
    assert draft.embed_tokens.weight.dtype != target.embed_tokens.weight.dtype or \
        draft.embed_tokens is target.embed_tokens   # shared, not copied, where the dtype allows


@pytest.mark.model
def test_smollm2_and_its_draft_keep_their_weights_in_huge_pages():
    """Every native layer of the served model and of its int8 draft, the heads included, lives
    in the mapping advised for transparent huge pages (packed_linear.place_in_huge_pages)."""
    from rudder.packed_linear import _NativeLinear

    llm = LLM("smollm2")
    try:
        llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, speculative="draft"))
        for model in (llm.model, llm.engine.spec._draft_model.model):
            layers = [m for m in model.modules() if isinstance(m, _NativeLinear)]
            assert len(layers) == 4 * model.cfg.num_layers + 1
            assert all(m.in_huge_pages for m in layers), [type(m).__name__ for m in layers if not m.in_huge_pages]
    finally:
        llm.close()
