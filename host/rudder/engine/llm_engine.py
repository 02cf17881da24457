"""The engine loop: schedule, forward, sample, stream - for many concurrent requests.

Per step (docs/design.md draws it):
  1. speculative sequences draft tokens to verify (engine/speculative.py);
  2. the scheduler picks the batch and its KV slots;
  3. each sequence that samples and has a controller gets its `mid_process` call started in the
     controller threads, so it runs while the model computes the logits;
  4. the runner's forward pass over the ragged batch;
  5. the controllers' answers are applied (engine/branching.py: backtrack, fork, fast-forward),
     drafts are verified, and every row that samples is sampled at once under its mask;
  6. each sequence appends its tokens, checks its stops and emits a text delta.

With `micro_batches` M > 1 (pipelines) up to M steps are in flight at once, each over a disjoint
group of the running sequences (`busy`): while the last stage computes one, the first computes
the next. M = 1 is the plain loop: launch a step, complete it.

A step never waits for a slow controller while others can go on: a call still running when
its step completes leaves its sequence out of that step (`late`); its logits row is kept, and
when the answer comes (checked at every step) it is applied and sampled from that row, so the
tokens are the ones it would have had. Requests also have progress budgets (engine/budget.py):
a controller that keeps a sequence from growing, or takes too much CPU per token, ends its
request with kind `limit`.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import kernels
from ..controller.limits import Limits
from ..healing import plan as plan_healing, tell as tell_healing
from .block_manager import BlockManager
from .budget import over_budget
from .branching import Sample, Steering
from .config import EngineConfig
from .controller_calls import ControllerCalls
from .cursor import Controller, ControllerCursor
from .drafts import DraftModel, build_draft_model
from .model_runner import ModelRunner
from .output import Completion, Delta, TextOutput
from .runner import Runner, RunnerFailure
from .sampler import Sampler, take_rows
from .kv_cache import tokens_for_memory
from .scheduler import Headroom, Scheduler, StepBudget
from .sequence import Request, SamplingParams, Sequence
from .step import ScheduledSeq
from .trace import sampler_params

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = ["Engine"]

# Cores' worth of CPU the controllers' calls used lately (ControllerCalls.demand) above which the
# model leaves them a core: a busy-looping neighbour is well above it, the json controller far
# below (the numbers: benchmarks/RESULTS.md, "Numbers the code's design rests on").
CONTROLLER_CORE_DEMAND = 0.1
# A controller's first call starts when its request is added, and the engine waits up to this long
# for the answer before the prompt's prefill: a pure fast-forward (a JSON schema's `{"key":"`)
# then joins the prompt, which saves a forward pass for the price of a short wait. A slower first
# call goes on while the prompt is computed, as every call does.
FIRST_ANSWER_WAIT = 0.002


@dataclass
class _Flight:
    """A launched step: its batch, the sequences that sample, their controller tasks, the
    runner's handle on its logits, and when it was launched."""

    batch: list[ScheduledSeq]
    ready: list[Sequence]
    calls: dict[int, Future]  # by seq_id: (answer, CPU seconds) of its mid_process call
    handle: Any
    launched: float
    forward_s: float = 0.0
    closing: list = field(default_factory=list)  # controllers of sequences that ended while in flight


@dataclass
class _Late:
    """A sequence whose controller had not answered when its step completed: its call, and its
    logits row from that step ([1, vocab]), sampled when the answer comes."""

    seq: Sequence
    call: Future
    logits: torch.Tensor


class Engine:
    def __init__(self, model, tokenizer: "Tokenizer", config: EngineConfig | None = None, *,
                 runner: Runner | None = None, **options):
        """`config` (or its fields as keyword arguments) sizes the engine; `runner` computes the
        model (default: a ModelRunner in this process; `rudder.pipeline` builds a PipelineRunner)."""
        config = (config or EngineConfig()).replace(**options) if options else (config or EngineConfig())
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.cfg
        if config.kv_cache_tokens is None:  # sized for this machine (a runner of its own was sized with it)
            if runner is not None:
                raise ValueError("kv_cache_tokens: give the size the runner's KV cache was made with")
            config = self.config = config.replace(kv_cache_tokens=tokens_for_memory(
                model.cfg, getattr(model, "act_dtype", torch.float32), model.embed_tokens.weight.device,
                config.kv_cache_memory, config.max_seqs * model.cfg.max_position))
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.runner: Runner = runner or ModelRunner(model, config.num_blocks, config.block_size)
        if config.model_threads == "shared":  # a core kept for controllers where there is one to keep
            threads = torch.get_num_threads()
            config = self.config = config.replace(
                model_threads=threads - 1 if self.runner.capabilities.native_decoder and threads > 1 else None)
        if config.model_threads is not None and not self.runner.capabilities.native_decoder:
            raise ValueError("model_threads caps the native CPU kernels of a bf16 or int8 model in this process; "
                             "this model does not run on them (fp32, a GPU, or a pipeline's stages): set torch's "
                             "threads instead (pipeline_threads for a pipeline)")
        target = None if config.step_target_ms is None else config.step_target_ms / 1000
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_seqs, StepBudget(target))
        self.steering = Steering(self.block_manager, self.scheduler, tokenizer.stop_token_ids,
                                 self.model_config.max_position, config.max_forks, self._sequence_ended)
        self.calls = ControllerCalls(config.controller_threads)
        # An engine dropped without close() still ends its worker threads (they hold the calls'
        # queue, not the engine, so the engine itself can be collected).
        weakref.finalize(self, self.calls.close)
        self.sampler = Sampler(self.model_config.vocab_size)  # for late sequences' kept rows
        self._late: dict[int, _Late] = {}  # by seq_id
        # What a first answer taken before the prefill appended, by seq_id, with its sequence: it
        # streams when the sequence's first step completes (or it ends), so that a stream never
        # shows forced text and then waits for the prompt's turn.
        self._held: dict[int, tuple[Sequence, list[Delta]]] = {}
        self.failure: str | None = None  # set when the runner failed for good
        self.requests: dict[int, Request] = {}
        self._request_ids = itertools.count()
        self._steps = 0  # steps completed (Usage.last_step)
        self._in_flight: deque[_Flight] = deque()
        self._busy: dict[int, _Flight] = {}  # seq_id -> the flight it is in
        self.spec = None  # the Speculator, set up by the first speculative request

    @property
    def max_forks(self) -> int:
        return self.config.max_forks

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    controller: Controller | None = None, limits: Limits | None = None,
                    trace: bool = False) -> Request:
        """Queue a request. The engine owns `controller` from here on (it is closed even if the
        request is refused). `limits`: the request's controller limits, whose progress budgets
        (steps and work per token, controller CPU per token) the engine enforces; default: the
        ABI's defaults. `trace`: record every Branch applied (engine/trace.py; its completions
        carry them)."""
        try:
            if self.failure is not None:
                raise RunnerFailure(self.failure)
            params = (params or SamplingParams()).validate()
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not prompt_ids:
                raise ValueError("the prompt is empty")
            if max(prompt_ids) >= self.model_config.vocab_size or min(prompt_ids) < 0:
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
            if len(prompt_ids) >= self.model_config.max_position:
                raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                 f"{self.model_config.max_position}")
            self.runner.capabilities.refuse(params)
            if params.speculative is not None:
                if self.spec is None:
                    from .speculative import Speculator

                    self.spec = Speculator(self)
                self.spec.check(params)  # a draft model that cannot be built refuses this request
            healing = plan_healing(self.tokenizer, prompt_ids) if params.token_healing else None
            if healing is not None:
                tell_healing(controller, healing)
        except BaseException:
            if controller is not None:
                controller.close()
            raise
        limits = limits or getattr(controller, "limits", None) or Limits()
        req = Request(next(self._request_ids), prompt_ids, params, limits)
        if trace:
            req.trace = []
        seq = Sequence(prompt_ids, params, np.random.default_rng(params.seed), req)
        seq.output = TextOutput(self.tokenizer, params.stop, healing.text if healing else "")
        seq.heal = healing.tokens if healing else 0
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        if controller is not None:
            seq.cursor = ControllerCursor(controller, prompt_ids)
            seq.cursor.started = self.calls.submit([(seq.seq_id, controller, *seq.cursor.call())])[seq.seq_id]
            seq.cursor.wait_until = time.perf_counter() + FIRST_ANSWER_WAIT
        return req

    def cancel(self, request_id: int) -> None:
        """Stop a request now; its KV blocks and controllers are released at once."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.cancelled = True
        for seq in req.seqs:
            self._held.pop(seq.seq_id, None)
            if not seq.finished:
                self.steering.finish(seq, "cancelled")
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight) or bool(self._late)

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        """Launch steps until `micro_batches` are in flight, then complete the oldest."""
        deltas: list[Delta] = []
        if self._late:
            self._take_late_answers(deltas, block=False)
        while len(self._in_flight) < self.config.micro_batches and self.failure is None:
            flight = self._launch_next(deltas)
            if flight is None:
                break
            self._in_flight.append(flight)
        if not self._in_flight and self._late:  # nothing can run until a late controller answers
            self._take_late_answers(deltas, block=True)
        while self._in_flight:
            self._complete(self._in_flight.popleft(), deltas)
            if self.failure is None:
                break
        if self._held:
            self._stream_held_of_ended(deltas)
        return deltas

    def _stream_held_of_ended(self, deltas: list[Delta]) -> None:
        """Held deltas of sequences that ended before their first step go out, before their end."""
        for seq_id, (seq, held) in list(self._held.items()):
            if seq.finished:
                del self._held[seq_id]
                at = next((i for i, d in enumerate(deltas) if (d.request_id, d.branch) == (seq.request_id, seq.branch)),
                          len(deltas))
                deltas[at:at] = held

    def _launch_next(self, deltas: list[Delta]) -> _Flight | None:
        busy, m = self._busy, self.config.micro_batches
        active = len(self.scheduler.running) + len(self.scheduler.waiting) - len(busy)
        limit = None if m == 1 else max(1, -(-active // m))
        if self.scheduler.waiting:
            self._take_first_answers(deltas)
        if self.spec is not None:  # speculative sequences draft the tokens this step verifies
            self.spec.propose(busy, limit)
        batch, unfit = self.scheduler.schedule(busy=busy, limit=limit)
        if self.spec is not None:
            self.spec.settle(batch, busy)
        for seq in unfit:
            deltas.append(self.steering.finish(seq, "error", f"the sequence ({len(seq)} tokens) does not fit "
                                               "in the KV cache"))
        if not batch:
            return None
        # Nothing else in flight and no other group to launch: a pipeline's stages take turns on
        # this step, so each may use all the cores.
        alone = self.runner.capabilities.shares_cores and not self._in_flight and (m == 1 or active <= 1)
        return self._launch(batch, alone, deltas)

    def _take_first_answers(self, deltas: list[Delta]) -> None:
        """Sequences still to be prefilled whose controller's first answer came (within
        FIRST_ANSWER_WAIT of the request's arrival) and needs no logits - a pure fast-forward, a
        stop, a failure, a backtrack - take it now; the fast-forward is then prefilled with the
        prompt, and a backtrack's sample (token healing) waits for the shorter prompt's prefill. Other
        answers wait for the prefill step, which takes the call as its own. (A slow first call
        holds up the steps once, for FIRST_ANSWER_WAIT at most, however long it stays queued.)"""
        started = [s for s in self.scheduler.waiting if s.cursor is not None and s.cursor.started is not None]
        if not started:
            return
        pending = [s.cursor.started for s in started if not s.cursor.started.done()]
        if pending:
            wait = max(s.cursor.wait_until for s in started) - time.perf_counter()
            if wait > 0:
                wait_futures(pending, timeout=wait)
        for seq in started:
            call = seq.cursor.started
            if not call.done():
                continue
            answer, secs = call.result()
            if isinstance(answer, list) and answer and (len(answer) > 1
                                                        or answer[0].samples and not answer[0].backtrack):
                continue  # it needs the prompt's logits
            seq.cursor.started = None
            seq.request.usage.controller_s += secs
            out: list[Delta] = []
            self.steering.apply_answer(seq, -1, answer, out, secs)  # samples nothing
            self._check_budgets({seq.request}, out)
            self._held.setdefault(seq.seq_id, (seq, []))[1].extend(out)

    def _launch(self, batch: list[ScheduledSeq], alone: bool, deltas: list[Delta]) -> _Flight | None:
        """Start the step: controllers in their threads, the forward pass here."""
        self.runner.copy_blocks(self.block_manager.take_copies())
        ready = [e.seq for e in batch if e.sample]
        # With a native decoder the calls start when the forward pass enters it (kernels.before_decoder)
        hold = self.runner.capabilities.native_decoder
        asking = [s for s in ready if s.cursor is not None and s.cursor.wants_call and s.draft is None]
        calls = self.calls.submit([(s.seq_id, s.cursor.controller, *s.cursor.call()) for s in asking
                                   if s.cursor.started is None], hold=hold)
        for s in asking:  # a first call started with the request is this step's
            if s.cursor.started is not None:
                calls[s.seq_id], s.cursor.started = s.cursor.started, None
        if hold and calls:
            kernels.before_decoder(self.calls.start_held)
        # (a drafted sequence's controller answered while drafting)
        early = None
        if self.runner.capabilities.sample_at_launch and not any(
                s.cursor is not None or s.draft is not None for s in ready):
            early = [(s.params, s.rng) for s in ready]
        # Controllers that keep a core busy get one: the model's kernels would otherwise use every
        # core and take their CPU (benchmarks/tenants.py; docs/performance.md, Threads).
        leave = 1 if self.calls.threads and self.calls.demand() > CONTROLLER_CORE_DEMAND else 0
        if self.config.model_threads is not None:
            leave = max(leave, torch.get_num_threads() - self.config.model_threads)
        kernels.leave_cores(leave)
        t0 = time.perf_counter()
        try:
            try:
                handle = self.runner.run(batch, alone, early)  # the controllers run meanwhile
            finally:
                if hold and kernels.take_before_decoder() is not None:  # the decoder did not run
                    self.calls.start_held()
        except RunnerFailure as e:
            wait_futures(calls.values())
            deltas.extend(self._fail_all(str(e)))
            return None
        flight = _Flight(batch, ready, calls, handle, t0, time.perf_counter() - t0)
        for entry in batch:
            self._busy[entry.seq.seq_id] = flight
        return flight

    def _complete(self, flight: _Flight, deltas: list[Delta]) -> None:
        """Take the controllers' answers, apply them, verify drafts, sample, append."""
        for entry in flight.batch:
            self._busy.pop(entry.seq.seq_id, None)
        try:
            if self.failure is None:
                self._apply(flight, deltas)
        except RunnerFailure as e:
            deltas.extend(self._fail_all(str(e)))
        finally:
            # Controllers of sequences that ended while this step was in flight: closed once their
            # call is over (now, or when a late one returns).
            for controller in flight.closing:
                _close_when_done(flight.calls.values(), controller)

    def _apply(self, flight: _Flight, deltas: list[Delta]) -> None:
        self._steps += 1
        self.scheduler.budget.observe(sum(e.num_tokens for e in flight.batch), flight.forward_s)
        for entry in flight.batch:
            held = self._held.pop(entry.seq.seq_id, None)
            if held is not None:  # its first step: what its first answer appended streams now
                deltas.extend(held[1])
            entry.seq.num_cached += entry.num_tokens
            # its full blocks computed now are the prefix cache's (registered once their data is written)
            self.block_manager.commit(entry.seq.seq_id, entry.seq.token_ids, entry.seq.num_cached)
            entry.seq.steps += entry.sample
            usage = entry.seq.request.usage
            if usage.last_step != self._steps:  # once per request, however many of its forks ran
                usage.last_step = self._steps
                usage.forward_s += flight.forward_s
        samples: list[Sample] = []
        rows = dict(zip((e.seq.seq_id for e in flight.batch if e.sample),
                        itertools.accumulate((e.logit_rows for e in flight.batch if e.sample), initial=0)))
        drafted = [s for s in flight.ready if s.draft is not None and not s.finished]
        if drafted:  # verify the drafts (their rows row, row + 1, ...), all rows fetched at once
            samples.extend(self.spec.verify(drafted, rows, partial(self.runner.logits, flight.handle), flight.launched,
                                            deltas))
        verified = {s.seq_id for s in drafted}
        late = self._late_calls(flight, verified)
        for seq in flight.ready:
            if seq.finished or seq.seq_id in verified or seq.seq_id in late:
                continue
            row = rows[seq.seq_id]
            if seq.cursor is None:
                samples.append(Sample(seq, row, None))
            elif not seq.cursor.wants_call:
                samples.append(Sample(seq, row, seq.cursor.take_deferred()))
            else:
                answer, secs = flight.calls[seq.seq_id].result()
                seq.request.usage.controller_s += secs
                samples.extend(self.steering.apply_answer(seq, row, answer, deltas, secs))
        if late:  # keep their rows; they sample when their answers come
            kept = self.runner.logits(flight.handle, [rows[i] for i in late])
            for j, (seq_id, seq) in enumerate(late.items()):
                self._late[seq_id] = _Late(seq, flight.calls[seq_id], kept[j:j + 1])
        samples = [s for s in samples if not s.seq.finished]  # a fork's request may have failed since
        if samples:
            self._sample(flight.handle, samples, deltas)
        elif flight.ready:
            self.runner.skip(flight.handle)
        self._check_budgets({e.seq.request for e in flight.batch}, deltas)

    def _late_calls(self, flight: _Flight, verified: set[int]) -> dict[int, Sequence]:
        """The sequences of this step whose controller is still running, when leaving them out
        lets something else go on (another sequence to run now or next); else wait for them."""
        pending = {s.seq_id: s for s in flight.ready
                   if s.seq_id in flight.calls and s.seq_id not in verified and not flight.calls[s.seq_id].done()}
        if not pending:
            return {}
        others = (len(self.scheduler.running) + len(self.scheduler.waiting)) - len(pending)
        if others > 0:
            return pending
        wait_futures([flight.calls[i] for i in pending])
        return {}

    def _take_late_answers(self, deltas: list[Delta], block: bool) -> None:
        """Apply the answers of late controllers that came, sampling from their kept rows."""
        if block:
            wait_futures([late.call for late in self._late.values()], timeout=1.0, return_when=FIRST_COMPLETED)
        for seq_id in [i for i, late in self._late.items() if late.call.done()]:
            # An answer applied before this one may have failed its request and so released this
            # sequence (a fork of the same request): it is gone from _late, its answer moot.
            late = self._late.pop(seq_id, None)
            if late is None:
                continue
            seq = late.seq
            answer, secs = late.call.result()
            seq.request.usage.controller_s += secs
            samples = [s for s in self.steering.apply_answer(seq, 0, answer, deltas, secs) if not s.seq.finished]
            if samples:  # every fork samples from the kept row (row 0 of it)
                rows = take_rows(late.logits, [0] * len(samples))
                self._sample(None, samples, deltas, kept=rows)
            self._check_budgets({seq.request}, deltas)

    def _check_budgets(self, requests, deltas: list[Delta]) -> None:
        for req in requests:
            if not req.finished:
                reason = over_budget(req)
                if reason is not None:
                    self.steering.fail_request(req, f"controller limit: {reason}", deltas)

    def _sample(self, handle, samples: list[Sample], deltas: list[Delta], kept: torch.Tensor | None = None) -> None:
        """Sample every Sample at once through the runner, or here from `kept` logits rows (a late
        sequence's, one per Sample)."""
        masks = [s.branch.mask if s.branch is not None else None for s in samples]
        params = [s.seq.params if s.seq.request.trace is None else sampler_params(s.seq.params)
                  for s in samples]  # a traced request's steps record the top alternatives
        # Penalties need each row's tokens (a runner that cannot apply them never gets such a row:
        # add_request refuses them by its capabilities).
        history = [(s.seq.token_ids, s.seq.num_prompt) if s.seq.params.penalized else None
                   for s in samples] if any(p.penalized for p in params) else None
        rngs = [s.seq.rng for s in samples]
        if kept is not None:
            out = self.sampler.sample(kept, params, rngs, masks, history)
        else:
            out = self.runner.sample(handle, [s.row for s in samples], params, rngs, masks, history)
        for s, token, logprob in zip(samples, out.tokens, out.logprobs):
            self.steering.take_sample(s.seq, s.branch, token, logprob, deltas)

    def _sequence_ended(self, seq: Sequence) -> None:
        """A sequence ended (Steering calls this): its controller and draft go."""
        if self.spec is not None:
            self.spec.forget(seq)
        cursor, seq.cursor = seq.cursor, None
        if cursor is None:
            return
        flight, late = self._busy.get(seq.seq_id), self._late.pop(seq.seq_id, None)
        if flight is not None:  # its mid_process may be running right now: close it after the join
            flight.closing.append(cursor.controller)
        elif late is not None:  # ... or it is a late one
            _close_when_done([late.call], cursor.controller)
        elif cursor.started is not None:  # ... or its first call, started with the request
            _close_when_done([cursor.started], cursor.controller)
        else:
            cursor.close()

    # -- what the speculator asks of the engine (speculative.EngineView) ------------------------

    def runnable(self, busy, limit: int | None = None) -> list[Sequence]:
        return self.scheduler.runnable(busy, limit)

    def headroom(self, running: list[Sequence]) -> Headroom:
        return self.scheduler.headroom(running)

    def call_controllers(self, calls: dict, inline: bool) -> dict:
        return self.calls.submit([(seq, seq.cursor.controller, *args) for seq, args in calls.items()], inline=inline)

    def new_draft_model(self) -> DraftModel:
        model = build_draft_model(self.config.draft_model, self.model)
        return DraftModel(model, self.block_manager.num_blocks, self.block_manager.block_size)

    def _fail_all(self, message: str) -> list[Delta]:
        """The runner is gone: every unfinished request ends with `message`."""
        self.failure = message
        deltas: list[Delta] = []
        for req in list(self.requests.values()):
            self.steering.fail_request(req, message, deltas)
        return deltas

    def close(self) -> None:
        """Release the runner (stops pipeline stages); the engine takes no more requests."""
        if self.failure is None:
            self.failure = "the engine is closed"
        while self._in_flight:
            flight = self._in_flight.popleft()
            wait_futures(flight.calls.values())
            for controller in flight.closing:
                controller.close()
        for late in self._late.values():
            late.call.result()
        self.calls.close()
        self.runner.close()

    # -- results -------------------------------------------------------------------------------

    def completions(self, req: Request) -> list[Completion]:
        stats = None if req.spec_stats is None else req.spec_stats.as_dict(sum(x.num_output for x in req.seqs))
        return [Completion(req.request_id, s.branch, s.output.text, s.output_ids, s.finish_reason or "",
                           len(req.prompt_ids), s.logprobs if s.params.logprobs is not None else None, s.error,
                           speculative=stats,
                           trace=None if req.trace is None else [t for t in req.trace if t.branch == s.branch],
                           cached_tokens=req.usage.cached_tokens)
                for s in req.seqs]

    def forget(self, req: Request) -> None:
        """Drop a finished request (its completions were read)."""
        self.requests.pop(req.request_id, None)


def _close_when_done(calls, controller) -> None:
    """Close `controller` once none of `calls` runs any more (it may be in one of them)."""
    pending = [c for c in calls if not c.done()]
    if not pending:
        controller.close()
        return
    left, lock = [len(pending)], threading.Lock()

    def done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            controller.close()

    for call in pending:
        call.add_done_callback(done)
