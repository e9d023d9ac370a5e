"""LayerNorm and RMSNorm: the jnp references (impl="xla") and the dispatch to the fused Pallas kernels
(impl="pallas", megajax/kernels/fused_norm.py); impl="auto": the fused kernel on GPUs, the reference on CPU
(megajax/kernels/auto.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from megajax.kernels.auto import by_platform, norm_fallback
from megajax.kernels.fused_norm import layer_norm_pallas, rms_norm_pallas
from megajax.kernels.keep_inputs import keeps_inputs


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


def _cast(y: jax.Array, out_dtype: DTypeLike | None) -> jax.Array:
    return y if out_dtype is None else y.astype(out_dtype)


# The references keep only their inputs for the backward and recompute the statistics there: autodiff would keep
# three fp32 copies of x (12 bytes an element against the input's 2), which the backward reads back anyway.
@keeps_inputs(static_argnums=(3, 4))
def _layer_norm_xla(x, scale, bias, eps, out_dtype):
    return _cast(layer_norm_reference(x, scale, bias, eps), out_dtype)


@keeps_inputs(static_argnums=(2, 3))
def _rms_norm_xla(x, scale, eps, out_dtype):
    return _cast(rms_norm_reference(x, scale, eps), out_dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5, *, impl: str = "xla",
               out_dtype: DTypeLike | None = None) -> jax.Array:
    """LayerNorm over the last dim, statistics in fp32. x [..., d], scale and bias [d] -> [..., d].

    Returns fp32 unless out_dtype is given (the fused kernel then writes that dtype directly).
    """
    if impl == "auto":
        return _auto(x, _layer_norm_xla, layer_norm_pallas, scale, bias, eps, out_dtype)
    if impl == "xla":
        return _layer_norm_xla(x, scale, bias, eps, out_dtype)
    if impl == "pallas":
        return layer_norm_pallas(x, scale, bias, eps, out_dtype=out_dtype)
    raise ValueError(f"unknown norm impl {impl!r}: use auto, xla or pallas")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6, *, impl: str = "xla",
             out_dtype: DTypeLike | None = None) -> jax.Array:
    """RMSNorm over the last dim, statistics in fp32. x [..., d], scale [d] -> [..., d] (fp32 unless
    out_dtype is given)."""
    if impl == "auto":
        return _auto(x, _rms_norm_xla, rms_norm_pallas, scale, eps, out_dtype)
    if impl == "xla":
        return _rms_norm_xla(x, scale, eps, out_dtype)
    if impl == "pallas":
        return rms_norm_pallas(x, scale, eps, out_dtype=out_dtype)
    raise ValueError(f"unknown norm impl {impl!r}: use auto, xla or pallas")


def _auto(x, reference, fused, *params_eps_dtype):
    """impl="auto": `fused` on GPUs, `reference` on CPU or where the fused kernel cannot take the row width."""
    *params, eps, out_dtype = params_eps_dtype
    if norm_fallback(x.shape[-1]):
        return reference(x, *params, eps, out_dtype)
    return by_platform(x, *params, cpu=lambda *a: reference(*a, eps, out_dtype),
                       gpu=lambda *a: fused(*a, eps, out_dtype=out_dtype))
