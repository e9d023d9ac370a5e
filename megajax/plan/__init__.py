"""The layout planner (`megajax plan`): which layout for a model on a cluster.

  hardware.py  the GPUs: every rate of the time model, from a microbenchmark or a datasheet, with its source
  cost.py      one layout's predicted step time and memory, term by term
  search.py    every valid layout, pruned by memory, ranked; the compile of the best few (megajax.audit)
  checks.py    the predictions against measurements (single-H100 steps, the SC21 paper's A100 runs)
  __main__.py  the command line: the table, --json, --write
"""
