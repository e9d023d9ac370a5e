"""Grouped matmul (a mixture of experts' expert matmuls) as Pallas kernels on the Triton backend.

x [a, k] rows sorted by group, w [e, k, n], sizes [e] (rows per group, summing to at most a; rows past the
groups are padding and give zeros): out[i] = x[i] @ w[group of i], the contract of `jax.lax.ragged_dot`, whose
GPU lowering (jax 0.10.2) computes every row against every group's weight (e times the FLOPs).

Layout: each group's rows are copied into a buffer where every group starts at a multiple of the row block
(`plan_rows`), so a tile of block_m rows belongs to one group; a small table names each tile's group. The buffer
has a static size, a + e (block_m - 1) rows rounded down to whole tiles (the most the groups' tiles can take).
Kernels, each a program per output tile:
  forward   (tile, block of n): the tile's rows times its group's [k, block_n] weight, a loop over k
  input grad  the forward's kernel with w transposed ([e, n, k])
  weight grad (group, block of k, block of n): sum over the group's tiles of x_tile^T dy_tile, a loop over
            the tiles from the group's first to its last (bounds read from a table)
The weight is read through a ref to the whole array (a tile's group is data, which Triton BlockSpecs cannot
index by), the rows through BlockSpecs. The jnp oracle is `jax.lax.ragged_dot`; the tests compare both in
Pallas interpret mode, and `jax.export(..., platforms=["cuda"])` lowers the kernels to Triton.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from megajax.kernels.launch import dot, pallas_call, shard_kernel

MIN_BLOCK = 16  # Triton's dot needs every dim >= 16


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes and Triton launch parameters (hashable: a nondiff argument of the custom_vjp)."""

    m: int = 64  # rows per tile (a group's rows are padded to a multiple of it)
    n: int = 64  # output columns per program
    k: int = 32  # contraction step
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool | None = None  # None: interpret on CPU, compile elsewhere (launch.pallas_call)


def group_of_rows(sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group [..., rows] from group sizes [..., e] (e for a padding row, past the groups)."""
    def one(sizes):  # (not jnp.searchsorted: jax 0.10.2's fails on operands varying over a manual axis)
        return jnp.sum(jnp.arange(rows)[:, None] >= jnp.cumsum(sizes)[None, :], axis=-1)

    return jax.vmap(one)(sizes) if sizes.ndim == 2 else one(sizes)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_rows(sizes: jax.Array, rows: int, block_m: int):
    """(each row's position in the padded buffer (past `padded_rows` for a padding row, each its own: dropped),
    each tile's group (e past the last group's tiles), each group's first tile, its tile count, the buffer's
    rows)."""
    e = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    # each group's rows rounded up to whole tiles take at most (rows + e (block_m - 1)) / block_m tiles in all
    tiles = max((rows + e * (block_m - 1)) // block_m, 1)
    padded_rows = tiles * block_m
    start = jnp.cumsum(sizes) - sizes
    group_tiles = (sizes + block_m - 1) // block_m
    first_tile = jnp.cumsum(group_tiles) - group_tiles
    row = jnp.arange(rows, dtype=jnp.int32)
    group = group_of_rows(sizes, rows).astype(jnp.int32)  # e for padding rows
    safe = jnp.minimum(group, e - 1)
    dest = jnp.where(group < e, first_tile[safe] * block_m + row - start[safe], padded_rows + row)
    tile_group = group_of_rows(group_tiles, tiles).astype(jnp.int32)  # e past the last group's tiles
    return dest, tile_group, first_tile.astype(jnp.int32), group_tiles.astype(jnp.int32), padded_rows


def _gmm_kernel(group_ref, x_ref, w_ref, o_ref, *, groups: int, block_n: int, block_k: int, k: int):
    """One [block_m, block_n] tile of out = x_tile @ w[group of the tile]."""
    t, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[t]
    cols = pl.ds(j * block_n, block_n)

    def body(kk, acc):
        ks = pl.ds(kk * block_k, block_k)
        return acc + dot(x_ref[:, ks], w_ref[g, ks, cols], (1, 0))

    @pl.when(g < groups)
    def _():
        o_ref[...] = lax.fori_loop(0, k // block_k, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)

    @pl.when(g >= groups)  # a tile past the last group's: zeros, no weight read
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _tgmm_kernel(first_ref, count_ref, x_ref, dy_ref, o_ref, *, block_m: int, block_k: int, block_n: int):
    """One [block_k, block_n] tile of dw[g] = sum over g's row tiles of x_tile^T dy_tile."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = first_ref[g]
    ks, ns = pl.ds(i * block_k, block_k), pl.ds(j * block_n, block_n)

    def body(t, acc):
        rows = pl.ds(t * block_m, block_m)
        return acc + dot(x_ref[rows, ks], dy_ref[rows, ns], (0, 0))

    acc = lax.fori_loop(first, first + count_ref[g], body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _params(b: Blocks, name: str) -> dict:
    return dict(name=name, interpret=b.interpret,
                compiler_params=pltriton.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages))


def _gmm(x_pad, w, tile_group, b: Blocks, out_dtype):
    """[padded rows, n] = each tile of x_pad times its group's weight (zeros for tiles of no group)."""
    rows, k = x_pad.shape
    e, _, n = w.shape
    kernel = functools.partial(_gmm_kernel, groups=e, block_n=b.n, block_k=b.k, k=k)
    return pallas_call(
        kernel, grid=(rows // b.m, n // b.n),
        in_specs=[pl.BlockSpec(tile_group.shape, lambda t, j: (0,)),
                  pl.BlockSpec((b.m, k), lambda t, j: (t, 0)),
                  pl.BlockSpec(w.shape, lambda t, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((b.m, b.n), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype), **_params(b, "grouped_matmul"))(tile_group, x_pad, w)


def _tgmm(x_pad, dy_pad, first_tile, group_tiles, b: Blocks, out_dtype):
    """[e, k, n]: per group, its rows of x_pad transposed times its rows of dy_pad."""
    rows, k = x_pad.shape
    n = dy_pad.shape[1]
    e = first_tile.shape[0]
    kernel = functools.partial(_tgmm_kernel, block_m=b.m, block_k=b.k, block_n=b.n)
    return pallas_call(
        kernel, grid=(e, k // b.k, n // b.n),
        in_specs=[pl.BlockSpec((e,), lambda g, i, j: (0,)), pl.BlockSpec((e,), lambda g, i, j: (0,)),
                  pl.BlockSpec((rows, k), lambda g, i, j: (0, 0)),
                  pl.BlockSpec((rows, n), lambda g, i, j: (0, 0))],
        out_specs=pl.BlockSpec((None, b.k, b.n), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
        **_params(b, "grouped_matmul_weight_grad"))(first_tile, group_tiles, x_pad, dy_pad)


def _fit(b: Blocks, k: int, n: int) -> tuple[Blocks, int, int]:
    """Blocks no larger than the (16-rounded) dims, and the dims padded to multiples of them."""
    kp, np_ = _round_up(max(k, MIN_BLOCK), MIN_BLOCK), _round_up(max(n, MIN_BLOCK), MIN_BLOCK)
    bk = min(b.k, 1 << (kp.bit_length() - 1))
    bn = min(b.n, 1 << (np_.bit_length() - 1))
    b = dataclasses.replace(b, k=bk, n=bn)
    return b, _round_up(k, b.k), _round_up(n, b.n)


def scatter_rows(x, dest, padded_rows):
    """x's rows [a, ...] at their places `dest` (unique) in a zeroed buffer of padded_rows (a dest past it: dropped)."""
    return jnp.zeros((padded_rows, x.shape[1]), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)


def _pad_cols(x, width):
    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _prepare(x, w, sizes, b: Blocks):
    """What the forward and the backward both build (cheap next to the matmuls): the fitted blocks, the plan
    (`plan_rows`), x scattered into the padded buffer and w padded to the blocks."""
    k, n = w.shape[1:]
    b, plan, x_pad = _layout(x, sizes, n, b)
    w_pad = jnp.pad(w, ((0, 0), (0, x_pad.shape[1] - k), (0, _round_up(n, b.n) - n)))
    return b, plan, x_pad, w_pad


def _layout(x, sizes, n: int, b: Blocks):
    """(the blocks fitted to x's [a, k] and an output width n, the plan, x scattered into the padded buffer)."""
    rows, k = x.shape
    b, kp, _ = _fit(b, k, n)
    plan = plan_rows(sizes, rows, b.m)
    return b, plan, _pad_cols(scatter_rows(x, plan[0], plan[-1]), kp)


def _forward(x, w, sizes, b: Blocks, out_dtype=None):
    """The local forward: [a, n] (in x's dtype, or out_dtype with w as it is: FP8 operands)."""
    b, (dest, tile_group, _, _, _), x_pad, w_pad = _prepare(x, w, sizes, b)
    out = _gmm(x_pad, w_pad if out_dtype else w_pad.astype(x.dtype), tile_group, b, out_dtype or x.dtype)
    return out.at[dest, :w.shape[2]].get(mode="fill", fill_value=0)


def _weight_dot(x, dy, sizes, b: Blocks):
    """The local per-group x^T dy: [e, k, n] in fp32."""
    k, n = x.shape[1], dy.shape[1]
    b, (dest, _, first, count, padded), x_pad = _layout(x, sizes, n, b)
    dy_pad = _pad_cols(scatter_rows(dy, dest, padded), _round_up(n, b.n))
    return _tgmm(x_pad, dy_pad, first, count, b, jnp.float32)[:, :k, :n]


def _backward(x, w, sizes, dy, b: Blocks):
    """The local (dx, dw); the plan and the padded rows are rebuilt from x rather than kept from the forward."""
    k, n = w.shape[1:]
    b, (dest, tile_group, first, count, padded), x_pad, w_pad = _prepare(x, w, sizes, b)
    dy_pad = _pad_cols(scatter_rows(dy, dest, padded), w_pad.shape[2])
    # the input gradient: the forward's kernel with the weight transposed (k and n swap roles)
    w_t = jnp.swapaxes(w_pad, 1, 2).astype(dy.dtype)
    dx = _gmm(dy_pad, w_t, tile_group, dataclasses.replace(b, k=b.n, n=b.k), dy.dtype)
    dx = dx.at[dest, :k].get(mode="fill", fill_value=0)
    dw = _tgmm(x_pad, dy_pad, first, count, b, jnp.float32)[:, :k, :n].astype(w.dtype)
    return dx, dw


@dataclasses.dataclass(frozen=True)
class _Static:
    """Blocks and the operands' logical axis names (x [a, k], w [e, k, n], out [a, n]) for launch.shard_kernel."""

    blocks: Blocks
    x_names: tuple | None
    w_names: tuple | None
    out_names: tuple | None

    @property
    def sizes_names(self) -> tuple | None:
        """The group sizes' names: the blocks' (x's leading names, with folded experts), then the groups'."""
        return None if self.x_names is None else (*self.x_names[:-2], None)


def _static(names: tuple | None, blocks: Blocks | None) -> _Static:
    """The public entry points' (names of (x, w, out) or None, blocks or None) as a _Static."""
    return _Static(blocks or Blocks(), *(names or (None, None, None)))


def _sharded(fn, args, in_names, out_names, st: _Static):
    """fn on args shard by shard (by the names), each shard's blocks of rows (x [g, a, k], w [g, e, k, n], sizes
    [g, e]: folded experts, a block per tensor rank) one after another."""
    if args[0].ndim == 3:
        fn = jax.vmap(fn)
    if st.x_names is None:
        return tuple(fn(*args))
    # outputs are partial sums where their contraction dim was split (launch.shard_kernel's `summed`)
    return shard_kernel(fn, args, in_names, out_names, summed=tuple(range(len(out_names))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, sizes, st: _Static):
    def local(x, w, sizes):
        return (_forward(x, w, sizes, st.blocks),)

    return _sharded(local, [x, w, sizes], [st.x_names, st.w_names, st.sizes_names], [st.out_names], st)[0]


def _grouped_fwd(x, w, sizes, st: _Static):
    return _grouped(x, w, sizes, st), (x, w, sizes)


def _grouped_bwd(st: _Static, res, dy):
    x, w, sizes = res

    def local(x, w, sizes, dy):
        return _backward(x, w, sizes, dy, st.blocks)

    dx, dw = _sharded(local, [x, w, sizes, dy], [st.x_names, st.w_names, st.sizes_names, st.out_names],
                      [st.x_names, st.w_names], st)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, names: tuple | None = None,
                   blocks: Blocks | None = None) -> jax.Array:
    """out [a, n] with out[i] = x[i] @ w[group of row i], rows grouped in order by sizes [e] (rows past
    sum(sizes) give zeros): `jax.lax.ragged_dot`'s contract, computing only each row's own group. names: the
    logical axis names of (x, w, out) to run shard by shard under a mesh (launch.shard_kernel); None: as is.
    With a leading dim on every operand (x [g, a, k], w [g, e, k, n], sizes [g, e]), g such products."""
    return _grouped(x, w, sizes, _static(names, blocks))


def grouped_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, names: tuple | None = None,
                blocks: Blocks | None = None) -> jax.Array:
    """`grouped_matmul`'s product in fp32 with the operands as they are (FP8 included; two FP8 formats are
    multiplied in bf16, launch.dot), not differentiable: the FP8 grouped GEMM's forward and input gradient
    (model.fp8.ragged_dot)."""
    st = _static(names, blocks)
    return _sharded(lambda x, w, sizes: (_forward(x, w, sizes, st.blocks, jnp.float32),), [x, w, sizes],
                    [st.x_names, st.w_names, st.sizes_names], [st.out_names], st)[0]


def grouped_weight_dot(x: jax.Array, dy: jax.Array, sizes: jax.Array, names: tuple | None = None,
                       blocks: Blocks | None = None) -> jax.Array:
    """dw [e, k, n] in fp32, dw[g] = x[rows of g]^T dy[rows of g] (x [a, k], dy [a, n]): the FP8 grouped GEMM's
    weight gradient. names: those of (x, w, dy) as for `grouped_matmul`."""
    st = _static(names, blocks)
    return _sharded(lambda x, dy, sizes: (_weight_dot(x, dy, sizes, st.blocks),), [x, dy, sizes],
                    [st.x_names, st.out_names, st.sizes_names], [st.w_names], st)[0]
