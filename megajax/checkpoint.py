"""Orbax checkpoints: async save, keep-N, resume from the newest complete step, reshard on restore.

A checkpoint step holds two items:
  state  the TrainState (params, optimizer state, step, loss scale, counters) as sharded arrays, in the
         layout it was trained with (stacked layers [L, ...], or [v, p, L/(p v), ...] under a pipeline)
  meta   JSON: step, consumed samples, seed, the config used and its layout
Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save
never damages earlier steps and `latest_step` only ever sees complete ones.

Restore reshards onto the current mesh: a different data or tensor size, sequence parallelism or the
distributed optimizer only change shardings, which Orbax applies while reading. A different pipeline
layout also changes the shape of the stacked layers: those leaves are read in their saved shape (split
over the new 'pipeline' axis where it divides) and reshaped in one jitted step; both layouts list the
layers in the same order, so that is a reshape, never a permutation of the data.

    python -m megajax.checkpoint inspect DIR            # steps, meta, every array's shape/dtype/size
    python -m megajax.checkpoint export DIR OUT [--step N]  # params only, canonical layout, for inference
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.config import Config

STATE_FIELDS = ("step", "params", "opt_state", "loss_scale", "good_steps", "bad_steps")


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked; the message names the parameters and the fix."""


def checkpoint_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


def manager(directory: str, keep: int = 3, use_async: bool = True, read_only: bool = False
            ) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=use_async, create=not read_only, read_only=read_only)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def manager_for(cfg: Config) -> ocp.CheckpointManager:
    return manager(checkpoint_dir(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_)


def state_dict(state) -> dict:
    return {f: getattr(state, f) for f in STATE_FIELDS}


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    """Starts a save; with async checkpointing it returns once the arrays are copied off the devices."""
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state_dict(state)), meta=ocp.args.JsonSave(meta)), force=True)


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict:
    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def saved_shapes(mgr: ocp.CheckpointManager, step: int) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every saved state array, in tree order."""
    tree = mgr.item_metadata(step)["state"].tree
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    return [(getattr(a, "name", "?"), tuple(a.shape), str(a.dtype)) for a in leaves]


def _is_layer_leaf(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def _lead_dims(pipeline: int) -> int:
    """Leading dims of a stacked-layer leaf: [L, ...] without a pipeline, [v, p, L/(p v), ...] with one."""
    return 3 if pipeline > 1 else 1


def _read_target(want: jax.ShapeDtypeStruct, saved_shape: tuple, lead_saved: int, lead_want: int,
                 pipeline: int) -> jax.ShapeDtypeStruct:
    """How to read a layer leaf saved in another pipeline layout: its saved shape, the current sharding
    of the per-layer dims, and 'pipeline' on the first layer dim it divides (no device reads every layer)."""
    spec = list(want.sharding.spec) + [None] * (len(want.shape) - len(want.sharding.spec))
    leading = [None] * lead_saved
    for i in range(lead_saved):
        if pipeline > 1 and saved_shape[i] % pipeline == 0:
            leading[i] = "pipeline"
            break
    read_spec = P(*leading, *spec[lead_want:])
    return jax.ShapeDtypeStruct(saved_shape, want.dtype, sharding=NamedSharding(want.sharding.mesh, read_spec))


def restore(mgr: ocp.CheckpointManager, step: int, abstract_state, shardings, cfg: Config) -> tuple[dict, dict]:
    """Restores `step` onto `shardings` (any mesh, any layout): returns (state fields, meta)."""
    meta = read_meta(mgr, step)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          state_dict(abstract_state), state_dict(shardings))
    saved = saved_shapes(mgr, step)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    if len(saved) != len(flat):
        raise CheckpointError(
            f"checkpoint step {step} in {mgr.directory} holds {len(saved)} arrays but this config's train "
            f"state has {len(flat)}: it was written for a different model or optimizer (its model config: "
            f"{meta.get('config', {}).get('model')})")
    lead_saved = _lead_dims(int(meta.get("layout", {}).get("pipeline", 1)))
    lead_want = _lead_dims(cfg.parallel.pipeline)
    read, relayout, mismatched = [], [], []
    for (path, want), (_, shape, _) in zip(flat, saved):
        if _is_layer_leaf(path) and len(shape) - lead_saved == len(want.shape) - lead_want \
                and shape[lead_saved:] == want.shape[lead_want:] \
                and math.prod(shape[:lead_saved]) == math.prod(want.shape[:lead_want]) and shape != want.shape:
            read.append(_read_target(want, shape, lead_saved, lead_want, cfg.parallel.pipeline))
            relayout.append(True)
        elif shape == want.shape:
            read.append(want)
            relayout.append(False)
        else:
            mismatched.append(f"{jax.tree_util.keystr(path)}: checkpoint {shape}, config {want.shape}")
    if mismatched:
        raise CheckpointError(
            f"checkpoint step {step} in {mgr.directory} does not fit this config; mismatched parameters:\n  "
            + "\n  ".join(mismatched[:20]) + "\nRestore with the model settings it was trained with "
            "(see `python -m megajax.checkpoint inspect DIR`), or start a new run elsewhere (checkpoint.dir).")
    out = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree_util.tree_unflatten(treedef, read))))["state"]
    if any(relayout):
        # Both layouts stack the layers in the same order, so a reshape moves each layer where it belongs.
        wants = [w for _, w in flat]
        convert = jax.jit(lambda xs: [x.reshape(w.shape) if r else x for x, w, r in zip(xs, wants, relayout)],
                          out_shardings=[w.sharding for w in wants])
        out = jax.tree_util.tree_unflatten(treedef, convert(jax.tree.leaves(out)))
    return out, meta


def latest_step(cfg: Config) -> int | None:
    if not Path(checkpoint_dir(cfg)).exists():
        return None
    mgr = manager(checkpoint_dir(cfg), read_only=True)
    try:
        return mgr.latest_step()
    finally:
        mgr.close()


# ----------------------------------------------------------------------------------------------------
# params-only checkpoints (for inference, export, and starting a run from converted weights)


def canonical_params(params: dict, pipeline: int) -> dict:
    """Stacked layers back to [L, ...] from the layout a run with `pipeline` stages trained them in."""
    if pipeline == 1:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.reshape(-1, *x.shape[3:]) if _is_layer_leaf(path) else x, params)


def inspect(directory: str) -> dict:
    """Steps, meta and every array's shape, dtype and size in a checkpoint directory."""
    if not Path(directory).exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    mgr = manager(directory, read_only=True)
    try:
        steps = mgr.all_steps()
        report = {"directory": os.path.abspath(directory), "steps": list(steps)}
        if steps:
            step = steps[-1]
            meta = read_meta(mgr, step)
            arrays = saved_shapes(mgr, step)
            size = sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in arrays)
            report.update({
                "latest": step, "consumed_samples": meta.get("consumed_samples"), "layout": meta.get("layout"),
                "total_bytes": int(size),
                "arrays": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in arrays],
            })
        return report
    finally:
        mgr.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="list steps and array shapes, dtypes and sizes")
    ins.add_argument("dir")
    args = parser.parse_args(argv)
    from megajax.distributed import prefer_cpu_without_gpu

    prefer_cpu_without_gpu()
    try:
        if args.cmd == "inspect":
            print(json.dumps(inspect(args.dir), indent=2))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
