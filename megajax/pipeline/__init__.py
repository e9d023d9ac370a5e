"""Pipeline parallelism: schedules as data and the shard_map executor that runs them."""

from megajax.pipeline.layout import from_stages, to_stages

__all__ = ["from_stages", "to_stages", "pipeline_grads"]


def pipeline_grads(*args, **kwargs):
    from megajax.pipeline.executor import pipeline_grads as impl

    return impl(*args, **kwargs)
