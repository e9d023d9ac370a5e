"""Orbax checkpoints: async save, keep-N, resume from the newest complete step, reshard on restore.

A checkpoint step holds two items:
  state  the TrainState (params, optimizer state, step, loss scale) as sharded arrays
  meta   JSON: consumed samples, the config used, the layout it was written with
Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save
never damages earlier steps, and `latest_step` only ever sees complete ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from megajax.config import Config


def checkpoint_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


def manager(cfg: Config, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep,
        enable_async_checkpointing=cfg.checkpoint.async_,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(checkpoint_dir(cfg), options=options, item_names=("state", "meta"))


def _state_dict(state) -> dict:
    return {f: getattr(state, f) for f in ("step", "params", "opt_state", "loss_scale", "good_steps", "bad_steps")}


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    """Starts a save (returns at once when async; the write finishes in the background)."""
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_state_dict(state)), meta=ocp.args.JsonSave(meta)), force=True)


def restore(mgr: ocp.CheckpointManager, step: int, abstract_state, shardings) -> tuple[dict, dict]:
    """Restores `step` onto `shardings` (any mesh): returns (state fields, meta)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          _state_dict(abstract_state), _state_dict(shardings))
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                    meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]


def latest_step(cfg: Config) -> int | None:
    if not Path(checkpoint_dir(cfg)).exists():
        return None
    mgr = manager(cfg, read_only=True)
    try:
        return mgr.latest_step()
    finally:
        mgr.close()
