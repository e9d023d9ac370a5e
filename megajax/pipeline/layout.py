"""Stacked layers [L, ...] <-> pipeline layout [v, p, L / (p v), ...].

Chunk c (0 <= c < p v) holds layers [c Lc, (c + 1) Lc) and lives on rank c mod p as local chunk c // p
(Megatron's interleaved assignment). A plain reshape does exactly that: element [i, r, j] of the staged
array is layer (i p + r) Lc + j, chunk i p + r. Sharding axis 1 over 'pipeline' gives each rank its chunks.
"""

from __future__ import annotations

import jax


def to_stages(params: dict, p: int, v: int) -> dict:
    def stage(x):
        return x.reshape(v, p, x.shape[0] // (p * v), *x.shape[1:])

    return {**params, "layers": jax.tree.map(stage, params["layers"])}


def from_stages(params: dict) -> dict:
    def unstage(x):
        return x.reshape(x.shape[0] * x.shape[1] * x.shape[2], *x.shape[3:])

    return {**params, "layers": jax.tree.map(unstage, params["layers"])}
