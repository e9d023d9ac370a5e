"""Stacked layers [L, ...] <-> pipeline layout [v, p, L / (p v), ...]: the one home of the staged layout.

Chunk c (0 <= c < p v) holds layers [c Lc, (c + 1) Lc) and lives on rank c mod p as local chunk c // p
(Megatron's interleaved assignment). A plain reshape does exactly that: element [i, r, j] of the staged
array is layer (i p + r) Lc + j, chunk i p + r. The staged dims have logical names ("chunk", "stage",
"layers"), and the rules table (megajax.sharding) maps "stage" to 'pipeline', so each rank holds its chunks.
"""

from __future__ import annotations

import jax

STAGED = ("chunk", "stage", "layers")  # [v, p, L / (p v)]: local chunk, pipeline rank, layer in the chunk


def lead_dims(pipelined: bool) -> int:
    """Leading dims of a stacked-layer leaf: [L, ...] without a pipeline, [v, p, L / (p v), ...] with one."""
    return len(STAGED) if pipelined else 1


def layout_names(names: tuple, pipelined: bool) -> tuple:
    """A parameter's logical names in the train state: a stacked layer's 'layers' becomes STAGED."""
    if pipelined and names[:1] == ("layers",):
        return STAGED + tuple(names[1:])
    return tuple(names)


def to_stages(params: dict, p: int, v: int) -> dict:
    def stage(x):
        return x.reshape(v, p, x.shape[0] // (p * v), *x.shape[1:])

    return {**params, "layers": jax.tree.map(stage, params["layers"])}


def from_stages(params: dict) -> dict:
    def unstage(x):
        return x.reshape(x.shape[0] * x.shape[1] * x.shape[2], *x.shape[3:])

    return {**params, "layers": jax.tree.map(unstage, params["layers"])}


def local_chunks(layers):
    """Inside the train step's shard_map: this rank's [v, 1, Lc, ...] shard of the stacked layers as its
    v chunks [v, Lc, ...]."""
    return jax.tree.map(lambda x: x[:, 0], layers)
