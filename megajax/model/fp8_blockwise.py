"""Blockwise FP8 (model.fp8_recipe=blockwise): DeepSeek-V3's fine-grained scaling, Megatron's "blockwise" recipe.

Every operand is e4m3 with a scale per tile of B = model.fp8_block elements (128): activations and output gradients
per 1 x B tile along the contraction (a token's B features), weights per B x B block, and the weight gradient's
operands, whose contraction runs over tokens, per B x 1 tile (B tokens of one feature). An outlier then costs
precision only in its own tile. The scales are powers of two (megajax/model/fp8.py's) and need no state and no
reduction across ranks; the products are the block-scaled kernels (megajax/kernels/block_fp8.py), which dequantize
each block of the contraction in fp32 as they accumulate. Each rank quantizes its own shard (launch.shard_kernel)
and its own tokens: where a shard's dims and a rank's tokens are whole tiles (model dims of 128s split over powers
of two), the tiles are one device's.

- `block_einsum`: a linear layer's einsum. The backward keeps x's B x 1 tiles and w's blocks in FP8 (one byte an
  element).
- `block_ragged_dot`: a mixture of experts' grouped matmul (rows grouped by expert, `jax.lax.ragged_dot`'s
  contract; the capacity buffers as groups of one expert each). The rows are laid out with each expert's from a
  multiple of B (kernels/grouped_matmul.py's `plan_rows`), so the weight gradient's B x 1 tiles are each one
  expert's tokens (as Megatron pads each expert's tokens for FP8). The backward keeps x, w and the group sizes and
  quantizes them again.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from megajax.kernels import block_fp8
from megajax.kernels.grouped_matmul import plan_rows, scatter_rows
from megajax.kernels.launch import shard_kernel
from megajax.model.fp8 import E4M3, einsum_operands, pow2_scale, quantize


def _padded(x2: jax.Array, rows: int, cols: int) -> jax.Array:
    """x2 [r, c] with zeros up to multiples of rows and cols (a zero changes no tile's maximum and no product)."""
    return jnp.pad(x2, ((0, -x2.shape[0] % rows), (0, -x2.shape[1] % cols)))


def _row_tiles(x2: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(x2 [r, c] in e4m3, c padded to c', its dequantization scales [c' / block, r]) in 1 x block tiles along c."""
    r = x2.shape[0]
    tiles = _padded(x2, 1, block).astype(jnp.float32).reshape(r, -1, block)
    scale = pow2_scale(jnp.max(jnp.abs(tiles), axis=-1), E4M3)
    return quantize(tiles, E4M3, scale[..., None])[0].reshape(r, -1), (1.0 / scale).T


def _column_tiles(x2: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(x2 [m, c] transposed, [c, m'], in e4m3, its scales [m' / block, c]) in block x 1 tiles along m, zero rows
    padding m to m'."""
    return _row_tiles(_padded(x2, block, 1).T, block)


def _weight_blocks(w2: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(w2 [k, n] in e4m3, its dequantization scales [k' / block, n' / block]) in block x block blocks, k and n
    padded to k' and n' (partial blocks at the ends: DeepSeek-V3's 576-wide key-value down-projection)."""
    k, n = w2.shape
    blocks = _padded(w2, block, block).astype(jnp.float32)
    blocks = blocks.reshape(blocks.shape[0] // block, block, blocks.shape[1] // block, block)
    scale = pow2_scale(jnp.max(jnp.abs(blocks), axis=(1, 3)), E4M3)
    q = quantize(blocks, E4M3, scale[:, None, :, None])[0].reshape(scale.shape[0] * block, -1)
    return q[:k, :n], 1.0 / scale


def _contraction(spec: str) -> int:
    """How many trailing dims of x (leading dims of w) an einsum contracts; x [free, contracted], w [contracted,
    free] and out [x's free, w's free], as every weight einsum of megajax/model/layers.py is."""
    x, w, out = einsum_operands(spec)
    contracted = "".join(c for c in x if c in w)
    if not (x.endswith(contracted) and w.startswith(contracted) and out == x[:-len(contracted)] + w[len(contracted):]):
        raise ValueError(f"blockwise FP8 takes einsums of x [free, contracted] and w [contracted, free], not {spec}")
    return len(contracted)


def _block_forward_local(nk: int, block: int, x, w):
    """One shard's forward: (y, x's block x 1 tiles [k, m'] and their scales, w's blocks (w's shape) and scales)."""
    k, n = math.prod(w.shape[:nk]), math.prod(w.shape[nk:])
    x2 = x.reshape(-1, k)
    xq, sx = _row_tiles(x2, block)
    wq, sw = _weight_blocks(w.reshape(k, n), block)
    y = block_fp8.matmul(xq, sx, _padded(wq, block, block), jnp.repeat(sw, block, axis=1), block, x.dtype)[:, :n]
    return (y.reshape(*x.shape[:-nk], *w.shape[nk:]), *_column_tiles(x2, block), wq.reshape(w.shape), sw)


def _block_input_grad_local(nk: int, block: int, dy, wq, sw):
    """One shard's input gradient dy . w^T, dy in 1 x block tiles along w's free dims."""
    k = math.prod(wq.shape[:nk])
    dyq, sdy = _row_tiles(dy.reshape(-1, wq.size // k), block)
    w_nk = _padded(wq.reshape(k, -1), block, block)  # (w^T as the kernel's [n, k] operand: no transpose)
    dx = block_fp8.matmul(dyq, sdy, w_nk, jnp.repeat(sw.T, block, axis=1), block, dy.dtype, b_nk=True)[:, :k]
    return dx.reshape(*dy.shape[:dy.ndim - (wq.ndim - nk)], *wq.shape[:nk])


def _block_weight_grad_local(w_shape: tuple, block: int, xt, sxt, dy, dtype=None):
    """One shard's weight gradient x^T . dy (in dtype, else dy's) from x's block x 1 tiles, dy's tiled the same way
    (over tokens)."""
    k = xt.shape[0]
    dyt, sdyt = _column_tiles(dy.reshape(-1, math.prod(w_shape) // k), block)
    return block_fp8.matmul(xt, sxt, dyt, sdyt, block, dtype or dy.dtype, b_nk=True).reshape(w_shape)


def _block_names(spec: str, w_names) -> tuple:
    """(the contracted dims' count, the logical names of x, of y, and of the residuals: x's tiles [k, m'] and
    scales, w's blocks and scales). A token dim is 'batch', the sequence whole (a column-parallel input is
    gathered, a row-parallel output not yet scattered). A merged dim (w's contracted or free dims) takes the name
    of the one of its dims that is split: the residuals are each shard's own, stacked, and read back by the same
    shards."""
    x, w, out = einsum_operands(spec)
    of = dict(zip(w, w_names)) | {"b": "batch", "s": None}
    nk = _contraction(spec)
    k_name = next((n for n in w_names[:nk] if n is not None), None)
    n_name = next((n for n in w_names[nk:] if n is not None), None)
    residuals = ((k_name, "batch"), ("batch", k_name), tuple(w_names), (k_name, n_name))
    return nk, tuple(of.get(c) for c in x), tuple(of.get(c) for c in out), residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def block_einsum(spec: str, block: int, w_names: tuple, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) with blockwise-scaled e4m3 operands (x and w of one dtype; the result has it too):
    1 x block tiles of x and of the output gradient, block x block blocks of w. w_names: w's logical axis names
    (megajax/model/layers.py's WEIGHT_NAMES), by which each tensor rank takes its shard."""
    return _block_forward(spec, block, w_names, x, w)[0]


def _block_forward(spec, block, w_names, x, w):
    nk, x_names, y_names, res_names = _block_names(spec, w_names)
    fn = functools.partial(_block_forward_local, nk, block)
    y, *res = shard_kernel(fn, (x, w), (x_names, w_names), (y_names, *res_names), summed=(0,))
    return y, tuple(res)


def _block_backward(spec, block, w_names, residuals, dy):
    xt, sxt, wq, sw = residuals
    nk, x_names, y_names, res_names = _block_names(spec, w_names)
    dx, = shard_kernel(lambda dy, wq, sw: (_block_input_grad_local(nk, block, dy, wq, sw),), (dy, wq, sw),
                       (y_names, *res_names[2:]), (x_names,), summed=(0,))
    dw, = shard_kernel(lambda xt, sxt, dy, wq: (_block_weight_grad_local(wq.shape, block, xt, sxt, dy),),
                       (xt, sxt, dy, wq), (*res_names[:2], y_names, w_names), (w_names,), summed=(0,))
    return dx, dw


block_einsum.defvjp(_block_forward, _block_backward)


def block_weight_grad(spec: str, block: int, w_names: tuple, x: jax.Array, dy: jax.Array, w: jax.Array) -> jax.Array:
    """The weight gradient of `block_einsum(spec, block, w_names, x, w)` from x and the output gradient, as its
    backward computes it (the zero-bubble schedule's deferred W pass)."""
    nk, x_names, y_names, _ = _block_names(spec, w_names)

    def local(x, dy, w):
        xt, sxt = _column_tiles(x.reshape(-1, math.prod(w.shape[:nk])), block)
        return (_block_weight_grad_local(w.shape, block, xt, sxt, dy),)

    return shard_kernel(local, (x, dy, w), (x_names, y_names, w_names), (w_names,), summed=(0,))[0]


# One rank's products on its pieces of the operands, without shard_kernel: the steps of a tensor-parallel ring
# (megajax/model/collective_matmul.py), inside its manual region. Each quantizes its operands as the products above
# do: the ring's pieces are whole sequence blocks (or chunks), so where those are whole tiles the tiles are one
# device's.
def local_forward(spec: str, block: int, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w) in x's dtype, blockwise FP8."""
    return _block_forward_local(_contraction(spec), block, x, w)[0]


def local_input_grad(spec: str, block: int, dy: jax.Array, w: jax.Array) -> jax.Array:
    """The input gradient of einsum(spec, x, w) from the output gradient dy, in dy's dtype, blockwise FP8."""
    nk = _contraction(spec)
    wq, sw = _weight_blocks(w.reshape(math.prod(w.shape[:nk]), -1), block)
    return _block_input_grad_local(nk, block, dy, wq.reshape(w.shape), sw)


def local_weight_grad(spec: str, block: int, x: jax.Array, dy: jax.Array) -> jax.Array:
    """The weight gradient of einsum(spec, x, w) from x and the output gradient dy, in fp32 (a term of a sum),
    blockwise FP8."""
    free = x.ndim - _contraction(spec)
    xt, sxt = _column_tiles(x.reshape(-1, math.prod(x.shape[free:])), block)
    return _block_weight_grad_local(x.shape[free:] + dy.shape[free:], block, xt, sxt, dy, jnp.float32)


def _token_tiles(x_pad: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(x_pad [r, c] in e4m3, c padded to c', its dequantization scales [r / block, c']) in block x 1 tiles over
    the rows (r a multiple of block: each tile one expert's rows in plan_rows' layout)."""
    x2 = _padded(x_pad, 1, block).astype(jnp.float32)
    tiles = x2.reshape(x2.shape[0] // block, block, -1)
    scale = pow2_scale(jnp.max(jnp.abs(tiles), axis=1), E4M3)
    return quantize(tiles, E4M3, scale[:, None])[0].reshape(x2.shape), 1.0 / scale


def _expert_blocks(w: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(w [e, k, n] in e4m3 padded to [e, k', n'], each expert's block scales [e, k' / block, n' / block])."""
    wq, sw = jax.vmap(lambda w: _weight_blocks(w, block))(w)
    return jnp.pad(wq, ((0, 0), (0, -wq.shape[1] % block), (0, -wq.shape[2] % block))), sw


def _by_tile(xq: jax.Array, sx: jax.Array, dest: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Row tiles (`_row_tiles`: x [a, c'], scales [c' / block, a]) moved to their rows' places in the plan's
    buffer of `rows` (zeros between the experts' rows)."""
    return scatter_rows(xq, dest, rows), scatter_rows(sx.T, dest, rows).T


def _ragged_forward_local(block: int, x, w, sizes):
    """One shard's forward: x [a, k] rows grouped by sizes [e], w [e, k, n] -> [a, n]."""
    dest, tile_group, _, _, rows = plan_rows(sizes, x.shape[0], block)
    wq, sw = _expert_blocks(w, block)
    xq, sx = _by_tile(*_row_tiles(x, block), dest, rows)
    y = block_fp8.grouped_matmul(xq, sx, wq, jnp.repeat(sw, block, axis=2), tile_group, block, x.dtype)
    return (y.at[dest, :w.shape[2]].get(mode="fill", fill_value=0),)


def _ragged_backward_local(block: int, x, w, sizes, dy):
    """One shard's (dx, dw): dy in 1 x block tiles along n against w's blocks transposed, and for dw x and dy in
    block x 1 tiles over each expert's tokens."""
    (a, k), n = x.shape, w.shape[2]
    dest, tile_group, first, count, rows = plan_rows(sizes, a, block)
    wq, sw = _expert_blocks(w, block)
    dyq, sdy = _by_tile(*_row_tiles(dy, block), dest, rows)
    dx = block_fp8.grouped_matmul(dyq, sdy, jnp.swapaxes(wq, 1, 2), jnp.repeat(jnp.swapaxes(sw, 1, 2), block, axis=2),
                                  tile_group, block, dy.dtype)
    xt, sxt = _token_tiles(scatter_rows(x, dest, rows), block)
    dyt, sdyt = _token_tiles(scatter_rows(dy, dest, rows), block)
    dw = block_fp8.grouped_weight_matmul(xt, sxt, dyt, sdyt, first, count, block, dy.dtype)
    return dx.at[dest, :k].get(mode="fill", fill_value=0), dw[:, :k, :n]


def _by_shard(fn, args, names, arg_names, out_names):
    """fn on args shard by shard by the logical names `names` of (x, w, out) (None: as is); with a leading dim on
    every operand (blocks of experts), fn on each block. Every output is a partial sum where its contraction was
    split."""
    if args[0].ndim == 3:
        fn = jax.vmap(fn)
    if names is None:
        return tuple(fn(*args))
    x_names, w_names, y_names = names
    of = {"x": x_names, "w": w_names, "y": y_names, "sizes": (*x_names[:-2], None)}
    return shard_kernel(fn, args, [of[a] for a in arg_names], [of[o] for o in out_names],
                        summed=tuple(range(len(out_names))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def block_ragged_dot(block: int, names: tuple | None, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x [a, k], w [e, k, n], sizes [e]) with blockwise-scaled e4m3 operands (x and w of one
    dtype; the result has it too; rows past the groups give zeros). With a leading dim on all three (x [g, a, k],
    w [g, e, k, n], sizes [g, e]: folded experts' blocks, or capacity buffers as one expert a block), each block's.
    names: the logical axis names of (x, w, out), by which each rank takes its shard, or None."""
    return _ragged_forward(block, names, x, w, sizes)[0]


def _ragged_forward(block, names, x, w, sizes):
    y, = _by_shard(functools.partial(_ragged_forward_local, block), (x, w, sizes), names, ("x", "w", "sizes"), ("y",))
    return y, (x, w, sizes)


def _ragged_backward(block, names, residuals, dy):
    x, w, sizes = residuals
    dx, dw = _by_shard(functools.partial(_ragged_backward_local, block), (x, w, sizes, dy), names,
                       ("x", "w", "sizes", "y"), ("x", "w"))
    return dx, dw, None


block_ragged_dot.defvjp(_ragged_forward, _ragged_backward)
