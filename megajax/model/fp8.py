"""FP8 matmuls for the linear layers (model.fp8): Transformer Engine's formats with current per-tensor scaling.

Each operand is scaled by a power of two chosen from its own absolute maximum (the largest 2^e with amax x 2^e <=
the format's maximum), cast to FP8, multiplied with fp32 accumulation, and the product unscaled:
  forward          y  = (x_q . w_q) / (s_x s_w)          x, w in e4m3
  input gradient   dx = (dy_q . w_q^T) / (s_dy s_w)      dy in e5m2 (hybrid) or e4m3
  weight gradient  dw = (x_q^T . dy_q) / (s_x s_dy)
The FP8 copies of x and w are what the backward keeps (half the bytes of bf16 residuals). Scales are powers of
two, so rescaling never rounds, and a tensor split over shards quantizes the same on every layout except for
values near the bottom of the format's range. An amax over a tensor sharded by GSPMD ('tensor') is a max over
every shard; inside the step's manual data axis each data rank scales its own micro batch (current scaling
needs no state and no cross-rank reduction; Transformer Engine's current scaling reduces over the tensor group).

XLA's GPU compiler turns each of these dots into a cuBLASLt FP8 GEMM on H100 (sm_90); on CPU the same program
runs emulated (the FP8 values are exact, the products are taken in fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (forward operands, output gradient) per model.fp8
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}


def scale_for(x: jax.Array, dtype) -> jax.Array:
    """The power of two that maps x's absolute maximum to at most the format's maximum (1 for an all-zero or
    non-finite x, so a NaN reaches the loss instead of being hidden by the scale)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    _, exponent = jnp.frexp(float(jnp.finfo(dtype).max) / amax)  # = mantissa in [0.5, 1) x 2^exponent, exactly
    scale = jnp.ldexp(jnp.float32(1), exponent - 1)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x x scale as FP8, scale)."""
    scale = scale_for(x, dtype)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype), scale


def _operands(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return x, w, out


def _dot(spec: str, a: jax.Array, b: jax.Array, inv_scale: jax.Array, dtype) -> jax.Array:
    return (jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * inv_scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def einsum(spec: str, fmt: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) with FP8 operands (x and w of the same dtype; the result has it too)."""
    return _forward(spec, fmt, x, w)[0]


def _forward(spec, fmt, x, w):
    forward, _ = FORMATS[fmt]
    xq, sx = quantize(x, forward)
    wq, sw = quantize(w, forward)
    return _dot(spec, xq, wq, 1.0 / (sx * sw), x.dtype), (xq, sx, wq, sw)


def _backward(spec, fmt, residuals, dy):
    xq, sx, wq, sw = residuals
    _, gradient = FORMATS[fmt]
    dyq, sdy = quantize(dy, gradient)
    x_sub, w_sub, y_sub = _operands(spec)
    dx = _dot(f"{y_sub},{w_sub}->{x_sub}", dyq, wq, 1.0 / (sdy * sw), dy.dtype)
    dw = _dot(f"{x_sub},{y_sub}->{w_sub}", xq, dyq, 1.0 / (sx * sdy), dy.dtype)
    return dx, dw


einsum.defvjp(_forward, _backward)


def weight_grad(spec: str, fmt: str, x: jax.Array, dy: jax.Array) -> jax.Array:
    """The weight gradient of `einsum(spec, fmt, x, w)` from x and the output gradient, as its backward computes
    it (for the zero-bubble schedule's deferred W pass)."""
    forward, gradient = FORMATS[fmt]
    xq, sx = quantize(x, forward)
    dyq, sdy = quantize(dy, gradient)
    x_sub, w_sub, y_sub = _operands(spec)
    return _dot(f"{x_sub},{y_sub}->{w_sub}", xq, dyq, 1.0 / (sx * sdy), dy.dtype)


_RAGGED_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ragged_dot(fmt: str, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x [n, d], w [g, d, f], sizes [g]) with FP8 operands (a mixture of experts' grouped
    matmul: rows grouped by expert). One scale per operand over all groups."""
    return _ragged_forward(fmt, x, w, sizes)[0]


def _ragged_forward(fmt, x, w, sizes):
    forward, _ = FORMATS[fmt]
    xq, sx = quantize(x, forward)
    wq, sw = quantize(w, forward)
    y = jax.lax.ragged_dot(xq, wq, sizes, preferred_element_type=jnp.float32) * (1.0 / (sx * sw))
    return y.astype(x.dtype), (xq, sx, wq, sw, sizes)


def _ragged_backward(fmt, residuals, dy):
    xq, sx, wq, sw, sizes = residuals
    _, gradient = FORMATS[fmt]
    dyq, sdy = quantize(dy, gradient)
    dx = jax.lax.ragged_dot(dyq, jnp.swapaxes(wq, 1, 2), sizes, preferred_element_type=jnp.float32)
    dw = jax.lax.ragged_dot_general(xq, dyq, sizes, _RAGGED_WEIGHT_GRAD, preferred_element_type=jnp.float32)
    return ((dx * (1.0 / (sdy * sw))).astype(dy.dtype), (dw * (1.0 / (sx * sdy))).astype(dy.dtype), None)


ragged_dot.defvjp(_ragged_forward, _ragged_backward)
