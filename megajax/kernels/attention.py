"""Attention: the jnp reference (impl="xla"), and the dispatch to the Pallas flash attention kernels
(impl="pallas", megajax/kernels/flash_attention.py), cuDNN (impl="cudnn"), or the fused kernel on GPUs and the
reference on CPU (impl="auto", megajax/kernels/auto.py).

q [b, s, h, k], k [b, s, g, k] and v [b, s, g, k_v] with h a multiple of g (grouped-query attention); the values may
be narrower than the queries and keys (multi-latent attention), and the output is [b, s, h, k_v].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from megajax.kernels.auto import attention_fallback, by_platform
from megajax.kernels.cudnn_attention import cudnn_attention
from megajax.kernels.dropout import AttentionDropout, column_words, dropped
from megajax.kernels.flash_attention import flash_attention


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    probs_dropout: AttentionDropout | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v in fp32, returned in q's dtype. [b,s,h,k] x [b,t,g,k], [b,t,g,k_v] ->
    [b,s,h,k_v]. probs_dropout: dropout on the probabilities, by their heads' and positions' hash (dropout.py)."""
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
        probs = dropped(probs, probs_dropout.row_words(jnp.arange(s)), column_words(jnp.arange(t)), probs_dropout.rate)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, v.shape[-1]).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
    probs_dropout: AttentionDropout | None = None,
) -> jax.Array:
    """Dispatches to the chosen implementation; all take and return [b, s, h, k].

    probs_dropout, if given, is applied to the attention probabilities: the same entries by "xla" and "pallas"
    (dropout.py); "cudnn" takes none.
    """
    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
                                   probs_dropout=probs_dropout)

    flash = functools.partial(flash_attention, causal=causal, segment_ids=segment_ids, scale=scale,
                              probs_dropout=probs_dropout)
    if impl == "auto":
        if attention_fallback(q.shape[-1]):
            return reference(q, k, v)
        return by_platform(q, k, v, cpu=reference, gpu=flash)
    if impl == "xla":
        return reference(q, k, v)
    if impl == "cudnn":
        if probs_dropout is not None:
            raise ValueError("impl='cudnn' takes no attention dropout here (its own draws other entries than "
                             "megajax's): set model.attention_impl=pallas or xla, or model.attention_dropout=0")
        if segment_ids is not None:
            raise ValueError("impl='cudnn' does not take segment_ids here: use impl='xla' or 'pallas'")
        return cudnn_attention(q, k, v, causal=causal, scale=scale)
    if impl == "pallas":
        # Under a mesh the kernels run per shard: heads over 'tensor', batch over 'data' (launch.py).
        return flash(q, k, v)
    raise ValueError(f"unknown attention impl {impl!r}: use auto, xla, pallas or cudnn")


# ----------------------------------------------------------------------------------------------------
# One block of a blockwise attention (the context-parallel ring, megajax/model/ring.py): the output with its
# log-sum-exp, and the backward from the whole attention's log-sum-exp and delta. The Pallas equivalents are
# flash_block_forward / flash_block_backward. `drop` is attention dropout's (row words [b, h, s], column words [t],
# rate) for the block's queries and keys (dropout.py): the probabilities are dropped where they weight the values,
# their log-sum-exp is of the whole ones.


def _block_probs_logits(q, k, q_seg, k_seg, causal: bool, scale: float):
    """fp32 logits [b, g, r, s, t] with the causal (s == t, the diagonal block) and segment masks."""
    b, s, h, d = q.shape
    t, g = k.shape[1], k.shape[2]
    qg = q.reshape(b, s, g, h // g, d)
    logits = jnp.einsum("bsgrk,btgk->bgrst", qg, k, preferred_element_type=jnp.float32) * scale
    mask = None
    if causal:
        mask = (jnp.arange(s)[:, None] >= jnp.arange(t)[None, :])[None, None, None]
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    return logits if mask is None else jnp.where(mask, logits, jnp.finfo(jnp.float32).min)


def attention_block_forward(q, k, v, q_seg=None, k_seg=None, *, causal: bool, scale: float, drop=None):
    """(o [b, s, h, k_v] fp32, lse [b, h, s] fp32, natural log) of q over this block of keys alone."""
    b, s, h, _ = q.shape
    logits = _block_probs_logits(q, k, q_seg, k_seg, causal, scale)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    if drop is not None:
        probs = dropped(probs, *drop)
    o = jnp.einsum("bgrst,btgk->bsgrk", probs, v.astype(jnp.float32))
    return o.reshape(b, s, h, v.shape[-1]), lse.reshape(b, h, s)


def attention_block_backward(q, k, v, do, lse, delta, q_seg=None, k_seg=None, *, causal: bool, scale: float,
                             drop=None):
    """(dq, dk, dv) in fp32 of this block's share of an attention whose log-sum-exp per query is lse [b, h, s]
    and delta = rowsum(o * do) [b, h, s] (both of the whole attention, not of this block)."""
    b, s, h, d = q.shape
    g = k.shape[2]
    logits = _block_probs_logits(q, k, q_seg, k_seg, causal, scale)
    rows = lambda x: x.reshape(b, g, h // g, s)[..., None]  # noqa: E731
    probs = jnp.exp(logits - rows(lse))
    qg = q.reshape(b, s, g, h // g, d).astype(jnp.float32)
    dog = do.reshape(b, s, g, h // g, v.shape[-1]).astype(jnp.float32)
    keep = (lambda x: x) if drop is None else (lambda x: dropped(x, *drop))  # noqa: E731
    dv = jnp.einsum("bgrst,bsgrk->btgk", keep(probs), dog)
    ds = probs * (keep(jnp.einsum("bsgrk,btgk->bgrst", dog, v.astype(jnp.float32))) - rows(delta))
    dq = jnp.einsum("bgrst,btgk->bsgrk", ds, k.astype(jnp.float32)) * scale
    dk = jnp.einsum("bgrst,bsgrk->btgk", ds, qg) * scale
    return dq.reshape(b, s, h, d), dk, dv
