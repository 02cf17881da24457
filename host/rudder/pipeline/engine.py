"""The engine loop with several micro-batches in flight (GPipe-style inference).

The running sequences are split into up to M disjoint groups, each a step of its own: while the
last stage computes group A, rank 0 computes stage 0 of group B. A sequence is in at most one
step in flight (`busy`); everything else - scheduling, Branch records, sampling - is the
single-process engine's code, so every sequence gets the tokens it would get alone."""

from __future__ import annotations

from collections import deque

from ..engine.llm_engine import Delta, Engine, _InFlight


class PipelineEngine(Engine):
    def __init__(self, *args, micro_batches: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        if micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        self.micro_batches = micro_batches
        self.in_flight: deque[_InFlight] = deque()
        self._busy: set[int] = set()
        self._closing: dict[int, list] = {}  # controllers of finished sequences still in a flight

    def step(self) -> list[Delta]:
        deltas: list[Delta] = []
        while len(self.in_flight) < self.micro_batches and self.failure is None:
            active = len(self.scheduler.running) + len(self.scheduler.waiting)
            limit = max(1, -(-active // self.micro_batches))
            batch, unfit = self.scheduler.schedule(busy=self._busy, limit=limit)
            self._fail_unfit(unfit, deltas)
            if not batch:
                break
            # Nothing else in flight and no other group to launch: the stages will take turns on
            # this step, so each may use all the cores.
            self.runner.alone = not self.in_flight and (self.micro_batches == 1 or active <= 1)
            flight = self._launch(batch, deltas)
            if flight is None:
                break
            self.in_flight.append(flight)
            self._busy.update(e.seq.seq_id for e in batch)
        while self.in_flight:
            flight = self.in_flight.popleft()
            ids = [e.seq.seq_id for e in flight.batch]
            self._busy.difference_update(ids)
            if self.failure is None:
                self._complete(flight, deltas)
            else:  # the runner failed: every request is already finished; just join the controllers
                for task in flight.tasks:
                    task.result()
            for seq_id in ids:
                for controller in self._closing.pop(seq_id, []):
                    controller.close()
            if self.failure is None:
                break
        return deltas

    def _finish(self, seq, reason, error=None) -> None:
        # A sequence in a step in flight may have its controller's mid_process running right now
        # (a fork of a request that failed in another micro-batch, a cancel): close it later.
        if seq.seq_id in self._busy and seq.controller is not None:
            self._closing.setdefault(seq.seq_id, []).append(seq.controller)
            seq.controller = None
        super()._finish(seq, reason, error)
