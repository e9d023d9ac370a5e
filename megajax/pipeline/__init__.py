"""Pipeline parallelism: schedules as data and the shard_map executor that runs them."""

from megajax.pipeline.executor import permute_bytes_per_step, pipeline_grads, pipeline_loss
from megajax.pipeline.layout import from_stages, to_stages

__all__ = ["from_stages", "permute_bytes_per_step", "pipeline_grads", "pipeline_loss", "to_stages"]
