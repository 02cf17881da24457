"""Trace events over HTTP (`"trace": true` on /v1/run, `rudder.trace` on the OpenAI endpoints):
one event per applied Branch of every kind - fast-forward, a mask with ff lists, backtrack and
sample, a pure backtrack, fork, masked sampling, stop - equal to what `LLM.generate(...,
trace=True)` records for the same request (tiny model, a C controller built with zig)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from rudder import LLM, SamplingParams
from rudder.controller.build import build_controller
from rudder.server import ServerConfig
from serve_util import LiveServer, apply_deltas, sse_events

# Each kind of Branch in turn, on the tiny model's byte-level tokenizer (ids 3..258 are bytes).
# The first answer samples: a first fast-forward may be applied before or after the prefill, as
# the controller's answer comes, and the two runs compared would count their steps apart.
KINDS_C = r'''
#include "rudder.h"
static const uint32_t FF[3] = {70, 71, 72}, LIST_A[2] = {80, 90}, LIST_B[3] = {81, 91, 92};
void controller_step(const rudder_step *step, rudder_out *out) {
    uint32_t *mask;
    rudder_branch *b;
    switch (step->index) {
    case 0:                                   /* a mask of three tokens, two of them with ff lists */
        mask = rudder_out_mask(out);
        rudder_mask_set(mask, 80), rudder_mask_set(mask, 81), rudder_mask_set(mask, 82);
        b = rudder_out_sample(out, mask);
        rudder_out_ff_list(out, b, LIST_A, 2);
        rudder_out_ff_list(out, b, LIST_B, 3);
        return;
    case 1:                                   /* fast-forward */
        rudder_out_ff(out, FF, 3);
        return;
    case 2:                                   /* take two back, sample freely */
        rudder_out_sample(out, NULL)->backtrack = 2;
        return;
    case 3:                                   /* only take one back */
        rudder_out_backtrack(out, 1);
        return;
    case 4:                                   /* fork in two */
        rudder_out_sample(out, NULL);
        rudder_out_sample(out, NULL);
        return;
    default:                                  /* lower-case letters, then stop */
        if (step->n_seq - step->n_prompt >= 12)
            return;
        mask = rudder_out_mask(out);
        for (uint32_t t = 'a' + 3; t <= 'z' + 3; t++)
            rudder_mask_set(mask, t);
        rudder_out_sample(out, mask);
    }
}
'''

PROMPT = "Trace me"
RUN = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.9, "seed": 11}


@pytest.fixture(scope="module")
def kinds_wasm(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("kinds")
    (d / "kinds.c").write_text(KINDS_C)
    return build_controller([d / "kinds.c"], d / "kinds.wasm").read_bytes()


@pytest.fixture(scope="module")
def server():
    with LiveServer(ServerConfig(model="tiny", max_tokens=200)) as s:
        yield s


@pytest.fixture(scope="module")
def kinds_id(server, kinds_wasm) -> str:
    with server.client() as c:
        r = c.post("/v1/controllers", content=kinds_wasm)
        assert r.status_code == 200, r.text
        return r.json()["module_id"]


def run_stream(server, body: dict) -> list:
    with server.client() as c, c.stream("POST", "/v1/run", json=body) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r))


def without_time(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("controller_ms", "type")}


def test_every_branch_kind_streams_as_the_python_api_records_it(server, kinds_id, kinds_wasm):
    events = run_stream(server, {**RUN, "controller": kinds_id, "trace": True})
    trace = [e for e in events if e["type"] == "trace"]
    [done] = [e for e in events if e["type"] == "done"]

    llm = LLM("tiny")
    try:
        [out] = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.9, seed=11), controller=kinds_wasm,
                             trace=True)
        expected = [t.as_dict(llm.tokenizer) for b in out.branches for t in b.trace]
    finally:
        llm.close()
    by_seq = sorted(trace, key=lambda e: e["seq"])  # the stream interleaves the forks; order within one is kept
    assert [without_time(e) for e in by_seq] == [without_time(e) for e in expected]
    assert [c["text"] for c in done["choices"]] == [b.text for b in out.branches]

    kinds = {}
    for e in trace:
        kinds.setdefault("ff", e) if e["ff"] and e["allowed"] is None and not e["backtrack"] else None
        kinds.setdefault("ff lists", e) if len(e["ff"]) > 1 else None
        kinds.setdefault("backtrack and sample", e) if e["backtrack"] and e["token"] is not None else None
        kinds.setdefault("backtrack", e) if e["backtrack"] and e["ff"] == [[]] else None
        kinds.setdefault("fork", e) if e["parent"] is not None else None
        kinds.setdefault("mask", e) if e["allowed"] == 26 else None
        kinds.setdefault("stop", e) if e["stop"] else None
    assert sorted(kinds) == sorted(["ff", "ff lists", "backtrack and sample", "backtrack", "fork", "mask", "stop"])
    assert kinds["ff"]["ff"] == [[70, 71, 72]] and kinds["ff"]["token"] is None
    assert kinds["ff"]["text"] == {"70": "C", "71": "D", "72": "E"}  # every id named has its text
    lists = kinds["ff lists"]
    assert lists["allowed"] == 3 and lists["first_allowed"] == [80, 81, 82] and lists["token"] in (80, 81, 82)
    assert lists["ff"] == [[80, 90], [81, 91, 92]]
    # the token's probability and its alternatives: the distribution under the mask
    assert lists["logprob"] <= 0 and {t for t, _ in lists["top"]} == {80, 81, 82}
    assert sum(np.exp(lp) for _, lp in lists["top"]) == pytest.approx(1, abs=1e-4)
    assert kinds["backtrack and sample"]["backtrack"] == 2 and kinds["backtrack"]["backtrack"] == 1
    fork = kinds["fork"]
    assert fork["seq"] == 1 and fork["parent"] == 0 and fork["fork"] == 1
    assert {e["seq"] for e in trace} == {0, 1}
    mask = kinds["mask"]
    assert all(chr(t - 3).islower() for t in mask["first_allowed"]) and len(mask["first_allowed"]) == 8
    assert 0 <= mask["token"] - 3 - ord("a") < 26 and len(mask["top"]) == 5
    assert all(e["stop"] for e in trace if e["stop"]) and {e["seq"] for e in trace if e["stop"]} == {0, 1}
    # a stream event comes once its step has its token: every sampling step has one
    assert all(e["token"] is not None for e in trace if not e["stop"] and (e["allowed"] or not e["ff"]))


def test_trace_changes_nothing_and_masks_come_when_asked(server, kinds_id):
    plain = run_stream(server, {**RUN, "controller": kinds_id})
    traced = run_stream(server, {**RUN, "controller": kinds_id, "trace": {"masks": True}})
    assert not any(e["type"] == "trace" for e in plain)
    texts_plain, texts_traced = {}, {}
    for events, texts in ((plain, texts_plain), (traced, texts_traced)):
        for e in events:
            if e["type"] == "step":
                apply_deltas(texts, e["deltas"])
    assert texts_plain == texts_traced and len(texts_plain) == 2
    masked = [e for e in traced if e["type"] == "trace" and e["allowed"] is not None]
    assert masked and all("mask" in e for e in masked)
    for e in masked:
        words = np.frombuffer(base64.b64decode(e["mask"]), dtype="<u4")
        allowed = [i for i in range(len(words) * 32) if words[i >> 5] >> (i & 31) & 1]
        assert len(allowed) == e["allowed"] and allowed[:8] == e["first_allowed"]
    assert not any("mask" in e for e in run_stream(server, {**RUN, "controller": kinds_id, "trace": True})
                   if e["type"] == "trace")


def test_a_whole_run_carries_each_choices_trace(server, kinds_id):
    with server.client() as c:
        body = c.post("/v1/run", json={**RUN, "controller": kinds_id, "trace": True, "stream": False}).json()
    streamed = [e for e in run_stream(server, {**RUN, "controller": kinds_id, "trace": True}) if e["type"] == "trace"]
    assert [c["branch"] for c in body["choices"]] == [0, 1]
    assert [without_time(t) for c in body["choices"] for t in c["trace"]] == \
        [without_time(e) for e in sorted(streamed, key=lambda e: e["seq"])]


def test_chat_rudder_trace(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=1, stream=True,
        extra_body={"rudder": {"regex": "[a-z]{3}", "trace": True}}))
    trace = [t for ch in chunks for t in (ch.model_extra or {}).get("rudder_trace") or []]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text) == 3 and text.isalpha()
    assert [t["index"] for t in trace] == [0] * len(trace) and len(trace) == 4  # three letters, then the stop
    assert [t["allowed"] for t in trace[:3]] == [26] * 3 and trace[3]["stop"]
    assert "".join(t["text"][str(t["token"])] for t in trace[:3]) == text
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=1,
        extra_body={"rudder": {"regex": "[a-z]{3}", "trace": True}})
    assert [without_time(t) for t in whole.choices[0].model_extra["rudder_trace"]] == [without_time(t) for t in trace]


def test_trace_without_a_controller_is_refused_by_name(server):
    with server.client() as c:
        r = c.post("/v1/run", json={"prompt": "hi", "trace": True, "stream": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "trace"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "rudder": {"trace": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rudder.trace"
        r = c.post("/v1/run", json={"controller": "force", "controller_arg": "x", "trace": True, "aici": True})
        assert r.status_code == 400 and "AICI" in r.json()["error"]["message"]
        r = c.post("/v1/run", json={"prompt": "hi", "controller": "force", "trace": {"masks": "lots"}})
        assert r.status_code == 400 and "trace" in r.json()["error"]["message"]


def test_every_step_reaches_the_stream_when_max_tokens_ends_the_forks(server):
    """Sequences that end on the host's limit, not the controller's stop: no step is held back."""
    events = run_stream(server, {**RUN, "controller": "fork", "controller_arg": "2", "trace": True, "max_tokens": 3})
    trace = [e for e in events if e["type"] == "trace"]
    assert events[-1]["type"] == "done" and {e["seq"] for e in trace} == {0, 1}
    assert all(e["token"] is not None for e in trace)
    assert httpx.get(server.url + "/healthz").json()["running"] == 0
