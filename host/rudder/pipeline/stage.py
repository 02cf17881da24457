"""A pipeline stage process: `python -m rudder.pipeline CONFIG_JSON` (spawned by the
coordinator), or `serve_stage()` called on ranks > 0 under torchrun.

A stage holds its layers and their KV cache and nothing else. Per step it receives the plan from
rank 0, the activations from the previous rank, runs its layers and passes the result on; the
last stage computes the sampling rows' logits, waits for the coordinator's sampling spec (masks,
params, uniforms), samples with the engine's own Sampler and sends the token ids back."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

from ..branch import mask_words
from ..engine.kv_cache import KVCache
from ..engine.sampler import Sampler, take_rows
from ..engine.step import StepArrays
from ..loading import load_config
from .partition import partition
from .protocol import (INLINE, OP_STOP, PLAN_WORDS, SPEC_COLS, PlanHeader, SpecHeader, decode_plan, encode_logprobs,
                       sampling_inputs)
from .stage_model import StageModel, build_stage_model
from .transport import ACT, PLAN, SPEC, TOKENS, Link, LinkError, connect, rank_device


def use_threads(n: int) -> None:
    """Torch threads for the next forward pass (a step that runs alone gets every stage's cores)."""
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)


class Stage:
    def __init__(self, model: StageModel, num_blocks: int, block_size: int, link: Link):
        cfg = model.cfg
        self.model, self.link, self.block_size = model, link, block_size
        self.rank, self.last = model.stage.index, model.stage.is_last
        self.device = model.rope_cos.device
        self.kv_cache = KVCache(cfg, num_blocks, block_size, self.device, num_layers=model.stage.num_layers,
                                dtype=model.act_dtype)
        self.sampler = Sampler(cfg.vocab_size) if self.last else None
        self.num_words = mask_words(cfg.vocab_size)

    def serve(self, store=None) -> None:
        link = self.link
        busy, first = 0.0, None
        while True:
            message = link.recv(PLAN_WORDS, torch.int64, 0, PLAN, forever=True).numpy()
            header = PlanHeader.of(message)
            size = header.payload_size()
            if header.op == OP_STOP:
                link.flush()
                if store is not None and first is not None:  # for the bubble measurement
                    store.set(f"stats/{self.rank}", json.dumps({"busy_s": busy, "wall_s": time.perf_counter() - first}))
                return
            payload = (message[PlanHeader.WORDS:PlanHeader.WORDS + size] if size <= INLINE
                       else link.recv(size, torch.int64, 0, PLAN).numpy())
            arrays, copies, spec = decode_plan(header, payload)
            link.step = header.step
            link.finish_sends(header.done)  # rank 0 has those steps' tokens: their sends were all received
            use_threads(header.threads)
            first = first or time.perf_counter()
            busy += self.step(arrays, copies, spec)

    @torch.inference_mode()
    def step(self, arrays: StepArrays, copies: list[tuple[int, int]], spec: np.ndarray | None) -> float:
        """Returns the seconds spent computing (not waiting)."""
        # While the previous stage computes: the attention metadata, and a spec that came with
        # the plan read into the sampler's arguments.
        _, positions, meta, sample_rows = arrays.tensors(self.block_size, self.device)
        inputs = sampling_inputs(spec, None) if spec is not None and self.last else None
        x = self.link.recv((len(arrays.slot_mapping), self.model.cfg.hidden_size), torch.float32, self.rank - 1, ACT)
        started = time.perf_counter()
        self.kv_cache.copy_blocks(copies)
        hidden = self.model(x, positions, meta, self.kv_cache.tensor)
        if not self.last:
            busy = time.perf_counter() - started
            self.link.send(hidden, self.rank + 1, ACT)
            return busy
        if not len(sample_rows):
            return time.perf_counter() - started
        logits = self.model.logits(hidden.index_select(0, sample_rows)).float()
        busy = time.perf_counter() - started
        return busy + self.sample(logits, inputs)

    def sample(self, logits: torch.Tensor, inputs: tuple | None) -> float:
        """Sample under the spec that came with the plan (`inputs`: unmasked), or under the next
        one of the SPEC stream (rank 0 sends it once the step's controllers are done), sending
        back the logits rows it asks for first (speculative verification)."""
        link = self.link
        while inputs is None:
            header = SpecHeader(*(int(v) for v in link.recv(SpecHeader.WORDS, torch.int64, 0, SPEC)))
            if header.fetch:
                rows = link.recv(header.fetch, torch.int64, 0, SPEC).to(logits.device)
                link.send(logits.index_select(0, rows).contiguous(), 0, TOKENS)
                continue
            if header.rows == 0:
                return 0.0
            spec = link.recv((header.rows, SPEC_COLS), torch.float64, 0, SPEC).numpy()
            masks = (link.recv((header.masks, self.num_words), torch.int32, 0, SPEC).numpy().view(np.uint32)
                     if header.masks else None)
            inputs = sampling_inputs(spec, masks)
        started = time.perf_counter()
        rows, params, uniforms, row_masks = inputs
        if rows != list(range(logits.shape[0])):
            logits = take_rows(logits, rows)
        out = self.sampler.sample(logits, params, uniforms, row_masks)
        link.send(torch.tensor(out.tokens, dtype=torch.int32), 0, TOKENS)
        extra = encode_logprobs(params, out)
        if extra is not None:
            link.send(torch.from_numpy(extra), 0, TOKENS)
        return time.perf_counter() - started


def _watch_parent() -> None:
    """Never outlive the coordinator (or torchrun's agent): exit when the parent goes away."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="rudder-stage-watchdog").start()


def serve_stage(spec: str, stages, rank: int, world: int, num_blocks: int, block_size: int, store, *,
                timeout: float, host: str | None = None, device: str = "cpu", local_rank: int | None = None,
                ready_key: str | None = None, dtype: str = "auto") -> None:
    """Build this rank's stage (weight precision `dtype`), join the group and serve steps until
    told to stop."""
    plan = partition(_num_layers(spec), stages)
    if len(plan) != world:
        raise ValueError(f"{len(plan)} pipeline stages but {world} ranks")
    dev = rank_device(device, rank if local_rank is None else local_rank)
    model = build_stage_model(spec, plan[rank], dev, dtype=dtype)
    if ready_key:
        store.set(ready_key, model.precision)  # the coordinator checks every stage holds its precision
    link = connect(store, rank, world, timeout, dev, host)
    Stage(model, num_blocks, block_size, link).serve(store)


def _num_layers(spec: str) -> int:
    return load_config(spec).num_layers


def main(argv: list[str]) -> int:
    from torch.distributed import TCPStore

    cfg = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl-C and stops us
    _watch_parent()
    torch.set_num_threads(cfg["threads"])
    rank = cfg["rank"]
    try:
        store = TCPStore(cfg["host"], cfg["port"], cfg["world"], is_master=False,
                         timeout=__import__("datetime").timedelta(seconds=cfg["timeout"]))
        serve_stage(cfg["model"], cfg["stages"], rank, cfg["world"], cfg["num_blocks"], cfg["block_size"], store,
                    timeout=cfg["timeout"], host=cfg["host"], device=cfg["device"], ready_key=f"ready/{rank}",
                    dtype=cfg["dtype"])
    except LinkError as e:
        print(f"rudder pipeline stage {rank}: {e}; exiting", file=sys.stderr)
        return 1
    except BaseException:
        print(f"rudder pipeline stage {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
