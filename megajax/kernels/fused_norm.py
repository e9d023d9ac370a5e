"""Fused LayerNorm and RMSNorm (forward and backward) as Pallas kernels on the Triton backend.

x [..., d] is normalized over d; scale (and bias) are [d]. The jnp oracles are `layer_norm_reference` and
`rms_norm_reference` in megajax/kernels/norms.py.

Forward: one program per block of rows reads its rows once, keeps them in registers for the statistics
(mean and variance computed from the centered values, not E[x^2] - E[x]^2) and writes y, plus per row the
mean (LayerNorm) and 1/std, saved for the backward. Backward: one program per group of row blocks reads x
and dy once, recomputes x_hat from the saved statistics, writes dx and accumulates its group's partial
dscale and dbias in fp32 registers; XLA sums the few partial rows (one per program). XLA cannot do this
for the jnp reference in one pass: the backward needs reductions along both axes (over d for dx, over the
rows for dscale and dbias), which its fusions do not share, so x and dy are read more than once.

Backend: Triton (see flash_attention.py for why). d need not be a power of 2 (GPT-2's 768): the columns
are loaded as a power-of-2 tile with the tail masked. Row blocks are powers of 2 that divide the row count
(an odd row count runs one row per program: slower, still exact). d above MAX_DIM is rejected.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from megajax.kernels.launch import match_varying, next_power_of_2, pallas_call, shard_kernel
from megajax.parallel.step_plan import varying_axes

MAX_DIM = 32768  # one row must fit in a program's registers (the 1T-parameter GPT has d = 25600)
TILE_ELEMENTS = 4096  # elements of x per forward tile: ~16 fp32 per thread at 8 warps
MIN_PROGRAMS = 256  # backward: at least this many programs (a few per SM) before groups grow


@dataclasses.dataclass(frozen=True)
class NormBlocks:
    """Tiling for n rows of width d: block_rows rows per tile, row_tiles tiles per backward program."""

    block_rows: int
    row_tiles: int
    num_warps: int

    @staticmethod
    def for_shape(n: int, d: int) -> NormBlocks:
        d_pad = next_power_of_2(d)
        rows = max(1, min(16, TILE_ELEMENTS // d_pad))
        while n % rows:  # a power of 2 that divides n, so no tile overhangs the array
            rows //= 2
        tiles = 1
        while (n // rows) % (2 * tiles) == 0 and n // (rows * 2 * tiles) >= MIN_PROGRAMS:
            tiles *= 2
        return NormBlocks(rows, tiles, num_warps=min(16, max(4, rows * d_pad // 512)))


@dataclasses.dataclass(frozen=True)
class _Static:
    eps: float
    centered: bool  # LayerNorm (subtract the mean, has a bias) or RMSNorm
    out_dtype: jnp.dtype
    interpret: bool | None

    def params(self, name: str, blocks: NormBlocks) -> dict:
        return dict(name=name, interpret=self.interpret,
                    compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=2))


def _load(ref, rows, d: int) -> jax.Array:
    """ref[rows, :d] as fp32 [rows, d_pad], zero beyond d (the power-of-2 tile Triton needs)."""
    d_pad = next_power_of_2(d)
    if d_pad == d:
        return ref[rows, :].astype(jnp.float32)
    n = ref.shape[0] if rows == slice(None) else rows.size
    mask = jnp.broadcast_to(jnp.arange(d_pad)[None, :] < d, (n, d_pad))
    return pltriton.load(ref.at[rows, pl.ds(0, d_pad)], mask=mask, other=0.0).astype(jnp.float32)


def _store(ref, rows, value: jax.Array, d: int) -> None:
    d_pad = value.shape[-1]
    if d_pad == d:
        ref[rows, :] = value.astype(ref.dtype)
        return
    mask = jnp.broadcast_to(jnp.arange(d_pad)[None, :] < d, value.shape)
    pltriton.store(ref.at[rows, pl.ds(0, d_pad)], value.astype(ref.dtype), mask=mask)


def _load_vector(ref, d: int) -> jax.Array:
    """A [d] parameter as fp32 [1, d_pad]."""
    d_pad = next_power_of_2(d)
    if d_pad == d:
        return ref[...].astype(jnp.float32)[None, :]
    v = pltriton.load(ref.at[pl.ds(0, d_pad)], mask=jnp.arange(d_pad) < d, other=0.0)
    return v.astype(jnp.float32)[None, :]


def _store_vector(ref, value: jax.Array, d: int) -> None:
    d_pad = value.shape[-1]
    if d_pad == d:
        ref[...] = value
    else:
        pltriton.store(ref.at[pl.ds(0, d_pad)], value, mask=jnp.arange(d_pad) < d)


def _forward_kernel(*refs, eps: float, centered: bool):
    if centered:
        x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref = refs
    else:
        (x_ref, w_ref, y_ref, rstd_ref), b_ref, mean_ref = refs, None, None
    d = x_ref.shape[1]
    x = _load(x_ref, slice(None), d)
    if centered:
        mean = jnp.sum(x, axis=1) / d  # the zero tail adds nothing
        x = jnp.where(jnp.arange(x.shape[1])[None, :] < d, x - mean[:, None], 0.0)
        mean_ref[...] = mean
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    y = x * rstd[:, None] * _load_vector(w_ref, d)
    if centered:
        y = y + _load_vector(b_ref, d)
    _store(y_ref, slice(None), y, d)
    rstd_ref[...] = rstd


def _backward_kernel(*refs, centered: bool, block_rows: int, row_tiles: int):
    if centered:
        x_ref, w_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = refs
    else:
        (x_ref, w_ref, dy_ref, rstd_ref, dx_ref, dw_ref), mean_ref, db_ref = refs, None, None
    d = x_ref.shape[1]
    w = _load_vector(w_ref, d)
    real = jnp.arange(w.shape[1])[None, :] < d

    def tile(t, carry):
        dw, db = carry
        rows = pl.ds(t * block_rows, block_rows)
        x, dy = _load(x_ref, rows, d), _load(dy_ref, rows, d)
        rstd = rstd_ref[rows][:, None]
        if centered:
            x = x - mean_ref[rows][:, None]
        x_hat = jnp.where(real, x * rstd, 0.0)
        g = dy * w  # dL/dx_hat
        # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)); RMSNorm has no mean(g) term.
        dx = g - x_hat * (jnp.sum(g * x_hat, axis=1, keepdims=True) / d)
        if centered:
            dx = dx - jnp.sum(g, axis=1, keepdims=True) / d
        _store(dx_ref, rows, dx * rstd, d)
        return dw + jnp.sum(dy * x_hat, axis=0), db + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((w.shape[1],), jnp.float32)
    dw, db = lax.fori_loop(0, row_tiles, tile, (zeros, zeros))
    _store_vector(dw_ref, dw, d)
    if centered:
        _store_vector(db_ref, db, d)


def _forward(x, params, st: _Static):
    """x [n, d], params [scale (, bias)] -> (y [n, d] in out_dtype, mean [n] (LayerNorm only), rstd [n])."""
    n, d = x.shape
    blocks = NormBlocks.for_shape(n, d)
    br = blocks.block_rows
    rows = pl.BlockSpec((br, d), lambda i: (i, 0))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    vector = pl.BlockSpec((d,), lambda i: (0,))
    n_stats = 2 if st.centered else 1
    return pallas_call(
        functools.partial(_forward_kernel, eps=st.eps, centered=st.centered), grid=(n // br,),
        in_specs=[rows, *[vector] * len(params)],
        out_specs=[rows, *[stat] * n_stats],
        out_shape=[jax.ShapeDtypeStruct((n, d), st.out_dtype), *[jax.ShapeDtypeStruct((n,), jnp.float32)] * n_stats],
        **st.params("layer_norm_fwd" if st.centered else "rms_norm_fwd", blocks))(x, *params)


def _backward(x, scale, dy, stats, st: _Static):
    """(dx [n, d], dscale [d] fp32, dbias [d] fp32 (LayerNorm only)) from the saved statistics."""
    n, d = x.shape
    blocks = NormBlocks.for_shape(n, d)
    br, tiles = blocks.block_rows, blocks.row_tiles
    programs = n // (br * tiles)
    rows = pl.BlockSpec((br * tiles, d), lambda i: (i, 0))
    stat = pl.BlockSpec((br * tiles,), lambda i: (i,))
    n_partials = 2 if st.centered else 1
    kernel = functools.partial(_backward_kernel, centered=st.centered, block_rows=br, row_tiles=tiles)
    dx, *partials = pallas_call(
        kernel, grid=(programs,),
        in_specs=[rows, pl.BlockSpec((d,), lambda i: (0,)), rows, *[stat] * len(stats)],
        out_specs=[rows, *[pl.BlockSpec((None, d), lambda i: (i, 0))] * n_partials],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   *[jax.ShapeDtypeStruct((programs, d), jnp.float32)] * n_partials],
        **st.params("layer_norm_bwd" if st.centered else "rms_norm_bwd", blocks))(x, scale, dy, *stats)
    # One partial row per program: a small [programs, d] sum, far below the [n, d] traffic of the kernel.
    return (dx, *(jnp.sum(p, axis=0) for p in partials))


def _names(ndim: int) -> tuple:
    """Logical names of a norm input: the residual stream [b, s, d] is split over batch and (with sequence
    parallelism) sequence; other ranks only by their rows' layout as is."""
    return ("batch", "seq", None) if ndim == 3 else (None,) * ndim


def _sharded_forward(x, scale, bias, st: _Static):
    """x [..., d] -> (y [..., d], *stats [...]), per shard; the rows are flattened inside each shard."""
    params = [scale, bias] if st.centered else [scale]

    def local(x, *params):
        y, *stats = _forward(x.reshape(-1, x.shape[-1]), params, st)
        return (y.reshape(x.shape), *(s.reshape(x.shape[:-1]) for s in stats))

    names = _names(x.ndim)
    return shard_kernel(local, (x, *params), (names, *[(None,)] * len(params)),
                        (names, *[names[:-1]] * (2 if st.centered else 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, scale, bias, st: _Static):
    return _sharded_forward(x, scale, bias, st)[0]


def _norm_fwd(x, scale, bias, st: _Static):
    y, *stats = _sharded_forward(x, scale, bias, st)
    return y, (x, scale, bias, stats)


def _norm_bwd(st: _Static, res, dy):
    x, scale, bias, stats = res

    def local(x, scale, dy, *stats):
        flat = [a.reshape(-1, x.shape[-1]) for a in (x, dy)]
        dx, *dparams = _backward(flat[0], scale, flat[1], [s.reshape(-1) for s in stats], st)
        return (dx.reshape(x.shape), *dparams)

    names = _names(x.ndim)
    n_params = 2 if st.centered else 1
    # dscale and dbias are sums over rows: shard_kernel adds up the shards' partial sums (with sequence
    # parallelism, Megatron's all-reduce of the norm weight gradients over 'tensor').
    dx, *dparams = shard_kernel(local, (x, scale, dy, *stats), (names, (None,), names, *[names[:-1]] * len(stats)),
                                (names, *[(None,)] * n_params), summed=range(1, 1 + n_params))
    dscale = match_varying(dparams[0].astype(scale.dtype), varying_axes(scale))
    dbias = None if bias is None else match_varying(dparams[1].astype(bias.dtype), varying_axes(bias))
    return match_varying(dx, varying_axes(x)), dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


def _fused(x, scale, bias, eps: float, out_dtype, interpret: bool | None) -> jax.Array:
    d = x.shape[-1]
    if scale.shape != (d,) or (bias is not None and bias.shape != (d,)):
        raise ValueError(f"scale and bias must be [d] = [{d}]: {scale.shape=} "
                         f"bias.shape={None if bias is None else bias.shape}")
    if d > MAX_DIM:
        raise ValueError(f"{d=} > {MAX_DIM}: a row would not fit in one program's registers; use impl='xla'")
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    return _norm(x, scale, bias, _Static(float(eps), bias is not None, out_dtype, interpret))


def layer_norm_pallas(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5, *,
                      out_dtype=None, interpret: bool | None = None) -> jax.Array:
    """Fused LayerNorm over the last dim. x [..., d], scale and bias [d] -> [..., d] in out_dtype.

    Statistics in fp32. out_dtype defaults to fp32 (as the reference); pass the compute dtype to write
    it directly (half the bytes in bf16). interpret=None interprets on CPU and compiles on GPU.
    """
    return _fused(x, scale, bias, eps, out_dtype, interpret)


def rms_norm_pallas(x: jax.Array, scale: jax.Array, eps: float = 1e-6, *, out_dtype=None,
                    interpret: bool | None = None) -> jax.Array:
    """Fused RMSNorm over the last dim. x [..., d], scale [d] -> [..., d] in out_dtype (default fp32)."""
    return _fused(x, scale, None, eps, out_dtype, interpret)
