"""Training checkpoints: async save, keep-N, resume from the newest complete step, reshard on restore.

A checkpoint step holds two items:
  state  the TrainState (params, the model's non-trainable state, optimizer state, step, loss scale, counters)
         as sharded arrays, in the layout it was trained with (stacked layers [L, ...], or [v, p, L/(p v), ...]
         under a pipeline)
  meta   JSON: step, consumed samples, seed, the config used and its layout, each array's checksums
Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save
never damages earlier steps and `latest_step` only ever sees complete ones.

Restore reshards onto the current mesh: a different data or tensor size, sequence parallelism or the
distributed optimizer only change shardings, which Orbax applies while reading. A different pipeline
layout also changes the shape of the stacked layers: those leaves are read in their saved shape (split
over the new 'pipeline' axis where it divides) and reshaped in one jitted step; both layouts list the
layers in the same order, so that is a reshape, never a permutation of the data.

Checkpoints written before the model's non-trainable state had its own entry (megajax/model/model_state.py:
FP8 amax counters, MoE statistics and routing bias inside "params", with optimizer moments of their own)
restore as they are: those arrays are read from "params" into "model_state", and their moments are left unread.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import config as config_lib
from megajax.config import Config, ModelConfig, StageSplit
from megajax.model import model_state
from megajax.parallel.pipeline.layout import STAGED, lead_dims, stage, unstage

STATE_FIELDS = ("step", "params", "model_state", "opt_state", "loss_scale", "good_steps", "bad_steps")


class CheckpointError(config_lib.InputError):
    """A checkpoint that cannot be restored as asked; the message names the parameters and the fix."""


def checkpoint_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.output_dir, "checkpoints"))


def manager(directory: str, keep: int = 3, use_async: bool = True, read_only: bool = False
            ) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=use_async, create=not read_only, read_only=read_only,
        cleanup_tmp_directories=not read_only)  # an interrupted or failed save's temporary directory
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_handlers=handlers)


def manager_for(cfg: Config) -> ocp.CheckpointManager:
    return manager(checkpoint_dir(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_)


def state_dict(state) -> dict:
    return {f: getattr(state, f) for f in STATE_FIELDS}


class UnreadableCheckpoint(Exception):
    """A saved array whose bytes read back differently from what was written (its checksum differs)."""


@jax.jit
def _checksum_arrays(tree):
    def one(x):
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[
                x.dtype.itemsize]).astype(jnp.uint32)
        mixed = (bits * jnp.uint32(0x9E3779B1)) ^ (bits >> 15)
        return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])

    return jax.tree.map(one, tree)


def checksums(tree) -> dict[str, list[int]]:
    """Per array (named as Orbax names it), two wrapping uint32 sums of its bit patterns, plain and mixed. Zero
    padding adds nothing and the order of a sum does not matter, so they do not depend on the layout (sharding,
    the pipeline's staging, the distributed optimizer's padding): a restore onto any layout can check them."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = jax.device_get(_checksum_arrays([x for _, x in flat]))
    return {path_name(path): [int(v) for v in s] for (path, _), s in zip(flat, sums)}


def metadata(cfg: Config, step: int, consumed: int) -> dict:
    """The meta item of a training checkpoint (besides the checksums): where the run is, its config (what resume
    compares, `check_same_model`) and the layout it was written with."""
    return {"step": step, "consumed_samples": consumed, "seed": cfg.train.seed, "config": cfg.to_dict(),
            "layout": {"data": cfg.parallel.data, "pipeline": cfg.parallel.pipeline,
                       "context": cfg.parallel.context, "tensor": cfg.parallel.tensor,
                       "instances": cfg.parallel.num_distributed_optimizer_instances,
                       "virtual_stages": cfg.parallel.virtual_stages,
                       "stage_units": list(cfg.stage_split.units) if cfg.parallel.pipeline > 1 else None}}


def save(mgr: ocp.CheckpointManager, step: int, state, cfg: Config, consumed: int) -> None:
    """Starts a save of the train state at `step` (`consumed` samples); with async checkpointing it returns once
    the arrays are copied off the devices. The meta item (`metadata`) records each array's checksums, which
    restore verifies."""
    state = state_dict(state)
    meta = {**metadata(cfg, step, consumed), "checksums": checksums(state)}
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
             force=True)


WRITE_ERRORS = ("No space left on device", "Disk quota exceeded", "Permission denied", "Read-only file system")


def write_failure(error: BaseException) -> str | None:
    """What the filesystem said when a save failed (no space, quota, permission, read-only), found in the error's
    chain (Orbax wraps the OSError, TensorStore reports it as text); None for any other error."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno and e.strerror:
            return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
        text = str(e)
        for known in WRITE_ERRORS:
            if known in text:
                return known
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def quiet_write_failures() -> None:
    """For entry points (it changes process-wide hooks). A save the filesystem refuses ends the run with one line
    (train.CheckpointSaveError). Orbax's writer threads and TensorStore's callbacks would print hundreds of lines
    of tracebacks about the same failure around it: Orbax's and asyncio's ERROR records naming a write error,
    'Event loop is closed' from callbacks of writes still in flight when Orbax closed its event loop, the writer
    threads' own errors, unawaited write coroutines at exit. Those are dropped; every other record and exception
    prints as before."""
    import logging
    import sys
    import threading
    import warnings

    def keep(record) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (any(known in record.getMessage() for known in WRITE_ERRORS)
                    or (error is not None and write_failure(error) is not None))

    for name in ("absl", "asyncio"):  # Orbax's records, and its write tasks' "exception was never retrieved"
        logging.getLogger(name).addFilter(keep)
    unraisable = sys.unraisablehook

    def quiet(arg):  # also at exit: threads that outlive the interpreter
        if not (arg.exc_type is RuntimeError and str(arg.exc_value) == "Event loop is closed"
                or write_failure(arg.exc_value) is not None
                or arg.exc_type is ImportError and "Python is likely shutting down" in str(arg.exc_value)):
            unraisable(arg)

    sys.unraisablehook = quiet
    thread_default = threading.excepthook

    def thread_hook(args):  # a writer thread's write failure: the main thread reports it; after
        # it, the same thread finding its queue closed by the main thread's close
        if not (write_failure(args.exc_value) is not None
                or args.exc_type is OSError and str(args.exc_value) == "handle is closed"):
            thread_default(args)

    threading.excepthook = thread_hook
    # Orbax's write coroutines that the failure left unawaited, reported as the interpreter exits
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message="Enable tracemalloc", category=RuntimeWarning)


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict:
    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def saved_shapes(mgr: ocp.CheckpointManager, step: int, tree=None) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every saved state array; names are dotted tree paths
    ("opt_state.1.mu.embed.embedding"). `tree`: the state item's metadata tree, where the caller has read it."""
    tree = mgr.item_metadata(step)["state"].tree if tree is None else tree
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    return [(getattr(a, "name", "?"), tuple(a.shape), str(a.dtype)) for a in leaves]


def path_name(path) -> str:
    """A tree path as Orbax names the saved array: keys, indices and attributes joined by dots."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _is_layer_leaf(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def _is_opt_leaf(path) -> bool:
    return bool(path) and getattr(path[0], "key", None) == "opt_state"


def _read_spec(saved_shape: tuple, want: jax.ShapeDtypeStruct, lead_saved: int, lead_want: int) -> P:
    """A sharding to read a leaf in its saved shape: the current sharding of the trailing dims where it
    divides the saved size, and for stacked layers 'pipeline' on the first leading dim it divides (so no
    device reads every layer)."""
    mesh = want.sharding.mesh
    spec = list(want.sharding.spec) + [None] * (len(want.shape) - len(want.sharding.spec))
    trailing = spec[lead_want:]
    leading = [None] * lead_saved
    if lead_want and "pipeline" in spec[:lead_want]:
        for i in range(lead_saved):
            if saved_shape[i] % mesh.shape["pipeline"] == 0:
                leading[i] = "pipeline"
                break
    out = leading + trailing
    for i, axes in enumerate(out):
        names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        if names and saved_shape[i] % math.prod(mesh.shape[a] for a in names):
            out[i] = None
    return P(*out)


def _convert(x: jax.Array, want_shape: tuple, lead_saved: int, lead_want: int, split_saved: StageSplit | None = None,
             split_want: StageSplit | None = None) -> jax.Array:
    """A saved leaf into the wanted layout: stacked layers moved between pipeline layouts (unstaged from the saved
    split, staged into the wanted one: layout.py; even splits list the layers in the same order, so a reshape),
    then the distributed optimizer's zero padding sliced off or added (the padding holds zeros, and both sizes are
    >= the true size)."""
    if lead_saved or lead_want:
        if lead_saved == len(STAGED):
            x = unstage(x, split_saved)
        if lead_want == len(STAGED):
            x = stage(x, split_want, want_shape[1])
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, want_shape))]
    return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, want_shape)])


def restore(mgr: ocp.CheckpointManager, step: int, abstract_state, shardings, cfg: Config) -> tuple[dict, dict]:
    """Restores `step` onto `shardings` (any mesh, any layout): returns (state fields, meta).

    Arrays are matched by their tree path. Parameters must have the wanted shape up to the pipeline
    layout of stacked layers; optimizer state, and the weights of a checkpoint of the same model (ZeRO-3 keeps
    them padded), may also differ by the distributed optimizer's padding.
    """
    meta = read_meta(mgr, step)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          state_dict(abstract_state), state_dict(shardings))
    # written before the model state had its own entry: read it from params (the module docstring)
    stored = mgr.item_metadata(step)["state"].tree
    legacy = "model_state" not in stored
    if legacy:
        target = {k: v for k, v in target.items() if k != "model_state"} | {
            "params": model_state.merge(target["params"], target["model_state"])}
    saved = {name: shape for name, shape, _ in saved_shapes(mgr, step, stored)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    names = [path_name(path) for path, _ in flat]
    missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if legacy:  # the optimizer moments of the state, which the optimizer no longer holds
        extra = [n for n in extra if not (n.startswith("opt_state.") and model_state.is_state_key(n.split(".")[-1]))]
    if missing or extra:
        raise CheckpointError(
            f"checkpoint step {step} in {mgr.directory} was written for a different model or optimizer: "
            + (f"this config's train state has {', '.join(missing[:8])}, which the checkpoint lacks; " if missing
               else "") + (f"the checkpoint has {', '.join(extra[:8])}, which this config lacks; " if extra else "")
            + f"its model config: {meta.get('config', {}).get('model')}")
    saved_pipeline = int(meta.get("layout", {}).get("pipeline", 1))
    splits = (_saved_split(meta, cfg), cfg.stage_split)
    # ZeRO-3 keeps weights with the distributed optimizer's zero padding (a size that depends on the data size):
    # a weight may then differ from the wanted one by padding alone, where both were written for the same model
    same_model = _same_model(meta, cfg)
    read, plans, mismatched = [], [], []
    for (path, want), name in zip(flat, names):
        shape = saved[name]
        leads = ((lead_dims(saved_pipeline > 1), lead_dims(cfg.parallel.pipeline > 1), *splits)
                 if _is_layer_leaf(path) else (0, 0))
        if shape == want.shape:
            read.append(want)
            plans.append(None)
        elif _fits(shape, want.shape, *leads, padded=_is_opt_leaf(path) or same_model):
            read.append(jax.ShapeDtypeStruct(shape, want.dtype, sharding=NamedSharding(
                want.sharding.mesh, _read_spec(shape, want, *leads[:2]))))
            plans.append(leads)
        else:
            mismatched.append(f"{jax.tree_util.keystr(path)}: checkpoint {shape}, config {want.shape}")
    if mismatched:
        raise CheckpointError(
            f"checkpoint step {step} in {mgr.directory} does not fit this config; mismatched parameters:\n  "
            + "\n  ".join(mismatched[:20]) + "\nRestore with the model settings it was trained with "
            "(see `python -m megajax.checkpoint inspect DIR`), or start a new run elsewhere (checkpoint.dir).")
    item = jax.tree_util.tree_unflatten(treedef, read)
    if legacy:  # a partial read: not the state's optimizer moments
        args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=True)
        out = ocp.PyTreeCheckpointer().restore(os.path.join(mgr.directory, str(step), "state"), args=args)
    else:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(item)))["state"]
    if any(plan is not None for plan in plans):
        wants = [w for _, w in flat]
        convert = jax.jit(lambda xs: [x if plan is None else _convert(x, w.shape, *plan)
                                      for x, w, plan in zip(xs, wants, plans)],
                          out_shardings=[w.sharding for w in wants])
        out = jax.tree_util.tree_unflatten(treedef, convert(jax.tree.leaves(out)))
    if "checksums" in meta:
        bad = [name for name, sums in checksums(out).items() if meta["checksums"].get(name, sums) != sums]
        if bad:
            raise UnreadableCheckpoint(f'Error reading "{bad[0]}": it does not match the checksum saved with it'
                                       + (f" ({len(bad) - 1} more arrays do not either)" if len(bad) > 1 else ""))
    if legacy:
        out["params"], out["model_state"] = model_state.split(out["params"])
    return out, meta


def unreadable_reason(error: Exception) -> str:
    """One line for a checkpoint read that failed inside Orbax / TensorStore: the array it names, if any."""
    import re

    text = str(error)
    array = re.search(r'Error reading "([^"/]+)', text) or re.search(r"'path': '([^'/]+)", text)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"array {array.group(1)} cannot be read" if array else first[:200]


def restore_newest_readable(mgr: ocp.CheckpointManager, abstract_state, shardings, cfg: Config, log
                            ) -> tuple[dict, dict] | None:
    """Restores checkpoint.resume_step, else the newest step that reads completely (None: there is none yet).

    A step that cannot be read (a truncated or damaged array file) is reported in one line and moved aside
    to `<step>.unreadable` (process 0 renames it: kept for inspection, never deleted or overwritten), and the
    next older step is tried. A checkpoint of another model is a CheckpointError at once, as is an unreadable
    checkpoint.resume_step. Rolling back to an older checkpoint.resume_step moves the later steps aside
    (`<step>.abandoned`)."""
    steps = sorted(mgr.all_steps(), reverse=True)
    wanted = cfg.checkpoint.resume_step
    if wanted is not None and wanted not in steps:
        raise CheckpointError(f"checkpoint.resume_step={wanted} is not in {mgr.directory} (steps: {steps}): "
                              "pick one of those, or null for the newest")
    for i, step in enumerate([wanted] if wanted is not None else steps):
        try:
            restored = restore(mgr, step, abstract_state, shardings, cfg)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (TensorStore's and Orbax's read errors have no common type)
            reason = unreadable_reason(e)
            if wanted is not None:
                raise CheckpointError(f"checkpoint step {step} in {mgr.directory} cannot be read: {reason}") from e
            rest = steps[i + 1:]
            aside = _move_aside(mgr, step, "unreadable")
            log.info(f"warning: checkpoint step {step} cannot be read ({reason}); moved aside to {aside}, "
                     + (f"resuming from step {rest[0]}" if rest else "no older step: starting from scratch"))
            mgr.reload()
            continue
        if wanted is not None and steps[0] > wanted:  # once the step it rolls back to has read completely
            _abandon_later_steps(mgr, [s for s in steps if s > wanted], wanted, log)
        return restored
    return None


def _aside_name(directory: str, step: int, why: str) -> str:
    """`<step>.<why>`, or `<step>.<why>.2`, .3, .. when an earlier one is there (never overwritten)."""
    base = os.path.join(directory, f"{step}.{why}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}.{n}"
    return path


def _move_aside(mgr: ocp.CheckpointManager, step: int, why: str) -> str:
    """Renames checkpoint `step` to a fresh `<step>.<why>[.n]` beside it (process 0; the others wait for it), kept
    for inspection and never deleted. Returns the new path."""
    directory = str(mgr.directory)
    aside = _aside_name(directory, step, why)
    if jax.process_index() == 0:
        os.replace(os.path.join(directory, str(step)), aside)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"megajax checkpoint {step} moved aside")
    return aside


def _abandon_later_steps(mgr: ocp.CheckpointManager, later: list[int], wanted: int, log) -> None:
    """checkpoint.resume_step rolls the run back: the abandoned timeline's later steps move aside (as
    `<step>.abandoned`), so the new timeline's saves of those step numbers neither collide with them nor
    are mixed with them on a later resume."""
    moved = [_move_aside(mgr, step, "abandoned") for step in sorted(later)]
    log.info(f"checkpoint.resume_step={wanted}: the later steps {sorted(later)} of the timeline it leaves moved "
             f"aside ({', '.join(os.path.basename(m) for m in moved)} in {mgr.directory})")
    mgr.reload()


def check_same_model(stored: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """The architecture a checkpoint was written for must be the one being built (the keys megajax/config/model.py marks
    `defines_model`, compared by their resolved values); names each differing key as config.yaml spells it."""
    # A resolved value can differ while its key does not (num_kv_heads null on both sides, num_heads not): the
    # difference is then named under the key it comes from, which is compared too.
    diffs = [f"model.{key}: {getattr(stored, key)!r} in the checkpoint, {getattr(wanted, key)!r} here"
             for key, value in config_lib.model_defining_fields().items()
             if getattr(stored, value) != getattr(wanted, value) and getattr(stored, key) != getattr(wanted, key)]
    if stored.arch == "gpt2" and stored.seq_length != wanted.seq_length:
        diffs.append(f"model.seq_length (GPT-2's position embedding): {stored.seq_length} in the checkpoint, "
                     f"{wanted.seq_length} here")
    if diffs:
        raise config_lib.ConfigError(f"{where} holds a different model: {'; '.join(diffs)}. Use the config written "
                                     "with it (its config.yaml, or megajax.convert --config-out)")


def _same_model(meta: dict, cfg: Config) -> bool:
    """Whether the checkpoint's saved config defines the model `cfg` does (megajax/config/model.py's
    `defines_model` keys)."""
    from megajax.config import io as config_io

    try:
        check_same_model(config_io.from_dict(meta["config"]).model, cfg.model, "")
    except (KeyError, config_lib.ConfigError, ValueError, TypeError):
        return False
    return True


def _saved_split(meta: dict, cfg: Config) -> StageSplit:
    """How the checkpoint's pipeline split the stacked layers (restore checks the model is the same): its
    layout's stage_units, else (written before uneven stages) an even split over its pipeline x virtual stages."""
    layout = meta.get("layout", {})
    if layout.get("stage_units"):
        units = tuple(int(n) for n in layout["stage_units"])
    else:
        chunks = int(layout.get("pipeline", 1)) * int(layout.get("virtual_stages", 1))
        total = cfg.model.stacked_layers // cfg.model.layer_period
        units = (total // chunks,) * chunks
    return StageSplit(units, units)  # (restore reads the units alone; the meta does not record the layers)


def _fits(saved: tuple, want: tuple, lead_saved: int, lead_want: int, split_saved: StageSplit | None = None,
          split_want: StageSplit | None = None, padded: bool = False) -> bool:
    """Whether a saved leaf converts into the wanted shape: the same layers in another pipeline layout,
    and (optimizer state, or ZeRO-3's weights: `padded`) trailing dims that differ only by the distributed
    optimizer's padding."""
    def units(shape, lead, split):  # the stacked layers a leaf holds
        if lead == len(STAGED):
            return sum(split.units) if math.prod(shape[:lead]) == len(split.units) * split.slots else -1
        return math.prod(shape[:lead])

    if len(saved) - lead_saved != len(want) - lead_want or \
            units(saved, lead_saved, split_saved) != units(want, lead_want, split_want):
        return False
    differ = [i for i, (a, b) in enumerate(zip(saved[lead_saved:], want[lead_want:])) if a != b]
    return not differ or (padded and len(differ) == 1)


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
