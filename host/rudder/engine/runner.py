"""The Runner protocol: what the engine needs of whatever computes the model - this process
(`ModelRunner`) or a pipeline of processes (`rudder.pipeline.PipelineRunner`).

A step is `copy_blocks` (copy-on-write of shared KV blocks), `run` (the forward pass; returns a
handle on the logits of the sampling rows), then either `sample` (tokens for some rows, each under
its own params, generator and mask) or `skip` (nothing samples), with `logits` in between when
speculative verification reads whole rows. What a runner can and cannot do beyond that, it
declares in its `capabilities`: the engine refuses by name, at `add_request`, the requests it
could not honour, and never probes for attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import RunnerFailure
from .sampler import SampleOutput
from .sequence import SamplingParams
from .step import ScheduledSeq

__all__ = ["Capabilities", "Runner", "RunnerFailure"]


@dataclass(frozen=True)
class Capabilities:
    verify_rows: bool = True  # run() honours ScheduledSeq.logit_rows and logits() returns rows (speculation)
    sample_at_launch: bool = False  # run(early=...) can sample an unconstrained step as soon as its logits exist
    shares_cores: bool = False  # run(alone=True) lets a step use every stage's cores (processes on one host)
    # run() spends the forward pass in one native call that runs kernels.before_decoder's hook
    # first: the engine starts the step's controller calls there (engine/llm_engine.py)
    native_decoder: bool = False
    # sample() applies logit processing: penalties (from `history=`), logit_bias and min_p
    logit_processing: bool = True
    name: str = "this runner"  # what a refusal calls it

    def refuse(self, params: SamplingParams) -> None:
        """Raise ValueError, naming the fields, when `params` ask for what this runner cannot do."""
        if params.speculative is not None and not self.verify_rows:
            raise ValueError(f"speculative: speculative decoding needs a runner that can verify several "
                             f"positions per step; {self.name} cannot")
        if not self.logit_processing and params.processed:
            raise ValueError(f"{', '.join(params.processing_fields())}: not available with {self.name}")


class Runner(Protocol):
    capabilities: Capabilities

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def run(self, batch: list[ScheduledSeq], alone: bool = False, early: list | None = None) -> Any:
        """Forward the batch; returns a handle on the logits of its sampling rows (the last
        `logit_rows` fed tokens of each entry with `sample`). `alone`: no other step is in flight.
        `early`: (params, generator) of every sampling row, when none has a mask or controller
        (only passed to runners with `sample_at_launch`)."""

    def logits(self, handle: Any, rows: list[int]) -> torch.Tensor:
        """Float32 logits of these rows, [len(rows), vocab], a copy the caller may change."""

    def sample(self, handle: Any, rows: list[int], params: list, rngs: list, masks: list[np.ndarray | None],
               history: list[tuple[list[int], int] | None] | None = None) -> SampleOutput:
        """One token per row. `history`: each row's (token ids, prompt length) where its params
        are `penalized` (None elsewhere), or None when no row's are."""

    def skip(self, handle: Any) -> None:
        """The step's logits are not sampled (every row backtracked or failed)."""

    def close(self) -> None: ...
