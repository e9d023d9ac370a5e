"""Pipeline parallelism, one module each: schedules as data (schedule.py, NumPy only), the executor's tick tables
built from them (ticks.py, NumPy only), the staged layer layout (layout.py), the shard_map executor that runs a
schedule (executor.py) with its chunk actions (chunks.py) and zero_bubble's split backward (zero_bubble.py), and
GPipe and evaluation's forward-only pipeline (gpipe.py); the split of the layers over the chunks (split.py) and the
`megajax schedule` CLI (schedule_cli.py). Import the module you need (`from megajax.parallel.pipeline import
executor`): this package imports none of them, so that `megajax schedule` plans and draws schedules with NumPy
alone."""
