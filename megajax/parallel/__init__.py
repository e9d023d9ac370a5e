"""Every parallel decision of the train step, in one package:

- step_plan.py: the plan, every decision resolved once from the config and the mesh (`StepPlan.resolve`), and the
  one context variable that puts it in force while a step is traced;
- sharding.py: the mesh, the logical-axis rules (parameters and activations), the manual region's collectives
  and the one split of a batch into micro batches;
- overlap.py: the data-parallel reductions and gathers issued layer by layer inside the backward and forward;
- engines.py: the gradient engines (a scan over micro batches, ZeRO-2/3's, a pipeline schedule) and the manual
  region they run in;
- pipeline/: schedules as data, their tick tables, the staged layer layout and the shard_map executor.

The model (megajax/model/) reads only the plan in force and the sharding helpers. Import the module you need: this
package imports none of them, so that `python -m megajax.parallel.pipeline.schedule` draws schedules with NumPy
alone.
"""
