"""Orbax checkpoints: training checkpoints that resume onto any layout, and params-only checkpoints.

  training.py  the train state's checkpoints: async save, keep-N, checksums, resume from the newest readable
               step, reshard on restore (any mesh, any pipeline layout), a damaged step moved aside
  params.py    params-only checkpoints (converted or exported models, `checkpoint.load_from`), and reading the
               model's variables out of any checkpoint
  __main__.py  the CLI:

    python -m megajax.checkpoint inspect DIR     # steps, meta, every array's shape/dtype/size
    python -m megajax.checkpoint export DIR OUT  # params only, canonical layout, for inference
"""

from megajax.checkpoint.params import (CONFIG_FILE, PARAMS_ITEM, ParamsSource, check_params_fit, find_params,
                                       load_params, save_params, stored_shapes)
from megajax.checkpoint.training import (STATE_FIELDS, WRITE_ERRORS, CheckpointError, UnreadableCheckpoint,
                                         check_same_model, checkpoint_dir, checksums, inspect, manager, manager_for,
                                         metadata,
                                         quiet_write_failures, read_meta, restore, restore_newest_readable, save,
                                         saved_shapes, state_dict, unreadable_reason, write_failure)

__all__ = ["CONFIG_FILE", "PARAMS_ITEM", "STATE_FIELDS", "WRITE_ERRORS", "CheckpointError", "ParamsSource",
           "UnreadableCheckpoint", "check_params_fit", "check_same_model", "checkpoint_dir", "checksums",
           "find_params", "inspect", "load_params", "manager", "manager_for", "metadata", "quiet_write_failures",
           "read_meta", "restore", "restore_newest_readable", "save", "save_params", "saved_shapes", "state_dict",
           "stored_shapes", "unreadable_reason", "write_failure"]

