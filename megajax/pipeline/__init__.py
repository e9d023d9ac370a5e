"""Pipeline parallelism, one module each: schedules as data (schedule.py, NumPy only), the executor's tick tables
built from them (ticks.py, NumPy only), the staged layer layout (layout.py) and the shard_map executor that runs
a schedule (executor.py). Import the module you need (`from megajax.pipeline import executor`): this package
imports none of them, so that `python -m megajax.pipeline.schedule` plans and draws schedules with NumPy alone."""
