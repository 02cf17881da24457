"""Speculative decoding (engine/speculative.py, docs/speculative.md).

Greedy output with speculation must be token-for-token that without it, with and without
controllers; the controllers here are stateful and mirror the sequence from what they are told
(backtrack, append), so a wrong rewind report changes their masks and shows up in the output.
That speculative sampling draws from the plain distribution is tests/test_spec_exactness.py."""

import itertools
import time

import numpy as np
import pytest

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from rudder.engine.speculative import _Adaptive

V = 512
MODES = [("lookup", 4), ("lookup", 8), ("draft", 3)]


@pytest.fixture(scope="module")
def llm():
    # block_size 4: rewinds cross block boundaries all the time; the draft is the target's first layer.
    return LLM("tiny", kv_cache_tokens=8192, block_size=4, draft_model="layers:1", max_seqs=256)


def mask_of(tokens):
    words = np.zeros((V + 31) // 32, np.uint32)
    for t in tokens:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words


def allowed_where(keep: np.ndarray):
    return np.packbits(keep.astype(np.uint8), bitorder="little").view(np.uint32).copy()


TOKENS = np.arange(V)


class Mirror:
    """A stateful controller: it keeps its own copy of the sequence from the calls alone, and
    answers with `policy(seq, n_prompt)`; forks copy that state."""

    def __init__(self, policy, log=None):
        self.policy, self.seq, self.n_prompt = policy, None, 0
        self.log = [] if log is None else log
        self.branch = 0

    def mid_process(self, branch_idx, backtrack, tokens):
        if self.seq is None:
            self.seq, self.n_prompt = list(tokens), len(tokens)
        else:
            assert 0 <= backtrack <= len(self.seq)
            del self.seq[len(self.seq) - backtrack:]
            self.seq.extend(tokens)
        self.branch = self.branch if branch_idx == 0 else branch_idx
        branches = self.policy(self)
        # Like a Wasm controller, hand out masks in a buffer that the next call overwrites.
        self.buffers = getattr(self, "buffers", None) or [np.zeros((V + 31) // 32, np.uint32) for _ in range(4)]
        for branch, buf in zip(branches, self.buffers):
            if branch.mask is not None:
                buf[:] = branch.mask
                branch.mask = buf
        return branches

    def fork(self):
        twin = Mirror(self.policy, self.log)
        twin.seq, twin.n_prompt, twin.branch = list(self.seq), self.n_prompt, self.branch
        twin.buffers = [buf.copy() for buf in self.buffers]  # a fork copies the memory, masks included
        return twin

    def close(self):
        self.log.append(list(self.seq))


def sparse_mask(c):  # a state-dependent fifth of the vocabulary
    s = c.seq
    return allowed_where((TOKENS * 31 + len(s) * 7 + s[-1]) % 5 == 0)


def free(c):
    return [Branch()]


def masked(c):
    return [Branch(mask=sparse_mask(c))]


def ff_mix(c):
    s = c.seq
    if len(s) % 7 == 0:
        return [Branch(ff=[[(s[-1] * 3 + i) % V for i in range(3)]])]
    mask = sparse_mask(c)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
    return [Branch(mask=mask, ff=[[int(t), int(t + 1) % V] for t in allowed[::4]])]


def forks(c):
    n = len(c.seq) - c.n_prompt
    if n == 3 and c.branch == 0:
        return [Branch(mask=sparse_mask(c)), Branch(mask=mask_of([c.seq[-1] % V, 17]))]
    return [Branch()]


def backtracks(c):
    s = c.seq
    if len(s) > c.n_prompt and s[-1] % 6 == 0:  # a banned token: take it back, sample again without it
        return [Branch(backtrack=1, mask=allowed_where(TOKENS % 6 != 0))]
    return [Branch()]


def stops(c):
    return [] if len(c.seq) - c.n_prompt >= 9 else masked(c)


POLICIES = {"none": None, "free": free, "mask": masked, "ff": ff_mix, "fork": forks, "backtrack": backtracks,
            "stop": stops}


def prompts():
    rng = np.random.default_rng(7)
    out = []
    for i in range(5):
        motif = rng.integers(3, V, 6 + i).tolist()
        out.append((motif * 4)[: 20 + 3 * i] + [int(rng.integers(3, V))])  # repetition: lookup finds matches
    return out


def run(llm, policy, mode=None, k=8, n=40, seed=0, temperature=0.0):
    """Greedy by default; a seed makes the choice of k independent of timing (docs/speculative.md)."""
    log = []
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=seed, speculative=mode,
                             spec_k=k) for _ in ps]
    ctls = None if policy is None else [Mirror(policy, log) for _ in ps]
    outs = llm.generate(ps, params, controllers=ctls)
    return [[b.token_ids for b in o.branches] for o in outs], outs, log


def check_caches_empty(llm):
    eng = llm.engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    if eng.spec is not None and eng.spec._draft_model is not None:
        dm = eng.spec._draft_model
        assert dm.cached == {} and dm.bm.num_free == dm.bm.num_blocks


@pytest.mark.parametrize("mode, k", MODES)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_speculation_is_token_for_token_plain_greedy(llm, policy, mode, k):
    plain, _, _ = run(llm, POLICIES[policy])
    spec, outs, spec_views = run(llm, POLICIES[policy], mode, k)
    assert spec == plain  # the policies' masks depend on the controller's own view: a bad rewind shows here
    assert len(spec_views) == (0 if policy == "none" else sum(len(b) for b in spec))  # every controller closed
    stats = [o.speculative for o in outs]
    assert all(s is not None and s["spec_steps"] > 0 for s in stats)
    if policy not in ("stop", "fork"):
        assert sum(s["accepted"] for s in stats) > 0
    if policy not in ("stop", "fork", "backtrack"):  # (a backtrack costs plain decoding forwards too)
        assert sum(s["target_forwards"] for s in stats) < sum(len(t[0]) for t in plain)
    check_caches_empty(llm)


def test_a_failing_fork_ends_its_request_without_unverified_tokens(llm):
    def fork_then_fail(c):
        # Whichever fork gets to 12 tokens first fails the request while the other may hold a
        # draft. (Not "fork 0 at 12": on a loaded host fork 0's controller can answer late, sit
        # steps out, and fork 1 finish all its tokens first.)
        if len(c.seq) - c.n_prompt >= 12:
            raise RuntimeError("a fork gives up")
        return forks(c)

    reference, _, _ = run(llm, forks, n=30)
    for mode in ("lookup", "draft"):
        spec, outs, _ = run(llm, fork_then_fail, mode, n=30)
        for ref, got, out in zip(reference, spec, outs):
            assert all(b.finish_reason == "error" and "a fork gives up" in b.error for b in out.branches), \
                (mode, [(b.finish_reason, len(b.token_ids)) for b in out.branches])
            for tokens, unfailed in zip(got, ref):  # only verified tokens: a prefix of the unfailed run
                assert tokens == unfailed[: len(tokens)]
        check_caches_empty(llm)


def test_controller_fast_forwards_ride_along_as_free_drafts(llm):
    plain, _, _ = run(llm, ff_mix)
    spec, outs, _ = run(llm, ff_mix, "lookup")
    assert spec == plain  # riding along changes nothing in the tokens
    assert sum(o.speculative["forced"] for o in outs) > 0
    for o in outs:
        s = o.speculative
        # no token is counted twice: verified drafts and forced tokens are all in the output, and
        # a request that had some rode them in fewer target forwards than it has tokens
        assert s["accepted"] + s["forced"] <= len(o.token_ids)
        assert not s["forced"] or s["target_forwards"] < len(o.token_ids)


def test_speculative_and_plain_requests_share_a_batch(llm):
    ps = prompts()
    plain = llm.generate(ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    mixed = llm.generate(ps, [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, seed=0,
                                             speculative=("lookup", None, "draft")[i % 3]) for i in range(len(ps))])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]
    assert mixed[1].speculative is None and mixed[0].speculative["accepted"] > 0
    check_caches_empty(llm)


def test_a_runner_that_cannot_verify_refuses_speculative_requests(llm):
    """A runner declares whether it can verify several positions per step; one that cannot
    refuses a speculative request up front (it would otherwise silently run plain)."""
    from rudder.engine import Capabilities

    runner = llm.engine.runner
    runner.capabilities = Capabilities(verify_rows=False)
    try:
        with pytest.raises(ValueError, match="speculative decoding needs a runner"):
            llm.generate(["x"], SamplingParams(max_tokens=4, speculative="lookup"))
    finally:
        del runner.capabilities  # back to the class's declaration
    assert llm.generate(["x"], SamplingParams(max_tokens=4, speculative="lookup"))[0].speculative is not None


def test_cancelling_a_stream_frees_both_caches(llm):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, speculative="draft", seed=0)
    stream = llm.stream(prompts()[0], params)
    for _ in range(6):
        next(stream)
    assert llm.engine.spec._draft_model.cached  # the draft cache follows the sequence
    stream.close()
    check_caches_empty(llm)


def test_seeded_speculative_sampling_repeats(llm):
    a, _, _ = run(llm, masked, "draft", seed=3, temperature=0.8)
    b, _, _ = run(llm, masked, "draft", seed=3, temperature=0.8)
    assert a == b


def test_adaptive_k_follows_acceptance_and_controller_cost():
    ad = _Adaptive()
    for _ in range(20):
        ad.observe(8, False)
    assert ad.choose_k(8, t_target=0.06, t_draft=0.001) == 8
    ad_bad = _Adaptive()
    for _ in range(20):
        ad_bad.observe(0, True)
    ks = [ad_bad.choose_k(8, t_target=0.06, t_draft=0.001) for _ in range(16)]
    assert ks == ([0] * 7 + [1]) * 2  # drafting stops, with a one-token probe every 8 steps
    ad_mid = _Adaptive()
    for _ in range(20):
        ad_mid.observe(2, True)  # acceptance ~2/3
    assert ad_mid.choose_k(8, t_target=0.06, t_draft=0.001) >= 4
    ad_mid.ctl_time = 0.03  # a slow controller makes each draft token expensive
    assert ad_mid.choose_k(8, t_target=0.06, t_draft=0.001) <= 2
    assert ad_mid.choose_k(8, t_target=0.06, t_draft=0.001, timed=False) >= 4


def test_bad_speculative_requests_are_value_errors(llm):
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="medusa").validate()
    with pytest.raises(ValueError, match="spec_k"):
        SamplingParams(speculative="lookup", spec_k=0).validate()
    # what verification does not apply is refused by name; min_p it applies (test_spec_exactness.py)
    with pytest.raises(ValueError, match="^presence_penalty, logit_bias: not available with speculative decoding"):
        SamplingParams(speculative="lookup", presence_penalty=0.5, logit_bias={3: 1.0}).validate()
    SamplingParams(speculative="draft", min_p=0.1, top_p=0.9, top_k=5).validate()
    bad = LLM("tiny", kv_cache_tokens=256, draft_model="layers:9")
    with pytest.raises(ValueError, match="draft model"):
        bad.engine.add_request([5, 6, 7], SamplingParams(speculative="draft"))  # refused: nothing queued
    assert not bad.engine.has_unfinished()
    # still serving (EOS ignored: unseeded, the random model sometimes samples a stop token first)
    [out] = bad.generate([[5, 6, 7]], SamplingParams(max_tokens=4, speculative="lookup", ignore_eos=True))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


# -- SmolLM2 with Wasm controllers ------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_folder):
    from rudder.controller import Limits

    # Deadlines are not under test here, and a loaded 2-core machine misses the 25 ms default.
    return LLM("smollm2", controller_limits=Limits(mid_process_ms=2000, init_ms=10000))


SMOL_CASES = [
    (None, "", "List three colours of the rainbow, then repeat the list."),
    ("uppercase", "24", "Shout a greeting."),
    ("choices", '["the red one", "the blue one", "the green one"]', "Which ball is best?"),
    ("force", "Dear Sir, thank you for your letter", "Write a letter."),
    ("fork", "2", "Name a boat."),
    ("backtrack", " the", "Describe the sea in one sentence."),
    ("regex", r"[A-Z][a-z]+ (is|was) [a-z ]{5,40}\.", "Describe a lighthouse."),
    ("json", '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
             '"required": ["name", "age"]}', "Invent a sailor: his name and age as JSON."),
]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["lookup", "draft"])
@pytest.mark.parametrize("controller, arg, prompt", SMOL_CASES, ids=[c[0] or "none" for c in SMOL_CASES])
def test_smollm2_greedy_speculation_is_exact_with_wasm_controllers(smol, controller, arg, prompt, mode):
    def go(spec):
        # seeded: k follows the acceptance rate only, not this machine's load (speculative.py)
        params = SamplingParams(max_tokens=24, temperature=0.0, seed=0, speculative=spec, spec_k=4)
        out = smol.generate([prompt], params, chat=True, controller=controller, controller_arg=arg)[0]
        return [b.token_ids for b in out.branches], [b.finish_reason for b in out.branches], out

    plain, reasons, _ = go(None)
    spec, spec_reasons, out = go(mode)
    assert spec == plain and spec_reasons == reasons
    assert "error" not in reasons
    if controller != "force":  # force fast-forwards everything at once: no decoding step to speculate on
        assert out.speculative["spec_steps"] > 0
    check_caches_empty(smol)


def test_the_guard_stops_drafting_that_is_measured_slower_and_backs_off_longer_each_time():
    """Drafting steps that yield fewer tokens per second than plain steps stop for a while
    (8 steps, then 16, ...); drafting that pays goes on. Driven by a fake clock."""
    from rudder.engine.speculative import BACKOFF, GUARD_SAMPLES

    def drive(ad, spec_rate, plain_rate, steps):
        clock, length, plan = 0.0, 0, []
        for _ in range(steps):
            ad.step(clock, length)
            k = ad.guard(4, plain_first=True)
            plan.append(k)
            ad.began(clock, length, k > 0)
            length += 5 if k else 1
            clock += 5 / spec_rate if k else 1 / plain_rate
        ad.step(clock, length)
        return plan

    losing = drive(_Adaptive(), spec_rate=20.0, plain_rate=30.0, steps=80)
    assert losing[:GUARD_SAMPLES] == [0] * GUARD_SAMPLES  # plain first: the rate to beat
    runs = [len(list(g)) for is_plain, g in itertools.groupby(k == 0 for k in losing) if is_plain][1:]
    assert runs[:2] == [BACKOFF + 1, 2 * BACKOFF + 1]  # the deciding step, then a back-off twice as long each time
    assert sum(k > 0 for k in losing) < 20  # drafting is mostly off (a few steps to judge each try)

    winning = drive(_Adaptive(), spec_rate=60.0, plain_rate=30.0, steps=80)
    assert sum(k > 0 for k in winning) > 70  # drafting goes on, with a plain step now and then


def test_a_draft_model_that_looks_too_dear_is_measured_again_by_its_probes():
    """When the estimates say drafting loses, only probes draft; a draft model's probe drafts 2
    tokens, so that its second round (the first also reads the tokens it sat out, and is not
    timed) measures it and a stale, too-high cost comes down. The draft model's costs are first
    timed when it is built (DraftModel.calibrate), before any request drafts."""
    llm = LLM("tiny", kv_cache_tokens=2048, draft_model="layers:1")
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, speculative="draft", spec_k=4)
    req = llm.engine.add_request("a b c d e f g h", params)  # (builds the draft model)
    spec = llm.engine.spec
    assert 0 < spec.t_read < 1 and 0 < spec.t_draft["draft"] < 1  # timed at build
    assert not spec.draft_model.cached and not spec.draft_model.bm.tables  # its throwaway sequence is gone
    spec.t_draft["draft"] = 10.0  # seconds per drafted token: drafting looks hopeless
    while not req.finished:
        llm.engine.step()
    out = llm.engine.completions(req)[0]
    assert out.speculative["drafted"] > 0  # the probes drafted ...
    assert spec.t_draft["draft"] < 10.0 * 0.9  # ... and were timed


def test_the_draft_models_catch_up_is_not_timed_as_a_drafted_token():
    """DraftModel.fed says how many tokens a sequence fed in the last call: the whole prompt at
    its first draft, 1-2 once it keeps up (what the speculator times)."""
    from rudder.engine.drafts import DraftModel
    from rudder.loading import load_model

    model, _ = load_model("tiny")
    dm = DraftModel(model, 64, 4)
    dm.logits([(7, list(range(1, 31)))])
    assert dm.fed == 30
    dm.logits([(7, list(range(1, 33)))])
    assert dm.fed == 2
    dm.logits([(7, list(range(1, 33)) + [5])])
    assert dm.fed == 1


def test_a_draft_model_times_its_read_and_its_step_on_a_throwaway_sequence():
    from rudder.engine.drafts import DraftModel
    from rudder.loading import load_model

    model, _ = load_model("tiny")
    dm = DraftModel(model, 64, 4)
    per_read, per_step = dm.calibrate()
    assert 0 < per_read < 1 and 0 < per_step < 1  # (which is less is the machine's business, not a test's)
    assert not dm.cached and dm.bm.num_free == 64  # nothing kept
    assert DraftModel(model, 8, 4).calibrate() is None  # 64 tokens do not fit 32 positions


def test_a_short_answer_to_a_long_prompt_is_not_drafted_by_a_model(monkeypatch):
    """A draft model must first read what it has not seen (here a 1500-token prompt, ~0.1 of its
    step per token): drafting for a 10-token answer cannot repay that, so the request decodes
    plain; a 10-token answer to a short prompt drafts. (The tiny model's draft is timed as dear
    as the target, whose step is all overhead: the costs here are the untimed shares instead.)"""
    from rudder.engine.drafts import DraftModel

    monkeypatch.setattr(DraftModel, "calibrate", lambda self: None)
    llm = LLM("tiny", kv_cache_tokens=4096, draft_model="layers:1")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, speculative="draft", spec_k=4)
    [long] = llm.generate(["a " * 750], [params])
    assert len(long.token_ids) == 10 and long.speculative["drafted"] == 0
    [short] = llm.generate(["a b c"], [params])
    assert len(short.token_ids) == 10 and short.speculative["drafted"] > 0
    llm.close()


def test_probes_grow_rarer_while_drafting_is_not_expected_to_pay():
    """A sequence whose drafts would gain less than MIN_GAIN drafts only probes, and each probe
    the estimates still turn down doubles the wait for the next (up to MAX_PROBE_EVERY)."""
    from rudder.engine.speculative import MAX_PROBE_EVERY, MIN_GAIN, PROBE_EVERY, ROW_COST, _Adaptive

    ad = _Adaptive()
    ad.hits, ad.tries = 0.0, 10.0  # nothing accepted lately
    assert (1 + 0.04) / (1 + ROW_COST) < 1 + MIN_GAIN  # a draft gaining < MIN_GAIN is not tried
    probes = []
    for step in range(400):
        if ad.choose_k(8, 0.01, 1e-4):
            probes.append(step)
            ad.observe(0, True)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] == 2 * PROBE_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_EVERY
    ad.hits, ad.tries = 9.0, 10.0  # drafts accepted again: drafting resumes, probes frequent again
    assert ad.choose_k(8, 0.01, 1e-4) > 0 and ad.probe_every == PROBE_EVERY


def test_prompt_lookup_proposes_little_on_a_one_token_match():
    """A one-token match (in free text mostly a common word) proposes at most 2 tokens; a longer
    match proposes up to k: the continuation of its most recent occurrence."""
    from rudder.engine.drafts import PromptLookup

    lookup = PromptLookup()
    seq = [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 5]  # ends in 5: a one-token match at the start
    assert lookup.continuation(seq, 8) == [1, 2]
    seq = [5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 1, 2]  # ends in "1 2": a two-token match
    assert lookup.continuation(seq, 8) == [3, 4, 6, 7, 8, 9, 10, 11]
    assert lookup.continuation([1, 2, 3], 8) == []  # nothing occurred before


def test_prompt_lookup_proposes_nothing_on_a_one_token_match_of_forced_text(llm, monkeypatch):
    """After the controller's fast-forward, a one-token match is the controller's own text
    recurring (a JSON key's `":"`): no proposal; a longer match still proposes."""
    from rudder.engine.drafts import PromptLookup

    lookup = PromptLookup()
    seq = [7, 9, 1, 2, 3, 4, 6, 9]  # ... 9 (forced): a one-token match
    assert lookup.continuation(seq, 8) == [1, 2] and lookup.continuation(seq, 8, after_forced=True) == []
    seq = [5, 9, 1, 2, 3, 4, 5, 9]  # ... 5 9: two tokens match
    assert lookup.continuation(seq, 8, after_forced=True) == [1, 2, 3, 4, 5, 9]

    # In the engine: every draft step that follows the controller's fast-forward looks up so.
    seen = []
    real = PromptLookup.continuation

    def spy(self, tokens, k, after_forced=False):
        seen.append((tokens[-2:] == [9, 9], after_forced))
        return real(self, tokens, k, after_forced)

    monkeypatch.setattr(PromptLookup, "continuation", spy)

    def keys(c):  # a "key" (9 9) forced after every third token; the model never samples a 9
        n = len(c.seq) - c.n_prompt
        return [Branch(ff=[[9, 9]])] if n % 5 == 3 else [Branch(mask=allowed_where(TOKENS != 9))]

    # seeded: k follows the acceptance rate only, not the machine's load
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, seed=0, speculative="lookup", spec_k=4)
    [out] = llm.generate([[9, 9, 40, 41, 42, 9, 9, 50]], params, controllers=[Mirror(keys)])
    assert out.speculative["forced"] > 0
    assert all(after_key == after_forced for after_key, after_forced in seen)
    assert {after_forced for _, after_forced in seen} == {True, False}


def test_a_prompt_prefilled_in_chunks_drafts_only_after_its_controllers_first_call(llm):
    """A prompt fed in chunks can have one token left to feed, like a decoding step; its
    controller's first call (started with the request) is still the one to take there: drafting
    then would call the controller a second time, while the first may still be running."""

    class OneAtATime(Mirror):
        running = False

        def mid_process(self, branch_idx, backtrack, tokens):
            assert not self.running, "two calls at once"
            self.running = True
            try:
                time.sleep(0.005)  # long enough for the engine's next step to start
                return super().mid_process(branch_idx, backtrack, tokens)
            finally:
                self.running = False

        def fork(self):
            raise AssertionError("no forks here")

    chunked = LLM("tiny", kv_cache_tokens=1024, block_size=4, max_batch_tokens=8)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5]  # 8 tokens in the first step, one left for the second
    outs = {}
    for mode in (None, "lookup"):
        log = []
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=0, speculative=mode)
        [out] = chunked.generate([prompt], params, controllers=[OneAtATime(free, log)])
        assert out.finish_reason == "length", out.error
        assert log == [prompt + out.token_ids[:-1]]  # what the controller was told is the sequence
        outs[mode] = out
    assert outs["lookup"].token_ids == outs[None].token_ids and outs["lookup"].speculative["drafted"] > 0


def test_the_speculator_changes_sequences_only_through_steering():
    """engine/speculative.py decides and Steering edits: no sequence field is assigned, deleted or
    mutated there (a Usage counter of the request aside), no block manager is touched, and of the
    engine it uses only what speculative.EngineView declares."""
    import ast
    import inspect

    from rudder.engine import speculative
    from rudder.engine.sequence import Request, Sequence

    fields = set(vars(Sequence([1], SamplingParams(), None, Request(0, [1], SamplingParams())))) - {"request"}
    mutators = {"append", "extend", "insert", "pop", "clear", "remove", "told", "settle_draft", "on_append",
                "on_backtrack", "took", "defer", "take_deferred"}

    def sequence_field(node) -> str | None:
        """The field when `node` is seq.<field>... (the speculator names a sequence `seq` or `s`)."""
        chain = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in ("seq", "s") and chain and chain[-1] in fields:
            return f"{node.id}.{'.'.join(reversed(chain))}"
        return None

    tree = ast.parse(inspect.getsource(speculative))
    edits, engine_uses = [], set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if sequence_field(t):
                    edits.append(f"line {node.lineno}: {sequence_field(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
            if sequence_field(node.func.value):
                edits.append(f"line {node.lineno}: {sequence_field(node.func.value)}.{node.func.attr}()")
        if isinstance(node, ast.Attribute) and node.attr in ("block_manager", "bm", "scheduler", "runner", "calls"):
            edits.append(f"line {node.lineno}: .{node.attr}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            engine_uses.add(node.attr)
    assert edits == []
    declared = set(speculative.EngineView.__annotations__) | {
        n for n, v in vars(speculative.EngineView).items() if callable(v) and not n.startswith("_")}
    assert engine_uses <= declared, engine_uses - declared
    from rudder.engine.llm_engine import Engine

    assert all(hasattr(Engine, n) or n in ("steering", "sampler") for n in declared)
