"""Block-scaled FP8 matmul (model.fp8_recipe=blockwise) as a Pallas kernel on the Triton backend.

    out[m, n] = sum over blocks kb of k:  (a[m, kb] . b[kb, n]) x sa[kb, m] x sb[kb, n]

a [m, k] and b [k, n] are FP8, the contraction is taken in blocks of `group` elements (128), and each block's
fp32 partial product is dequantized by the outer product of its scales (a's per row, b's per column) before it
joins the fp32 accumulator: DeepSeek-V3's promotion of the tensor cores' partial sums to fp32 every 128 elements of
k, which is what lets every 1 x 128 tile of an activation and every 128 x 128 block of a weight carry its own
scale. The scales are the dequantization factors (1 / the quantization scale), fp32, a's stored transposed
([k / group, m], one row per block of k: a row read per loop step). A 128 x 128 weight block's scale comes
repeated over its block's columns; the weight gradient's tiles over tokens (128 x 1, both operands) come as they
are. megajax/model/fp8.py quantizes and calls this.

A program per [block_m, block_n] output tile loops over the blocks of k. The rows and columns are padded to the
tiles; k must be a multiple of `group` (>= 16: Triton's dot). The jnp oracle `reference` dequantizes and
multiplies in fp32, and is what runs on CPU; the tests compare the kernel with it in Pallas interpret mode, and
`jax.export(..., platforms=["cuda"])` lowers the kernel to Triton (the audit names it `block_fp8_matmul` and
counts its FLOPs as FP8).

The mixture of experts' grouped form (`grouped_matmul`, `grouped_weight_matmul`) takes rows laid out as
kernels/grouped_matmul.py lays them out (`plan_rows`: each expert's rows from a multiple of `group`, so a tile of
`group` rows is one expert's and one block of the weight gradient's tokens): the forward and input gradient a
program per (row tile, block of n) with its tile's expert's weight and scales, the weight gradient a program per
(expert, block of k, block of n) summing the expert's row tiles, each dequantized by its tokens' scales. Their
references (`grouped_reference`, `grouped_weight_reference`) are `jax.lax.ragged_dot` on the dequantized operands.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from megajax.kernels.launch import dot, next_power_of_2, pallas_call
from megajax.parallel import step_plan

NAME = "block_fp8_matmul"
GROUPED_NAMES = ("block_fp8_grouped_matmul", "block_fp8_grouped_weight_matmul")
MIN_BLOCK = 16  # Triton's dot needs every dim >= 16


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes and Triton launch parameters (vLLM's and DeepGEMM's tiles for block-scaled FP8 on Hopper)."""

    m: int = 64
    n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    interpret: bool | None = None  # None: interpret on CPU, compile elsewhere (launch.pallas_call)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, group: int, blocks: int, b_nk: bool):
    """One [block_m, block_n] tile: the blocks of k, each dequantized by its scales' outer product (b's tile
    [block_n, k] where b_nk, else [k, block_n])."""

    def body(kb, acc):
        ks = pl.ds(kb * group, group)
        part = dot(a_ref[:, ks], b_ref[:, ks], (1, 1)) if b_nk else dot(a_ref[:, ks], b_ref[ks, :], (1, 0))
        return acc + part * sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]

    o_ref[...] = lax.fori_loop(0, blocks, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile(size: int, most: int) -> int:
    return min(most, max(MIN_BLOCK, next_power_of_2(size)))


def matmul(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, group: int, out_dtype,
           blocks: Blocks = Blocks(), b_nk: bool = False) -> jax.Array:
    """[m, n] in out_dtype = a [m, k] (FP8) x b [k, n] (FP8; b_nk: b given as [n, k], k contiguous), block kb of
    k dequantized by sa [k/group, m] and sb [k/group, n] (fp32). b_nk takes a weight's blocks as they are for its
    input gradient (dy . w^T), so no transpose of w is asked of XLA: one of a loop-invariant weight, XLA made once
    in fp32 and held for the step. On CPU, `reference` (the same products in XLA: the interpreted kernel would make
    a CPU training run ten times slower) unless blocks.interpret says True (the kernel's tests)."""
    _check(a.shape[1], group)
    return _on_platform(blocks, lambda a, sa, b, sb, blocks: _call(a, sa, b, sb, group, out_dtype, blocks, b_nk),
                        lambda a, sa, b, sb: reference(a, sa, b.T if b_nk else b, sb, group, out_dtype),
                        a, sa, b, sb)


def _call(a, sa, b, sb, group: int, out_dtype, blocks: Blocks, b_nk: bool) -> jax.Array:
    """The kernel on operands padded to whole tiles."""
    (m, k), n = a.shape, sb.shape[1]
    bm, bn = _tile(m, blocks.m), _tile(n, blocks.n)
    mp, np_ = _round_up(m, bm), _round_up(n, bn)
    a, sa = jnp.pad(a, ((0, mp - m), (0, 0))), jnp.pad(sa, ((0, 0), (0, mp - m)))
    b = jnp.pad(b, ((0, np_ - n), (0, 0)) if b_nk else ((0, 0), (0, np_ - n)))
    sb = jnp.pad(sb, ((0, 0), (0, np_ - n)))
    kb = k // group
    b_spec = pl.BlockSpec((bn, k), lambda i, j: (j, 0)) if b_nk else pl.BlockSpec((k, bn), lambda i, j: (0, j))
    out = pallas_call(
        functools.partial(_kernel, group=group, blocks=kb, b_nk=b_nk), grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((kb, bm), lambda i, j: (0, i)),
                  b_spec, pl.BlockSpec((kb, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype), **_params(blocks, NAME),
    )(a, sa.astype(jnp.float32), b, sb.astype(jnp.float32))
    return out[:m, :n]


def reference(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, group: int, out_dtype) -> jax.Array:
    """`matmul` in jnp: each operand dequantized in fp32, one fp32 matmul."""
    a32 = a.astype(jnp.float32) * jnp.repeat(sa.T, group, axis=1)
    b32 = b.astype(jnp.float32) * jnp.repeat(sb, group, axis=0)
    return jnp.dot(a32, b32, precision=lax.Precision.HIGHEST).astype(out_dtype)


def _grouped_kernel(group_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, *, groups: int, group: int, blocks: int,
                    block_n: int):
    """One [group, block_n] tile: the tile's rows times its expert's weight, block by block of k."""
    t, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[t]
    cols = pl.ds(j * block_n, block_n)

    def body(kb, acc):
        ks = pl.ds(kb * group, group)
        part = dot(a_ref[:, ks], b_ref[g, ks, cols], (1, 0))
        return acc + part * sa_ref[kb, :][:, None] * sb_ref[g, kb, cols][None, :]

    @pl.when(g < groups)
    def _():
        o_ref[...] = lax.fori_loop(0, blocks, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)

    @pl.when(g >= groups)  # a tile past the last expert's: zeros, no weight read
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _grouped_weight_kernel(first_ref, count_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, *, group: int, block_k: int,
                           block_n: int):
    """One [block_k, block_n] tile of dw[g]: the sum over g's row tiles of a_tile^T b_tile times their scales."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = first_ref[g]
    ks, ns = pl.ds(i * block_k, block_k), pl.ds(j * block_n, block_n)

    def body(t, acc):
        rows = pl.ds(t * group, group)
        part = dot(a_ref[rows, ks], b_ref[rows, ns], (0, 0))
        return acc + part * sa_ref[t, ks][:, None] * sb_ref[t, ns][None, :]

    o_ref[...] = lax.fori_loop(first, first + count_ref[g], body,
                               jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


def _params(blocks: Blocks, name: str) -> dict:
    return dict(name=name, interpret=blocks.interpret,
                compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages))


def _on_platform(blocks: Blocks, call, reference_call, *ops):
    """`call` (the kernel) where the step is compiled for a GPU, `reference_call` on CPU; the kernel in Pallas
    interpret mode wherever blocks.interpret says True (the tests)."""
    if blocks.interpret is not None:
        return call(*ops, blocks)
    compiled = dataclasses.replace(blocks, interpret=False)
    return step_plan.platform_dependent(*ops, cpu=reference_call, default=lambda *o: call(*o, compiled))


def grouped_matmul(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, tile_group: jax.Array, group: int,
                   out_dtype, blocks: Blocks = Blocks()) -> jax.Array:
    """[rows, n] in out_dtype: each tile of `group` rows of a [rows, k] (FP8) times its expert's b [e, k, n] (FP8),
    block kb of k dequantized by sa [k/group, rows] and sb [e, k/group, n] (fp32); tile_group [rows / group]: each
    tile's expert (e: no expert, zeros)."""
    def call(a, sa, b, sb, tile_group, blocks):
        (rows, k), (e, _, n) = a.shape, b.shape
        bn = _tile(n, blocks.n)
        np_ = _round_up(n, bn)
        b, sb = jnp.pad(b, ((0, 0), (0, 0), (0, np_ - n))), jnp.pad(sb, ((0, 0), (0, 0), (0, np_ - n)))
        kernel = functools.partial(_grouped_kernel, groups=e, group=group, blocks=k // group, block_n=bn)
        return pallas_call(
            kernel, grid=(rows // group, np_ // bn),
            in_specs=[pl.BlockSpec(tile_group.shape, lambda t, j: (0,)),
                      pl.BlockSpec((group, k), lambda t, j: (t, 0)),
                      pl.BlockSpec((k // group, group), lambda t, j: (0, t)),
                      pl.BlockSpec(b.shape, lambda t, j: (0, 0, 0)), pl.BlockSpec(sb.shape, lambda t, j: (0, 0, 0))],
            out_specs=pl.BlockSpec((group, bn), lambda t, j: (t, j)),
            out_shape=jax.ShapeDtypeStruct((rows, np_), out_dtype), **_params(blocks, GROUPED_NAMES[0]),
        )(tile_group, a, sa.astype(jnp.float32), b, sb.astype(jnp.float32))[:, :n]

    _check(a.shape[1], group)
    return _on_platform(blocks, call, lambda *ops: grouped_reference(*ops, group, out_dtype), a, sa, b, sb,
                        tile_group)


def grouped_weight_matmul(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, first: jax.Array,
                          count: jax.Array, group: int, out_dtype, blocks: Blocks = Blocks()) -> jax.Array:
    """[e, k, n] in out_dtype: per expert g, the sum over its row tiles (`count[g]` from `first[g]`) of a_tile^T
    b_tile, a [rows, k] and b [rows, n] FP8, each tile's products dequantized by sa [rows / group, k] and sb
    [rows / group, n] (fp32: one scale per tile and column, over the tile's `group` tokens)."""
    def call(a, sa, b, sb, first, count, blocks):
        k, n, e = a.shape[1], b.shape[1], first.shape[0]
        bk, bn = _tile(k, blocks.n), _tile(n, blocks.n)
        kp, np_ = _round_up(k, bk), _round_up(n, bn)
        a, sa = jnp.pad(a, ((0, 0), (0, kp - k))), jnp.pad(sa, ((0, 0), (0, kp - k)))
        b, sb = jnp.pad(b, ((0, 0), (0, np_ - n))), jnp.pad(sb, ((0, 0), (0, np_ - n)))
        kernel = functools.partial(_grouped_weight_kernel, group=group, block_k=bk, block_n=bn)
        whole = [pl.BlockSpec(x.shape, lambda g, i, j: (0, 0)) for x in (a, sa, b, sb)]
        return pallas_call(
            kernel, grid=(e, kp // bk, np_ // bn),
            in_specs=[pl.BlockSpec((e,), lambda g, i, j: (0,)), pl.BlockSpec((e,), lambda g, i, j: (0,)), *whole],
            out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
            out_shape=jax.ShapeDtypeStruct((e, kp, np_), out_dtype), **_params(blocks, GROUPED_NAMES[1]),
        )(first, count, a, sa.astype(jnp.float32), b, sb.astype(jnp.float32))[:, :k, :n]

    return _on_platform(blocks, call, lambda *ops: grouped_weight_reference(*ops, group, out_dtype), a, sa, b, sb,
                        first, count)


def _check(k: int, group: int) -> None:
    if k % group or group < MIN_BLOCK:
        raise ValueError(f"block-scaled FP8: the contraction ({k}) must be a multiple of the block ({group}), "
                         f"which must be at least {MIN_BLOCK}")


def grouped_reference(a, sa, b, sb, tile_group, group: int, out_dtype) -> jax.Array:
    """`grouped_matmul` in jnp: the operands dequantized in fp32, `jax.lax.ragged_dot` over the experts' tiles."""
    e = b.shape[0]
    a32 = a.astype(jnp.float32) * jnp.repeat(sa.T, group, axis=1)
    b32 = b.astype(jnp.float32) * jnp.repeat(sb, group, axis=1)
    sizes = jnp.sum(tile_group[None, :] == jnp.arange(e)[:, None], axis=1, dtype=jnp.int32) * group
    return lax.ragged_dot(a32, b32, sizes, precision=lax.Precision.HIGHEST).astype(out_dtype)


_WEIGHT_GRAD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def grouped_weight_reference(a, sa, b, sb, first, count, group: int, out_dtype) -> jax.Array:
    """`grouped_weight_matmul` in jnp: the operands dequantized per tile in fp32, `jax.lax.ragged_dot_general`
    over each expert's tiles (they lie in expert order from row 0)."""
    a32 = a.astype(jnp.float32) * jnp.repeat(sa, group, axis=0)
    b32 = b.astype(jnp.float32) * jnp.repeat(sb, group, axis=0)
    return lax.ragged_dot_general(a32, b32, count * group, _WEIGHT_GRAD, precision=lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32).astype(out_dtype)
