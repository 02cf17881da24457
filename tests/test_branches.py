"""The engine applies Branch records exactly as docs/abi.md says (Python controllers, tiny model).

Each test checks the result against an independent fresh run: after a backtrack, fork or
fast-forward, greedy decoding must continue exactly as a new request with the same tokens."""

import numpy as np
import pytest

from rudder import LLM, SamplingParams
from rudder.branch import Branch

V = 512
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", kv_cache_tokens=2048, block_size=4)


def mask_of(tokens, vocab=V):
    words = np.zeros((vocab + 31) // 32, np.uint32)
    for t in tokens:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words


def everything_but(tokens):
    return mask_of(sorted(set(range(V)) - set(tokens)))


class Scripted:
    """Answers each call with the next Branch list of a script (then samples freely); records calls.

    A script entry may be a function of the call (branch_idx, backtrack, tokens) returning branches."""

    def __init__(self, script, calls=None, forks=None):
        self.script = list(script)
        self.calls = [] if calls is None else calls
        self.forks = forks if forks is not None else []
        self.closed = False

    def mid_process(self, branch_idx, backtrack, tokens):
        self.calls.append((branch_idx, backtrack, list(tokens)))
        if not self.script:
            return [Branch()]
        entry = self.script.pop(0)
        return entry(branch_idx, backtrack, tokens) if callable(entry) else entry

    def fork(self):
        twin = Scripted(self.script, self.calls, self.forks)
        self.forks.append(twin)
        return twin

    def close(self):
        self.closed = True


def fresh(llm, prompt_ids, n=GREEDY.max_tokens):
    return llm.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


PROMPT = [10, 20, 30, 40, 50, 60, 70]


def test_first_call_sees_the_prompt_then_each_appended_token(llm):
    ctl = Scripted([])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    assert ctl.calls[0] == (0, 0, PROMPT)
    assert [c[2] for c in ctl.calls[1:]] == [[t] for t in out.token_ids[:-1]]
    assert out.token_ids == fresh(llm, PROMPT)
    assert ctl.closed


def test_fast_forward_appends_in_one_step_and_decoding_continues_correctly(llm):
    ff = [100, 101, 102, 103, 104, 105]
    ctl = Scripted([[Branch(ff=[ff])]])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    assert out.token_ids[:6] == ff
    assert out.token_ids[6:] == fresh(llm, PROMPT + ff, 6)
    assert ctl.calls[1] == (0, 0, ff)  # the whole list is reported as appended at once


def test_masked_ff_lists_extend_the_sampled_token(llm):
    first = fresh(llm, PROMPT, 1)[0]
    other = (first + 1) % V
    branch = Branch(mask=mask_of([first, other]), ff=[[other, 7], [first, 8, 9]])
    out = llm.generate([PROMPT], GREEDY, controllers=[Scripted([[branch]])])[0]
    assert out.token_ids[:3] == [first, 8, 9]
    assert out.token_ids[3:] == fresh(llm, PROMPT + [first, 8, 9], 9)


def test_backtrack_and_sample_uses_fresh_logits(llm):
    """After 5 tokens, drop 3 and sample again forbidding the token that came first: the result
    must equal greedy decoding of (prompt + 2 kept tokens) under that mask."""
    base = fresh(llm, PROMPT, 5)
    banned = base[2]
    script = [[Branch()]] * 5 + [[Branch(backtrack=3, mask=everything_but([banned]))]]
    ctl = Scripted(script)
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    expected_next = [t for t in np.argsort(-first_logits(llm, PROMPT + base[:2])) if t != banned][0]
    assert out.token_ids[:3] == base[:2] + [int(expected_next)]
    assert out.token_ids[3:] == fresh(llm, PROMPT + out.token_ids[:3], 9)
    # The controller saw one round trip: its next call reports the backtrack and the new token.
    assert ctl.calls[6] == (0, 3, [int(expected_next)])


def first_logits(llm, ids):
    logits = {}
    run = llm.engine.runner.run
    llm.engine.runner.run = lambda batch, *args: logits.setdefault("x", run(batch, *args))
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.runner.run = run
    return logits["x"][0].numpy()


def test_backtrack_then_fast_forward_rewrites_the_prompt(llm):
    ctl = Scripted([[Branch(backtrack=3, ff=[[200, 201]])]])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    rewritten = PROMPT[:-3] + [200, 201]
    assert out.token_ids[:2] == [200, 201]
    assert out.token_ids[2:] == fresh(llm, rewritten, 10)
    assert ctl.calls[1] == (0, 3, [200, 201])


def test_pop_only_branch_refeeds_and_asks_again(llm):
    ctl = Scripted([[Branch()]] * 4 + [[Branch(backtrack=2, ff=[[]])]])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    assert ctl.calls[5][1] == 2 and ctl.calls[5][2] == []
    assert out.token_ids == fresh(llm, PROMPT, 12)  # greedy re-samples the same two tokens


def test_fork_gives_each_branch_its_own_mask_and_controller(llm):
    firsts = [5, 6, 7]
    ctl = Scripted([[Branch(mask=mask_of([t])) for t in firsts]])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    assert len(out.branches) == 3 and len(ctl.forks) == 2
    for t, comp in zip(firsts, out.branches):
        assert comp.token_ids[0] == t
        assert comp.token_ids[1:] == fresh(llm, PROMPT + [t], 11)
    # The call after the fork tells each copy which branch it became.
    assert all((b, 0, [t]) in ctl.calls for b, t in enumerate(firsts))
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_forks_stream_their_whole_text(llm):
    ctl = Scripted([[Branch()] * 2])
    deltas = list(llm.stream(PROMPT, GREEDY, controller=ctl))
    by_branch = {}
    for d in deltas:
        by_branch.setdefault(d.branch, []).append(d)
    assert set(by_branch) == {0, 1}
    texts = ["".join(d.text for d in ds) for _, ds in sorted(by_branch.items())]
    alone = llm.tokenizer.decode(fresh(llm, PROMPT, GREEDY.max_tokens))
    assert alone and texts == [alone, alone]  # greedy: each fork streams what one request alone decodes
    assert all(ds[-1].finished for ds in by_branch.values())


def test_empty_result_stops(llm):
    ctl = Scripted([[Branch()], [Branch()], []])
    out = llm.generate([PROMPT], GREEDY, controllers=[ctl])[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 2


@pytest.mark.parametrize("branches, message", [
    ([Branch(backtrack=99)], "cannot backtrack 99"),
    ([Branch(ff=[[1], [2]])], "need a mask"),
    ([Branch(mask=mask_of([3]), ff=[[]])], "must not be empty"),
    ([Branch(ff=[[]])], "must sample, fast-forward or backtrack"),
    ([Branch()] * 17, "exceed 16 live sequences"),
    ([Branch(mask=np.zeros((V + 31) // 32, np.uint32))], "allowed no token"),
])
def test_invalid_branches_fail_only_their_request(llm, branches, message):
    good = llm.engine.add_request(PROMPT, GREEDY)
    bad = llm.engine.add_request(PROMPT, GREEDY, controller=Scripted([branches]))
    while not (good.finished and bad.finished):
        llm.engine.step()
    [g], failed = llm.engine.completions(good), llm.engine.completions(bad)
    llm.engine.forget(good)
    llm.engine.forget(bad)
    assert g.token_ids == fresh(llm, PROMPT)
    assert all(c.finish_reason == "error" for c in failed)
    assert message in failed[0].error
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_a_raising_controller_fails_its_request_with_its_message(llm):
    def boom(*_):
        raise RuntimeError("deliberate failure")

    out = llm.generate([PROMPT, PROMPT], GREEDY, controllers=[Scripted([boom]), None])
    assert out[0].finish_reason == "error" and "deliberate failure" in out[0].error
    assert out[1].token_ids == fresh(llm, PROMPT)
