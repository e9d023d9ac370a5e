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
MIN_BLOCK = 16  # Triton's dot needs every dim >= 16


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes and Triton launch parameters (vLLM's and DeepGEMM's tiles for block-scaled FP8 on Hopper)."""

    m: int = 64
    n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    interpret: bool | None = None  # None: interpret on CPU, compile elsewhere (launch.pallas_call)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, group: int, blocks: int):
    """One [block_m, block_n] tile: the blocks of k, each dequantized by its scales' outer product."""

    def body(kb, acc):
        ks = pl.ds(kb * group, group)
        part = dot(a_ref[:, ks], b_ref[ks, :], (1, 0))
        return acc + part * sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :]

    o_ref[...] = lax.fori_loop(0, blocks, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile(size: int, most: int) -> int:
    return min(most, max(MIN_BLOCK, next_power_of_2(size)))


def matmul(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, group: int, out_dtype,
           blocks: Blocks = Blocks()) -> jax.Array:
    """[m, n] in out_dtype = a [m, k] (FP8) x b [k, n] (FP8), block kb of k dequantized by sa [k/group, m] and
    sb [k/group, n] (fp32). On CPU, `reference` (the same products in XLA: the interpreted kernel would make a
    CPU training run ten times slower) unless blocks.interpret says True (the kernel's tests)."""
    k = a.shape[1]
    if k % group or group < MIN_BLOCK:
        raise ValueError(f"block-scaled FP8: the contraction ({k}) must be a multiple of the block ({group}), "
                         f"which must be at least {MIN_BLOCK}")
    if blocks.interpret is not None:
        return _call(a, sa, b, sb, group, out_dtype, blocks)
    compiled = dataclasses.replace(blocks, interpret=False)
    return step_plan.platform_dependent(a, sa, b, sb, cpu=lambda *ops: reference(*ops, group, out_dtype),
                                        default=lambda *ops: _call(*ops, group, out_dtype, compiled))


def _call(a, sa, b, sb, group: int, out_dtype, blocks: Blocks) -> jax.Array:
    """The kernel on operands padded to whole tiles."""
    (m, k), n = a.shape, b.shape[1]
    bm, bn = _tile(m, blocks.m), _tile(n, blocks.n)
    mp, np_ = _round_up(m, bm), _round_up(n, bn)
    a, sa = jnp.pad(a, ((0, mp - m), (0, 0))), jnp.pad(sa, ((0, 0), (0, mp - m)))
    b, sb = jnp.pad(b, ((0, 0), (0, np_ - n))), jnp.pad(sb, ((0, 0), (0, np_ - n)))
    kb = k // group
    out = pallas_call(
        functools.partial(_kernel, group=group, blocks=kb), grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((kb, bm), lambda i, j: (0, i)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j)), pl.BlockSpec((kb, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype), name=NAME, interpret=blocks.interpret,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    )(a, sa.astype(jnp.float32), b, sb.astype(jnp.float32))
    return out[:m, :n]


def reference(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, group: int, out_dtype) -> jax.Array:
    """`matmul` in jnp: each operand dequantized in fp32, one fp32 matmul."""
    a32 = a.astype(jnp.float32) * jnp.repeat(sa.T, group, axis=1)
    b32 = b.astype(jnp.float32) * jnp.repeat(sb, group, axis=0)
    return jnp.dot(a32, b32, precision=lax.Precision.HIGHEST).astype(out_dtype)
