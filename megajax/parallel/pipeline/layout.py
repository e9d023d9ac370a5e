"""Stacked layers [L, ...] <-> pipeline layout [v, p, S, ...]: the one home of the staged layout.

Global chunk c (0 <= c < p v) lives on rank c mod p as local chunk c // p (Megatron's interleaved
assignment) and holds the stack's units [starts[c], starts[c] + units[c]) of `Config.stage_split`. Every chunk
has S = max(units) slots: element [i, r, j] of the staged array is unit starts[i p + r] + j, and a chunk with
fewer units (uneven stages: parallel.decoder_first/last_pipeline_num_layers, parallel.account_for_*) leaves its
last slots empty: zero weights that the executor skips (chunks.unless_empty), which get zero gradients and stay
zero. With an even split S = L / (p v) and staging is a plain reshape. The staged dims have logical names
("chunk", "stage", "layers"), and the rules table (megajax.parallel.step_plan) maps "stage" to 'pipeline', so each rank
holds its chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import StageSplit

STAGED = ("chunk", "stage", "layers")  # [v, p, S]: local chunk, pipeline rank, slot in the chunk


def lead_dims(pipelined: bool) -> int:
    """Leading dims of a stacked-layer leaf: [L, ...] without a pipeline, [v, p, S, ...] with one."""
    return len(STAGED) if pipelined else 1


def layout_names(names: tuple, pipelined: bool) -> tuple:
    """A parameter's logical names in the train state: a stacked layer's 'layers' becomes STAGED."""
    if pipelined and names[:1] == ("layers",):
        return STAGED + tuple(names[1:])
    return tuple(names)


def _slot_units(split: StageSplit, p: int) -> np.ndarray:
    """[v, p, S]: the stack index of the unit in each slot, the stack's length (a zero row) where it is empty."""
    total, slots = sum(split.units), split.slots
    v = len(split.units) // p
    index = np.full((v * p, slots), total, np.int32)
    for c, (start, n) in enumerate(zip(split.starts, split.units)):
        index[c, :n] = np.arange(start, start + n)
    return index.reshape(v, p, slots)


def _filled(split: StageSplit) -> np.ndarray:
    """The flat [v p S] positions of the filled slots, in stack order."""
    return np.asarray([c * split.slots + j for c, n in enumerate(split.units) for j in range(n)], np.int32)


def stage(x, split: StageSplit, p: int):
    """One stacked leaf [L, ...] -> [v, p, S, ...] (NumPy or JAX arrays)."""
    v = len(split.units) // p
    if split.even:
        return x.reshape(v, p, split.slots, *x.shape[1:])
    xp = np if isinstance(x, np.ndarray) else jnp
    padded = xp.concatenate([x, xp.zeros((1, *x.shape[1:]), x.dtype)])
    return padded[_slot_units(split, p)]


def unstage(x, split: StageSplit):
    """One staged leaf [v, p, S, ...] -> [L, ...]: the filled slots in stack order."""
    flat = x.reshape(x.shape[0] * x.shape[1] * x.shape[2], *x.shape[3:])
    return flat if split.even else flat[_filled(split)]


def to_stages(params: dict, split: StageSplit, p: int) -> dict:
    return {**params, "layers": jax.tree.map(lambda x: stage(x, split, p), params["layers"])}


def from_stages(params: dict, split: StageSplit) -> dict:
    return {**params, "layers": jax.tree.map(lambda x: unstage(x, split), params["layers"])}


def chunk_tables(split: StageSplit, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, units), each [v, p]: per local chunk and rank, the stack index of its first unit and how many
    of its slots hold units."""
    v = len(split.units) // p
    return (np.asarray(split.starts, np.int32).reshape(v, p), np.asarray(split.units, np.int32).reshape(v, p))


def local_chunks(layers):
    """Inside the train step's shard_map: this rank's [v, 1, S, ...] shard of the stacked layers as its
    v chunks [v, S, ...]."""
    return jax.tree.map(lambda x: x[:, 0], layers)
