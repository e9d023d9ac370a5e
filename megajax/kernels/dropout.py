"""Dropout by position. Whether an element is kept is a hash of where it lies, never of the array that holds it:
on the residual branches (model.dropout) of (the sample's seed for the site, the token's position in the sequence,
the feature: `kept_features`); on the attention probabilities (model.attention_dropout) of (the sample's seed for
the layer, the head, the query position, the key position: `AttentionDropout`). So every piece of an activation
draws its own piece of one mask, and draws it the same, on any layout: a context rank its tokens, XLA's attention
the whole [s, s], the flash kernels tile by tile, a context-parallel ring block by block, an all-to-all's heads;
a backward draws it again instead of keeping it.

The hash comes in two words: a row word per (sample, token) [b, s] or (sample, head, query position) [b, h, s]
(attention's, computed once per attention, as wide as its log-sum-exp) and a column word per feature or key
position (`column_words`); an element is kept where mix(row ^ column) < (1 - rate) 2^32 (`kept`): one 32-bit mix
per element, which fuses into the neighbouring fusion (XLA) or the tile (Pallas). mix is a 32-bit avalanche
finalizer (Wellons' lowbias32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_M1, _M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)
_GOLDEN, _COLUMN = np.uint32(0x9E3779B9), np.uint32(0x632BE5AB)


def mix(x: jax.Array) -> jax.Array:
    """A uint32 avalanche: every output bit depends on every input bit (jnp, and inside Pallas kernels)."""
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 16)


def threshold(rate: float) -> np.uint32:
    """The uint32 below which a hashed entry is kept: (1 - rate) of the range."""
    return np.uint32(min(round((1.0 - rate) * 2.0**32), 2**32 - 1))


def column_words(positions: jax.Array) -> jax.Array:
    """The column word [t] uint32 of each key position (attention) or feature (the residual branches)."""
    return mix(positions.astype(jnp.uint32) * _GOLDEN + _COLUMN)


def kept(rows: jax.Array, columns: jax.Array, rate: float) -> jax.Array:
    """Whether each entry of rows x columns is kept: [..., s] x [t] -> bool [..., s, t]."""
    return mix(rows[..., None] ^ columns) < threshold(rate)


def dropped(x: jax.Array, rows: jax.Array, columns: jax.Array, rate: float) -> jax.Array:
    """x [..., s, t] with the dropped entries zeroed and the rest scaled by 1 / (1 - rate): rows (`row_words`)
    holding x's leading elements, as [b, g r, s] for probabilities [b, g, r, s, t] (head g r + i at [:, g, i]) or a
    kernel tile's [s]; columns [t] (`column_words`). Also the gradient of what was dropped so (jnp, and inside
    Pallas kernels)."""
    keep = kept(rows.reshape(x.shape[:-1]), columns, rate)
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0)


def seeds(keys: jax.Array, salt: int | jax.Array) -> jax.Array:
    """Each sample's seed words [b, 2] uint32 for the site `salt`, from its key [b] (typed PRNG keys): the key's
    first two words, each mixed with the salt. (A threefry fold_in per site and layer cost more to compile than the
    masks themselves: a CPU pipeline step with dropout, 17.6 s of XLA compile against 12.4.)"""
    words = jax.random.key_data(keys).astype(jnp.uint32)
    salt = mix(jnp.asarray(salt).astype(jnp.uint32) * _GOLDEN + _COLUMN)
    first = mix(words[:, 0] ^ salt)
    return jnp.stack([first, mix(words[:, 1] ^ mix(first + salt))], axis=1)


def kept_features(seeds_b2: jax.Array, positions: jax.Array, width: int, rate: float) -> jax.Array:
    """Whether each feature of each token is kept, bool [b, s, width]: tokens at `positions` [s] in the sequence."""
    rows = mix(mix(seeds_b2[:, 0, None] ^ mix(positions.astype(jnp.uint32) ^ _GOLDEN)) + seeds_b2[:, 1, None])
    return kept(rows, column_words(jnp.arange(width)), rate)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionDropout:
    """One layer's attention dropout: each sample's seed words [b, 2] uint32 (`seeds`) and the global index of each
    head the attention holds [h] int32 (0 .. h - 1 on one device; an all-to-all's ranks hold other heads)."""

    seeds: jax.Array
    heads: jax.Array
    rate: float = dataclasses.field(metadata=dict(static=True), default=0.0)

    @staticmethod
    def of(keys: jax.Array, salt: int | jax.Array, rate: float, heads: int) -> AttentionDropout:
        """The dropout of the site `salt` from each sample's key [b] (typed PRNG keys) over `heads` heads."""
        return AttentionDropout(seeds(keys, salt), jnp.arange(heads, dtype=jnp.int32), rate)

    def with_heads(self, heads: jax.Array) -> AttentionDropout:
        return dataclasses.replace(self, heads=heads)

    def row_words(self, positions: jax.Array) -> jax.Array:
        """The row word [b, h, s] uint32 of each (sample, head, query position)."""
        s0, s1 = self.seeds[:, 0, None], self.seeds[:, 1, None]
        head = mix(s0 ^ mix(self.heads.astype(jnp.uint32) + s1))  # [b, h]
        return mix(head[..., None] + mix(positions.astype(jnp.uint32) ^ _GOLDEN))
