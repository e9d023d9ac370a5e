"""Attention: the jnp reference (impl="xla"), and the dispatch to the Pallas flash attention kernels
(impl="pallas", megajax/kernels/flash_attention.py) or cuDNN (impl="cudnn").

q [b, s, h, k], k and v [b, s, g, k] with h a multiple of g (grouped-query attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from megajax.kernels.flash_attention import flash_attention


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    probs_dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v in fp32, returned in q's dtype. [b,s,h,k] x [b,t,g,k] -> [b,s,h,k]."""
    b, s, h, d = q.shape
    t, g = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(b, s, g, h // g, d)
    logits = jnp.einsum("bsgrk,btgk->bgrst", qg, k, preferred_element_type=jnp.float32) * scale
    mask = None
    if causal:
        mask = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
        mask = mask[None, None, None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, s, t]
        same = same[:, None, None]
        mask = same if mask is None else mask & same
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if probs_dropout is not None:  # the model's layout-independent dropout on [b, g, r, s, t]
        probs = probs_dropout(probs)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
    probs_dropout: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Dispatches to the chosen implementation; all take and return [b, s, h, k].

    probs_dropout, if given, is applied to the attention probabilities (only impl="xla" supports it).
    """
    if impl == "xla":
        return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
                                   probs_dropout=probs_dropout)
    if probs_dropout is not None:
        raise ValueError(f"attention dropout is only implemented for impl='xla', got impl={impl!r}: "
                         "set model.attention_dropout=0 or model.attention_impl=xla")
    if impl == "cudnn":
        if segment_ids is not None:
            raise ValueError("impl='cudnn' does not take segment_ids here: use impl='xla' or 'pallas'")
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
    if impl == "pallas":
        # Under a mesh the kernels run per shard: heads over 'tensor', batch over 'data' (launch.py).
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale)
    raise ValueError(f"unknown attention impl {impl!r}: use xla, pallas or cudnn")
