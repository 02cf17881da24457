"""Pipeline-parallel model shards over torch.distributed, steered by the same Branch records
(docs/pipeline.md)."""

from .partition import StageSpec, partition
from .runner import PipelineError, PipelineRunner, start_pipeline

__all__ = ["PipelineError", "PipelineRunner", "StageSpec", "partition", "start_pipeline"]
