"""The engine loop: schedule, forward, sample, stream - for many concurrent requests.

Per step:
  1. the scheduler picks the batch (and the KV slots for its tokens);
  2. each sequence that samples this step has its *step hook* started in a thread pool, so it
     runs while the model computes the logits (this is where controllers plug in);
  3. one forward pass over the ragged batch;
  4. the sampler waits only for the hooks' masks, then samples every row at once;
  5. each sequence appends its token, checks stop conditions, and emits a text delta.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence, SeqStatus

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

# Called once per sampling step per sequence, concurrently with the forward pass; returns the
# allowed-token bitmask (uint32 words) for that step, or None for no constraint.
StepHook = Callable[[Sequence], "np.ndarray | None"]


@dataclass
class Delta:
    """What one step added to one sequence of a request."""

    request_id: int
    branch: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    logprobs: list[dict] = field(default_factory=list)
    error: str | None = None  # what went wrong, when finish_reason is "error"


@dataclass
class Completion:
    """The final result of one sequence of a request."""

    request_id: int
    branch: int
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[dict] | None = None
    error: str | None = None


class _Output:
    """Text bookkeeping for one sequence: detokenization and stop strings.

    Text that could still turn out to begin a stop string is held back from the stream until it
    is decided, so a client never sees text that is later cut."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Returns the new text that is safe to stream and whether a stop string was hit."""
        self.text += self.decoder.push(token_ids)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold), False

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted: upto], upto
        return delta


class Request:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, step_hook: StepHook | None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.step_hook = step_hook
        self.seqs: list[Sequence] = []
        self.outputs: dict[int, _Output] = {}  # by seq_id
        self.cancelled = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, *, kv_cache_tokens: int = 16384, block_size: int = 16,
                 max_batch_tokens: int = 512, max_seqs: int = 64, hook_threads: int = 2):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, max_seqs)
        self.sampler = Sampler(model.cfg.vocab_size)
        self.hook_pool = ThreadPoolExecutor(max_workers=hook_threads, thread_name_prefix="rudder-hook")
        self.requests: dict[int, Request] = {}
        self._request_ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    step_hook: StepHook | None = None) -> Request:
        params = (params or SamplingParams()).validate()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max(prompt_ids) >= self.cfg.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if len(prompt_ids) >= self.cfg.max_position:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.cfg.max_position}")
        req = Request(next(self._request_ids), prompt_ids, params, step_hook)
        rng = np.random.default_rng(params.seed)
        seq = Sequence(prompt_ids, params, rng, req.request_id)
        req.seqs.append(seq)
        req.outputs[seq.seq_id] = _Output(self.tokenizer, params.stop)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req

    def cancel(self, request_id: int) -> None:
        """Stop a request now; its KV blocks return to the pool at once."""
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
        batch, unfit = self.scheduler.schedule()
        for seq in unfit:
            deltas.append(self._finish_delta(seq, "error", f"the sequence ({len(seq)} tokens) does not fit in the KV cache"))
        if not batch:
            return deltas
        self.runner.copy_blocks(self.block_manager.take_copies())

        sampling = [e.seq for e in batch if e.sample]
        hooks = {}
        for seq in sampling:
            hook = self.requests[seq.request_id].step_hook
            if hook is not None:
                hooks[seq.seq_id] = self.hook_pool.submit(hook, seq)

        logits = self.runner.run(batch)
        for entry in batch:
            entry.seq.num_cached += entry.num_tokens
        if not sampling:
            return deltas

        masks = []
        for seq in sampling:
            future = hooks.get(seq.seq_id)
            masks.append(None if future is None else future.result())
        out = self.sampler.sample(logits, [s.params for s in sampling], [s.rng for s in sampling], masks)
        for seq, token, logprob in zip(sampling, out.tokens, out.logprobs):
            deltas.append(self._accept(seq, token, logprob))
        return deltas

    def _accept(self, seq: Sequence, token: int, logprob: dict | None) -> Delta:
        params, output = seq.params, self.requests[seq.request_id].outputs[seq.seq_id]
        if token < 0:
            return self._finish_delta(seq, "error", "the sample mask allowed no token")
        if token in self.tokenizer.stop_token_ids and not params.ignore_eos:
            return self._finish_delta(seq, "stop")
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        text, hit_stop = output.add([token])
        delta = Delta(seq.request_id, seq.branch, text, [token], logprobs=[logprob] if logprob else [])
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
        self.scheduler.remove(seq)

    def _finish_delta(self, seq: Sequence, reason: str, error: str | None = None) -> Delta:
        self._finish(seq, reason, error)
        text = self.requests[seq.request_id].outputs[seq.seq_id].finish()
        return Delta(seq.request_id, seq.branch, text, [], True, reason, error=error)

    # -- results -------------------------------------------------------------------------------

    def completions(self, req: Request) -> list[Completion]:
        return [
            Completion(req.request_id, s.branch, req.outputs[s.seq_id].text, s.output_ids, s.finish_reason or "",
                       len(req.prompt_ids), s.logprobs if s.params.logprobs is not None else None, s.error)
            for s in req.seqs
        ]

    def release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
