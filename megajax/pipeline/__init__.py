"""Pipeline parallelism: schedules as data (schedule.py, NumPy only), the executor's tick tables built from
them (ticks.py, NumPy only), the staged layer layout (layout.py) and the shard_map executor that runs a schedule
(executor.py).

The executor and the layout are imported on first use, so that `python -m megajax.pipeline.schedule`
plans and draws schedules with NumPy alone (no JAX import).
"""

import importlib

_EXPORTS = {"branch_runs": "ticks", "permute_bytes_per_step": "executor", "pipeline_grads": "executor",
            "pipeline_loss": "executor", "from_stages": "layout", "to_stages": "layout"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megajax.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megajax.pipeline.{_EXPORTS[name]}"), name)
