"""Speculative sampling is exact: with speculation (prompt lookup and a draft model), the tokens
follow the very distribution plain sampling draws from - temperature, top-k, top-p and min-p
included, under a controller's mask or not (engine/speculative.py, docs/speculative.md).

The measured position: a controller's mask forces the first output token, so the second is
drawn from one known distribution, and it is the position the speculator drafts (each request
drafts there: counted). The prompt repeats a trigram that ends in the forced token, so prompt
lookup proposes the token that followed it; the draft model (the target's first layer) proposes
from a distribution of its own. Thousands of seeded requests per (setting, mode) give the counts.

The reference is computed here, independently of `sampler.sampling_weights`, from the target's
logits. Three checks per sample, each with a false-alarm rate of at most 0.1% (seeds are fixed,
so a run is deterministic: the rate says how unlikely a correct engine is to have failed at
these seeds): no token outside the reference's support (an impossible event for a correct
engine: what drops when the top-p or min-p step goes missing), a chi-square goodness of fit
against the reference, and a chi-square test of homogeneity of each speculative sample against
the plain one. The tests also show their power: the same counts reject the distribution without
the truncations.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from rudder.engine.model_runner import ModelRunner
from rudder.engine.step import ScheduledSeq

V = 512
FIRST = 77  # the only token the controller allows first
N = 1200  # requests per (setting, mode)
Z_999 = 3.09  # the normal distribution's 0.999 quantile: each test's false-alarm rate is 0.1%


@pytest.fixture(scope="module")
def llm():
    # block_size 4: the rejected positions' rewinds cross block boundaries.
    return LLM("tiny", kv_cache_tokens=16384, block_size=4, draft_model="layers:1", max_seqs=256)


def allowed_bits(keep: np.ndarray) -> np.ndarray:
    return np.packbits(keep.astype(np.uint8), bitorder="little").view(np.uint32).copy()


class Constraint:
    """Allows FIRST alone at the first output position, then the tokens of `allowed` (None:
    every token). Stateful as a real controller is: it follows the sequence from what it is told
    (drafted tokens, the backtrack that takes rejected ones back)."""

    def __init__(self, allowed: np.ndarray | None):
        self.allowed, self.length, self.prompt = allowed, 0, None

    def mid_process(self, branch_idx, backtrack, tokens):
        self.length += len(tokens) - backtrack
        if self.prompt is None:
            self.prompt = self.length
        if self.length == self.prompt:
            return [Branch(mask=allowed_bits(np.arange(V) == FIRST))]
        return [Branch(mask=None if self.allowed is None else allowed_bits(self.allowed))]

    def fork(self):
        raise AssertionError("no forks here")

    def close(self):
        pass


# -- the reference, written out from the definitions ----------------------------------------------

def target_logits(model, ids: list[int]) -> np.ndarray:
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    view = SimpleNamespace(token_ids=ids, num_cached=0)
    entry = ScheduledSeq(view, len(ids), list(range(len(ids))), list(range(8)), True)
    return runner.run([entry])[0].double().numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference(logits: np.ndarray, p: SamplingParams, allowed: np.ndarray | None) -> tuple[np.ndarray, float]:
    """The distribution of a token drawn from `logits`: the mask, then the temperature, the k most
    likely, the smallest set whose mass reaches top_p (on what top-k kept), and the tokens at
    least min_p times as likely as the most likely one. Also how far the row is from the top_p
    and min_p boundaries (float32 rounding in the engine must not move a token across one)."""
    x = logits.copy()
    if allowed is not None:
        x[~allowed] = -np.inf
    x = x / p.temperature
    if p.top_k:
        x[x < np.sort(x)[-p.top_k]] = -np.inf
    probs, margin = softmax(x), 1.0
    if p.top_p < 1:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]
        margin = min(margin, np.abs(before - p.top_p).min())
        x[order[before >= p.top_p]] = -np.inf
        probs = softmax(x)
    if p.min_p:
        ratio = probs / probs.max()
        margin = min(margin, np.abs(ratio - p.min_p).min())
        probs[ratio < p.min_p] = 0.0
        probs /= probs.sum()
    return probs, margin


# -- the statistics ------------------------------------------------------------------------------

def chi2_critical(df: int) -> float:
    """The upper 0.1% point of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + Z_999 * np.sqrt(2 / (9 * df))) ** 3


def pooled(expected: np.ndarray, *counts: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cells with an expected count under 5 pooled into one (the chi-square approximation's rule)."""
    small = expected < 5
    return (np.append(expected[~small], expected[small].sum()),
            [np.append(c[~small], c[small].sum()) for c in counts])


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(Pearson's statistic, its 0.1% critical value) of counts drawn from probs."""
    expected, (observed,) = pooled(probs * counts.sum(), counts)
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(statistic, 0.1% critical value) of the chi-square test that two samples of the same size
    come from one distribution."""
    expected, (a, b) = pooled((a + b) / 2, a, b)
    keep = expected > 0
    stat = float((((a - expected) ** 2 + (b - expected) ** 2)[keep] / expected[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


# -- the settings -----------------------------------------------------------------------------------

TOKENS = np.arange(V)
QUARTER = (TOKENS * 13 % 16 < 4) | (TOKENS == FIRST)  # a constraint's mask: a quarter of the vocabulary

SETTINGS = {  # (params, the mask after the first token)
    "top_p": (dict(temperature=0.6, top_p=0.6), None),
    "min_p, masked": (dict(temperature=0.8, min_p=0.15), QUARTER),
    "top_k, top_p, min_p, masked": (dict(temperature=1.0, top_k=40, top_p=0.8, min_p=0.1), QUARTER),
}


def lookup_prompt(model, params: SamplingParams, allowed) -> tuple[list[int], np.ndarray, int]:
    """A prompt `a b FIRST X c d a b` (prompt lookup proposes X after FIRST) and the reference
    after it, with X the most likely token there (found by iterating X <- the argmax; the random
    model needs a few tries of c) and drawn a fair share of the time, so that both acceptance and
    rejection happen."""
    a, b, d = 11, 22, 44
    for c in range(100, V):
        x = 200
        for _ in range(6):
            prompt = [a, b, FIRST, x, c, d, a, b]
            probs, margin = reference(target_logits(model, prompt + [FIRST]), params, allowed)
            if probs.argmax() == x:
                if 0.15 < probs[x] < 0.6 and margin > 1e-5 and x not in (a, b, c, d, FIRST):
                    return prompt, probs, x
                break
            x = int(probs.argmax())
    raise AssertionError("no token to propose")


def draw(llm, prompt, params: SamplingParams, allowed, mode: str | None, seeds: range):
    """The second output token of each seeded request, and the speculation counts."""
    plist = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, speculative=mode, **params) for s in seeds]
    outs = llm.generate([prompt] * len(plist), plist, controllers=[Constraint(allowed) for _ in plist])
    assert all(o.token_ids[0] == FIRST and len(o.token_ids) == 3 for o in outs)
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=V)
    stats = None if mode is None else {k: sum(o.speculative[k] for o in outs) for k in ("drafted", "accepted")}
    return counts, stats


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_draws_from_the_plain_distribution(llm, setting):
    fields, allowed = SETTINGS[setting]
    params = SamplingParams(**fields)
    prompt, probs, proposed = lookup_prompt(llm.model, params, allowed)
    support = probs > 0
    assert support.sum() >= 4  # a distribution, not a near-certain token
    untruncated, _ = reference(target_logits(llm.model, prompt + [FIRST]),
                               SamplingParams(temperature=params.temperature), allowed)
    assert untruncated[~support].sum() > 0.15  # the truncations matter: they drop this much mass

    samples = {}
    for i, mode in enumerate((None, "lookup", "draft")):
        counts, stats = draw(llm, prompt, fields, allowed, mode, range(i * N, (i + 1) * N))
        samples[mode] = counts
        where = f"{setting}, {mode or 'plain'}"
        outside = counts[~support].sum()
        assert outside == 0, f"{where}: {outside} tokens outside the support (of {N}), e.g. " \
                             f"{np.flatnonzero(counts * ~support)[:5].tolist()}"
        stat, critical = goodness_of_fit(counts, probs)
        assert stat < critical, f"{where}: chi-square {stat:.1f} against the reference, critical {critical:.1f}"
        tv = 0.5 * np.abs(counts / N - probs).sum()
        assert goodness_of_fit(counts, untruncated)[0] > goodness_of_fit(counts, untruncated)[1], \
            f"{where}: no power (total variation to the reference {tv:.3f})"
        if mode is not None:  # speculation ran at the measured position, and both of its outcomes happened
            assert stats["drafted"] >= N, (where, stats)
            assert 0.05 < stats["accepted"] / stats["drafted"] < 0.95, (where, stats)
            stat, critical = homogeneity(samples[None], counts)
            assert stat < critical, f"{where}: chi-square {stat:.1f} against plain sampling, critical {critical:.1f}"
    assert samples["lookup"][proposed] > 0  # the proposal itself was accepted sometimes
