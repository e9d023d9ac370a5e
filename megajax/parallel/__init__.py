"""Every parallel decision of the train step, in one package:

- step_plan.py: the plan, every decision resolved once from the config and the mesh (`StepPlan.resolve`), the
  one context variable that puts it in force while a step is traced, the logical-axis table it applies
  (parameters and activations) and the typing of values inside the step's manual region;
- sharding.py: the mesh, the manual region's reductions and the order of its collectives, and the one split of a
  batch into micro batches;
- overlap.py: the data-parallel reductions and gathers issued layer by layer inside the backward and forward;
- engines.py: the gradient engines (a scan over micro batches, ZeRO-2/3's, a pipeline schedule) and the manual
  region they run in;
- pipeline/: schedules as data, their tick tables, the staged layer layout and the shard_map executor.

The model (megajax/model/) and the kernels import step_plan.py alone. Import the module you need: this
package imports none of them, so that `python -m megajax.parallel.pipeline.schedule` draws schedules with NumPy
alone.
"""
