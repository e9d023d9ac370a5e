"""FP8 matmuls for the linear layers (model.fp8): Transformer Engine's formats, current or delayed scaling (blockwise:
megajax/model/fp8_blockwise.py).

Each operand is scaled by a power of two (current scaling: the largest 2^e with amax x 2^e <= the format's
maximum, from the operand itself; delayed scaling: from the amax history, below), cast to FP8, multiplied with
fp32 accumulation, and the product unscaled:
  forward          y  = (x_q . w_q) / (s_x s_w)          x, w in e4m3
  input gradient   dx = (dy_q . w_q^T) / (s_dy s_w)      dy in e5m2 (hybrid) or e4m3
  weight gradient  dw = (x_q^T . dy_q) / (s_x s_dy)
The FP8 copies of x and w are what the backward keeps (half the bytes of bf16 residuals). Scales are powers of
two, so rescaling never rounds, and a tensor split over shards quantizes the same on every layout except for
values near the bottom of the format's range. An amax over a tensor sharded by GSPMD ('tensor') is a max over
every shard; inside the step's manual data axis each data rank scales its own micro batch (current scaling
needs no state and no cross-rank reduction; Transformer Engine's current scaling reduces over the tensor group).

XLA's GPU compiler turns each of these dots into an FP8 GEMM on H100 (sm_90; in the compile-only program a Triton
GEMM fusion with FP8 operands and the unscaling in its epilogue); on CPU the same program runs emulated (the FP8
values are exact, the products are taken in fp32).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from megajax.kernels.grouped_matmul import group_of_rows, grouped_dot, grouped_weight_dot
from megajax.parallel import step_plan
from megajax.parallel.step_plan import vary, varying_axes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (forward operands, output gradient) per model.fp8
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}


def pow2_scale(amax: jax.Array, dtype) -> jax.Array:
    """The powers of two that map absolute maxima to at most the format's maximum (1 for an all-zero or
    non-finite operand, so a NaN reaches the loss instead of being hidden by the scale)."""
    _, exponent = jnp.frexp(float(jnp.finfo(dtype).max) / amax)  # = mantissa in [0.5, 1) x 2^exponent, exactly
    scale = jnp.ldexp(jnp.ones_like(amax), exponent - 1)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.ones_like(amax))


def scale_for(x: jax.Array, dtype) -> jax.Array:
    """The power of two that maps x's absolute maximum to at most the format's maximum."""
    return pow2_scale(jnp.max(jnp.abs(x)).astype(jnp.float32), dtype)


def expert_amax(x: jax.Array, rows_of: jax.Array | None = None, experts: int = 0) -> jax.Array:
    """Each expert's absolute maximum, [..., e], for its own scale (Transformer Engine's grouped GEMMs quantize each
    expert's operands on their own, so an expert with large values does not push the others' towards the bottom
    of the format's range): of x [..., e, m, n] by its expert dim, or of rows x [..., rows, n] by each row's expert
    rows_of [..., rows] (of `experts`; a row past them, padding, counts nowhere; -inf for an expert without
    rows)."""
    mag = jnp.abs(x).astype(jnp.float32)
    if rows_of is None:
        return jnp.max(mag, axis=(-2, -1))

    def per_expert(row_max, rows_of):
        return jax.ops.segment_max(row_max, rows_of, num_segments=experts)

    row_max = jnp.max(mag, axis=-1)
    return (jax.vmap(per_expert) if row_max.ndim == 2 else per_expert)(row_max, rows_of)


def quantize(x: jax.Array, dtype, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x x scale as FP8, scale); the scale is x's own (current scaling) unless given. Values past the format's
    maximum (possible with a delayed scale) saturate."""
    scale = scale_for(x, dtype) if scale is None else scale
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype), scale


def einsum_operands(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return x, w, out


def dot(spec: str, a: jax.Array, b: jax.Array, inv_scale: jax.Array, dtype) -> jax.Array:
    """einsum(spec, a, b) of FP8 operands, unscaled by inv_scale, as `dtype`. The GEMM accumulates in fp32 and
    writes bf16 (or fp32) itself, unscaled after: a power of two rescales exactly, and a product of scaled operands
    is far from the ends of bf16's range, so this rounds as unscaling in fp32 would. A row-parallel matmul's
    partial sums then cross 'tensor' in bf16, not fp32 (half the reduce-scatter's bytes). fp16's range is too
    short for the scaled product (448^2 alone is past its maximum): it is unscaled in fp32."""
    if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:
        return (jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * inv_scale).astype(dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=dtype) * inv_scale.astype(dtype)


# Delayed scaling (model.fp8_recipe=delayed, Transformer Engine's default recipe): each matmul's scales come from
# the largest absolute maxima of its operands over the last model.fp8_amax_history steps, recorded as they are
# used. As the scales are powers of two, an amax matters only by its binary exponent: each linear layer has a
# state variable `fp8_<weight>` of 3 x BINS counters (x, w, dy by amax exponent bin: the steps for which a
# step whose amax had that exponent stays in the history; non-trainable: megajax/model/model_state.py). The
# backward hands the variable, as its gradient, a one-hot of each operand's exponent: summed over micro batches,
# data ranks and pipeline ticks by the ordinary gradient reduction, the nonzero bins are exactly the exponents seen
# in the step, whose max is the step's amax. After the step, `seen_of` reads these gradients and `update_meta` sets
# the counters; the state is checkpointed and restored onto any layout as the weights are.
# A run's first step has no history: there an operand takes its own scale (current scaling). Every later step runs
# another program (StepPlan.fp8_histories_only), where the scales come from the histories alone, an operand without
# one scaling by 1 (one whose amax was zero or not finite in every step of its history): no cast then waits for a
# reduction over its own operand, so XLA computes each operand's amax (for the history) in the same pass as its
# cast, fused into the operation that produces it, where current scaling reads the operand (or recomputes its
# producer) twice.
BINS = 256
META_PREFIX = "fp8_"


def delays(mcfg) -> bool:
    """Whether the model's FP8 matmuls scale from amax histories (model.fp8_recipe=delayed)."""
    return mcfg.fp8 != "none" and mcfg.fp8_recipe == "delayed"


def _max_exponent(dtype) -> int:
    return math.frexp(float(jnp.finfo(dtype).max))[1] - 1  # floor(log2(max)): 8 for e4m3, 15 for e5m2


def amax_bins(amax: jax.Array) -> jax.Array:
    """One-hot [..., BINS] of the exponents e of absolute maxima [...] (amax < 2^e); zeros for a zero or
    non-finite one."""
    _, e = jnp.frexp(amax)
    ok = ((amax > 0) & jnp.isfinite(amax))[..., None]
    return jnp.where(ok, jax.nn.one_hot(jnp.clip(e + BINS // 2, 0, BINS - 1), BINS, dtype=jnp.float32), 0.0)


def amax_bin(x: jax.Array) -> jax.Array:
    """`amax_bins` of x's absolute maximum: [BINS]."""
    return amax_bins(jnp.max(jnp.abs(x)).astype(jnp.float32))


def delayed_scale(counters: jax.Array, amax: jax.Array, dtype, margin: int) -> jax.Array:
    """The powers of two for the largest exponents still in the histories (counters [..., BINS]), divided by
    2^margin; where one has none, the scale of its absolute maximum amax [...] (current scaling), or 1 under
    StepPlan.fp8_histories_only (amax unread)."""
    top = jnp.max(jnp.where(counters > 0, jnp.arange(BINS), -1), axis=-1)
    k = jnp.clip(_max_exponent(dtype) - (top - BINS // 2) - margin, -126, 126)
    without = jnp.ones_like(amax) if step_plan.in_force().fp8_histories_only else pow2_scale(amax, dtype)
    return jnp.where(top >= 0, jnp.ldexp(jnp.ones_like(amax), k), without)


def _quantize(x, dtype, counters, margin):
    """`quantize` with current scaling (counters None) or delayed scaling."""
    if counters is None:
        return quantize(x, dtype)
    return quantize(x, dtype, delayed_scale(counters, jnp.max(jnp.abs(x)).astype(jnp.float32), dtype, margin))


def _counters(meta):
    """The x, w and dy counters of the delayed-scaling state [..., 3 BINS] (None each with current scaling)."""
    if meta is None:
        return None, None, None
    rows = meta.reshape(*meta.shape[:-1], 3, BINS)
    return rows[..., 0, :], rows[..., 1, :], rows[..., 2, :]


def _scales(amax, dtype, counters, margin):
    """Per expert [..., e]: current scales of the experts' absolute maxima, or delayed from their histories."""
    return pow2_scale(amax, dtype) if counters is None else delayed_scale(counters, amax, dtype, margin)


def _seen(bins, meta):
    return vary(bins, tuple(varying_axes(meta)))


def expert_operands(fmt, margin, x, w, meta, rows_of=None, experts: int = 0):
    """(x_q, s_x, w_q, s_w, dy's counters, the forward's exponents as meta's gradient part) for one experts' matmul,
    every expert scaled on its own: scales [..., e], current, or delayed with `meta` [..., e, 3 BINS] (one
    history per expert). x: buffers [..., e, c, d], or rows [..., n, d] of the experts rows_of [..., n]."""
    forward, _ = FORMATS[fmt]
    x_counters, w_counters, dy_counters = _counters(meta)
    ax, aw = expert_amax(x, rows_of, experts), expert_amax(w)
    sx, sw = _scales(ax, forward, x_counters, margin), _scales(aw, forward, w_counters, margin)
    against = _lead if rows_of is None else functools.partial(_by_row, rows_of=rows_of)
    (xq, _), (wq, _) = quantize(x, forward, against(sx)), quantize(w, forward, _lead(sw))
    seen = None if meta is None else _seen(jnp.concatenate([amax_bins(ax), amax_bins(aw)], axis=-1), meta)
    return xq, sx, wq, sw, dy_counters, seen


def expert_gradient(fmt, margin, dy, dy_counters, seen, rows_of=None, experts: int = 0):
    """(dy_q, s_dy [..., e], meta's gradient [..., e, 3 BINS] or None): `expert_operands` for the output gradient."""
    gradient = FORMATS[fmt][1]
    ady = expert_amax(dy, rows_of, experts)
    sdy = _scales(ady, gradient, dy_counters, margin)
    dyq = quantize(dy, gradient, _lead(sdy) if rows_of is None else _by_row(sdy, rows_of))[0]
    if seen is None:
        return dyq, sdy, None
    return dyq, sdy, jnp.concatenate([seen, _seen(amax_bins(ady), seen)], axis=-1)


def quantize_operands(fmt, margin, x, w, meta):
    """(x_q, s_x, w_q, s_w, dy's counters, the forward's exponents as meta's gradient part) for one matmul."""
    forward, _ = FORMATS[fmt]
    x_counters, w_counters, dy_counters = _counters(meta)
    xq, sx = _quantize(x, forward, x_counters, margin)
    wq, sw = _quantize(w, forward, w_counters, margin)
    seen = None if meta is None else vary(jnp.concatenate([amax_bin(x), amax_bin(w)]), tuple(varying_axes(meta)))
    return xq, sx, wq, sw, dy_counters, seen


def quantize_gradient(fmt, margin, dy, dy_counters, seen):
    """(dy_q, s_dy, meta's gradient: the operands' exponents, or None with current scaling)."""
    dyq, sdy = _quantize(dy, FORMATS[fmt][1], dy_counters, margin)
    if seen is None:
        return dyq, sdy, None
    return dyq, sdy, jnp.concatenate([seen, vary(amax_bin(dy), tuple(varying_axes(seen)))])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 6))
def einsum(spec: str, fmt: str, margin: int, x: jax.Array, w: jax.Array,
           meta: jax.Array | None = None, by_expert: bool = False) -> jax.Array:
    """jnp.einsum(spec, x, w) with FP8 operands (x and w of the same dtype; the result has it too): current
    scaling, or with `meta` ([3 x BINS] counters of x, w and dy) delayed scaling, `meta` getting the step's amax
    exponents as its gradient. by_expert: x, w and the output lead with the experts ([e, c, d] capacity buffers,
    [e, d, f] weights, "ecd,edf->ecf"), and each expert's operands are scaled on their own (`expert_operands`;
    delayed: `meta` [e, 3 BINS], one history per expert)."""
    return _forward(spec, fmt, margin, x, w, meta, by_expert)[0]


def _lead(scale: jax.Array) -> jax.Array:
    """Scales [..., e] (or one) against operands [..., e, m, n]."""
    return scale if scale.ndim == 0 else scale[..., None, None]


def _forward(spec, fmt, margin, x, w, meta, by_expert):
    operands = expert_operands if by_expert else quantize_operands
    xq, sx, wq, sw, dy_counters, seen = operands(fmt, margin, x, w, meta)
    return dot(spec, xq, wq, 1.0 / _lead(sx * sw), x.dtype), (xq, sx, wq, sw, dy_counters, seen)


def _backward(spec, fmt, margin, by_expert, residuals, dy):
    xq, sx, wq, sw, dy_counters, seen = residuals
    gradient = expert_gradient if by_expert else quantize_gradient
    dyq, sdy, g_meta = gradient(fmt, margin, dy, dy_counters, seen)
    sx, sw, sdy = _lead(sx), _lead(sw), _lead(sdy)
    x_sub, w_sub, y_sub = einsum_operands(spec)
    dx = dot(f"{y_sub},{w_sub}->{x_sub}", dyq, wq, 1.0 / (sdy * sw), dy.dtype)
    dw = dot(f"{x_sub},{y_sub}->{w_sub}", xq, dyq, 1.0 / (sx * sdy), dy.dtype)
    return dx, dw, g_meta


einsum.defvjp(_forward, _backward)


def weight_grad(spec: str, fmt: str, margin: int, x: jax.Array, dy: jax.Array,
                meta: jax.Array | None = None) -> jax.Array:
    """The weight gradient of `einsum(spec, fmt, margin, x, w, meta)` from x and the output gradient, as its
    backward computes it (for the zero-bubble schedule's deferred W pass)."""
    xq, sx, dyq, sdy = weight_grad_operands(fmt, margin, x, dy, meta)
    x_sub, w_sub, y_sub = einsum_operands(spec)
    return dot(f"{x_sub},{y_sub}->{w_sub}", xq, dyq, 1.0 / (sx * sdy), dy.dtype)


def weight_grad_operands(fmt: str, margin: int, x: jax.Array, dy: jax.Array, meta: jax.Array | None = None):
    """(x_q, s_x, dy_q, s_dy): the weight gradient's FP8 operands, quantized as the forward and backward did."""
    forward, gradient = FORMATS[fmt]
    x_counters, _, dy_counters = _counters(meta)
    return (*_quantize(x, forward, x_counters, margin), *_quantize(dy, gradient, dy_counters, margin))


_RAGGED_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 6))
def ragged_dot(fmt: str, margin: int, x: jax.Array, w: jax.Array, sizes: jax.Array,
               meta: jax.Array | None = None, grouped: tuple | None = None) -> jax.Array:
    """jax.lax.ragged_dot(x [n, d], w [g, d, f], sizes [g]) with FP8 operands (a mixture of experts' grouped
    matmul: rows grouped by expert). Each expert's rows, weight and output gradient are scaled on their own
    (`expert_operands`, as Transformer Engine's grouped GEMM), current, or delayed with `meta` [g, 3 BINS], one
    history per expert. With a leading dim on all of them (folded experts' blocks), each block's experts. grouped: the
    logical names of (x, w, out) to run the three products as the Pallas grouped GEMM (model.moe_grouped_gemm,
    kernels.grouped_matmul: only each row's own group), else jax.lax.ragged_dot."""
    return _ragged_forward(fmt, margin, x, w, sizes, meta, grouped)[0]


def _group_dot(grouped, a, b, sizes):
    """a [n, k] times b [g, k, f] by groups of rows, in fp32 (with a leading dim on all three, blocks of such)."""
    if grouped is None:
        dot = functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
        return (jax.vmap(dot) if a.ndim == 3 else dot)(a, b, sizes)
    return grouped_dot(a, b, sizes, grouped)


def _by_row(scale: jax.Array, rows_of: jax.Array) -> jax.Array:
    """Scales [..., g] (or one) against rows [..., n, d]: each row's group's (padding rows: the last group's)."""
    if scale.ndim == 0:
        return scale
    return jnp.take_along_axis(scale, jnp.minimum(rows_of, scale.shape[-1] - 1), axis=-1)[..., None]


def _ragged_forward(fmt, margin, x, w, sizes, meta, grouped):
    rows_of = group_of_rows(sizes, x.shape[-2])
    xq, sx, wq, sw, dy_counters, seen = expert_operands(fmt, margin, x, w, meta, rows_of, sizes.shape[-1])
    y = _group_dot(grouped, xq, wq, sizes) * (1.0 / _by_row(sx * sw, rows_of))
    return y.astype(x.dtype), (xq, sx, wq, sw, sizes, dy_counters, seen)


def _ragged_backward(fmt, margin, grouped, residuals, dy):
    xq, sx, wq, sw, sizes, dy_counters, seen = residuals
    rows_of = group_of_rows(sizes, xq.shape[-2])
    dyq, sdy, g_meta = expert_gradient(fmt, margin, dy, dy_counters, seen, rows_of, sizes.shape[-1])
    if grouped is None:
        dot = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=_RAGGED_WEIGHT_GRAD,
                                preferred_element_type=jnp.float32)
        dw = (jax.vmap(dot) if xq.ndim == 3 else dot)(xq, dyq, sizes)
        transposed = None
    else:
        x_names, w_names, y_names = grouped
        dw = grouped_weight_dot(xq, dyq, sizes, grouped)
        transposed = (y_names, (*w_names[:-2], w_names[-1], w_names[-2]), x_names)
    dx = _group_dot(transposed, dyq, jnp.swapaxes(wq, -1, -2), sizes)
    dx = dx * (1.0 / _by_row(sdy * sw, rows_of))
    return dx.astype(dy.dtype), (dw * (1.0 / _lead(sx * sdy))).astype(dy.dtype), None, g_meta


ragged_dot.defvjp(_ragged_forward, _ragged_backward)


def seen_of(grads) -> dict:
    """The FP8 state's gradients by path (from a tree of the model state's gradients): per operand, the amax
    exponent bins the step saw."""
    seen = {}

    def take(path, g):
        if str(getattr(path[-1], "key", path[-1])).startswith(META_PREFIX):
            seen[path] = g

    jax.tree_util.tree_map_with_path(take, grads)
    return seen


def update_meta(state, seen: dict, history: int):
    """Each operand's counters: `history` at the step's amax exponent (the largest one seen: the max over
    every micro batch and rank, so the same on every layout), the others one less (down to 0)."""

    def one(path, p):
        if path not in seen:
            return p
        rows = seen[path].reshape(*p.shape[:-1], 3, BINS)
        top = jnp.max(jnp.where(rows > 0, jnp.arange(BINS), -1), axis=-1, keepdims=True)
        hit = (jnp.arange(BINS) == top).reshape(p.shape)
        return jnp.where(hit, jnp.float32(history), jnp.maximum(p - 1, 0)).astype(p.dtype)

    return jax.tree_util.tree_map_with_path(one, state)
