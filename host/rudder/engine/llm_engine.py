"""The engine loop: schedule, forward, sample, stream - for many concurrent requests.

Per step:
  1. the scheduler picks the batch (and the KV slots for its tokens);
  2. each sequence that samples this step and has a controller gets its `mid_process` call
     started in a thread pool, so it runs while the model computes the logits;
  3. one forward pass over the ragged batch;
  4. the controllers' Branch records are applied (`_apply_branch`: backtrack, fork,
     fast-forward), and every row that samples is sampled at once under its mask;
  5. each sequence appends its tokens, checks stop conditions, and emits a text delta.
The Branch semantics (stale logits after a backtrack, forks, ff lists) are those of docs/abi.md.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..branch import Branch
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .output import Completion, Delta, TextOutput, Usage
from .sequence import SamplingParams, Sequence, SeqStatus

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


class Controller(Protocol):
    """What the engine needs of a controller (the Wasm one, or a Python one in tests)."""

    def mid_process(self, branch_idx: int, backtrack: int, tokens: list[int]) -> list[Branch]: ...

    def fork(self) -> "Controller": ...

    def close(self) -> None: ...


class RunnerFailure(RuntimeError):
    """The model runner itself failed (a pipeline stage died or timed out): every request in
    flight ends with this error, and the engine takes no more requests."""


class InvalidBranch(ValueError):
    """A Branch the sequence cannot take (too long a backtrack, an empty fast-forward...)."""


class Request:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[Sequence] = []
        self.outputs: dict[int, TextOutput] = {}  # by seq_id
        self.cancelled = False
        self.error: str | None = None
        self.usage = Usage()
        self.spec_stats = None  # speculative.SpecStats of a speculative request

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def live(self) -> int:
        return sum(not s.finished for s in self.seqs)


@dataclass
class _Sample:
    """A row to sample this step: which sequence, which logits row, and its Branch (if any)."""

    seq: Sequence
    row: int
    branch: Branch | None


@dataclass
class _InFlight:
    """A launched step: its batch, the sequences that sample, their controller tasks, and the
    runner's logits (or, in a pipeline, its handle on them)."""

    batch: list
    ready: list[Sequence]
    tasks: list
    logits: object
    forward_s: float = 0.0


def _run_calls(calls) -> list:
    """Run mid_process calls `(key, controller, branch_idx, backtrack, tokens)` in order; each
    answer is (key, a Branch list or the exception raised, seconds taken)."""
    answers = []
    for key, controller, branch_idx, backtrack, tokens in calls:
        t0 = time.perf_counter()
        try:
            answer = controller.mid_process(branch_idx, backtrack, tokens)
        except Exception as e:
            answer = e
        answers.append((key, answer, time.perf_counter() - t0))
    return answers


class Engine:
    def __init__(self, model, tokenizer: "Tokenizer", *, kv_cache_tokens: int = 16384, block_size: int = 16,
                 max_batch_tokens: int = 512, max_seqs: int = 64, max_forks: int = 16, controller_threads: int = 2,
                 runner_factory=None, draft_model="int8"):
        """`runner_factory(num_blocks, block_size)` builds the model runner (default: a local
        ModelRunner; `rudder.pipeline.PipelineRunner` shards the model over processes).
        `draft_model`: the draft of requests with speculative="draft" (engine/drafts.py), built on
        first use."""
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.runner = (runner_factory or (lambda n, b: ModelRunner(model, n, b)))(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, max_seqs)
        self.sampler: Sampler | None = getattr(self.runner, "sampler", None)
        self.failure: str | None = None  # set when the runner failed for good
        self.max_forks = max_forks
        self.controller_threads = controller_threads
        self.pool = (ThreadPoolExecutor(max_workers=controller_threads, thread_name_prefix="rudder-controller")
                     if controller_threads > 0 else None)
        self.requests: dict[int, Request] = {}
        self._request_ids = itertools.count()
        self._steps = 0  # steps completed (Usage.last_step)
        # Speculative decoding (engine/speculative.py), set up by the first request that asks.
        self.draft_model = draft_model
        self.spec = None

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    controller: Controller | None = None) -> Request:
        """Queue a request. The engine owns `controller` from here on (it is closed even if the
        request is refused)."""
        try:
            if self.failure is not None:
                raise RunnerFailure(self.failure)
            params = (params or SamplingParams()).validate()
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not prompt_ids:
                raise ValueError("the prompt is empty")
            if max(prompt_ids) >= self.cfg.vocab_size or min(prompt_ids) < 0:
                raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
            if len(prompt_ids) >= self.cfg.max_position:
                raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                 f"{self.cfg.max_position}")
            if params.speculative is not None:
                if self.spec is None:
                    from .speculative import Speculator

                    self.spec = Speculator(self)
                self.spec.check(params)  # a draft model that cannot be built refuses this request
        except BaseException:
            if controller is not None:
                controller.close()
            raise
        req = Request(next(self._request_ids), prompt_ids, params)
        seq = Sequence(prompt_ids, params, np.random.default_rng(params.seed), req.request_id)
        seq.controller = controller
        seq.usage = req.usage
        req.seqs.append(seq)
        req.outputs[seq.seq_id] = TextOutput(self.tokenizer, params.stop)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req

    def cancel(self, request_id: int) -> None:
        """Stop a request now; its KV blocks and controllers are released at once."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.cancelled = True
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, "cancelled")
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        deltas: list[Delta] = []
        if self.spec is not None:  # speculative requests get draft tokens to verify in this step
            self.spec.propose(deltas)
        batch, unfit = self.scheduler.schedule()
        if self.spec is not None:
            batch = self.spec.settle(batch, deltas)
        self._fail_unfit(unfit, deltas)
        if not batch:
            return deltas
        flight = self._launch(batch, deltas)
        if flight is not None:
            self._complete(flight, deltas)
        return deltas

    def _fail_unfit(self, unfit: list[Sequence], deltas: list[Delta]) -> None:
        for seq in unfit:
            deltas.append(self._finish_delta(seq, "error", f"the sequence ({len(seq)} tokens) does not fit in the KV cache"))

    def _launch(self, batch: list, deltas: list[Delta]) -> "_InFlight | None":
        """Start the step: controllers in their threads, the forward pass here."""
        self.runner.copy_blocks(self.block_manager.take_copies())
        ready = [e.seq for e in batch if e.sample]
        tasks = self._start_controllers([s for s in ready if s.controller is not None and s.deferred is None
                                         and s.draft is None])  # a draft's controller answered while drafting
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(batch)  # the controllers run meanwhile
        except RunnerFailure as e:
            for task in tasks:
                task.result()
            deltas.extend(self._fail_all(str(e)))
            return None
        return _InFlight(batch, ready, tasks, logits, time.perf_counter() - t0)

    def _complete(self, flight: "_InFlight", deltas: list[Delta]) -> None:
        """Join the controllers, apply their Branch records, sample, append."""
        self._steps += 1
        for entry in flight.batch:
            entry.seq.num_cached += entry.num_tokens
            usage = entry.seq.usage
            if usage.last_step != self._steps:  # once per request, however many of its forks ran
                usage.last_step = self._steps
                usage.forward_s += flight.forward_s
        answers = {seq_id: (answer, secs) for task in flight.tasks for seq_id, answer, secs in task.result()}  # all done before any is closed

        samples: list[_Sample] = []
        rows = itertools.accumulate((e.logit_rows for e in flight.batch if e.sample), initial=0)
        for seq, row in zip(flight.ready, rows):
            if seq.finished:  # its request failed earlier in this loop
                continue
            if seq.draft is not None:  # verify its draft tokens (rows row, row + 1, ...)
                samples.extend(self.spec.verify(seq, flight.logits, row, deltas))
            elif seq.controller is None:
                samples.append(_Sample(seq, row, None))
            elif seq.deferred is not None:
                branch, seq.deferred = seq.deferred, None
                samples.append(_Sample(seq, row, branch))
            else:
                answer, secs = answers[seq.seq_id]
                seq.usage.controller_s += secs
                samples.extend(self._take_branches(seq, row, answer, deltas))
        try:
            if samples:
                deltas.extend(self._sample(flight.logits, samples))
            elif flight.ready:
                self.runner.skip(flight.logits)
        except RunnerFailure as e:
            deltas.extend(self._fail_all(str(e)))

    def _fail_all(self, message: str) -> list[Delta]:
        """The runner is gone: every unfinished request ends with `message`."""
        self.failure = message
        deltas: list[Delta] = []
        for req in list(self.requests.values()):
            self._fail_request(req, message, deltas)
        return deltas

    def close(self) -> None:
        """Release the runner (stops pipeline stages); the engine takes no more requests."""
        if self.failure is None:
            self.failure = "the engine is closed"
        self.runner.close()

    def _start_controllers(self, seqs: list[Sequence]) -> list:
        """Submit this step's mid_process calls, one pool task per worker thread (not per
        sequence): on a CPU host every thread wake-up competes with torch's own threads."""
        calls = []
        for seq in seqs:
            tokens, seq.ctl_append = seq.ctl_append, []
            backtrack, seq.ctl_backtrack = seq.ctl_backtrack, 0
            calls.append((seq.seq_id, seq.controller, seq.ctl_branch, backtrack, tokens))
        return self.submit_calls(calls)

    def submit_calls(self, calls: list) -> list:
        """Futures of `_run_calls` over `calls`, split over the controller threads."""
        if self.pool is None:  # controller_threads=0: run them here, before the forward pass
            done = Future()
            done.set_result(_run_calls(calls))
            return [done]
        n = min(self.controller_threads, len(calls))
        return [self.pool.submit(_run_calls, calls[i::n]) for i in range(n)]

    def _take_branches(self, seq: Sequence, row: int, answer, deltas: list[Delta]) -> list[_Sample]:
        """Apply a controller's answer; returns the rows that sample now."""
        req = self.requests[seq.request_id]
        try:
            if isinstance(answer, BaseException):
                raise answer
            branches = answer
            if not branches:
                deltas.append(self._finish_delta(seq, "stop"))
                return []
            if req.live + len(branches) - 1 > self.max_forks:
                raise InvalidBranch(f"{len(branches)} branches would exceed {self.max_forks} live sequences")
            forks = [seq] + [self._fork(seq, req, deltas) for _ in branches[1:]]
            samples = []
            for k, (s, branch) in enumerate(zip(forks, branches)):
                s.ctl_branch = k if len(branches) > 1 else 0
                if self._apply_branch(s, branch, deltas):
                    samples.append(_Sample(s, row, branch))
            return samples
        except Exception as e:  # a controller's failure ends its own request, nothing else
            kind = getattr(e, "kind", None) or ("invalid_branch" if isinstance(e, InvalidBranch) else "error")
            self._fail_request(req, f"controller {kind}: {e}", deltas)
            return []

    def _fork(self, parent: Sequence, req: Request, deltas: list[Delta]) -> Sequence:
        child = Sequence(parent.token_ids, parent.params, parent.rng.spawn(1)[0], req.request_id, branch=len(req.seqs))
        child.num_prompt, child.num_cached = parent.num_prompt, parent.num_cached
        child.ctl_append, child.ctl_backtrack = list(parent.ctl_append), parent.ctl_backtrack
        child.controller = parent.controller.fork()
        child.usage = parent.usage
        req.usage.forks += 1
        self.block_manager.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)
        req.outputs[child.seq_id] = req.outputs[parent.seq_id].fork(child.output_ids)
        self.scheduler.add_running(child)
        deltas.append(Delta(req.request_id, child.branch, "", []))  # announces the fork before any text
        return child

    def _apply_branch(self, seq: Sequence, branch: Branch, deltas: list[Delta]) -> bool:
        """Backtrack and fast-forward; True when the sequence samples from this step's logits."""
        n = branch.backtrack
        if branch.mask is None and len(branch.ff) > 1:
            raise InvalidBranch("several fast-forward lists need a mask")
        if branch.mask is not None and any(not ff for ff in branch.ff):
            raise InvalidBranch("fast-forward lists under a mask must not be empty")
        appends = [] if branch.samples else branch.ff[0]
        if not 0 <= n <= len(seq) or (n == len(seq) and not appends):
            raise InvalidBranch(f"cannot backtrack {n} of {len(seq)} tokens and keep a non-empty sequence")
        if not branch.samples and not appends and n == 0:
            raise InvalidBranch("a branch must sample, fast-forward or backtrack")
        if n:
            self._backtrack(seq, n, deltas)
            if not appends:
                # Stale logits: drop one more position and re-feed it, then sample (docs/abi.md).
                self.block_manager.pop(seq.seq_id, 1)
                seq.num_cached -= 1
                seq.deferred = branch if branch.samples else None
                return False
        if appends:
            seq.usage.ff_tokens += len(appends)
            deltas.append(self._append(seq, list(appends)))
            return False
        return True

    def _backtrack(self, seq: Sequence, n: int, deltas: list[Delta]) -> None:
        del seq.token_ids[len(seq.token_ids) - n:]
        self.block_manager.pop(seq.seq_id, n)
        seq.num_cached -= n
        seq.num_prompt = min(seq.num_prompt, len(seq.token_ids))
        unreported = min(n, len(seq.ctl_append))  # appended since the last call: just forget them
        del seq.ctl_append[len(seq.ctl_append) - unreported:]
        seq.ctl_backtrack += n - unreported
        del seq.logprobs[max(0, len(seq.logprobs) - n):]
        chars = self.requests[seq.request_id].outputs[seq.seq_id].pop(n)
        deltas.append(Delta(seq.request_id, seq.branch, "", [], backtrack_chars=chars, backtrack_tokens=n))

    def _sample(self, logits, samples: list[_Sample]) -> list[Delta]:
        masks = [s.branch.mask if s.branch is not None else None for s in samples]
        out = self.runner.sample(logits, [s.row for s in samples], [s.seq.params for s in samples],
                                 [s.seq.rng for s in samples], masks)
        deltas = []
        for s, token, logprob in zip(samples, out.tokens, out.logprobs):
            seq = s.seq
            if token < 0:
                deltas.append(self._finish_delta(seq, "error", "the sample mask allowed no token"))
                continue
            if token in self.tokenizer.stop_token_ids and not seq.params.ignore_eos:
                deltas.append(self._finish_delta(seq, "stop"))
                continue
            tokens = [token]
            if s.branch is not None:
                tokens = next((ff for ff in s.branch.ff if ff[0] == token), tokens)
            if logprob is not None:
                seq.logprobs.append(logprob)
            seq.usage.sampled_tokens += 1
            seq.usage.ff_tokens += len(tokens) - 1
            deltas.append(self._append(seq, list(tokens), [logprob] if logprob else []))
        return deltas

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None = None) -> Delta:
        """Append tokens (sampled and/or fast-forwarded), stream their text, check the stops."""
        params, output = seq.params, self.requests[seq.request_id].outputs[seq.seq_id]
        room = params.max_tokens - seq.num_output
        tokens = tokens[: max(room, 0)]
        seq.token_ids.extend(tokens)
        seq.ctl_append.extend(tokens)
        text, hit_stop = output.add(tokens)
        delta = Delta(seq.request_id, seq.branch, text, tokens, logprobs=logprobs or [])
        reason = None
        if hit_stop:
            reason = "stop"
        elif seq.num_output >= params.max_tokens or len(seq) >= self.cfg.max_position:
            reason = "length"
        if reason:
            self._finish(seq, reason)
            delta.text += output.finish() if not hit_stop else ""
            delta.finished, delta.finish_reason = True, reason
        return delta

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.deferred = None
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq)
        if seq.controller is not None:
            seq.controller.close()

    def _finish_delta(self, seq: Sequence, reason: str, error: str | None = None) -> Delta:
        self._finish(seq, reason, error)
        text = self.requests[seq.request_id].outputs[seq.seq_id].finish()
        return Delta(seq.request_id, seq.branch, text, [], True, reason, error=error)

    def _fail_request(self, req: Request, message: str, deltas: list[Delta]) -> None:
        req.error = message
        for s in req.seqs:
            if not s.finished:
                deltas.append(self._finish_delta(s, "error", message))

    # -- results -------------------------------------------------------------------------------

    def completions(self, req: Request) -> list[Completion]:
        return [
            Completion(req.request_id, s.branch, req.outputs[s.seq_id].text, s.output_ids, s.finish_reason or "",
                       len(req.prompt_ids), s.logprobs if s.params.logprobs is not None else None, s.error,
                       speculative=None if req.spec_stats is None
                       else req.spec_stats.as_dict(sum(x.num_output for x in req.seqs)))
            for s in req.seqs
        ]

    def release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
