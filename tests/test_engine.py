"""The engine loop: continuous batching, stops, streaming, cancellation, preemption, step hooks."""

import threading
import time

import numpy as np
import pytest

from rudder import LLM, SamplingParams
from rudder.branch import Branch

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", kv_cache_tokens=4096, block_size=8)


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2")


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "Rudders steer ships because"]


def solo(llm, prompts, params):
    return [llm.generate([p], params)[0] for p in prompts]


def test_batched_equals_one_at_a_time_tiny(tiny):
    batched = tiny.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in batched] == [c.token_ids for c in solo(tiny, PROMPTS, GREEDY)]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in batched)


@pytest.mark.model
def test_batched_equals_one_at_a_time_smollm2(smol):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    batched = smol.generate(PROMPTS, params, chat=True)
    one_by_one = [smol.generate([p], params, chat=True)[0] for p in PROMPTS]
    assert [c.token_ids for c in batched] == [c.token_ids for c in one_by_one]


@pytest.mark.model
def test_smollm2_answers_coherently(smol):
    [out] = smol.generate(["What is the capital of France? Answer in one word."],
                          SamplingParams(max_tokens=10, temperature=0.0), chat=True)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ended with <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.text


def test_requests_joining_mid_decode_get_the_same_tokens(tiny):
    """Continuous batching: a request admitted while others decode is unaffected by them."""
    expected = [c.token_ids for c in solo(tiny, PROMPTS, GREEDY)]
    engine = tiny.engine
    reqs = [engine.add_request(PROMPTS[0], GREEDY)]
    for p in PROMPTS[1:]:
        for _ in range(3):
            engine.step()
        reqs.append(engine.add_request(p, GREEDY))
    while not all(r.finished for r in reqs):
        engine.step()
    assert [engine.completions(r)[0].token_ids for r in reqs] == expected
    for r in reqs:
        engine.forget(r)


def test_seeded_sampling_repeats_and_is_batch_independent(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = tiny.generate(["hello"], params)[0].token_ids
    b = tiny.generate(["other", "hello", "third"], [SamplingParams(seed=1, max_tokens=5), params,
                                                   SamplingParams(seed=2, max_tokens=9)])[1].token_ids
    c = tiny.generate(["hello"], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321,
                                                ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_stream_deltas_add_up_and_stop_strings_cut(smol_or_tiny):
    llm = smol_or_tiny
    full = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[5:8]  # a stop string known to appear
    deltas = list(llm.stream("Count: 1, 2, 3,", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                                  stop=[stop, "never-there"])))
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert stop not in text
    assert text == full.text[: full.text.find(stop)]


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.model)])
def smol_or_tiny(request, tiny):
    return tiny if request.param == "tiny" else request.getfixturevalue("smol")


def test_cancel_frees_kv_blocks(tiny):
    engine = tiny.engine
    free = engine.block_manager.num_free
    req = engine.add_request("a long enough prompt " * 5, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free < free
    engine.cancel(req.request_id)
    assert engine.block_manager.num_free == free
    assert req.seqs[0].finish_reason == "cancelled"
    assert not engine.has_unfinished()


def test_closing_a_stream_cancels(tiny):
    free = tiny.engine.block_manager.num_free
    stream = tiny.stream("abc", SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    assert tiny.engine.block_manager.num_free == free


def test_preemption_under_a_small_kv_cache_keeps_outputs():
    llm = LLM("tiny", kv_cache_tokens=96, block_size=8)  # 12 blocks: the 5 requests cannot all fit
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in batched] == [c.token_ids for c in solo(llm, PROMPTS, params)]
    assert llm.engine.block_manager.num_free == 12


def test_a_sequence_that_cannot_fit_fails_clearly():
    llm = LLM("tiny", kv_cache_tokens=32, block_size=8)
    ok, too_long = llm.generate(["short", "x" * 100], SamplingParams(max_tokens=5, ignore_eos=True))
    assert ok.finish_reason == "length" and len(ok.token_ids) == 5
    assert too_long.finish_reason == "error" and "does not fit in the KV cache" in too_long.error


def test_bad_input_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([""])
    with pytest.raises(ValueError, match="top_p"):
        tiny.generate(["x"], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="token ids"):
        tiny.engine.add_request([1, 10**6])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_controller_masks_and_runs_during_the_forward_pass(dtype, monkeypatch):
    """The controller's mask constrains sampling, and mid_process runs while the model computes:
    from the step's start on the torch path (fp32); with the native decoder (bf16), from the
    moment the forward pass enters it and not before (the engine thread then holds no GIL)."""
    from rudder import kernels

    llm = LLM("tiny", dtype=dtype, kv_cache_tokens=4096, block_size=8)
    native = llm.engine.runner.capabilities.native_decoder
    assert native == (dtype == "bf16" and kernels.available())
    allowed = [ord(c) + 3 for c in "xyz"]  # byte-level ids: 3 specials, then bytes
    words = np.zeros((llm.model.cfg.vocab_size + 31) // 32, np.uint32)
    for t in allowed:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    overlapped, held, started = [], [], threading.Event()
    run = llm.engine.runner.run

    def watching_run(batch, *args):
        # If controllers ran after the forward pass, this wait would time out.
        overlapped.append(started.wait(timeout=5))
        started.clear()
        return run(batch, *args)

    take = kernels.take_before_decoder

    def watching_decoder():  # inside DecoderStack.run, right before its native call
        hook = take()
        if hook is not None:
            held.append(not started.is_set())  # nothing ran before the decoder started
            hook()
            overlapped.append(started.wait(timeout=5))
            started.clear()

    class XYZ:
        def mid_process(self, branch_idx, backtrack, tokens):
            assert threading.current_thread().name.startswith("rudder-controller")
            started.set()
            return [Branch(mask=words)]

        def fork(self):
            raise AssertionError("no forks here")

        def close(self):
            pass

    if native:
        monkeypatch.setattr(kernels, "take_before_decoder", watching_decoder)
    else:
        llm.engine.runner.run = watching_run
    [out] = llm.generate(["hi"], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
                         controllers=[XYZ()])
    assert set(out.text) <= set("xyz") and len(out.token_ids) == 12
    # (the first call starts when the request is added: it may have run before the prompt's
    # prefill, or not yet on a busy machine)
    assert overlapped == [True] * 12 and (held[1:] == [True] * 11 if native else held == [])


@pytest.mark.skipif("not __import__('rudder').kernels.available()", reason="no native kernels")
def test_held_controller_calls_are_released_when_the_forward_pass_fails(monkeypatch):
    """A forward pass that fails before the native decoder starts still hands the step's held
    controller calls to the workers, so the engine fails the requests instead of waiting."""
    from rudder.engine import RunnerFailure

    llm = LLM("tiny", dtype="bf16", kv_cache_tokens=4096, block_size=8)
    assert llm.engine.runner.capabilities.native_decoder
    run = llm.engine.runner.run
    calls = []

    class Counting:
        def mid_process(self, branch_idx, backtrack, tokens):
            calls.append(len(tokens))
            return [Branch()]

        def fork(self):
            raise AssertionError("no forks here")

        def close(self):
            pass

    runs = []

    def failing(batch, *args):
        runs.append(batch)
        if len(runs) > 1:  # the first step ran; the second fails before reaching the decoder
            raise RunnerFailure("the model is gone")
        return run(batch, *args)

    monkeypatch.setattr(llm.engine.runner, "run", failing)
    req = llm.engine.add_request("hi", SamplingParams(max_tokens=8, ignore_eos=True), Counting())
    done = threading.Event()

    def drive():
        while not req.finished:
            llm.engine.step()
        done.set()

    threading.Thread(target=drive, daemon=True).start()
    assert done.wait(timeout=30), "the engine waited for controller calls nobody started"
    assert llm.engine.completions(req)[0].finish_reason == "error" and len(calls) == 2


def test_an_llm_dropped_without_close_ends_its_controller_threads():
    """Its controller-call workers hold their queue, not the engine: once the LLM is collected
    they end (before, every unclosed LLM of a process kept its threads, and with them the
    runtime's reserved address space, for good)."""
    import gc

    def workers() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("rudder-controller-") and t.is_alive()}

    before = workers()
    llm = LLM("tiny")
    assert llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"
    mine = workers() - before  # (other unclosed LLMs' workers may end meanwhile: only these count)
    assert mine
    del llm
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in mine)


class _FirstAnswer:
    """Answers `first` to the call that tells it the prompt (after `delay` s, or once `release` is
    set), then samples freely; records the tokens each call was told."""

    def __init__(self, first, delay: float = 0.0, release: threading.Event | None = None):
        self.first, self.delay, self.release, self.told = first, delay, release, []

    def mid_process(self, branch_idx, backtrack, tokens):
        self.told.append(list(tokens))
        if len(self.told) == 1:
            time.sleep(self.delay)
            if self.release is not None:
                assert self.release.wait(30), "never released"
            return self.first
        return [Branch()]

    def fork(self):
        raise AssertionError("no forks here")

    def close(self):
        pass


@pytest.mark.parametrize("late", [False, True])
def test_a_first_fast_forward_is_prefilled_with_the_prompt(monkeypatch, late):
    """A controller's first answer that needs no logits (a fast-forward) joins the prompt's prefill
    when it comes in time (FIRST_ANSWER_WAIT); one that comes later is applied after the prefill as
    before. Either way the tokens and what the controller is told are the same. (No clock decides
    which: in time, the engine may wait as long as it takes; late, the answer is held back until
    the prefill has been launched.)"""
    from rudder.engine import llm_engine

    if not late:  # in time however loaded the machine (the wait ends when the answer comes)
        monkeypatch.setattr(llm_engine, "FIRST_ANSWER_WAIT", 10.0)
    llm = LLM("tiny", kv_cache_tokens=4096, block_size=8)
    fed = []
    run = llm.engine.runner.run
    prefilled = threading.Event()

    def counting(batch, *args):
        fed.append(sum(e.num_tokens for e in batch))
        prefilled.set()
        return run(batch, *args)

    monkeypatch.setattr(llm.engine.runner, "run", counting)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    controller = _FirstAnswer([Branch(ff=[[40, 41, 42]])], release=prefilled if late else None)
    [out] = llm.generate([prompt], params, controllers=[controller])
    assert out.token_ids[:3] == [40, 41, 42] and len(out.token_ids) == 6
    assert controller.told[:2] == [prompt, [40, 41, 42]]
    if not late:  # prompt and fast-forward in one forward, then one per sampled token
        assert fed == [7, 1, 1]
    else:  # the prompt's logits go unused: the fast-forward needs a forward of its own
        assert fed == [4, 3, 1, 1]
    fed.clear()
    [plain] = llm.generate([prompt + [40, 41, 42]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert out.token_ids[3:] == plain.token_ids


def test_a_first_fast_forward_streams_with_its_prefill_not_while_it_queues(monkeypatch):
    """A first answer taken before the prefill joins the prompt, but its text streams only when
    the sequence's first step is done: a request that queues (here behind max_seqs) shows nothing,
    then its forced text and its first sampled token at once - no stream stalls on the queue."""
    from rudder.engine import llm_engine

    monkeypatch.setattr(llm_engine, "FIRST_ANSWER_WAIT", 10.0)  # in time, however loaded the machine
    eng = LLM("tiny", kv_cache_tokens=4096, block_size=8, max_seqs=1, controller_threads=0).engine
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    queued = eng.add_request([8, 9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                             _FirstAnswer([Branch(ff=[[40, 41]])]))
    seen = []  # per step: the queued sequence's cached positions, and the tokens it streamed
    while eng.has_unfinished():
        deltas = eng.step()
        seen.append((queued.seqs[0].num_cached, [t for d in deltas if d.request_id == queued.request_id
                                                 for t in d.token_ids]))
    shown = next(i for i, (_, tokens) in enumerate(seen) if tokens)
    assert shown == 3 and all(cached == 0 for cached, _ in seen[:shown])  # behind the first's 3 steps
    cached, tokens = seen[shown]
    assert cached == 4 and tokens[:2] == [40, 41] and len(tokens) == 3  # prompt + ff in one forward, a token


def test_a_first_answer_that_stops_or_masks(tiny, monkeypatch):
    """A stop as the first answer ends the request before any forward; a mask waits for the
    prompt's logits (and is not asked for twice)."""
    from rudder.engine import llm_engine

    monkeypatch.setattr(llm_engine, "FIRST_ANSWER_WAIT", 10.0)  # in time however loaded the machine
    fed = []
    run = tiny.engine.runner.run

    def counting(batch, *args):
        fed.append(sum(e.num_tokens for e in batch))
        return run(batch, *args)

    tiny.engine.runner.run = counting
    try:
        [stopped] = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=4), controllers=[_FirstAnswer([])])
        assert stopped.finish_reason == "stop" and stopped.token_ids == [] and fed == []
        words = np.zeros((tiny.model.cfg.vocab_size + 31) // 32, np.uint32)
        words[50 >> 5] = np.uint32(1 << (50 & 31))
        masked = _FirstAnswer([Branch(mask=words)])
        [out] = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), controllers=[masked])
        assert out.token_ids[0] == 50 and fed == [3, 1] and masked.told[:2] == [[5, 6, 7], [50]]
    finally:
        del tiny.engine.runner.run


def test_a_request_cancelled_before_its_prefill_closes_its_controller_after_the_first_call(tiny):
    """The first call starts with the request: cancelling the request while that call runs closes
    the controller only once the call is over (never under a running call)."""
    events, release = [], threading.Event()

    class Slow(_FirstAnswer):
        def mid_process(self, branch_idx, backtrack, tokens):
            events.append("call")
            assert release.wait(30), "never released"  # returns only after the cancel
            events.append("returned")
            return [Branch()]

        def close(self):
            events.append("closed")

    req = tiny.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), Slow(None))
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:  # the call has started on a worker
        time.sleep(0.001)
    tiny.engine.cancel(req.request_id)
    assert "closed" not in events
    release.set()
    deadline = time.monotonic() + 5
    while "closed" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ["call", "returned", "closed"]
    assert not tiny.engine.has_unfinished()


def test_a_slow_first_call_holds_up_the_steps_once(monkeypatch):
    """While a request waits for a batch slot, its slow first call does not make every step wait
    FIRST_ANSWER_WAIT again: the wait is bounded per request, from its arrival."""
    from rudder.engine import llm_engine

    llm = LLM("tiny", kv_cache_tokens=4096, block_size=8, max_seqs=1)
    waits = []
    real = llm_engine.wait_futures

    def recording(futures, timeout=None, **kw):
        if timeout is not None and timeout <= llm_engine.FIRST_ANSWER_WAIT:
            waits.append(timeout)
        return real(futures, timeout=timeout, **kw)

    monkeypatch.setattr(llm_engine, "wait_futures", recording)
    engine = llm.engine
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))
    engine.step()  # the first request runs; the second waits for its slot
    second = engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True), _FirstAnswer([Branch()], delay=0.3))
    steps = 0
    while not first.finished:
        engine.step()
        steps += 1
    assert steps >= 20 and sum(waits) <= llm_engine.FIRST_ANSWER_WAIT + 1e-9
    while engine.has_unfinished():
        engine.step()
    assert len(engine.completions(second)[0].token_ids) == 2


# -- the scheduler: the step's token budget, and who waits -------------------------------------------

class _Plan:
    """A Scheduler over a real BlockManager, with sequences named by their prompts' first token;
    `step()` schedules, then does what the engine does after the forward (cached, one sampled
    token), and returns {name: tokens fed} plus the names that could never fit."""

    def __init__(self, num_blocks=64, block_size=4, max_batch_tokens=16, max_seqs=8, budget=None,
                 prefix_caching=False):
        from rudder.engine.block_manager import BlockManager
        from rudder.engine.scheduler import Scheduler

        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_batch_tokens, max_seqs, budget)
        self.seqs = {}

    def add(self, name: int, prompt_len: int):
        from rudder.engine.sequence import Request, Sequence

        params = SamplingParams()
        prompt = [name] * prompt_len
        seq = self.seqs[name] = Sequence(prompt, params, np.random.default_rng(0), Request(name, prompt, params))
        self.sched.add(seq)
        return seq

    def step(self, **kw):
        batch, unfit = self.sched.schedule(**kw)
        self.bm.check_invariants()
        fed = {}
        for e in batch:
            assert e.slots == [self.bm.slot(e.seq.seq_id, p) for p in range(e.seq.num_cached, e.seq.num_cached + e.num_tokens)]
            assert e.sample == (e.num_tokens == e.seq.num_pending)
            e.seq.num_cached += e.num_tokens
            self.bm.commit(e.seq.seq_id, e.seq.token_ids, e.seq.num_cached)
            if e.sample:
                e.seq.token_ids.append(9)
            fed[e.seq.token_ids[0]] = e.num_tokens
        return fed, [s.token_ids[0] for s in unfit]

    def waiting(self):
        return [s.token_ids[0] for s in self.sched.waiting]


def test_a_step_feeds_at_most_its_token_budget_running_sequences_first():
    plan = _Plan(max_batch_tokens=16)
    for name in (1, 2, 3):
        plan.add(name, 3)
    assert plan.step() == ({1: 3, 2: 3, 3: 3}, [])  # 9 prompt tokens: all admitted
    plan.add(4, 10)
    plan.add(5, 10)
    # the three decode first (3 tokens); then 13 of the budget: prompt 4 whole, 3 tokens of prompt 5
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 10, 5: 3}, [])
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 1, 5: 7}, [])  # the rest of prompt 5, in the budget
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 1, 5: 1}, [])


def test_a_prompt_longer_than_the_budget_is_fed_in_chunks():
    plan = _Plan(max_batch_tokens=8)
    plan.add(1, 21)
    plan.add(2, 2)
    assert [plan.step()[0] for _ in range(4)] == [{1: 8}, {1: 8}, {1: 5, 2: 2}, {1: 1, 2: 1}]


def test_who_waits_for_kv_blocks_and_batch_slots():
    """Admission is first come, first served: a prompt that does not fit the free blocks waits,
    and holds up the ones behind it (no overtaking); max_seqs caps the running sequences; a
    sequence larger than the whole cache fails instead of waiting forever."""
    plan = _Plan(num_blocks=6, block_size=4, max_batch_tokens=64, max_seqs=3)
    plan.add(1, 12)  # 3 blocks
    plan.add(2, 16)  # 4 blocks: 3 are free
    plan.add(3, 2)  # would fit, but comes after 2
    assert plan.step() == ({1: 12}, [])
    assert plan.waiting() == [2, 3]
    plan.sched.remove(plan.seqs[1])  # 1 finishes: its blocks come back
    plan.add(4, 40)  # 10 blocks: more than the cache holds, it fails when its turn comes
    assert plan.step() == ({2: 16, 3: 2}, [4])
    plan.sched.remove(plan.seqs[2])
    plan.sched.remove(plan.seqs[3])
    for name in (5, 6, 7, 8):
        plan.add(name, 2)
    assert plan.step() == ({5: 2, 6: 2, 7: 2}, [])  # max_seqs: 3 running, 8 waits
    assert plan.waiting() == [8]


def test_a_full_cache_preempts_the_latest_admitted_sequence():
    plan = _Plan(num_blocks=4, block_size=4, max_batch_tokens=64, max_seqs=8)
    plan.add(1, 8)
    plan.add(2, 7)
    assert plan.step() == ({1: 8, 2: 7}, [])  # 4 blocks taken; 2 has room for one more token
    # 1 needs a block for its next token: 2, the latest admitted, gives its blocks back and waits
    fed, _ = plan.step()
    assert fed == {1: 1} and plan.waiting() == [2] and plan.seqs[2].num_cached == 0


def test_busy_sequences_are_left_alone_and_limit_caps_the_batch():
    plan = _Plan()
    for name in (1, 2, 3):
        plan.add(name, 3)
    plan.step()
    busy = {plan.seqs[2].seq_id}
    assert plan.step(busy=busy) == ({1: 1, 3: 1}, [])
    assert plan.step(limit=2) == ({1: 1, 2: 1}, [])


def test_decodes_go_first_and_prompts_take_what_the_step_target_leaves(monkeypatch):
    """Stall-free batching: with sequences decoding, prompts get only the tokens that keep the step
    near its target time, in chunks. Here a step costs 30 ms + 1 ms a token, and the target is
    twice (STALL_FACTOR, a tunable, set here) a step that decodes every sequence there is; with
    nothing decoding, prompts take the whole budget."""
    from rudder.engine import scheduler
    from rudder.engine.scheduler import StepBudget

    monkeypatch.setattr(scheduler, "STALL_FACTOR", 2.0)

    plan = _Plan(max_batch_tokens=128, max_seqs=16, budget=StepBudget(fixed_s=0.030, per_token_s=0.001))
    for name in (1, 2, 3):
        plan.add(name, 3)
    assert plan.step() == ({1: 3, 2: 3, 3: 3}, [])
    plan.add(4, 70)  # 3 decodes (33 ms); 4 sequences: 2 x 34 ms - 33 ms = 35 tokens of prompt
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 35}, [])
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 35}, [])
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 1}, [])
    for name in range(5, 13):  # a burst: the 12 sequences will decode together, 2 x 42 ms a step
        plan.add(name, 10)
    assert plan.step() == ({1: 1, 2: 1, 3: 1, 4: 1, 5: 10, 6: 10, 7: 10, 8: 10, 9: 10}, [])  # 84 - 34 = 50
    fed, _ = plan.step()  # 9 decode (39 ms): 45 tokens of prompt, the burst's last three
    assert fed == {**{name: 1 for name in range(1, 10)}, 10: 10, 11: 10, 12: 10}


def test_a_step_target_below_the_decodes_cost_still_moves_prompts_on():
    from rudder.engine.scheduler import MIN_PREFILL_TOKENS, StepBudget

    plan = _Plan(max_batch_tokens=64, budget=StepBudget(target_s=0.001, fixed_s=0.010, per_token_s=0.001))
    plan.add(1, 3)
    plan.step()
    plan.add(2, 40)
    assert plan.step() == ({1: 1, 2: MIN_PREFILL_TOKENS}, [])


def test_a_prefilling_sequence_never_holds_up_decodes_listed_after_it():
    """A fork decoding behind a sequence still prefilling (in the running order) decodes first;
    the old order gave the prefilling one the whole budget and the fork nothing."""
    plan = _Plan(max_batch_tokens=16)
    plan.add(1, 3)
    plan.step()
    plan.add(2, 100)
    assert plan.step() == ({1: 1, 2: 15}, [])
    fork = plan.seqs[1]
    child = type(fork)(list(fork.token_ids), fork.params, fork.rng, fork.request)
    child.num_prompt, child.num_cached = fork.num_prompt, fork.num_cached
    plan.bm.fork(fork.seq_id, child.seq_id)
    plan.sched.add_running(child)  # running order: 1, 2 (prefilling), the fork
    batch, _ = plan.sched.schedule()
    assert [(e.seq.seq_id, e.num_tokens) for e in batch] == [(fork.seq_id, 1), (child.seq_id, 1),
                                                             (plan.seqs[2].seq_id, 14)]


def test_the_step_budget_learns_the_hosts_cost_per_token(monkeypatch):
    """The fit of seconds = fixed + per_token * tokens over the steps reported (no clock: the
    times are given); steps that all feed alike tell no slope, and prompts then take everything."""
    from rudder.engine import scheduler
    from rudder.engine.scheduler import StepBudget

    monkeypatch.setattr(scheduler, "STALL_FACTOR", 2.0)

    flat = StepBudget()
    for _ in range(50):
        flat.observe(32, 0.05)
    assert flat.per_token_s is None and flat.prompt_tokens(32, 32, 400) == 400
    budget = StepBudget()
    for tokens in [1, 300, 16, 64, 32, 500, 8] * 5:
        budget.observe(tokens, 0.02 + 0.002 * tokens)
    assert budget.per_token_s == pytest.approx(0.002) and budget.fixed_s == pytest.approx(0.02)
    # twice the decodes' 0.02 + 16 * 0.002 = 0.052 s: 26 more tokens' worth...
    assert budget.prompt_tokens(16, 16, 400) == 26
    # ... and with 32 sequences to decode, twice their 0.084 s: 0.168 - 0.052 s, 58 tokens
    assert budget.prompt_tokens(16, 32, 400) == 58
    assert StepBudget(target_s=0.5, fixed_s=0.02, per_token_s=0.002).prompt_tokens(16, 16, 100) == 100


def test_every_runner_takes_what_the_loop_passes():
    """The Runner protocol (engine/runner.py) declares each call the engine makes, `history=`
    included; every runner's methods take those arguments (the handle's name aside), and any
    more only as options."""
    import inspect

    from rudder.engine.model_runner import ModelRunner
    from rudder.engine.runner import Runner
    from rudder.pipeline.runner import PipelineRunner

    def arguments(f, skip: int):
        return [(p.name, p.default) for p in list(inspect.signature(f).parameters.values())[skip:]]

    for name, skip in (("copy_blocks", 1), ("run", 1), ("logits", 2), ("sample", 2), ("skip", 2), ("close", 1)):
        want = arguments(getattr(Runner, name), skip)
        for runner in (ModelRunner, PipelineRunner):
            got = arguments(getattr(runner, name), skip)
            assert got[:len(want)] == want, (runner, name)
            assert all(default is not inspect.Parameter.empty for _, default in got[len(want):]), (runner, name)
    assert ("history", None) in arguments(Runner.sample, 2)
