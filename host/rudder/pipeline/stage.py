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

from ..engine.model_runner import StepArrays
from ..engine.sampler import Sampler
from ..engine.sequence import SamplingParams
from .partition import partition
from .stage_model import StageModel, build_stage_model
from .transport import ACT, PLAN, SPEC, TOKENS, Link, LinkError, connect, rank_device

OP_STOP, OP_STEP = 0, 1
# op, B, T, table blocks, copies, sample rows, step, the last step whose tokens rank 0 has, torch
# threads for the step, and the rows of a sampling spec that came with the plan (0: it follows on
# the SPEC stream)
HEADER = 10
# A plan message is the header plus up to this many payload words, so a small step (a few
# sequences decoding) is one message: every message on the step's path costs a wake-up of the
# receiving process. A larger payload follows as a second message.
INLINE = 118
PLAN_WORDS = HEADER + INLINE
SPEC_COLS = 7  # row, top_k, logprobs (-1: none), mask index (-1: none), temperature, top_p, uniform


class FixedUniform:
    """Stands in for a sequence's Generator on the last stage: the coordinator drew the uniform."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def encode_plan(arrays: StepArrays, copies: list[tuple[int, int]], step: int, done: int, threads: int,
                spec: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plan message (header and, when it fits, the payload) and the payload message when it
    does not fit; `spec`: the step's sampling spec when it is known at launch (float64 rows,
    carried bit for bit in the int64 payload)."""
    copies_arr = np.asarray(copies, dtype=np.int64).reshape(-1)
    spec_arr = np.zeros(0, dtype=np.int64) if spec is None else np.ascontiguousarray(spec, np.float64).view(np.int64)
    header = [OP_STEP, len(arrays.counts), len(arrays.slot_mapping), arrays.tables.shape[1], len(copies),
              len(arrays.sample_rows), step, done, threads, 0 if spec is None else len(spec)]
    payload = np.concatenate([arrays.counts, arrays.starts, arrays.slot_mapping, arrays.tables.reshape(-1),
                              copies_arr, arrays.sample_rows, spec_arr.reshape(-1)])
    message = np.zeros(PLAN_WORDS, dtype=np.int64)
    message[:HEADER] = header
    if len(payload) <= INLINE:
        message[HEADER:HEADER + len(payload)] = payload
        return torch.from_numpy(message), None
    return torch.from_numpy(message), torch.from_numpy(payload)


def stop_message() -> torch.Tensor:
    message = torch.zeros(PLAN_WORDS, dtype=torch.int64)
    message[0] = OP_STOP
    return message


def decode_plan(header: np.ndarray, payload: np.ndarray):
    """(StepArrays, copies, the spec that came with the plan or None), as views of `payload`."""
    _, B, T, NTB, C, R, _, _, _, S = header.tolist()
    tables, copies = 2 * B + T, 2 * B + T + B * NTB
    rows = copies + 2 * C
    arrays = StepArrays(payload[:B], payload[B:2 * B], payload[2 * B:tables], payload[tables:copies].reshape(B, NTB),
                        payload[rows:rows + R])
    return (arrays, [(a, b) for a, b in payload[copies:rows].reshape(C, 2).tolist()],
            payload[rows + R:rows + R + S * SPEC_COLS].view(np.float64).reshape(S, SPEC_COLS) if S else None)


def plan_size(header: np.ndarray) -> int:
    _, B, T, NTB, C, R, _, _, _, S = header[:HEADER].tolist()
    return 2 * B + T + B * NTB + 2 * C + R + S * SPEC_COLS


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
        self.kv_cache = torch.zeros(model.stage.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=torch.float32, device=self.device)
        self.sampler = Sampler(cfg.vocab_size) if self.last else None
        self.num_words = (cfg.vocab_size + 31) // 32

    def serve(self, store=None) -> None:
        link = self.link
        busy, first = 0.0, None
        while True:
            message = link.recv(PLAN_WORDS, torch.int64, 0, PLAN, forever=True).numpy()
            header, size = message[:HEADER], plan_size(message)
            if header[0] == OP_STOP:
                link.flush()
                if store is not None and first is not None:  # for the bubble measurement
                    store.set(f"stats/{self.rank}", json.dumps({"busy_s": busy, "wall_s": time.perf_counter() - first}))
                return
            payload = (message[HEADER:HEADER + size] if size <= INLINE
                       else link.recv(size, torch.int64, 0, PLAN).numpy())
            arrays, copies, spec = decode_plan(header, payload)
            link.step = int(header[6])
            link.release(int(header[7]))  # rank 0 has those steps' tokens: their sends were all received
            use_threads(int(header[8]))
            first = first or time.perf_counter()
            busy += self.step(arrays, copies, spec)

    @torch.inference_mode()
    def step(self, arrays: StepArrays, copies: list[tuple[int, int]], spec: np.ndarray | None) -> float:
        """Returns the seconds spent computing (not waiting)."""
        # While the previous stage computes: the attention metadata, and a spec that came with
        # the plan read into the sampler's arguments.
        _, positions, meta, sample_rows = arrays.tensors(self.block_size, self.device)
        inputs = _sampling_inputs(spec, None) if spec is not None and self.last else None
        x = self.link.recv((len(arrays.slot_mapping), self.model.cfg.hidden_size), torch.float32, self.rank - 1, ACT)
        started = time.perf_counter()
        for src, dst in copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        hidden = self.model(x, positions, meta, self.kv_cache)
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
        one of the SPEC stream (rank 0 sends it once the step's controllers are done)."""
        link = self.link
        if inputs is None:
            n, num_masks = (int(v) for v in link.recv(2, torch.int64, 0, SPEC))
            if n == 0:
                return 0.0
            spec = link.recv((n, SPEC_COLS), torch.float64, 0, SPEC).numpy()
            masks = (link.recv((num_masks, self.num_words), torch.int32, 0, SPEC).numpy().view(np.uint32)
                     if num_masks else None)
            inputs = _sampling_inputs(spec, masks)
        started = time.perf_counter()
        rows, params, uniforms, row_masks = inputs
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        out = self.sampler.sample(logits, params, uniforms, row_masks)
        link.send(torch.tensor(out.tokens, dtype=torch.int32), 0, TOKENS)
        extra = []
        for p, lp in zip(params, out.logprobs):
            if p.logprobs is None:
                continue
            k = p.logprobs
            if lp is None:
                extra.append(np.zeros(1 + 2 * k))
            else:
                ids = [t for t, _ in lp["top"]]
                values = [v for _, v in lp["top"]]
                extra.append(np.array([lp["logprob"], *ids, *values], dtype=np.float64))
        if extra:
            link.send(torch.from_numpy(np.concatenate(extra)), 0, TOKENS)
        return time.perf_counter() - started


def _sampling_inputs(spec: np.ndarray, masks: np.ndarray | None) -> tuple:
    """The Sampler's arguments from a sampling spec: (logits rows, params, generators, masks)."""
    params = [SamplingParams(temperature=t, top_k=int(k), top_p=p, logprobs=None if lp < 0 else int(lp))
              for k, lp, t, p in spec[:, [1, 2, 4, 5]].tolist()]
    row_masks = [None if m < 0 else masks[int(m)] for m in spec[:, 3].tolist()]
    return (spec[:, 0].astype(np.int64).tolist(), params, [FixedUniform(u) for u in spec[:, 6].tolist()],
            row_masks if masks is not None else None)


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
                ready_key: str | None = None) -> None:
    """Build this rank's stage, join the group and serve steps until told to stop."""
    plan = partition(_num_layers(spec), stages)
    if len(plan) != world:
        raise ValueError(f"{len(plan)} pipeline stages but {world} ranks")
    dev = rank_device(device, rank if local_rank is None else local_rank)
    model = build_stage_model(spec, plan[rank], dev)
    if ready_key:
        store.set(ready_key, "1")
    link = connect(store, rank, world, timeout, dev, host)
    Stage(model, num_blocks, block_size, link).serve(store)


def _num_layers(spec: str) -> int:
    from .stage_model import load_config_for

    return load_config_for(spec).num_layers


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
                    timeout=cfg["timeout"], host=cfg["host"], device=cfg["device"], ready_key=f"ready/{rank}")
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
