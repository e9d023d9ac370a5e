"""LayerNorm and RMSNorm: the jnp references (impl="xla"); the fused Pallas kernels plug in here."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_norm_reference(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last dim in fp32; returns fp32. x [..., d], scale and bias [d]."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


def rms_norm_reference(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dim in fp32; returns fp32. x [..., d], scale [d]."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return xf * jax.lax.rsqrt(ms + eps) * scale.astype(jnp.float32)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5, *, impl: str = "xla") -> jax.Array:
    if impl == "xla":
        return layer_norm_reference(x, scale, bias, eps)
    if impl == "pallas":
        raise NotImplementedError("the fused Pallas LayerNorm is not built yet: use model.norm_impl=xla")
    raise ValueError(f"unknown norm impl {impl!r}: use xla or pallas")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6, *, impl: str = "xla") -> jax.Array:
    if impl == "xla":
        return rms_norm_reference(x, scale, eps)
    if impl == "pallas":
        raise NotImplementedError("the fused Pallas RMSNorm is not built yet: use model.norm_impl=xla")
    raise ValueError(f"unknown norm impl {impl!r}: use xla or pallas")
