"""Logit processing in the sampler: logit_bias, presence/frequency/repetition penalties, min_p
(OpenAI / vLLM semantics), checked against a plain reference, and their way through the engine."""

import numpy as np
import pytest
import torch

from rudder.engine.sampler import Sampler
from rudder.engine.sequence import SamplingParams

V = 1000


def mask_of(allowed_ids, vocab=V) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in allowed_ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words


def reference(logits: np.ndarray, p: SamplingParams, ids: list[int], n_prompt: int) -> np.ndarray:
    """The processed row, one token at a time (what vLLM documents)."""
    x = logits.astype(np.float64).copy()
    for t in set(ids):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = ids[n_prompt:]
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    return x


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=1.3),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.6,
                   logit_bias={3: 5.0, 999: -7.5, 12: 100}),
])
def test_processing_matches_the_reference(params):
    params.validate()
    gen = np.random.default_rng(1)
    logits = gen.normal(0, 3, (3, V)).astype(np.float32)
    histories = [([5, 5, 9, 3, 5, 700, 9], 3), ([1, 2, 3], 3), None]  # row 2: no history given
    got = torch.from_numpy(logits.copy())
    plain = SamplingParams()
    Sampler(V).apply_processing(got, [params, params, plain], histories)
    for row in range(2):
        ids, n_prompt = histories[row]
        np.testing.assert_allclose(got[row].numpy(), reference(logits[row], params, ids, n_prompt), rtol=1e-6,
                                   atol=1e-5)
    np.testing.assert_array_equal(got[2].numpy(), logits[2])  # an unprocessed row is untouched


def test_logit_bias_forces_and_bans_but_never_lifts_a_mask():
    gen = np.random.default_rng(2)
    sampler = Sampler(V)
    for temperature in (0.0, 1.0):
        logits = torch.from_numpy(gen.normal(0, 3, (3, V)).astype(np.float32))
        params = [SamplingParams(temperature=temperature, logit_bias={17: 100}),
                  SamplingParams(temperature=temperature, logit_bias={17: 100}),
                  SamplingParams(temperature=temperature, logit_bias={t: -100 for t in range(V) if t != 40})]
        out = sampler.sample(logits, params, [np.random.default_rng(i) for i in range(3)],
                             [None, mask_of([3, 4, 5]), None])
        assert out.tokens[0] == 17        # +100 wins
        assert out.tokens[1] in (3, 4, 5)  # the mask still rules: 17 is not allowed there
        assert out.tokens[2] == 40        # everything else banned


def test_min_p_keeps_only_likely_tokens():
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.tensor([5.0, 4.5, 1.0, 0.0])  # p(2)/p(0) ~ 0.018
    p = SamplingParams(temperature=1.0, min_p=0.1).validate()
    sampler = Sampler(V)
    seen = {sampler.sample(logits.clone(), [p], [np.random.default_rng(s)]).tokens[0] for s in range(200)}
    assert seen == {0, 1}


def test_logprobs_describe_the_processed_distribution():
    logits = torch.zeros((1, V))
    p = SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 3.0}).validate()
    out = Sampler(V).sample(logits, [p], [np.random.default_rng(0)])
    assert out.tokens == [7]
    expect = 3.0 - np.log(np.exp(3.0) + V - 1)
    assert out.logprobs[0]["logprob"] == pytest.approx(expect, rel=1e-5)
    assert out.logprobs[0]["top"][0][0] == 7


@pytest.mark.parametrize("bad, word", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(frequency_penalty=0.5, speculative="lookup"), "speculative"),
    (dict(json_schema={}), "json_schema"),
])
def test_bad_values_are_refused_by_name(bad, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**bad).validate()


def test_the_engine_hands_penalized_rows_their_tokens(monkeypatch):
    """Through the engine: the sampler sees each penalized row's whole sequence (prompt length
    included), and a strong repetition penalty changes greedy output."""
    from rudder import LLM

    llm = LLM("tiny")
    seen = []
    real = Sampler.sample

    def spy(self, logits, params, rngs, masks=None, history=None):
        seen.append(None if history is None else [(list(ids), n) for ids, n in history])  # live lists: copy
        return real(self, logits, params, rngs, masks, history)

    monkeypatch.setattr(Sampler, "sample", spy)
    prompt = "abcabc"
    plain, = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert all(h is None for h in seen)
    seen.clear()
    rep, = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 repetition_penalty=5.0))
    prompt_ids = llm.tokenizer.encode(prompt)
    assert len(seen) == 12
    for k, history in enumerate(seen):
        (ids, n_prompt), = history
        assert n_prompt == len(prompt_ids) and ids[:n_prompt] == prompt_ids and len(ids) == n_prompt + k
    assert len(set(rep.token_ids)) > len(set(plain.token_ids))  # repeats are pushed down


def test_a_pipeline_refuses_what_its_last_stage_cannot_apply():
    """A pipeline's last stage samples from a spec without penalties or bias: refused by name,
    by LLM (the server's 400) and by the engine itself, as its runner's capabilities say."""
    from rudder import LLM
    from rudder.pipeline.runner import PipelineRunner

    llm = LLM("tiny")
    llm.engine.runner.capabilities = PipelineRunner.capabilities  # the declaration is all that differs here
    try:
        with pytest.raises(ValueError, match="presence_penalty, logit_bias: not available with pipeline stages"):
            llm.generate(["x"], SamplingParams(presence_penalty=1.0, logit_bias={3: 1.0}, max_tokens=2))
        with pytest.raises(ValueError, match="^min_p: not available with pipeline stages"):
            llm.engine.add_request([5, 6], SamplingParams(min_p=0.1, max_tokens=2))
        assert not llm.engine.has_unfinished()
        assert llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"
    finally:
        del llm.engine.runner.capabilities  # back to the class's declaration
