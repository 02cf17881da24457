"""Which contiguous layers each pipeline stage holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    index: int  # stage = rank: 0 is the coordinator
    num_stages: int
    first_layer: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def partition(num_layers: int, stages: int | list[int]) -> list[StageSpec]:
    """Split `num_layers` into contiguous stages: a count (an even split, the remainder going to
    the last stage) or an explicit list of layers per stage (summing to num_layers)."""
    if isinstance(stages, int):
        if not 1 <= stages <= num_layers:
            raise ValueError(f"pipeline stages must be between 1 and the model's {num_layers} layers, got {stages}")
        counts = [num_layers // stages] * stages
        counts[-1] += num_layers - sum(counts)
    else:
        counts = [int(c) for c in stages]
        if not counts or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"a stage layout must list at least one layer per stage and sum to {num_layers}, "
                             f"got {counts}")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [StageSpec(i, len(counts), s, c) for i, (s, c) in enumerate(zip(starts, counts))]
