"""Params-only checkpoints: converted or exported models, and `checkpoint.load_from`.

A params-only checkpoint is a directory with
  params/       Orbax tree of the model's variables {embed, layers, head} (weights and non-trainable state),
                layers stacked on a leading axis (never pipeline-staged)
  config.yaml   the megajax config the params belong to
`find_params` also accepts a training checkpoint (the newest step's "state" item: its params and model state),
a step directory, or a train.output_dir, so every reader of params (export, generation, fine-tuning) takes any
of them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import yaml

from megajax.checkpoint.training import CheckpointError
from megajax.config import io as config_io
from megajax.config import Config
from megajax.model import model_state
from megajax.parallel.pipeline.layout import from_stages

PARAMS_ITEM = "params"
CONFIG_FILE = "config.yaml"


@dataclasses.dataclass(frozen=True)
class ParamsSource:
    """Where a parameter tree is stored and the config it was written with."""

    root: Path  # the directory the user named
    tree: Path  # the Orbax tree directory (params/, or <step>/state of a training checkpoint)
    config: Config
    step: int | None  # the training step, or None for a params-only checkpoint

    @property
    def in_state(self) -> bool:
        """True for a training checkpoint: the params are the "params" entry of the saved TrainState."""
        return self.step is not None

    @property
    def staged(self) -> bool:
        """Pipeline-parallel training states keep stacked layers as [v, p, L / (p v), ...]."""
        return self.in_state and self.config.parallel.pipeline > 1


def save_params(directory: str | os.PathLike, params, cfg: Config) -> None:
    """Writes a params-only checkpoint (canonical layout; NumPy or jax arrays) and its config.yaml."""
    directory = Path(directory).absolute()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory / PARAMS_ITEM, params)
    ckptr.wait_until_finished()
    if jax.process_index() == 0:
        (directory / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def find_params(directory: str | os.PathLike) -> ParamsSource:
    """Resolves a params-only checkpoint, a training checkpoint directory (its newest step), one step of
    it (<dir>/<step>), or a train.output_dir (its checkpoints/)."""
    root = Path(directory).absolute()
    if (root / PARAMS_ITEM).is_dir() and (root / CONFIG_FILE).exists():
        cfg = config_io.from_dict(yaml.safe_load((root / CONFIG_FILE).read_text()))
        return ParamsSource(root, root / PARAMS_ITEM, cfg, None)
    ckpt_dir, step = root, None
    if (root / "state").is_dir() and root.name.isdigit():
        ckpt_dir, step = root.parent, int(root.name)
    elif not _has_steps(root) and _has_steps(root / "checkpoints"):
        ckpt_dir = root / "checkpoints"
    if not ckpt_dir.is_dir() or (step is None and not _has_steps(ckpt_dir)):
        raise CheckpointError(f"{root} is not a megajax checkpoint: expected {PARAMS_ITEM}/ and {CONFIG_FILE} "
                         "(python -m megajax.convert from-hf) or a training checkpoint directory")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    mgr = ocp.CheckpointManager(ckpt_dir, options=options, item_names=("state", "meta"))
    try:
        step = mgr.latest_step() if step is None else step
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mgr.close()
    return ParamsSource(root, ckpt_dir / str(step) / "state", config_io.from_dict(meta["config"]), step)


def _has_steps(path: Path) -> bool:
    return path.is_dir() and any(p.name.isdigit() and (p / "state").is_dir() for p in path.iterdir())


def _is_meta(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _stored_metadata(source: ParamsSource):
    """Orbax's per-array metadata (shape, dtype) of the stored model variables (a train state's params and model
    state), as stored."""
    tree = ocp.PyTreeCheckpointer().metadata(source.tree).item_metadata.tree
    return model_state.merge(tree["params"], tree.get("model_state", {})) if source.in_state else tree


def stored_shapes(source: ParamsSource) -> dict:
    """Tree of (shape, dtype) of the stored params, in the canonical layout (staged layers unstaged)."""
    stored = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)),
                          _stored_metadata(source), is_leaf=_is_meta)
    if source.staged:
        stored = jax.eval_shape(lambda t: from_stages(t, source.config.stage_split), stored)
    own = _own_shapes(source)
    if own is not None:  # (ZeRO-3's padding is not part of the model)
        stored = own
    return jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), stored)


def _own_shapes(source: ParamsSource):
    """For a training checkpoint whose weights carry the distributed optimizer's zero padding (ZeRO-3 keeps its
    weights padded; never under a pipeline), the model's own shapes (jax.ShapeDtypeStructs); else None."""
    if not source.in_state or source.staged:
        return None
    from megajax import model

    stored = jax.tree.map(lambda m: tuple(m.shape), _stored_metadata(source), is_leaf=_is_meta)
    own = model.abstract_params(source.config.model)
    if jax.tree.structure(stored, is_leaf=lambda x: isinstance(x, tuple)) != jax.tree.structure(own):
        return None
    pairs = list(zip(jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(own)))
    padded = [s != o.shape for s, o in pairs]
    fits = all(len(s) == o.ndim and all(a >= b for a, b in zip(s, o.shape)) for s, o in pairs)
    return own if any(padded) and fits else None


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)


def _restore(source: ParamsSource, item, restore_args):
    ckptr = ocp.PyTreeCheckpointer()
    if source.in_state:  # the model's variables of the saved TrainState, not the optimizer state
        if "model_state" in ckptr.metadata(source.tree).item_metadata.tree:
            (params, state), (p_args, s_args) = model_state.split(item), model_state.split(restore_args)
            item, restore_args = {"params": params, "model_state": state}, {"params": p_args, "model_state": s_args}
        else:  # (written before the model state had its own entry: it is in params)
            item, restore_args = {"params": item}, {"params": restore_args}
    out = ckptr.restore(source.tree, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                 partial_restore=source.in_state))
    return model_state.merge(out["params"], out.get("model_state", {})) if source.in_state else out


def check_params_fit(stored: dict, expected: dict, where: str) -> None:
    """Same parameter names and shapes (trees of (shape, dtype) or arrays), else an error naming the tensor."""
    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_shape(x) or _is_meta(x))[0]
        return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(x[0] if _is_shape(x) else x.shape)
                for path, x in leaves}

    have, want = flat(stored), flat(expected)
    for name in sorted(set(want) | set(have)):
        if name not in have:
            raise CheckpointError(f"parameter {name} is missing from {where} (was it written for another model "
                                  "config?)")
        if name not in want:
            raise CheckpointError(f"{where} has parameter {name}, which this model config does not have")
        if have[name] != want[name]:
            raise CheckpointError(f"parameter {name} in {where} has shape {have[name]}, but the model config needs "
                             f"{want[name]}")


def load_params(source: ParamsSource | str | os.PathLike, target=None):
    """The params of a checkpoint (any kind `find_params` accepts) in the canonical layout.

    target: None for NumPy arrays on the host, or a tree of jax.ShapeDtypeStruct with shardings (canonical
    layout, any mesh) to restore onto; its shapes are checked first, errors name the tensor.
    """
    source = source if isinstance(source, ParamsSource) else find_params(source)
    if target is not None:
        target, fresh = _without_fresh_fp8_state(source, target)
        if fresh:
            return _with_fresh_fp8_state(load_params(source, target), fresh)
        check_params_fit(stored_shapes(source), target, str(source.root))
    own = _own_shapes(source)
    if target is not None and not source.staged and own is None:
        args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype), target)
        return _restore(source, target, args)
    stored = _stored_metadata(source)
    item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored, is_leaf=_is_meta)
    host = _restore(source, item, jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), stored,
                                               is_leaf=_is_meta))
    if source.staged:
        host = from_stages(host, source.config.stage_split)
    if own is not None:  # ZeRO-3's zero padding sliced off
        host = jax.tree.map(lambda a, o: a[tuple(slice(0, n) for n in o.shape)], host, own)
    if target is None:
        return host
    # Staged on disk: reassemble on the host, then place each canonical shard where the target wants it.
    return jax.tree.map(lambda a, t: jax.make_array_from_callback(
        t.shape, t.sharding, lambda idx: np.asarray(a[idx], dtype=t.dtype)), host, target)


def _without_fresh_fp8_state(source: ParamsSource, target: dict) -> tuple[dict, dict]:
    """(target without the FP8 delayed-scaling state leaves the checkpoint lacks or holds in another shape, those
    leaves by path): weights trained or imported without model.fp8_recipe=delayed, or with one history over all of
    an MoE layer's experts (megajax before per-expert histories), start the amax history empty (megajax.model.fp8:
    the first step scales from the operands themselves)."""
    from flax import traverse_util

    from megajax.model.fp8 import META_PREFIX

    stored = traverse_util.flatten_dict(stored_shapes(source))
    flat = traverse_util.flatten_dict(target)
    fresh = {k: v for k, v in flat.items()
             if k[-1].startswith(META_PREFIX) and (k not in stored or tuple(stored[k]) != tuple(v.shape))}
    if not fresh:
        return target, {}
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k not in fresh}), fresh


def _with_fresh_fp8_state(params: dict, fresh: dict) -> dict:
    from flax import traverse_util

    flat = traverse_util.flatten_dict(params)
    for path, t in fresh.items():
        flat[path] = jnp.zeros(t.shape, t.dtype, device=t.sharding) if hasattr(t, "sharding") else np.zeros(
            t.shape, t.dtype)
    return traverse_util.unflatten_dict(flat)
