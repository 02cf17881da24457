"""The coordinator's side of a pipeline: `PipelineRunner` plays ModelRunner's role in the engine.

Rank 0 is both the coordinator (scheduler, block manager, controllers, every Branch decision)
and stage 0 (the embeddings and the first layers). `run(batch)` sends the step plan to every
other stage, computes stage 0 and passes the activations on; `sample(...)` sends the last stage
what to sample (rows, params, packed masks, the uniforms drawn here from each sequence's own
Generator) and receives one int32 per token. See docs/pipeline.md."""

from __future__ import annotations

import atexit
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import deque

import numpy as np
import torch

from ..omp import SHORT_OMP_SPIN
from ..branch import mask_words
from ..engine.kv_cache import KVCache
from ..engine.runner import Capabilities, RunnerFailure
from ..engine.sampler import SampleOutput
from ..engine.step import ScheduledSeq, StepArrays
from ..loading import load_config
from .partition import StageSpec, partition
from .protocol import SpecHeader, decode_logprobs, encode_plan, encode_spec, logprob_words, stop_message
from .stage import serve_stage, use_threads
from .stage_model import StageModel, build_stage_model
from .transport import ACT, PLAN, SPEC, TOKENS, Link, LinkError, connect, rank_device, torchrun_env


class PipelineError(RunnerFailure):
    """A stage died, timed out or failed: the requests in flight fail with this message."""


class _Step:
    def __init__(self, index: int, num_rows: int):
        self.index = index  # the step number in plans
        self.num_rows = num_rows
        self.open = num_rows > 0  # the last stage waits for a sampling spec
        self.early: list | None = None  # the params of its rows when its spec went out with the plan


class PipelineRunner:
    """The Runner (engine/runner.py) of a pipeline: rank 0's side."""

    # The last stage samples from a spec of temperature, top-k and top-p (pipeline/protocol.py).
    capabilities = Capabilities(verify_rows=True, sample_at_launch=True, shares_cores=True, logit_processing=False,
                                name="pipeline stages (the last stage samples)")

    def __init__(self, model: StageModel, num_blocks: int, block_size: int, link: Link,
                 children: list[subprocess.Popen] | None = None, threads_before: int | None = None,
                 threads: int | None = None, shared_threads: int | None = None, store=None):
        cfg = model.cfg
        self.model = model
        self.link = link
        self.store = store  # the rendezvous store, where stages leave their stats at exit
        self.block_size = block_size
        self.num_stages = model.stage.num_stages
        self.last = self.num_stages - 1
        self.vocab_size = cfg.vocab_size
        self.num_words = mask_words(cfg.vocab_size)
        self.kv_cache = KVCache(cfg, num_blocks, block_size, model.rope_cos.device, num_layers=model.stage.num_layers,
                                dtype=model.act_dtype)  # the activations' precision, as in ModelRunner
        self.children = children or []
        self.stage_precisions = [model.precision]  # every local stage's, once they have started
        self._copies: list[tuple[int, int]] = []
        self._open: deque[_Step] = deque()  # steps with rows: a spec still to send or tokens to take
        self.busy_s = 0.0  # time rank 0 spent computing stage 0 (for the bubble measurement)
        self.stats: dict[int, dict] = {}  # per-stage busy/wall seconds, filled in by close()
        self._steps = 0
        self._done = -1  # the last step whose tokens came back
        self._threads_before = threads_before
        # Torch threads per stage while steps overlap, and for a step that runs alone: then the
        # stages take turns, so on one machine each may use the cores of all (shared_threads).
        self.threads = threads or torch.get_num_threads()
        self.shared_threads = shared_threads or self.threads
        self.failure: str | None = None
        self.closed = False
        self._stop_watch = threading.Event()
        if self.children:
            threading.Thread(target=self._watch, daemon=True, name="rudder-pipeline-watchdog").start()
        atexit.register(_close_ref, weakref.ref(self))

    # -- the engine's runner interface ----------------------------------------------------------

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._copies.extend(copies)

    def run(self, batch: list[ScheduledSeq], alone: bool = False, early: list | None = None) -> _Step:
        self._check()
        arrays = StepArrays.of(batch)
        copies, self._copies = self._copies, []
        step = _Step(self._steps, len(arrays.sample_rows))
        try:
            self.link.step = step.index
            spec = self._early_spec(step, early) if step.open and early is not None else None
            threads = self.shared_threads if alone else self.threads
            message, payload = encode_plan(arrays, copies, step.index, self._done, threads, spec)
            self._send_plan(message, payload)
            self._steps += 1
            # Rank 0's own workers must yield soon once its part is done (see rudder/__init__.py).
            use_threads(threads if SHORT_OMP_SPIN else self.threads)
            started = time.perf_counter()
            with torch.inference_mode():
                self.kv_cache.copy_blocks(copies)
                input_ids, positions, meta, _ = arrays.tensors(self.block_size, self.kv_cache.device)
                hidden = self.model(input_ids, positions, meta, self.kv_cache.tensor)
            self.busy_s += time.perf_counter() - started
            self.link.send(hidden, 1, ACT)
            # The sends of steps whose tokens came back, forgotten while the other stages compute
            # (not once the tokens are in: that is on the step's path).
            self.link.finish_sends(self._done)
        except LinkError as e:
            self._fail(e)
        if step.open:
            self._open.append(step)
        return step

    def _send_plan(self, message, payload) -> None:
        for rank in range(1, self.num_stages):
            self.link.send(message, rank, PLAN)
            if payload is not None:
                self.link.send(payload, rank, PLAN)

    def _early_spec(self, step: _Step, early: list) -> np.ndarray:
        """A step none of whose sampling rows has a controller (the engine passes `early` only
        then) samples every row, unmasked, with params known now: its spec goes with the plan, so
        the last stage samples as soon as its logits are ready instead of waiting for the
        coordinator (which is computing stage 0 of the next micro-batch by then), and no message
        of its own is sent. The uniforms are drawn now from the sequences' own Generators: the
        same values the engine's sample call would draw (each draws once per sampled step, and a
        sequence is in one step in flight at most)."""
        step.early = [p for p, _ in early]
        return encode_spec(list(range(len(early))), step.early, [g for _, g in early], [None] * len(early),
                           self.num_words)[0]

    def _send_spec(self, spec: np.ndarray, packed: list) -> None:
        self.link.send(SpecHeader(len(spec), len(packed), 0).tensor(), self.last, SPEC)
        self.link.send(torch.from_numpy(spec), self.last, SPEC)
        if packed:
            self.link.send(torch.from_numpy(np.stack(packed).view(np.int32)), self.last, SPEC)

    def logits(self, step: _Step, rows: list[int]) -> torch.Tensor:
        """Rows of the step's logits, from the last stage (speculative verification): one round
        trip; the step's sampling spec follows later as usual."""
        self._check()
        if step.early is not None or not step.open:
            raise ValueError("this step's logits were sampled with its plan")
        self._drop_older(step)
        try:
            self.link.send(SpecHeader(0, 0, len(rows)).tensor(), self.last, SPEC)
            self.link.send(torch.tensor(rows, dtype=torch.int64), self.last, SPEC)
            return self.link.recv((len(rows), self.vocab_size), torch.float32, self.last, TOKENS).clone()
        except LinkError as e:
            self._fail(e)

    def sample(self, step: _Step, rows: list[int], params: list, rngs: list, masks: list,
               history: list | None = None) -> SampleOutput:
        """`history` is None: no row is penalized (`capabilities.logit_processing` is off, so the
        engine refuses such requests)."""
        if history is not None:
            raise ValueError("penalties are not available with pipeline stages")
        self._check()
        if step.early is not None:
            # The spec went out with the plan (every row, unmasked, uniforms drawn then): take
            # all its tokens and keep the rows asked for (fewer when a sequence finished since).
            if any(m is not None for m in masks) or any(step.early[r] is not p for r, p in zip(rows, params)):
                raise ValueError("a step sampled with its plan cannot take masks or other params")
            self._settle(step)
            out = self._take_tokens(step, step.early)
            return SampleOutput([out.tokens[r] for r in rows], [out.logprobs[r] for r in rows])
        spec = encode_spec(rows, params, rngs, masks, self.num_words)
        self._settle(step)
        try:
            self._send_spec(*spec)
        except LinkError as e:
            self._fail(e)
        return self._take_tokens(step, params)

    def _take_tokens(self, step: _Step, params: list) -> SampleOutput:
        """Receive one step's tokens (and logprobs where asked for) from the last stage."""
        try:
            tokens = self.link.recv(len(params), torch.int32, self.last, TOKENS).tolist()
            words = logprob_words(params)
            extra = self.link.recv(words, torch.float64, self.last, TOKENS).tolist() if words else []
            self._done = max(self._done, step.index)
        except LinkError as e:
            self._fail(e)
        return SampleOutput(tokens, decode_logprobs(params, tokens, extra))

    def _drop_older(self, step: _Step) -> None:
        """The last stage takes sampling specs, and sends tokens, in step order: older steps
        that were abandoned (an exception between run and sample) get an empty spec or have
        their tokens taken and dropped first."""
        while self._open and self._open[0] is not step:
            older = self._open.popleft()
            older.open = False
            self._drop(older)

    def _settle(self, step: _Step) -> None:
        self._drop_older(step)
        if self._open:
            self._open.popleft()
        step.open = False

    def skip(self, step: _Step) -> None:
        if not step.open:
            return
        self._settle(step)
        self._drop(step)

    def _drop(self, step: _Step) -> None:
        if step.early is not None:  # sampled anyway: take the tokens and drop them
            self._take_tokens(step, step.early)
            return
        try:
            self.link.send(SpecHeader(0, 0, 0).tensor(), self.last, SPEC)
        except LinkError as e:
            self._fail(e)

    # -- failure and shutdown ------------------------------------------------------------------

    def _check(self) -> None:
        if self.failure is not None:
            raise PipelineError(self.failure)
        if self.closed:
            raise PipelineError("the pipeline is closed")

    def _fail(self, error: BaseException) -> None:
        # A lost connection usually means a stage died: name it when it did (it may take a moment
        # for its exit to be seen).
        deadline = time.monotonic() + 0.5
        while self.failure is None and self.children and time.monotonic() < deadline:
            for rank, child in enumerate(self.children, start=1):
                if child.poll() is not None and self.failure is None:
                    self.failure = f"pipeline failed: stage {rank} (pid {child.pid}) {_exit_text(child.returncode)}"
            time.sleep(0.02)
        if self.failure is None:
            self.failure = f"pipeline failed: {error}"
        self.close(graceful=False)
        raise PipelineError(self.failure) from error

    def _watch(self) -> None:
        """A stage that exits takes the whole pipeline down at once: the others are killed, so
        every wait on them fails now rather than at its timeout."""
        while not self._stop_watch.wait(0.1):
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None:
                    if self.failure is None and not self.closed:
                        self.failure = f"pipeline failed: stage {rank} (pid {child.pid}) {_exit_text(code)}"
                    self._kill_children()
                    return

    def _kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self, graceful: bool = True) -> None:
        """Stop every stage (a stop message, then a kill for any that lingers); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop_watch.set()
        if graceful and self.failure is None:
            try:
                stop = stop_message()
                while self._open:
                    self.skip(self._open[0])
                for rank in range(1, self.num_stages):
                    self.link.send(stop, rank, PLAN)
                self.link.flush()
            except (LinkError, PipelineError):
                pass
            deadline = time.monotonic() + 5
            for child in self.children:
                try:
                    child.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._read_stats()
        self._kill_children()
        try:
            self.link.group.abort() if not graceful else self.link.group.shutdown()
        except Exception:
            pass
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def _read_stats(self) -> None:
        store = self.store
        for rank in range(1, self.num_stages):
            try:
                if store is not None and store.check([f"stats/{rank}"]):
                    self.stats[rank] = json.loads(store.get(f"stats/{rank}"))
            except Exception:
                pass

    def __del__(self):
        try:
            self.close(graceful=False)
        except Exception:
            pass


def _exit_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _close_ref(ref) -> None:
    runner = ref()
    if runner is not None:
        runner.close(graceful=False)


# -- starting a pipeline ---------------------------------------------------------------------------


def launch_stage(config: dict) -> subprocess.Popen:
    """One local stage: `python -m rudder.pipeline CONFIG_JSON` (stage.py). The runner needs only
    what Popen offers of it: pid, poll, wait, kill, returncode."""
    return subprocess.Popen([sys.executable, "-m", "rudder.pipeline", json.dumps(config)], stdin=subprocess.DEVNULL)


def start_pipeline(spec: str, stages: int | list[int], *, kv_cache_tokens: int, block_size: int,
                   device: str = "cpu", threads: int | None = None, timeout: float = 60.0,
                   startup_timeout: float = 300.0, dtype: str = "auto"):
    """Load stage 0 here and return `(stage-0 model, factory)`; `factory(num_blocks, block_size)`
    starts the other stages and returns the PipelineRunner. Every stage holds its layers in the
    weight precision stage 0 resolved `dtype` to (rudder/precision.py).

    Launched by torchrun (RANK/WORLD_SIZE/MASTER_ADDR set), ranks > 0 serve their stage right
    here and then exit the process; only rank 0 returns."""
    cfg = load_config(spec)
    plan = partition(cfg.num_layers, stages)
    world = len(plan)
    env = torchrun_env()
    if env is not None:
        return _join_torchrun(spec, stages, plan, env, kv_cache_tokens, block_size, device, timeout, dtype)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    threads_before = torch.get_num_threads()
    dev = rank_device(device, 0)
    for rank in range(1, world):
        rank_device(device, rank)  # every local stage has its GPU (fail here, not in a child)
    model = build_stage_model(spec, plan[0], dev, dtype=dtype)

    def factory(num_blocks: int, bs: int) -> PipelineRunner:
        from torch.distributed import TCPStore

        host = "127.0.0.1"
        store = TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=startup_timeout))
        children = []
        try:
            for rank in range(1, world):
                config = {"model": spec, "stages": stages, "rank": rank, "world": world, "host": host,
                          "port": store.port, "num_blocks": num_blocks, "block_size": bs, "threads": threads,
                          "timeout": timeout, "device": device, "dtype": model.precision}
                children.append(launch_stage(config))
            deadline = time.monotonic() + startup_timeout
            while not store.check([f"ready/{r}" for r in range(1, world)]):
                for rank, child in enumerate(children, start=1):
                    if child.poll() is not None:
                        raise PipelineError(f"pipeline stage {rank} failed to start (exit code {child.returncode})")
                if time.monotonic() > deadline:
                    raise PipelineError(f"pipeline stages did not start within {startup_timeout:g} s")
                time.sleep(0.05)
            precisions = [model.precision, *(store.get(f"ready/{r}").decode() for r in range(1, world))]
            if len(set(precisions)) != 1:
                raise PipelineError(f"pipeline stages hold different weight precisions: {precisions}")
            link = connect(store, 0, world, timeout, dev, host)
        except BaseException:
            for child in children:
                child.kill()
                child.wait()
            raise
        torch.set_num_threads(threads)
        # The local stages share this machine's cores.
        runner = PipelineRunner(model, num_blocks, bs, link, children, threads_before, threads, threads * world, store)
        runner.stage_precisions = precisions
        return runner

    return model, factory


def _join_torchrun(spec, stages, plan: list[StageSpec], env, kv_cache_tokens, block_size, device, timeout, dtype):
    import torch.distributed as dist

    rank, world = env
    if world != len(plan):
        raise ValueError(f"torchrun started {world} processes for {len(plan)} pipeline stages")
    store, _, _ = next(dist.rendezvous("env://", rank, world))
    if rank == 0:  # rank 0 sizes every stage's KV cache (a size from memory differs from host to host)
        store.set("rudder/kv_cache_tokens", str(kv_cache_tokens))
    num_blocks = max(1, int(store.get("rudder/kv_cache_tokens")) // block_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if rank != 0:
        try:
            serve_stage(spec, stages, rank, world, num_blocks, block_size, store, timeout=timeout, device=device,
                        local_rank=local_rank, dtype=dtype)
        except LinkError as e:
            print(f"rudder pipeline stage {rank}: {e}; exiting", file=sys.stderr)
            raise SystemExit(1)
        raise SystemExit(0)
    dev = rank_device(device, local_rank)
    model = build_stage_model(spec, plan[0], dev, dtype=dtype)

    def factory(nb: int, bs: int) -> PipelineRunner:
        return PipelineRunner(model, nb, bs, connect(store, 0, world, timeout, dev))

    return model, factory
