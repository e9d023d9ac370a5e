"""Orbax checkpoints: async save, keep-N, resume from the newest complete step, reshard on restore.

A checkpoint step holds two items:
  state  the TrainState (params, optimizer state, step, loss scale) as sharded arrays
  meta   JSON: consumed samples, the config used, the layout it was written with
Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save
never damages earlier steps, and `latest_step` only ever sees complete ones.

Params-only checkpoints (converted or exported models, `checkpoint.load_from`) are at the end of the file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from megajax import config as config_lib
from megajax.config import Config, ModelConfig


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


# ----------------------------------------------------------------------------------------------------
# Params only: converted or exported models, and `checkpoint.load_from`.
#
# A params-only checkpoint is a directory with
#   params/       Orbax tree {embed, layers, head}, layers stacked on a leading axis (never pipeline-staged)
#   config.yaml   the megajax config the params belong to
# `find_params` also accepts a training checkpoint (the newest step's "state" item), a step directory, or a
# train.output_dir, so every reader of params (export, generation, fine-tuning) takes any of them.

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
        cfg = config_lib.from_dict(yaml.safe_load((root / CONFIG_FILE).read_text()))
        return ParamsSource(root, root / PARAMS_ITEM, cfg, None)
    ckpt_dir, step = root, None
    if (root / "state").is_dir() and root.name.isdigit():
        ckpt_dir, step = root.parent, int(root.name)
    elif not _has_steps(root) and _has_steps(root / "checkpoints"):
        ckpt_dir = root / "checkpoints"
    if not ckpt_dir.is_dir() or (step is None and not _has_steps(ckpt_dir)):
        raise ValueError(f"{root} is not a megajax checkpoint: expected {PARAMS_ITEM}/ and {CONFIG_FILE} "
                         "(python -m megajax.convert from-hf) or a training checkpoint directory")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    mgr = ocp.CheckpointManager(ckpt_dir, options=options, item_names=("state", "meta"))
    try:
        step = mgr.latest_step() if step is None else step
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mgr.close()
    return ParamsSource(root, ckpt_dir / str(step) / "state", config_lib.from_dict(meta["config"]), step)


def _has_steps(path: Path) -> bool:
    return path.is_dir() and any(p.name.isdigit() and (p / "state").is_dir() for p in path.iterdir())


def _is_meta(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _stored_metadata(source: ParamsSource):
    """Orbax's per-array metadata (shape, dtype) of the stored params, as stored."""
    tree = ocp.PyTreeCheckpointer().metadata(source.tree).item_metadata.tree
    return tree["params"] if source.in_state else tree


def stored_shapes(source: ParamsSource) -> dict:
    """Tree of (shape, dtype) of the stored params, in the canonical layout (staged layers unstaged)."""
    shapes = jax.tree.map(lambda m: (tuple(m.shape), np.dtype(m.dtype)), _stored_metadata(source), is_leaf=_is_meta)
    if source.staged:
        def unstage(sd):
            (v, p, n, *rest), dtype = sd
            return (v * p * n, *rest), dtype

        shapes = {**shapes, "layers": jax.tree.map(unstage, shapes["layers"], is_leaf=_is_shape)}
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)


def _restore(source: ParamsSource, item, restore_args):
    if source.in_state:  # only the params of the saved TrainState, not the optimizer state
        item, restore_args = {"params": item}, {"params": restore_args}
    out = ocp.PyTreeCheckpointer().restore(
        source.tree, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                 partial_restore=source.in_state))
    return out["params"] if source.in_state else out


def check_params_fit(stored: dict, expected: dict, where: str) -> None:
    """Same parameter names and shapes (trees of (shape, dtype) or arrays), else an error naming the tensor."""
    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_shape(x) or _is_meta(x))[0]
        return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(x[0] if _is_shape(x) else x.shape)
                for path, x in leaves}

    have, want = flat(stored), flat(expected)
    for name in sorted(set(want) | set(have)):
        if name not in have:
            raise ValueError(f"parameter {name} is missing from {where} (was it written for another model config?)")
        if name not in want:
            raise ValueError(f"{where} has parameter {name}, which this model config does not have")
        if have[name] != want[name]:
            raise ValueError(f"parameter {name} in {where} has shape {have[name]}, but the model config needs "
                             f"{want[name]}")


def load_params(source: ParamsSource | str | os.PathLike, target=None):
    """The params of a checkpoint (any kind `find_params` accepts) in the canonical layout.

    target: None for NumPy arrays on the host, or a tree of jax.ShapeDtypeStruct with shardings (canonical
    layout, any mesh) to restore onto; its shapes are checked first, errors name the tensor.
    """
    source = source if isinstance(source, ParamsSource) else find_params(source)
    if target is not None:
        check_params_fit(stored_shapes(source), target, str(source.root))
    if target is not None and not source.staged:
        args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype), target)
        return _restore(source, target, args)
    stored = _stored_metadata(source)
    item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored, is_leaf=_is_meta)
    host = _restore(source, item, jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), stored,
                                               is_leaf=_is_meta))
    if source.staged:
        from megajax.pipeline.layout import from_stages

        host = from_stages(host)
    if target is None:
        return host
    # Staged on disk: reassemble on the host, then place each canonical shard where the target wants it.
    return jax.tree.map(lambda a, t: jax.make_array_from_callback(
        t.shape, t.sharding, lambda idx: np.asarray(a[idx], dtype=t.dtype)), host, target)


# Model fields that change what the parameters compute without changing their shapes.
_SAME_MODEL_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "kv_heads", "ffn_size", "vocab_size",
                      "padded_vocab_size", "tied", "norm_eps", "rope_theta")


def check_same_model(stored: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """The architecture a checkpoint was written for must be the one being built; names each difference."""
    diffs = [f"model.{f}: {getattr(stored, f)!r} in the checkpoint, {getattr(wanted, f)!r} here"
             for f in _SAME_MODEL_FIELDS if getattr(stored, f) != getattr(wanted, f)]
    if stored.arch == "gpt2" and stored.seq_length != wanted.seq_length:
        diffs.append(f"model.seq_length (GPT-2's position embedding): {stored.seq_length} in the checkpoint, "
                     f"{wanted.seq_length} here")
    if diffs:
        raise config_lib.ConfigError(f"{where} holds a different model: {'; '.join(diffs)}. Use the config written "
                                     "with it (its config.yaml, or megajax.convert --config-out)")
