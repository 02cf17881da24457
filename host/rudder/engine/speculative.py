"""Constrained speculative decoding: draft, verify, rewind (docs/speculative.md).

A sequence with `SamplingParams.speculative` that is at a plain decoding step (one sampled token
waiting, nothing deferred) drafts before the step is scheduled:

    answer = controller(reported tokens)                       # the mask for the next position
    repeat up to k times:
        answer is one simple Branch?  (no backtrack, no fork, no stop) else end the draft
        pure fast-forward  -> its tokens are free drafts (forced)
        sampling Branch    -> the draft source proposes a token under the mask (+ its ff list)
        answer = controller(those tokens)                      # n_append = 1 (or the ff list)

The drafted tokens are appended as pending tokens, so the one target forward of the step runs
over them all (`ScheduledSeq.logit_rows` = 1 + drafted). `verify` then walks the positions with
the masks recorded while drafting (no extra controller call): greedy accepts while the target's
masked argmax agrees; sampling accepts with min(1, p/q) and resamples a rejection from the
normalised residual max(0, p - q), with p and q from the one definition plain sampling draws
from (`sampler.sampling_weights`), so the output follows plain sampling's distribution. Rejected
positions are popped from the KV cache, the controller learns them as `backtrack` at its next
call, with the corrected token as its `append` (the cursor's `ahead`, engine/cursor.py). The
speculator only decides: `Steering` makes every change to a sequence (attach_draft,
settle_draft, append), and of the engine it sees `EngineView` alone. When
every draft token is accepted, the controller's last answer - whatever it is: fork, backtrack,
stop - is applied to the logits of the position after the draft by the same code as any answer
(`Steering.apply_answer`, engine/branching.py). The verification rows are read through the
runner (`Runner.logits`), so a pipeline verifies like one process.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..branch import Branch
from .branching import Sample, Steering, ends_sequence, mask_allows, tokens_after
from .drafts import DraftModel, PromptLookup
from .sampler import Sampler, argmax, draw, sampling_weights, take_rows
from .scheduler import Headroom
from .sequence import Sequence

_EMA = 0.8  # weight of the past in the running acceptance and timing estimates
FORCED_ROOM = 16  # positions reserved per draft for controller fast-forwards beyond k
NOMINAL_T_TARGET = 0.06  # seconds per target forward and per drafted token: the estimates' start
# Each verified position adds about this fraction of a one-token forward (benchmarks/verify_rows.py
# measures it by precision; docs/speculative.md). One value for every precision: the measured
# ones gave smaller drafts and no gain, since a draft step also pays the controller's calls and
# the host's work (benchmarks/RESULTS.md, speculative.py).
ROW_COST = 0.03
PROBE_EVERY = 8  # a sequence that stopped drafting (k = 0) tries one token this often, to notice a change
MAX_PROBE_EVERY = 64  # ... doubling after each probe while drafting is not expected to pay, up to this
# A draft must be expected to gain this share of tokens per second over plain decoding: the
# model of `rate` leaves out a drafting step's host work, and free text with prompt lookup,
# drafting single tokens rarely accepted, ran slower than plain without this margin.
MIN_GAIN = 0.05
NOMINAL_T_DRAFT = {"lookup": 1e-4, "draft": 0.03}  # seeded requests' fixed estimates (no wall clock)
# Until a draft model's step has been measured, its cost is taken as this fraction of the
# target's measured step (an int8 copy of a bf16 target costs about half): drafting is then
# tried, measured, and judged, whatever the target's speed.
UNMEASURED_DRAFT_SHARE = 0.5
# What a draft model pays to read a token it missed (the prompt, the steps it sat out), as a share
# of its decode step until measured: a prefill reads about ten tokens in the time of one decode
# step (benchmarks/decode.py).
UNMEASURED_READ_SHARE = 0.1
# A draft model's round is timed only when it read at most this many new tokens per sequence: a
# round that first reads what the draft model missed (the prompt, the steps it sat out) is not
# the cost of a drafted position.
CAUGHT_UP_TOKENS = 2
# A draft model's probe (drafting the estimates turn down, to measure again) is skipped when the
# draft model would first have to read more than this many tokens it missed (about two target
# steps' worth at int8): probes that read all they missed made free chat with an int8 draft
# slower than plain.
PROBE_READ = 32
# The guard (_Adaptive.guard): measured tokens per second of a sequence's drafting steps against
# its plain steps. A sequence decodes GUARD_SAMPLES plain steps first (the rate to beat, before a
# draft model pays for reading the prompt). Drafting that runs slower than plain by more than
# GUARD_MARGIN stops for BACKOFF steps, doubling up to MAX_BACKOFF while it keeps losing; it is
# judged on GUARD_SAMPLES fresh drafting steps each time it resumes, and a plain step every
# REFRESH_EVERY drafting steps keeps the plain rate current.
GUARD_MARGIN, GUARD_SAMPLES, BACKOFF, MAX_BACKOFF, REFRESH_EVERY = 0.02, 3, 8, 256, 32


@dataclass
class SpecStats:
    """Per request: what speculation did (reported in the completion and the API usage)."""

    drafted: int = 0  # draft tokens verified by the target (controller fast-forwards not counted)
    accepted: int = 0
    forced: int = 0  # controller fast-forward tokens that rode along in a verification forward
    target_forwards: int = 0  # target forward passes that produced this request's next tokens
    spec_steps: int = 0  # of those, the ones that verified a draft

    def as_dict(self, output_tokens: int) -> dict:
        return {
            "drafted": self.drafted, "accepted": self.accepted, "forced": self.forced,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "target_forwards": self.target_forwards, "spec_steps": self.spec_steps,
            "tokens_per_target_forward": round(output_tokens / self.target_forwards, 4) if self.target_forwards else None,
        }


@dataclass
class _Step:
    """One drafted position: the Branch it was drafted under and the tokens it adds - a proposed
    token with the ff list it selected, or (forced) a controller fast-forward."""

    branch: Branch | None
    tokens: list[int]
    forced: bool
    q: torch.Tensor | None = None  # the draft's distribution (draft model, temperature > 0)


@dataclass
class Draft:
    """A sequence's draft for this step; `answer` is the controller's answer after all of it."""

    base: int  # len(seq) before the draft
    k: int  # the most proposed (verified) tokens
    room: int  # the most positions, controller fast-forwards included (reserved in the step)
    steps: list[_Step] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    answer: object = None  # list[Branch] or the exception the controller raised
    lookup: list[int] = field(default_factory=list)  # prompt lookup's remaining proposals ...
    lookup_at: int = -1  # ... valid while the draft has this many tokens
    ctl_time: float = 0.0
    done: bool = False


class _Rate:
    """Tokens per second over recent steps: running sums of tokens and seconds."""

    def __init__(self):
        self.tokens = self.seconds = 0.0
        self.samples = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = _EMA * self.tokens + tokens
        self.seconds = _EMA * self.seconds + seconds
        self.samples += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Adaptive:
    """Per-sequence running estimates that pick k, and the guard that stops drafting when it is
    measured to lose."""

    def __init__(self):
        self.hits, self.tries = 4.0, 5.0  # acceptance rate prior 0.8
        self.ctl_time = 0.0  # seconds per controller call while drafting
        self.idle = 0  # steps since the last draft
        self.probe_every, self.probing = PROBE_EVERY, False
        # the guard: each step's wall time and tokens, by whether it drafted
        self.rates = {True: _Rate(), False: _Rate()}
        self.last: tuple | None = None  # (time, length, drafted, first drafting step) at the last propose
        self.backoff, self.next_backoff, self.since_plain = 0, BACKOFF, 0

    @property
    def alpha(self) -> float:
        return min(self.hits / self.tries, 0.98)

    def observe(self, accepted: int, rejected: bool) -> None:
        self.hits = _EMA * self.hits + accepted
        self.tries = _EMA * self.tries + accepted + rejected
        if self.probing:  # each probe the estimates still turn down waits twice as long for the next
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.probing = False

    def rate(self, k: int, t_target: float, cost: float) -> float:
        """Expected tokens per second of drafts of k tokens: (1 - a^(k+1)) / (1 - a) tokens for
        one target forward over k + 1 positions (each extra one ROW_COST of a one-token forward)
        plus k draft steps of `cost` seconds each."""
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a) / (t_target * (1 + ROW_COST * k) + k * cost)

    def choose_k(self, k_max: int, t_target: float, t_draft: float, timed: bool = True, probe: int = 1) -> int:
        """The k that maximises expected tokens per second (`rate`; a draft step's cost includes
        the controller's call, whose measured time counts when `timed`). 0 = do not
        draft this step (then every PROBE_EVERY steps a probe of `probe` tokens: a draft model's
        probe drafts 2, since only its second round is timed - see CAUGHT_UP_TOKENS)."""
        cost = t_draft + (self.ctl_time if timed else 0.0)
        best, best_rate = 0, (1.0 + (MIN_GAIN if timed else 0.0)) / t_target
        for k in range(1, k_max + 1):
            rate = self.rate(k, t_target, cost)
            if rate > best_rate:
                best, best_rate = k, rate
        self.probing = False
        if best == 0:
            self.idle += 1
            if self.idle >= (self.probe_every if timed else PROBE_EVERY):
                best = min(probe, k_max)
                self.probing = timed
        elif timed:
            self.probe_every = PROBE_EVERY  # drafting pays again: probe often when it stops
        if best:
            self.idle = 0
        return best

    def gain(self, k: int, t_target: float, t_draft: float) -> float:
        """Seconds saved per output token by drafts of k tokens (expected; <= 0: none)."""
        return t_target - 1.0 / self.rate(k, t_target, t_draft + self.ctl_time) if k > 0 else 0.0

    def plain_step(self) -> float | None:
        """Seconds per token of this sequence's plain steps, when measured."""
        plain = self.rates[False]
        return 1.0 / plain.value if plain.samples >= GUARD_SAMPLES and plain.value > 0 else None

    def step(self, now: float, length: int) -> None:
        """A new step begins: the one that just ended took now - then and added length - then's.
        The first drafting step after plain ones is not counted: a draft model then also reads
        what it missed (the prompt, the steps it sat out), a cost that drafting on amortises."""
        if self.last is not None:
            then, before, drafted, first = self.last
            if not (drafted and first):
                self.rates[drafted].add(max(length - before, 0), now - then)

    def guard(self, k: int, plain_first: bool) -> int:
        """k, or 0 when this sequence's drafting steps have been measured slower than its plain ones
        (then it backs off: BACKOFF steps, doubling while drafting keeps losing). `plain_first`:
        measure plain steps before the first draft (a draft model's first draft reads the whole
        prompt; prompt lookup costs nothing to try)."""
        spec, plain = self.rates[True], self.rates[False]
        if k == 0 or self.backoff > 0:
            self.backoff = max(self.backoff - 1, 0)
            if self.backoff == 0 and k:
                self.rates[True] = _Rate()  # resuming: judge drafting on fresh steps
            return 0
        if (plain_first and plain.samples < GUARD_SAMPLES) or self.since_plain >= REFRESH_EVERY:
            return 0  # plain steps first, and one now and then: the rate to beat
        if spec.samples >= GUARD_SAMPLES and plain.samples and spec.value < plain.value * (1 - GUARD_MARGIN):
            self.backoff, self.next_backoff = self.next_backoff, min(2 * self.next_backoff, MAX_BACKOFF)
            return 0
        if spec.samples >= GUARD_SAMPLES and plain.samples and spec.value >= plain.value:
            self.next_backoff = BACKOFF  # drafting pays: a later loss backs off briefly again
        return k

    def began(self, now: float, length: int, drafted: bool) -> None:
        self.last = (now, length, drafted, drafted and self.since_plain == 0)
        self.since_plain = self.since_plain + 1 if drafted else 0


def _probs(row: torch.Tensor, params) -> torch.Tensor:
    """The probabilities the Sampler draws from for this (already masked) row: its one
    definition (sampler.sampling_weights), normalized."""
    w = sampling_weights(row.unsqueeze(0), [params])[0]
    return w / w.sum()


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The token a uniform draws from a row's weights, by the sampler's rule (sampler.draw)."""
    return int(draw(weights.unsqueeze(0), [u])[0])


class EngineView(Protocol):
    """What the Speculator asks of the engine (engine/llm_engine.py's Engine), and nothing else:
    every change to a sequence goes through `steering`."""

    steering: Steering
    sampler: Sampler  # its masks (drafting and verification run on the engine's thread)

    def runnable(self, busy, limit: int | None = None) -> list[Sequence]:
        """The running sequences not in a step in flight, in the order the next step takes them."""

    def headroom(self, running: list[Sequence]) -> Headroom:
        """The step tokens and KV blocks the next step has beyond `running`'s pending tokens."""

    def call_controllers(self, calls: dict, inline: bool) -> dict[Sequence, Future]:
        """Start mid_process calls, {seq: (branch, backtrack, tokens)}: (answer, seconds) futures."""

    def new_draft_model(self) -> DraftModel:
        """The draft model of the engine's config (a ValueError for a bad spec)."""


class Speculator:
    """Drafting before the step, verification after it, for the engine's speculative sequences."""

    def __init__(self, engine: EngineView):
        self.engine = engine
        self.steering = engine.steering
        self.sampler = engine.sampler
        self.lookup = PromptLookup()
        self._draft_model: DraftModel | None = None
        self.adaptive: dict[int, _Adaptive] = {}  # by seq_id
        self.t_target = NOMINAL_T_TARGET  # seconds per one-token forward, running estimate
        self.t_read: float | None = None  # seconds per token a draft model reads to catch up
        # seconds per drafted position, per source (None: the draft model not measured yet)
        self.t_draft: dict[str, float | None] = {"lookup": NOMINAL_T_DRAFT["lookup"], "draft": None}

    @property
    def draft_model(self) -> DraftModel:
        """The engine's draft model (built on first use: a ValueError for a bad spec)."""
        if self._draft_model is None:
            self._draft_model = self.engine.new_draft_model()
            # Its costs timed now, once: guessed costs made the first drafting request draft and
            # read its whole prompt into the draft model, then measure that it did not pay.
            costs = self._draft_model.calibrate()
            if costs is not None:
                self.t_read, self.t_draft["draft"] = costs
        return self._draft_model

    def check(self, params) -> None:
        """Raise ValueError if the request's draft source cannot be had (builds the draft model)."""
        if params.speculative == "draft":
            self.draft_model  # noqa: B018 (built here, on the request's own account)

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, busy, limit: int | None) -> None:
        """Draft for the speculative sequences the scheduler will take next (`limit`: the most it
        takes; `busy`: sequences in a step in flight, left alone)."""
        running = self.engine.runnable(busy, limit)
        now = time.perf_counter()
        for seq in running:  # the guard's clock: every speculative sequence's last step
            if seq.params.speculative and seq.params.seed is None:
                self._adaptive(seq).step(now, len(seq))
        # (not while a controller's first call, started with the request, is unclaimed: a prompt
        # prefilled in chunks can have one token left, and drafting would call the controller again
        # while that call may still run)
        candidates = [s for s in running if s.params.speculative and s.num_pending == 1 and s.num_cached > 0
                      and (s.cursor is None or (s.cursor.wants_call and s.cursor.started is None))
                      and s.draft is None]
        if not candidates:
            self._began(running, set(), now)
            return
        # Room for the drafts in this step's token budget and in the free KV blocks, so that the
        # scheduler takes every drafted sequence whole (no preemption, no partial feed).
        headroom = self.engine.headroom(running)
        drafts = {}
        for seq in candidates:
            p = seq.params
            room = headroom.room(seq, min(p.max_tokens - seq.num_output, self.steering.max_position - len(seq)) - 1)
            if room <= 0:
                continue
            ad = self._adaptive(seq)
            if p.seed is None:
                # The step to beat: this sequence's measured plain steps (the host's work
                # included) once it has some, else the verification forwards' estimate.
                t_target = ad.plain_step() or self.t_target
                t_draft = self.t_draft[p.speculative]
                if t_draft is None:
                    t_draft = UNMEASURED_DRAFT_SHARE * t_target
                k = ad.guard(ad.choose_k(p.spec_k, t_target, t_draft, probe=2 if p.speculative == "draft" else 1),
                             plain_first=p.speculative == "draft")
                if k and p.speculative == "draft" and not self._repaid(seq, ad, k, t_target, t_draft):
                    k = 0
            else:  # a seeded request repeats only if its drafts do: no wall-clock input to k
                k = ad.choose_k(p.spec_k, NOMINAL_T_TARGET, NOMINAL_T_DRAFT[p.speculative], timed=False)
            if k == 0:
                continue
            d = drafts[seq] = Draft(len(seq), k, min(k + FORCED_ROOM, room))
            headroom.take(seq, d.room)
        if drafts:
            self._draft(drafts)
        self._began(running, set(candidates), now)

    def _adaptive(self, seq) -> "_Adaptive":
        ad = self.adaptive.get(seq.seq_id)
        if ad is None:
            ad = self.adaptive[seq.seq_id] = _Adaptive()
        return ad

    def _repaid(self, seq, ad: "_Adaptive", k: int, t_target: float, t_draft: float) -> bool:
        """Whether what drafting can save over the rest of the request repays the draft model's
        reading what it has not seen of the sequence (all of a long prompt, at first): a short
        answer to a long prompt is decoded plain rather than pay for that read."""
        behind = len(seq) - len(self.draft_model.cached.get(seq.seq_id, ()))
        if behind <= CAUGHT_UP_TOKENS:
            return True
        gain = ad.gain(k, t_target, t_draft)
        if gain <= 0:  # a probe (choose_k's), there to measure again: not at the price of a long read
            return behind <= PROBE_READ
        t_read = self.t_read if self.t_read is not None else UNMEASURED_READ_SHARE * t_draft
        return (seq.params.max_tokens - seq.num_output) * gain > behind * t_read

    def _began(self, running: list, candidates: set, now: float) -> None:
        """The guard's clock: a decoding step (drafted or plain) of each candidate begins; other
        steps (a prefill, a re-feed) are not timed."""
        for seq in running:
            ad = self.adaptive.get(seq.seq_id)
            if ad is None or not seq.params.speculative or seq.params.seed is not None:
                continue
            if seq in candidates:
                ad.began(now, len(seq) - (len(seq.draft.tokens) if seq.draft else 0), seq.draft is not None)
            else:
                ad.last = None

    def _draft(self, drafts: dict) -> None:
        # The first call reports what the normal step would (the pending token, a backtrack...).
        tell = {seq: seq.cursor.call() for seq in drafts if seq.cursor is not None}
        while True:
            t0 = time.perf_counter()
            by_source = {"draft": [], "lookup": []}
            for seq, d in drafts.items():
                # (a draft that has its k proposals needs only the controller's last answer, not
                # the draft model's next logits: one forward fewer per drafting step)
                if not d.done and sum(not st.forced for st in d.steps) < d.k:
                    by_source[seq.params.speculative].append(seq)
            # One call with nothing to overlap it (no draft model's forward, no other sequence's
            # call) runs here: a draft of k tokens would pay k round trips to a worker thread.
            tasks = self.engine.call_controllers(tell, inline=len(tell) <= 1 and not by_source["draft"])
            model_rows, caught_up = {}, True
            if by_source["draft"]:  # the draft model computes while the controllers run
                jobs = [(s.seq_id, s.token_ids + drafts[s].tokens) for s in by_source["draft"]]
                read_from = time.perf_counter()
                model_rows = dict(zip(by_source["draft"], self.draft_model.logits(jobs)))
                caught_up = self.draft_model.fed <= CAUGHT_UP_TOKENS
                if not caught_up and self.draft_model.fed >= 16:  # a read of what it missed: its cost per token
                    took = (time.perf_counter() - read_from) / self.draft_model.fed
                    self.t_read = took if self.t_read is None else _EMA * self.t_read + (1 - _EMA) * took
            for seq, future in tasks.items():
                answer, seconds = future.result()
                d = drafts[seq]
                d.answer, d.ctl_time = answer, d.ctl_time + seconds
                seq.request.usage.controller_s += seconds
                ad = self.adaptive[seq.seq_id]
                ad.ctl_time = _EMA * ad.ctl_time + (1 - _EMA) * seconds
            active = [s for s, d in drafts.items() if not d.done]
            tell = {}
            for seq in active:
                step = self._next_step(seq, drafts[seq], model_rows.get(seq, False))
                if step is None:
                    drafts[seq].done = True
                    continue
                d = drafts[seq]
                d.steps.append(step)
                d.tokens.extend(step.tokens)
                if seq.cursor is not None:
                    self.steering.tell_ahead(seq, step.tokens)
                    tell[seq] = (0, 0, step.tokens)
            if active:
                n = sum(1 for s in active if not drafts[s].done)
                for source in ("draft", "lookup"):
                    # a round in which the draft model also read what it missed is not counted
                    if by_source[source] and n and (caught_up or source == "lookup"):
                        took, before = time.perf_counter() - t0, self.t_draft[source]
                        self.t_draft[source] = took if before is None else _EMA * before + (1 - _EMA) * took
            if not any(not d.done for d in drafts.values()):
                break
        for seq, d in drafts.items():
            self.steering.attach_draft(seq, d)

    def _next_step(self, seq, d: Draft, draft_logits) -> _Step | None:
        """The next drafted position under the controller's latest answer, or None to end the
        draft (the answer is then applied at the verified end by the engine)."""
        if sum(not s.forced for s in d.steps) >= d.k:
            return None
        branch = None
        if seq.cursor is not None:
            answer = d.answer
            if isinstance(answer, BaseException) or len(answer) != 1 or answer[0].backtrack:
                return None  # a failure, a stop, a fork or a backtrack: the ordinary path applies it
            branch = answer[0]
            if not branch.samples:  # a fast-forward: free draft tokens
                ff = branch.ff[0] if len(branch.ff) == 1 else []
                if not ff or len(d.tokens) + len(ff) > d.room:
                    return None
                return _Step(branch, list(ff), True)
            if d.ctl_time > 0.5 * self.t_target and seq.params.seed is None:  # the controller's draft budget is spent
                return None
        token, q = self._propose(seq, d, branch, draft_logits)
        if token is None or ends_sequence(token, seq, self.steering.stop_ids):
            return None  # an end of sequence is left to the target to sample
        tokens = tokens_after(branch, token)
        if len(d.tokens) + len(tokens) > d.room:
            return None
        if branch is not None and branch.mask is not None:
            # A Wasm controller's mask is a view of its memory that the next call overwrites;
            # verification needs this one.
            branch = Branch(0, branch.mask.copy(), branch.ff)
        return _Step(branch, tokens, False, q)

    @torch.inference_mode()
    def _propose(self, seq, d: Draft, branch: Branch | None, draft_logits):
        """(token, q) from the sequence's source under the branch's mask; (None, None) if none."""
        mask = None if branch is None else branch.mask
        if seq.params.speculative == "lookup":
            if d.lookup_at != len(d.tokens) or not d.lookup:  # forced tokens moved it: look again
                d.lookup = self.lookup.continuation(seq.token_ids + d.tokens, d.k,
                                                    after_forced=bool(d.steps) and d.steps[-1].forced)
            if not d.lookup:
                return None, None
            token = d.lookup.pop(0)
            d.lookup_at = len(d.tokens) + 1
            if not mask_allows(mask, token):
                return None, None
            return token, None
        if draft_logits is None:
            return None, None
        # (numpy on the CPU: torch's copy and max over a vocabulary row run on its OpenMP
        # threads, whose spinning afterwards slows the next forward - see sampler.take_rows)
        row = take_rows(draft_logits.unsqueeze(0), [0], copy=True)[0]
        if mask is not None:
            self.sampler.apply_masks(row.unsqueeze(0), [mask])
        if (row.numpy().max() if row.device.type == "cpu" else row.max()) == float("-inf"):
            return None, None
        if seq.params.temperature == 0:
            return int(argmax(row)), None
        q = _probs(row, seq.params)
        return _inverse_cdf(q, seq.rng.random()), q

    # -- scheduling ----------------------------------------------------------------------------

    def settle(self, batch: list, busy) -> None:
        """Mark the verification rows of drafted sequences in the scheduled batch; count forwards."""
        for entry in batch:
            seq = entry.seq
            if not seq.params.speculative or not entry.sample:
                continue
            self._stats(seq).target_forwards += 1
            if seq.draft is not None:
                entry.logit_rows = 1 + len(seq.draft.tokens)
        scheduled = {e.seq.seq_id for e in batch if e.sample}
        for seq in self.engine.runnable(busy):
            if seq.draft is not None and seq.seq_id not in scheduled:
                # propose() reserved its room, so this should not happen: the draft goes unverified,
                # and the controller (told its tokens) takes them back at its next call
                self.steering.settle_draft(seq, [], fed=False, deltas=[])

    # -- verification --------------------------------------------------------------------------

    @torch.inference_mode()
    def verify(self, drafted: list, rows: dict, logits: Callable[[list[int]], torch.Tensor], launched: float,
               deltas) -> list[Sample]:
        """Verify the drafts of a completed step, launched at `launched` (perf_counter); `logits`
        fetches rows of its logits (the runner's, in one call). Returns the rows the engine samples
        (the controllers' answers after fully accepted drafts)."""
        sizes = [len(seq.draft.tokens) for seq in drafted]
        wanted = [r for seq, n in zip(drafted, sizes) for r in range(rows[seq.seq_id], rows[seq.seq_id] + n)]
        fetched = logits(wanted) if wanted else None
        elapsed = time.perf_counter() - launched
        samples, at = [], 0
        for seq, n in zip(drafted, sizes):
            at += n
            if seq.finished:  # another sequence of its request failed while verifying (a fork)
                continue
            self.t_target = _EMA * self.t_target + (1 - _EMA) * elapsed / (1 + ROW_COST * n)
            samples.extend(self._verify_one(seq, fetched[at - n:at] if n else None, rows[seq.seq_id], deltas))
        return samples

    def _verify_one(self, seq, logits, row: int, deltas) -> list[Sample]:
        """Accept the longest agreeing prefix of the draft (`logits`: one row per drafted position)."""
        d = seq.draft
        stats = self._stats(seq)
        stats.spec_steps += 1
        kept, accepted, rejected, corrected = 0, [], None, None  # kept: the accepted steps' tokens
        for step in d.steps:
            if not step.forced:
                ok, token = self._check(seq, logits[kept], step)
                stats.drafted += 1
                if not ok:
                    rejected, corrected = step, token
                    break
                stats.accepted += 1
            else:
                stats.forced += len(step.tokens)
            accepted.append(step)
            kept += len(step.tokens)
        self.adaptive[seq.seq_id].observe(sum(not s.forced for s in accepted), rejected is not None)
        # a verified token counts as sampled (plus its ff list); a forced one as fast-forwarded
        self.steering.settle_draft(seq, [(s.tokens, 0 if s.forced else 1) for s in accepted], True, deltas)
        if seq.finished:
            return []
        if rejected is not None:
            self.steering.take_sample(seq, rejected.branch, corrected, None, deltas)
            return []
        end = row + len(d.tokens)  # the position after the draft: the controller's last answer applies
        if seq.cursor is None:
            return [Sample(seq, end, None)]
        return self.steering.apply_answer(seq, end, d.answer, deltas)

    def _check(self, seq, row: torch.Tensor, step: _Step) -> tuple[bool, int]:
        """(accepted, the token the target puts there instead when not)."""
        token = step.tokens[0]
        if step.branch is not None and step.branch.mask is not None:
            self.sampler.apply_masks(row.unsqueeze(0), [step.branch.mask])
        params = seq.params
        if params.temperature == 0:
            best = int(argmax(row))
            return best == token, best
        p = _probs(row, params)
        q_token = 1.0 if step.q is None else float(step.q[token])  # prompt lookup proposes with certainty
        if seq.rng.random() * q_token < float(p[token]):
            return True, token
        if step.q is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - step.q).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p <= q everywhere only by rounding
            residual = p
        return False, _inverse_cdf(residual, seq.rng.random())

    # -- bookkeeping ---------------------------------------------------------------------------

    def _stats(self, seq) -> SpecStats:
        req = seq.request
        if req.spec_stats is None:
            req.spec_stats = SpecStats()
        return req.spec_stats

    def forget(self, seq) -> None:
        """The sequence finished: drop its draft-cache blocks and estimates (and an unverified
        draft: it finished before its verification, e.g. a fork of its request failed)."""
        if seq.draft is not None:
            self.steering.settle_draft(seq, [], fed=False, deltas=[])
        self.adaptive.pop(seq.seq_id, None)
        if self._draft_model is not None:
            self._draft_model.drop(seq.seq_id)
