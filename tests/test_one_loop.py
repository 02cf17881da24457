"""One engine loop: the plain engine, speculative decoding and a pipeline of processes give the
same tokens for the same requests - with controllers that mask, fast-forward, backtrack and fork.

The controllers here are hypothesis-drawn *pure* functions of their sequence (as real
constraint controllers are): what they answer depends on the tokens, not on how many times they
were called. Speculation tells a controller draft tokens that may be taken back, so a controller
that counted its calls could legitimately answer differently; a pure one must not.

What must agree:
- greedy: every engine (single process, speculative lookup, 2-stage pipeline with 1 and with 2
  micro-batches, speculative on the pipeline) gives the same tokens, finish reasons and errors;
- seeded sampling: the single process and the pipelines agree, plain with plain and speculative
  with speculative (speculative sampling draws its own uniforms for acceptance, so it follows the
  target's distribution without repeating plain sampling's tokens).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from test_branches import mask_of

MODEL = "tiny:4"
OPTIONS = dict(kv_cache_tokens=4096, block_size=4, max_forks=8)
VOCAB = 512
PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [5, 6, 7, 5, 6, 7, 5, 6], [300, 301, 302]]


class Pure:
    """Answers from its sequence alone (plus the branch it took at a fork, which the host tells it):

    - after the output reaches `stop_at` tokens: stop (no branch);
    - the last token is banned: take it back and sample again without the banned ones (no
      livelock: the new token cannot be banned);
    - the last token is a trigger: fast-forward its tokens (never banned, never triggers);
    - at output length `fork_at` (before any fork of its own): fork in two; the second fork
      samples under `allowed`, and so does every later step of a second fork;
    - every `mask_every`-th output position: sample under `allowed`, with an ff list after
      the smallest allowed token;
    - otherwise: sample freely."""

    def __init__(self, plan: dict, prompt_len: int, seen: dict | None = None):
        self.plan, self.prompt_len = plan, prompt_len
        self.tokens: list[int] = []
        self.lineage: tuple[int, ...] = ()
        self.seen = seen  # counts of the Branch kinds answered, when the caller wants them

    def mid_process(self, branch_idx, backtrack, tokens):
        answer = self._answer(branch_idx, backtrack, tokens)
        if self.seen is not None:
            kind = ("stop" if not answer else "fork" if len(answer) > 1 else "backtrack" if answer[0].backtrack
                    else "ff" if answer[0].ff and answer[0].mask is None else "mask" if answer[0].mask is not None
                    else "sample")
            self.seen[kind] = self.seen.get(kind, 0) + 1
        return answer

    def _answer(self, branch_idx, backtrack, tokens):
        if branch_idx:
            self.lineage += (branch_idx,)
        if backtrack:
            del self.tokens[len(self.tokens) - backtrack:]
        self.tokens.extend(tokens)
        p, out = self.plan, len(self.tokens) - self.prompt_len
        allowed = mask_of(p["allowed"])
        last = self.tokens[-1] if out > 0 else None
        if out >= p["stop_at"]:
            return []
        if last in p["banned"]:
            return [Branch(backtrack=1, mask=mask_of(set(range(VOCAB)) - p["banned"]))]
        if last in p["triggers"]:
            return [Branch(ff=[list(p["triggers"][last])])]
        if out == p["fork_at"] and not self.lineage:
            return [Branch(), Branch(mask=allowed)]
        if self.lineage or (out % p["mask_every"] == 0):
            first = min(p["allowed"])
            return [Branch(mask=allowed, ff=[[first, *p["tail"]]])]
        return [Branch()]

    def fork(self):
        twin = Pure(self.plan, self.prompt_len, self.seen)
        twin.tokens, twin.lineage = list(self.tokens), self.lineage
        return twin

    def close(self):
        pass


# Banned, triggers and ff tokens come from disjoint ranges, so no answer re-triggers itself.
plans = st.fixed_dictionaries({
    "banned": st.frozensets(st.integers(100, 199), max_size=40),
    "triggers": st.dictionaries(st.integers(200, 299), st.lists(st.integers(400, 499), min_size=1, max_size=3),
                                max_size=30),
    "allowed": st.frozensets(st.integers(300, 399), min_size=1, max_size=12),
    "tail": st.lists(st.integers(400, 499), max_size=2),
    "mask_every": st.integers(2, 5),
    "fork_at": st.integers(1, 6),
    "stop_at": st.integers(4, 14),
})


@pytest.fixture(scope="module")
def engines():
    single = LLM(MODEL, **OPTIONS)
    piped1 = LLM(MODEL, pipeline_stages=2, micro_batches=1, **OPTIONS)
    piped2 = LLM(MODEL, pipeline_stages=2, micro_batches=2, **OPTIONS)
    yield {"single": single, "pipeline-M1": piped1, "pipeline-M2": piped2}
    for llm in (piped1, piped2):
        llm.close()


def outcome(llm, plan, params_of) -> list:
    """Per prompt: each branch's (tokens, finish reason, error); the request's block usage back to 0."""
    outs = llm.generate(PROMPTS, [params_of(i) for i in range(len(PROMPTS))],
                        controllers=[Pure(plan, len(p)) for p in PROMPTS])
    bm = llm.engine.block_manager
    assert bm.num_free == bm.num_blocks  # every block of every fork came back
    return [[(b.token_ids, b.finish_reason, b.error) for b in o.branches] for o in outs]


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(plan=plans)
def test_greedy_tokens_agree_across_engines(engines, plan):
    def params(speculative):
        return lambda i: SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=speculative)

    reference = outcome(engines["single"], plan, params(None))
    for name, llm in engines.items():
        for spec in (None, "lookup"):
            if name == "single" and spec is None:
                continue
            assert outcome(llm, plan, params(spec)) == reference, (name, spec)


@SETTINGS
@given(plan=plans, seed=st.integers(0, 2**31))
def test_seeded_tokens_agree_across_engines(engines, plan, seed):
    for spec in (None, "lookup"):
        def params(i):
            return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed + i, ignore_eos=True,
                                  speculative=spec)

        reference = outcome(engines["single"], plan, params)
        for name in ("pipeline-M1", "pipeline-M2"):
            assert outcome(engines[name], plan, params) == reference, (name, spec)


def test_a_plan_that_uses_every_branch_kind_agrees_across_engines(engines):
    """The property tests above draw plans at random; this one is known to make the controllers
    backtrack, fast-forward, mask and fork (counted), and every engine must still agree."""
    plan = {"banned": frozenset(range(100, 200)), "triggers": {t: [400 + t % 100] for t in range(200, 300)},
            "allowed": frozenset({300, 301, 302}), "tail": [401], "mask_every": 3, "fork_at": 2, "stop_at": 12}

    def run(llm, spec):
        seen: dict = {}
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=spec)
        outs = llm.generate(PROMPTS, [params] * len(PROMPTS), controllers=[Pure(plan, len(p), seen) for p in PROMPTS])
        return [[(b.token_ids, b.finish_reason, b.error) for b in o.branches] for o in outs], seen

    reference, seen = run(engines["single"], None)
    assert all(seen.get(kind, 0) > 0 for kind in ("backtrack", "ff", "mask", "fork", "stop")), seen
    for name, llm in engines.items():
        for spec in (None, "lookup"):
            if (name, spec) != ("single", None):
                assert run(llm, spec)[0] == reference, (name, spec)


def test_speculation_on_a_pipeline_verifies_drafts(engines):
    """Not just agreement: on the pipeline, drafts are made, verified and mostly accepted (a
    repetitive prompt), and a fork inside a speculative request works there too."""
    plan = {"banned": frozenset(), "triggers": {}, "allowed": frozenset({301}), "tail": [], "mask_every": 100,
            "fork_at": 3, "stop_at": 20}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative="lookup")
    [out] = engines["pipeline-M2"].generate([PROMPTS[1]], params, controllers=[Pure(plan, len(PROMPTS[1]))])
    stats = out.speculative
    assert stats["spec_steps"] > 0 and stats["drafted"] > 0 and stats["accepted"] > 0
    assert len(out.branches) == 2 and all(b.finish_reason == "stop" for b in out.branches)
    [plain] = engines["single"].generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                                         controllers=[Pure(plan, len(PROMPTS[1]))])
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in plain.branches]


def test_draft_model_speculation_on_a_pipeline(engines):
    """The 'draft' source on a pipeline: a draft built from the whole target (int8, layers:N) is
    refused with a clear reason (rank 0 holds only stage 0); a draft checkpoint of its own works."""
    llm = engines["pipeline-M1"]
    with pytest.raises(ValueError, match="whole target model"):
        llm.generate(["x"], SamplingParams(max_tokens=4, speculative="draft"))
    llm.engine.config = llm.engine.config.replace(draft_model=MODEL)  # a checkpoint (the same tiny model)
    llm.engine.spec = None
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculative="draft")
        [out] = llm.generate([PROMPTS[0]], params)
        [plain] = engines["single"].generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True))
        assert out.token_ids == plain.token_ids
        assert out.speculative["accepted"] > 0  # the same weights as the target: its drafts are right
    finally:
        llm.engine.config = llm.engine.config.replace(draft_model="int8")
        llm.engine.spec = None
