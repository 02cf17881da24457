"""Seeing what a controller did: `LLM.generate(..., trace=True)` and `rudder run --trace` list,
per step and sequence, the Branch the host applied (tiny model, Python and Wasm controllers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bitarray import bitarray

from rudder import LLM, SamplingParams
from rudder.branch import Branch
from test_branches import Scripted, mask_of

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def test_each_applied_branch_is_traced(llm):
    mask = mask_of([65, 66, 300])
    ctl = Scripted([[Branch(mask=mask, ff=[[66, 67, 68]])], [Branch(backtrack=1)], [Branch(ff=[[70, 71]])]])
    [out] = llm.generate([[10, 20, 30]], GREEDY, controllers=[ctl], trace=True)
    first, second, third = out.trace[:3]
    assert isinstance(first.mask, bitarray) and first.allowed == 3
    assert [i for i in range(512) if first.mask[i]] == [65, 66, 300]  # bit i is token i, no reordering
    assert first.ff == [[66, 67, 68]] and first.backtrack == 0 and first.controller_ms >= 0
    assert second.backtrack == 1 and second.mask is None and second.ff == []
    assert third.ff == [[70, 71]]
    assert [t.step for t in out.trace] == sorted(t.step for t in out.trace)
    line = first.describe(llm.tokenizer)
    assert "mask allows 3" in line and "'>'" in line and "ff '?@A'" in line  # ids 3..258 are the bytes


def test_the_traced_mask_is_a_copy(llm):
    """The controller may overwrite its mask at its next call (it is a view of its memory); the
    trace keeps what was applied."""
    words = mask_of([65])

    def rewrite(b, bt, t):
        words[:] = mask_of([66])  # the "guest memory" changes under the earlier answer
        return [Branch(mask=words)]

    [out] = llm.generate([[10, 20]], GREEDY, controllers=[Scripted([[Branch(mask=words)], rewrite])], trace=True)
    assert out.trace[0].mask[65] and not out.trace[0].mask[66]
    assert out.trace[1].mask[66]


def test_forks_have_their_own_traces_and_untraced_requests_have_none(llm):
    ctl = Scripted([[Branch(mask=mask_of([65])), Branch(mask=mask_of([66]))]])
    [out] = llm.generate([[10, 20]], GREEDY, controllers=[ctl], trace=True)
    assert [b.trace[0].fork for b in out.branches] == [0, 1]
    assert [b.trace[0].mask.count() for b in out.branches] == [1, 1]
    assert all(t.branch == b.branch for b in out.branches for t in b.trace)
    [plain] = llm.generate([[10, 20]], GREEDY, controllers=[Scripted([[Branch()]])])
    assert plain.trace is None


def test_cli_trace_prints_each_step():
    rudder = Path(sys.executable).with_name("rudder")
    done = subprocess.run([str(rudder), "run", "--model", "tiny", "--controller", "choices", "--arg", '["yes", "no"]',
                           "--trace", "--max-tokens", "4", "--seed", "1", "hi"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("[trace]")]
    assert lines and "mask allows 2" in lines[0] and "'y'" in lines[0] and "'n'" in lines[0]
    assert done.stdout.strip() in ("yes", "no")
    assert len(np.unique([ln.split(",")[0] for ln in lines])) == len(lines)  # one line per step


def test_a_step_records_its_sampled_token_and_alternatives_and_a_stop_is_a_step(llm):
    letters = mask_of(range(100, 140))  # ids 3..258 are the bytes: 'a' is 100
    ctl = Scripted([[Branch(mask=letters)], []])
    [out] = llm.generate([[10, 20]], SamplingParams(max_tokens=4, temperature=0.7, seed=3), controllers=[ctl],
                         trace=True)
    first, stop = out.trace
    assert first.token == out.token_ids[0] and 100 <= first.token < 140
    assert len(first.top) == 5 and all(100 <= t < 140 for t, _ in first.top)  # the distribution under the mask
    assert first.top == sorted(first.top, key=lambda t: -t[1]) and first.top[0][1] >= first.logprob
    assert stop.stop and stop.token is None and stop.branch == 0 and out.finish_reason == "stop"
    line = first.describe(llm.tokenizer)
    assert "mask allows 40: 'a', 'b', 'c', 'd', 'e', ..." in line and "sampled " in line and " p=0." in line
    assert stop.describe().startswith(f"step {stop.step} seq 0, stop,")


def test_tracing_changes_neither_the_tokens_nor_the_logprobs_asked_for(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, logprobs=2, ignore_eos=True)
    runs = [llm.generate([[10, 20]], params, controllers=[Scripted([[Branch(mask=mask_of(range(60, 200)))]])],
                         trace=trace)[0] for trace in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].logprobs == runs[1].logprobs and all(len(lp["top"]) == 2 for lp in runs[1].logprobs)
    assert [t.token for t in runs[1].trace] == runs[1].token_ids  # one Branch per token here
