"""Tenants sharing one engine (tiny model, Python controllers): a request whose controller
misbehaves - never lets its sequence grow, is slow, burns CPU - fails or waits alone, while a
plain greedy request beside it gets exactly the tokens it gets alone, without waiting for it.

The Wasm side of the same rules (CPU-time deadlines, tokenize budgets, memory budgets) is in
test_deadlines.py and test_budgets.py; the same cases over a real server in test_tenants_server.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from rudder.controller import Limits
from test_branches import mask_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = [10, 20, 30, 40, 50, 60, 70]
NEIGHBOUR = [7, 8, 9, 7, 8, 9]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", kv_cache_tokens=8192, block_size=4, max_forks=16)


@pytest.fixture(scope="module")
def alone(llm):
    """The plain greedy request's tokens on an idle engine."""
    return llm.generate([PROMPT], GREEDY)[0].token_ids


class Policy:
    """A controller from a function of (call number, branch_idx, backtrack, tokens) -> Branches."""

    def __init__(self, fn, state=None):
        self.fn, self.state = fn, state if state is not None else {"calls": 0}

    def mid_process(self, branch_idx, backtrack, tokens):
        self.state["calls"] += 1
        return self.fn(self.state["calls"], branch_idx, backtrack, tokens)

    def fork(self):
        return Policy(self.fn, self.state)

    def close(self):
        pass


LIVELOCKS = {
    # After the first token: take it back and sample again, forever.
    "backtrack-and-resample": lambda n, b, bt, t: [Branch()] if n <= 2 else [Branch(backtrack=1)],
    # Fast-forward one token, then take it back.
    "ff-one-take-back": lambda n, b, bt, t: [Branch(ff=[[5]])] if n % 2 else [Branch(backtrack=1, ff=[[]])],
    # Fast-forward 200 tokens, then take them back.
    "ff-200-take-back": lambda n, b, bt, t: [Branch(ff=[[5] * 200])] if n % 2 else [Branch(backtrack=200, ff=[[]])],
    # Fork in two, then the second fork stops; again and again.
    "fork-and-stop": lambda n, b, bt, t: [] if b == 1 else [Branch(backtrack=1), Branch()] if n > 1 else [Branch()],
}


def _run_beside(llm, neighbour_params, neighbour, limits=None):
    """The plain request and a neighbour with `neighbour` as controller, in one engine."""
    eng = llm.engine
    plain = eng.add_request(PROMPT, GREEDY)
    other = eng.add_request(NEIGHBOUR, neighbour_params, neighbour, limits)
    steps = 0
    while not (plain.finished and other.finished):
        eng.step()
        steps += 1
        assert steps < 5000, "the engine did not finish"
    out = {r.request_id: eng.completions(r) for r in (plain, other)}
    for r in (plain, other):
        eng.forget(r)
    return out[plain.request_id][0], out[other.request_id], steps


@pytest.mark.parametrize("name", sorted(LIVELOCKS))
@pytest.mark.parametrize("speculative", [None, "lookup"])
def test_a_livelock_fails_alone_with_kind_limit(llm, alone, name, speculative):
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True, speculative=speculative)
    plain, other, steps = _run_beside(llm, params, Policy(LIVELOCKS[name]))
    assert plain.token_ids == alone
    assert other[0].finish_reason == "error" and other[0].error.startswith("controller limit:"), other[0].error
    assert all(c.finish_reason in ("error", "stop") for c in other)  # forks that stopped before it failed
    assert steps < 200  # its budget stopped it, though max_tokens (1000) was far away
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_budgets_are_lowered_per_request(llm):
    """The same backtracking controller with a lower step budget fails sooner."""
    fn = LIVELOCKS["backtrack-and-resample"]
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    _, other, steps_default = _run_beside(llm, params, Policy(fn))
    _, other_low, steps_low = _run_beside(llm, params, Policy(fn), Limits().capped({"max_steps_per_token": 1}))
    assert "max_steps_per_token 1" in other_low[0].error and steps_low < steps_default


def test_an_honest_backtracking_controller_is_within_budget(llm):
    """A controller that takes one token back every few tokens (as an editing controller might)
    finishes normally: the budgets leave room for real controllers."""
    def edit(n, b, bt, t):
        return [Branch(backtrack=1, mask=mask_of([300 + n % 50]))] if n % 3 == 0 else [Branch()]

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, other, _ = _run_beside(llm, params, Policy(edit))
    assert other[0].finish_reason == "length" and len(other[0].token_ids) == 40


class Blocked:
    """A controller whose second call blocks until released (a very slow controller)."""

    def __init__(self, release: threading.Event):
        self.release, self.calls = release, 0

    def mid_process(self, branch_idx, backtrack, tokens):
        self.calls += 1
        if self.calls == 2:
            assert self.release.wait(60)
        return [Branch()]

    def fork(self):
        raise AssertionError

    def close(self):
        pass


def test_a_slow_controller_never_holds_up_its_neighbours(llm, alone):
    """The neighbour's controller blocks on its second call: the plain request decodes all its
    tokens meanwhile (it never waits for it), then the neighbour goes on from its kept logits
    row and gets exactly the tokens it gets with a prompt controller."""
    eng = llm.engine
    release = threading.Event()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = eng.add_request(PROMPT, GREEDY)
    other = eng.add_request(NEIGHBOUR, params, Blocked(release))
    while not plain.finished:
        eng.step()
    assert not other.finished and eng.completions(other)[0].token_ids == NEIGHBOUR[:0] + other.seqs[0].output_ids
    assert eng.completions(plain)[0].token_ids == alone
    release.set()
    while not other.finished:
        eng.step()
    got = eng.completions(other)[0].token_ids
    for r in (plain, other):
        eng.forget(r)
    reference = llm.generate([NEIGHBOUR], params, controllers=[Policy(lambda *a: [Branch()])])[0].token_ids
    assert got == reference


def test_a_late_controllers_request_can_be_cancelled(llm):
    eng = llm.engine
    release = threading.Event()
    plain = eng.add_request(PROMPT, GREEDY)
    other = eng.add_request(NEIGHBOUR, GREEDY, Blocked(release))
    for _ in range(5):
        eng.step()
    eng.cancel(other.request_id)  # its controller is mid-call: it is closed when the call returns
    while not plain.finished:
        eng.step()
    release.set()
    eng.forget(plain)
    time.sleep(0.05)
    assert not eng.has_unfinished() and eng.block_manager.num_free == eng.block_manager.num_blocks


class ForkThenFail:
    """Forks into two sequences on its first call; both forks' next calls block until released,
    then raise (shared state: one controller, two cursors)."""

    def __init__(self, release: threading.Event, state=None):
        self.release, self.state = release, state if state is not None else {"calls": 0}

    def mid_process(self, branch_idx, backtrack, tokens):
        self.state["calls"] += 1
        if self.state["calls"] == 1:
            return [Branch(), Branch()]
        assert self.release.wait(60)
        raise RuntimeError("the controller gave up")

    def fork(self):
        return ForkThenFail(self.release, self.state)

    def close(self):
        pass


def test_late_forks_whose_first_answer_fails_their_request(llm):
    """Two late forks of one request answer in the same step, the first with a failure: that
    ends the request (both forks), and the second answer, now of a finished sequence, is dropped
    (never a failed engine step)."""
    eng = llm.engine
    release = threading.Event()
    plain = eng.add_request(PROMPT, GREEDY)
    other = eng.add_request(NEIGHBOUR, GREEDY, ForkThenFail(release))
    while not plain.finished:
        eng.step()
    assert not other.finished and len(other.seqs) == 2   # both forks are waiting for their calls
    release.set()
    time.sleep(0.2)   # both answers are in before the next step takes them
    for _ in range(50):
        if other.finished:
            break
        eng.step()
    [a, b] = eng.completions(other)
    assert a.finish_reason == b.finish_reason == "error" and "gave up" in a.error
    for r in (plain, other):
        eng.forget(r)
    assert not eng.has_unfinished()


def test_controller_cpu_per_token_is_budgeted(llm, alone):
    def burn(n, b, bt, t):
        end = time.thread_time() + 0.004  # 4 ms of CPU a step
        while time.thread_time() < end:
            pass
        return [Branch()]

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain, other, _ = _run_beside(llm, params, Policy(burn), Limits().capped({"controller_ms_per_token": 1}))
    assert plain.token_ids == alone
    assert other[0].finish_reason == "error" and "ms of CPU time" in other[0].error
    plain, other, _ = _run_beside(llm, params, Policy(burn))  # the default (50 ms a token) lets it run
    assert other[0].finish_reason == "length"

