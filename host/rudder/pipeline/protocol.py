"""The pipeline's wire format: what rank 0 sends the stages and what the last stage sends back.

Streams (transport.py tags; each (peer, tag) is ordered):
- PLAN, rank 0 -> every stage, once per step: a fixed-size int64 message, a `PlanHeader` then,
  when it fits, the payload (StepArrays, block copies, sample rows, and the step's sampling spec
  when it was known at launch); a larger payload follows as a second message. A stop is a plan
  with op OP_STOP.
- ACT, rank r -> r + 1: the activations [tokens, hidden].
- SPEC, rank 0 -> the last stage, per step with sampling rows still to decide: a `SpecHeader`
  (n rows to sample, n masks, n logits rows to send back first), then the fetch rows, then the
  spec rows (SPEC_COLS float64 each) and the packed masks. n = 0 with no fetch: nothing samples.
- TOKENS, the last stage -> rank 0: the fetched logits rows (float32), then one int32 token per
  spec row, then the logprobs of the rows that asked (`encode_logprobs`).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import numpy as np
import torch

from ..engine.sampler import SampleOutput, draw_uniform
from ..engine.sequence import SamplingParams
from ..engine.step import StepArrays

__all__ = ["OP_STEP", "OP_STOP", "PlanHeader", "PLAN_WORDS", "INLINE", "SPEC_COLS", "SpecHeader", "FixedUniform", "logprob_words",
           "encode_plan", "decode_plan", "stop_message", "encode_spec", "sampling_inputs", "encode_logprobs",
           "decode_logprobs"]

OP_STOP, OP_STEP = 0, 1


@dataclass
class PlanHeader:
    op: int
    batch: int  # B sequences
    tokens: int  # T fed tokens
    table_blocks: int  # width of the block tables
    copies: int  # copy-on-write block pairs
    sample_rows: int  # R logits rows
    step: int  # the step's number
    done: int  # the last step whose tokens rank 0 has (older sends can be released)
    threads: int  # torch threads for this step's forward pass
    spec_rows: int  # rows of a sampling spec that came with the plan (0: it follows on SPEC)

    WORDS = 10

    def payload_size(self) -> int:
        return (2 * self.batch + self.tokens + self.batch * self.table_blocks + 2 * self.copies + self.sample_rows
                + self.spec_rows * SPEC_COLS)

    @classmethod
    def of(cls, words: np.ndarray) -> "PlanHeader":
        return cls(*(int(w) for w in words[:cls.WORDS]))


# A plan message is the header plus up to this many payload words, so a small step (a few
# sequences decoding) is one message: every message on the step's path costs a wake-up of the
# receiving process. A larger payload follows as a second message.
INLINE = 118
PLAN_WORDS = PlanHeader.WORDS + INLINE
SPEC_COLS = 7  # row, top_k, logprobs (-1: none), mask index (-1: none), temperature, top_p, uniform


def encode_plan(arrays: StepArrays, copies: list[tuple[int, int]], step: int, done: int, threads: int,
                spec: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plan message (header and, when it fits, the payload) and the payload message when it
    does not fit; `spec`: the step's sampling spec when it is known at launch (float64 rows,
    carried bit for bit in the int64 payload)."""
    copies_arr = np.asarray(copies, dtype=np.int64).reshape(-1)
    spec_arr = np.zeros(0, dtype=np.int64) if spec is None else np.ascontiguousarray(spec, np.float64).view(np.int64)
    header = PlanHeader(OP_STEP, len(arrays.counts), len(arrays.slot_mapping), arrays.tables.shape[1], len(copies),
                        len(arrays.sample_rows), step, done, threads, 0 if spec is None else len(spec))
    payload = np.concatenate([arrays.counts, arrays.starts, arrays.slot_mapping, arrays.tables.reshape(-1),
                              copies_arr, arrays.sample_rows, spec_arr.reshape(-1)])
    message = np.zeros(PLAN_WORDS, dtype=np.int64)
    message[:PlanHeader.WORDS] = astuple(header)
    if len(payload) <= INLINE:
        message[PlanHeader.WORDS:PlanHeader.WORDS + len(payload)] = payload
        return torch.from_numpy(message), None
    return torch.from_numpy(message), torch.from_numpy(payload)


def stop_message() -> torch.Tensor:
    message = torch.zeros(PLAN_WORDS, dtype=torch.int64)
    message[0] = OP_STOP
    return message


def decode_plan(header: PlanHeader, payload: np.ndarray):
    """(StepArrays, copies, the spec that came with the plan or None), as views of `payload`."""
    B, T, NTB, C, R, S = header.batch, header.tokens, header.table_blocks, header.copies, header.sample_rows, \
        header.spec_rows
    tables, copies = 2 * B + T, 2 * B + T + B * NTB
    rows = copies + 2 * C
    arrays = StepArrays(payload[:B], payload[B:2 * B], payload[2 * B:tables], payload[tables:copies].reshape(B, NTB),
                        payload[rows:rows + R])
    return (arrays, [(a, b) for a, b in payload[copies:rows].reshape(C, 2).tolist()],
            payload[rows + R:rows + R + S * SPEC_COLS].view(np.float64).reshape(S, SPEC_COLS) if S else None)


# -- sampling specs --------------------------------------------------------------------------------


@dataclass
class SpecHeader:
    rows: int  # spec rows (tokens to sample); 0 with no fetch: the step samples nothing
    masks: int  # packed masks that follow the spec
    fetch: int  # logits rows to send back before sampling (speculative verification)

    WORDS = 3

    def tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)


def encode_spec(rows: list[int], params: list[SamplingParams], rngs: list, masks: list,
                num_words: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(spec rows, packed masks). The uniforms are drawn here, from each sequence's own generator,
    by the Sampler's rule (`draw_uniform`): the same values one process would draw."""
    spec = np.zeros((len(rows), SPEC_COLS), dtype=np.float64)
    packed = []
    for j, (row, p, rng, mask) in enumerate(zip(rows, params, rngs, masks)):
        if mask is not None:
            if mask.dtype != np.uint32 or mask.shape != (num_words,):
                raise ValueError(f"sample mask must be {num_words} uint32 words, got {mask.dtype} {mask.shape}")
            packed.append(mask)
        spec[j] = (row, p.top_k, -1 if p.logprobs is None else p.logprobs, len(packed) - 1 if mask is not None else -1,
                   p.temperature, p.top_p, draw_uniform(p, rng))
    return spec, packed


class FixedUniform:
    """Stands in for a sequence's Generator on the last stage: the coordinator drew the uniform."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def sampling_inputs(spec: np.ndarray, masks: np.ndarray | None) -> tuple:
    """The Sampler's arguments from a sampling spec: (logits rows, params, generators, masks)."""
    params = [SamplingParams(temperature=t, top_k=int(k), top_p=p, logprobs=None if lp < 0 else int(lp))
              for k, lp, t, p in spec[:, [1, 2, 4, 5]].tolist()]
    row_masks = [None if m < 0 else masks[int(m)] for m in spec[:, 3].tolist()]
    return (spec[:, 0].astype(np.int64).tolist(), params, [FixedUniform(u) for u in spec[:, 6].tolist()],
            row_masks if masks is not None else None)


# -- logprobs --------------------------------------------------------------------------------------


def encode_logprobs(params: list[SamplingParams], out: SampleOutput) -> np.ndarray | None:
    """The logprobs of the rows that asked for them, flat: per row the token's logprob, then k
    top ids, then their k logprobs (zeros where the row sampled nothing). None: no row asked."""
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
    return np.concatenate(extra) if extra else None


def logprob_words(params: list[SamplingParams]) -> int:
    """Length of the encoded logprobs of these rows."""
    return sum(1 + 2 * p.logprobs for p in params if p.logprobs is not None)


def decode_logprobs(params: list[SamplingParams], tokens: list[int], extra: list[float]) -> list[dict | None]:
    logprobs: list[dict | None] = [None] * len(params)
    at = 0
    for j, p in enumerate(params):
        if p.logprobs is None:
            continue
        k = p.logprobs
        chunk, at = extra[at: at + 1 + 2 * k], at + 1 + 2 * k
        if tokens[j] >= 0:
            logprobs[j] = {"token": tokens[j], "logprob": chunk[0],
                           "top": list(zip((int(t) for t in chunk[1: 1 + k]), chunk[1 + k:]))}
    return logprobs
