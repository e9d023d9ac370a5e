"""Flash attention (forward and backward) as Pallas kernels on the Triton backend.

q and k [b, s, h, k] and [b, s, g, k], v [b, s, g, k_v], h a multiple of g (grouped-query attention: query head i
reads kv head i // (h // g)); the values may be narrower than the queries and keys (multi-latent attention: 192 and
128). The jnp oracle is `megajax.kernels.attention.attention_reference`.

Algorithm (FlashAttention-2). Forward: one program per (batch, head, block of block_q queries) keeps its
queries in SRAM and streams the keys and values in blocks of block_k, with an online softmax (running max
m, running sum l, fp32 accumulator rescaled when m grows); it writes the output and the log-sum-exp
lse = m + log2(l) per query. Backward: delta = rowsum(o * do) (one fused XLA pass), then two kernels that
recompute the probabilities blockwise from q, k and lse: dq (a program per query block, looping over key
blocks) and dk/dv (a program per key block of a kv head, looping over the query blocks of all h // g query
heads that share it, so grouped-query gradients are summed in registers, not in an [b, s, h, k] buffer).
No [s, s] matrix exists anywhere. Logits are scaled by scale * log2(e) so the kernels use exp2. With
causal masking the loops stop at (forward, dq) or start from (dk/dv) the diagonal block: the blocks above
it are never visited.

Backend: Triton (`pallas.triton.CompilerParams`), on purpose. It compiles for A100 (sm80) and H100/H200
(sm90), the GPUs Megatron-style training runs on today, and it runs in Pallas interpret mode on CPU, so
every test of this file runs on a laptop. Pallas Mosaic GPU is where Pallas GPU is heading (TMA copies,
warpgroup MMA and explicit pipelining, the Hopper features Triton reaches only through its compiler; jax
ships its own Hopper attention in attention_mgpu.py), but it needs Hopper or newer, and its TMA copies and
barriers do not run in interpret mode, so it could be tested only on a GPU. A Mosaic variant can sit
beside this one behind the same custom_vjp once a GPU is at hand to test and time it.

Shapes that do not fit the tiles are padded, never mis-computed: Triton loads and multiplies power-of-2 tiles (each
dim at least 16), so a head dim is read in at most two power-of-2 parts (`head_parts`: 192 as 128 + 64, 80 as
64 + 16), zero-padded only up to their sum (100 to 128); sequences are padded to a multiple of the blocks, and padded
keys are masked.
Head dims above 256 are rejected (the tiles would not fit in shared memory). Under a mesh every kernel runs
per shard, heads over 'tensor' and batch over 'data' (launch.shard_kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from megajax.kernels.dropout import AttentionDropout, column_words, dropped
from megajax.kernels.launch import dot, match_varying, next_power_of_2, pallas_call, shard_kernel
from megajax.parallel.step_plan import varying_axes

LOG2E = math.log2(math.e)
# Finite, so a fully masked row (only ever a padded one) yields uniform weights rather than NaNs that would
# reach real gradients through 0 * NaN; 0.7 leaves headroom for subtracting the running max.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_BLOCK = 16  # Triton's dot needs every dim >= 16
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (rows of q or k per tile) of the three kernels, and the Triton launch parameters.

    Every block is a power of 2 >= 16; each is clipped to the (power-of-2 rounded) sequence length.
    """

    block_q: int = 64  # forward: queries per program
    block_k: int = 64  # forward: keys per inner step
    block_q_dq: int = 64  # dq kernel: queries per program
    block_k_dq: int = 64  # dq kernel: keys per inner step
    block_q_dkv: int = 64  # dk/dv kernel: queries per inner step
    block_k_dkv: int = 64  # dk/dv kernel: keys per program
    num_warps: int = 4  # forward kernel
    num_stages: int = 2
    bwd_num_warps: int | None = None  # dq and dk/dv kernels; None: as the forward
    bwd_num_stages: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("block") and (value < MIN_BLOCK or value & (value - 1)):
                raise ValueError(f"BlockSizes.{f.name}={value} must be a power of 2 >= {MIN_BLOCK}")

    def fit(self, seq_len: int) -> BlockSizes:
        """Blocks no larger than the sequence rounded up to a power of 2 (short sequences: one block)."""
        cap = max(MIN_BLOCK, next_power_of_2(seq_len))
        return dataclasses.replace(self, **{f.name: min(getattr(self, f.name), cap)
                                            for f in dataclasses.fields(self) if f.name.startswith("block")})

    @property
    def largest(self) -> int:
        return max(getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("block"))


# Defaults by (head dim bucket, bytes per element). Sized to the shared memory of an A100 (164 KiB) with
# Triton's 2-stage pipelining: fp32 tiles take twice the bytes, so they get half the rows; the backward
# holds more tiles live (q, k, v, do, dk, dv) than the forward, so its blocks are smaller. The bf16 entries
# for head dims 64 and 128 are the best of `scripts/bench_kernels.py --tune` on an H100 (jax 0.11.2, causal,
# s 2048: forward + backward 1.28 -> 1.07 ms at llama-1b's shape, 1.98 -> 1.12 ms at gpt2-1.3b's); the
# others are untuned. tests/test_kernels.py compiles every entry for A100 and H100 with XLA's GPU compiler,
# so each one at least fits.
BLOCK_TABLE: dict[tuple[int, int], BlockSizes] = {
    (64, 2): BlockSizes(64, 64, 64, 32, 64, 64, num_warps=4, num_stages=2, bwd_num_warps=4, bwd_num_stages=3),
    (128, 2): BlockSizes(128, 128, 128, 32, 64, 64, num_warps=8, num_stages=2, bwd_num_warps=4, bwd_num_stages=2),
    (256, 2): BlockSizes(64, 32, 32, 32, 32, 32, num_warps=8),
    (64, 4): BlockSizes(64, 64, 64, 32, 32, 64, num_warps=4),
    (128, 4): BlockSizes(64, 32, 32, 32, 32, 32, num_warps=8),
    (256, 4): BlockSizes(32, 16, 16, 16, 16, 16, num_warps=8),
}


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The table entry for this head dim (rounded up to 64, 128 or 256) and dtype width."""
    bucket = next(d for d in (64, 128, 256) if head_dim <= d)
    return BLOCK_TABLE[(bucket, 4 if jnp.dtype(dtype).itemsize >= 4 else 2)]


def head_parts(d: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of the power-of-2 parts (each >= MIN_BLOCK) a head dim of d is read and multiplied in: one
    part where d is a power of 2, else two where they cover d with less padding than one (192: 128 + 64, 80:
    64 + 16), else the power of 2 above d (100: 128). The arrays are zero-padded to the parts' sum (`head_width`),
    which changes no logit and adds zero output columns."""
    whole = max(MIN_BLOCK, next_power_of_2(d))
    rest = max(MIN_BLOCK, next_power_of_2(d - whole // 2)) if d > whole // 2 else 0
    if 0 < rest < whole // 2:
        return (0, whole // 2), (whole // 2, rest)
    return ((0, whole),)


def head_width(d: int) -> int:
    """The head dim the kernels run a head dim of d at: the sum of its `head_parts`."""
    return sum(n for _, n in head_parts(d))


def _sum_dots(a_parts, b_parts, contract: tuple[int, int]):
    """sum_i dot(a_i, b_i): a product contracted over a head dim that both operands hold in the same parts."""
    total = None
    for a, b in zip(a_parts, b_parts):
        total = dot(a, b, contract) if total is None else total + dot(a, b, contract)
    return total


def _load_parts(ref, *index):
    """The head-dim parts of ref[*index, :] (its last dim the head dim)."""
    return [ref[(*index, pl.ds(off, n))] for off, n in head_parts(ref.shape[-1])]


def _store_parts(ref, parts, dtype, scale=None):
    """ref[:, part i] = parts[i] (times scale), cast to dtype."""
    for x, (off, n) in zip(parts, head_parts(ref.shape[-1])):
        ref[:, pl.ds(off, n)] = (x if scale is None else x * scale).astype(dtype)


# ----------------------------------------------------------------------------------------------------
# Kernels. Refs arrive as 2D tiles: the batch and head dims are squeezed out by the BlockSpecs.


def _masked_logits(s, q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: int | None):
    """Applies the causal, segment and padding masks to a [block_q, block_k] tile of logits."""
    mask = None
    if causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        mask = same if mask is None else mask & same
    if kv_len is not None:  # non-causal with padded keys (causal already hides them from real queries)
        real = jnp.broadcast_to(k_pos[None, :] < kv_len, s.shape)
        mask = real if mask is None else mask & real
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def _split_refs(refs, has_segments: bool, n_in: int, rate: float = 0.0):
    """(inputs, q segment ids ref, kv segment ids ref, dropout's row words ref, its column words ref, outputs);
    the segment refs are None without segments, the words' without attention dropout (rate 0)."""
    refs = list(refs)
    inputs, refs = refs[:n_in], refs[n_in:]
    sq, sk = (refs.pop(0), refs.pop(0)) if has_segments else (None, None)
    rw, cw = (refs.pop(0), refs.pop(0)) if rate else (None, None)
    return inputs, sq, sk, rw, cw, refs


def _dropped(x, rows, columns, rate: float):
    """A tile x [rows, columns] with attention dropout's dropped entries zeroed, the rest scaled by 1 / (1 - rate)
    (kernels/dropout.py: the same entries as XLA's reference drops); x itself at rate 0."""
    return dropped(x, rows, columns, rate) if rate else x


def _forward_kernel(*refs, scale: float, causal: bool, kv_len: int, length_mask: bool, block_k: int,
                    has_segments: bool, rate: float):
    (q_ref, k_ref, v_ref), sq_ref, sk_ref, rw_ref, cw_ref, (o_ref, lse_ref) = _split_refs(refs, has_segments, 3, rate)
    block_q = q_ref.shape[0]
    qi = pl.program_id(2)
    q = _load_parts(q_ref, slice(None))
    q_pos = qi * block_q + jnp.arange(block_q)
    q_seg = None if sq_ref is None else sq_ref[...]
    rows = None if rw_ref is None else rw_ref[...]

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * block_k, block_k)
        k_seg = None if sk_ref is None else sk_ref[ks]
        s = _sum_dots(q, _load_parts(k_ref, ks), (1, 1)) * (scale * LOG2E)
        s = _masked_logits(s, q_pos, j * block_k + jnp.arange(block_k), q_seg, k_seg, causal=causal,
                           kv_len=kv_len if length_mask else None)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp2(s - m_new[:, None])
        v = _load_parts(v_ref, ks)
        kept = _dropped(p, rows, None if cw_ref is None else cw_ref[ks], rate)  # (the sum l is of all of p)
        acc = tuple(a * alpha[:, None] + dot(kept.astype(x.dtype), x, (1, 0)) for a, x in zip(acc, v))
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    n_kv = pl.cdiv(kv_len, block_k)  # key blocks made only of padding are never read
    upper = jnp.minimum(lax.div((qi + 1) * block_q + block_k - 1, block_k), n_kv) if causal else n_kv
    init = (tuple(jnp.zeros((block_q, n), jnp.float32) for _, n in head_parts(v_ref.shape[-1])),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, upper, body, init)
    _store_parts(o_ref, [a / l[:, None] for a in acc], o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(*refs, scale: float, causal: bool, kv_len: int, length_mask: bool, block_k: int,
               has_segments: bool, rate: float):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), sq_ref, sk_ref, rw_ref, cw_ref, (dq_ref,) = _split_refs(
        refs, has_segments, 6, rate)
    rows = None if rw_ref is None else rw_ref[...]
    block_q = q_ref.shape[0]
    qi = pl.program_id(2)
    q, do = _load_parts(q_ref, slice(None)), _load_parts(do_ref, slice(None))
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = qi * block_q + jnp.arange(block_q)
    q_seg = None if sq_ref is None else sq_ref[...]

    def body(j, dq):
        ks = pl.ds(j * block_k, block_k)
        k = _load_parts(k_ref, ks)
        k_seg = None if sk_ref is None else sk_ref[ks]
        s = _sum_dots(q, k, (1, 1)) * (scale * LOG2E)
        s = _masked_logits(s, q_pos, j * block_k + jnp.arange(block_k), q_seg, k_seg, causal=causal,
                           kv_len=kv_len if length_mask else None)
        p = jnp.exp2(s - lse[:, None])
        dp = _dropped(_sum_dots(do, _load_parts(v_ref, ks), (1, 1)), rows, None if cw_ref is None else cw_ref[ks], rate)
        ds = (p * (dp - delta[:, None])).astype(k_ref.dtype)  # dL/dlogits
        return tuple(a + dot(ds, kp, (1, 0)) for a, kp in zip(dq, k))

    n_kv = pl.cdiv(kv_len, block_k)
    upper = jnp.minimum(lax.div((qi + 1) * block_q + block_k - 1, block_k), n_kv) if causal else n_kv
    dq = lax.fori_loop(0, upper, body, tuple(jnp.zeros(x.shape, jnp.float32) for x in q))
    _store_parts(dq_ref, dq, dq_ref.dtype, scale)


def _dkv_kernel(*refs, scale: float, causal: bool, kv_len: int, q_len: int, length_mask: bool, block_q: int,
                group: int, has_segments: bool, rate: float):
    """q: [s, group, k], do: [s, group, k_v] (the query heads of this kv head); lse, delta and dropout's row words:
    [group, s]; k: [block_k, k], v: [block_k, k_v]; dropout's column words: [block_k]."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), sq_ref, sk_ref, rw_ref, cw_ref, (dk_ref, dv_ref) = _split_refs(
        refs, has_segments, 6, rate)
    columns = None if cw_ref is None else cw_ref[...]
    block_k = k_ref.shape[0]
    ki = pl.program_id(2)
    k, v = _load_parts(k_ref, slice(None)), _load_parts(v_ref, slice(None))
    k_pos = ki * block_k + jnp.arange(block_k)
    k_seg = None if sk_ref is None else sk_ref[...]

    def q_block(i, carry, head):
        dk, dv = carry
        qs = pl.ds(i * block_q, block_q)
        q, do = _load_parts(q_ref, qs, head), _load_parts(do_ref, qs, head)
        q_seg = None if sq_ref is None else sq_ref[qs]
        s = _sum_dots(q, k, (1, 1)) * (scale * LOG2E)
        s = _masked_logits(s, i * block_q + jnp.arange(block_q), k_pos, q_seg, k_seg, causal=causal,
                           kv_len=kv_len if length_mask else None)
        p = jnp.exp2(s - lse_ref[head, qs][:, None])
        rows = None if rw_ref is None else rw_ref[head, qs]
        kept = _dropped(p, rows, columns, rate)
        dv = tuple(a + dot(kept.astype(x.dtype), x, (0, 0)) for a, x in zip(dv, do))
        dp = _dropped(_sum_dots(do, v, (1, 1)), rows, columns, rate)
        ds = (p * (dp - delta_ref[head, qs][:, None])).astype(q_ref.dtype)
        return tuple(a + dot(ds, x, (0, 0)) for a, x in zip(dk, q)), dv

    # Query blocks after the last real query only hold padding, whose do is zero: skip them.
    lower = lax.div(ki * block_k, block_q) if causal else 0
    n_q = pl.cdiv(q_len, block_q)

    def one_head(head, carry):
        return lax.fori_loop(lower, n_q, functools.partial(q_block, head=head), carry)

    zeros = lambda parts: tuple(jnp.zeros(x.shape, jnp.float32) for x in parts)  # noqa: E731
    dk, dv = lax.fori_loop(0, group, one_head, (zeros(k), zeros(v)))
    _store_parts(dk_ref, dk, dk_ref.dtype, scale)
    _store_parts(dv_ref, dv, dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# pallas_calls. Grids are (batch, head, block); the 4D arrays keep their [b, s, h, k] layout in HBM (no
# transposes) and the BlockSpecs pick one head's [block, k] tile out of it.


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the kernels need besides arrays; hashable, so it can be a nondiff argument of the custom_vjp."""

    causal: bool
    scale: float
    kv_len: int  # real (unpadded) key length
    blocks: BlockSizes
    interpret: bool | None
    q_len: int | None = None  # real (unpadded) query length; None: kv_len (self-attention)
    out_dtype: str | None = None  # of the output (forward) and the gradients (backward); None: the inputs'
    rate: float = 0.0  # attention dropout's (kernels/dropout.py; its row and column words come as operands)

    def params(self, name: str, backward: bool = False) -> dict:
        b = self.blocks
        warps, stages = b.num_warps, b.num_stages
        if backward:
            warps, stages = b.bwd_num_warps or warps, b.bwd_num_stages or stages
        return dict(name=name, interpret=self.interpret,
                    compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))

    def kernel_args(self, key_block: int, has_segments: bool) -> dict:
        # Padded keys need their own mask only without causality (which already hides them from every real
        # query) and only when the last key block is part padding (whole padding blocks are not visited).
        return dict(scale=self.scale, causal=self.causal, kv_len=self.kv_len, has_segments=has_segments,
                    length_mask=not self.causal and self.kv_len % key_block != 0, rate=self.rate)

    def dkv_args(self, key_block: int, has_segments: bool) -> dict:
        return dict(self.kernel_args(key_block, has_segments), q_len=self.kv_len if self.q_len is None else self.q_len)


def _segment_specs(row_seg, full_seg, row_block: int, row_index, full_index) -> tuple[list, list]:
    """(specs, arrays) passing segment ids twice: this program's rows (of row_seg), and the whole other sequence
    (full_seg); the same array for self-attention."""
    if row_seg is None:
        return [], []
    return ([pl.BlockSpec((None, row_block), row_index), pl.BlockSpec((None, full_seg.shape[1]), full_index)],
            [row_seg, full_seg])


def _word_specs(st: _Static, rw, cw, row_spec, column_spec) -> tuple[list, list]:
    """(specs, arrays) passing attention dropout's row words (this program's, as its log-sum-exp) and column words;
    none without dropout."""
    return ([row_spec, column_spec], [rw, cw]) if st.rate else ([], [])


def _dtype(st: _Static, like):
    return jnp.dtype(st.out_dtype) if st.out_dtype else like.dtype


def _head_spec(rows: int, d: int, index):
    """A [rows, d] tile of one head of a [b, s, h, d] array."""
    return pl.BlockSpec((None, rows, None, d), index)


def _forward(q, k, v, q_seg, k_seg, rw, cw, st: _Static):
    b, s_pad, h, _ = q.shape
    group = h // k.shape[2]
    bq, bk = st.blocks.block_q, st.blocks.block_k
    seg_specs, seg_args = _segment_specs(q_seg, k_seg, bq, lambda bi, hi, qi: (bi, qi),
                                         lambda bi, hi, qi: (bi, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
    word_specs, word_args = _word_specs(st, rw, cw, row_spec, pl.BlockSpec((k.shape[1],), lambda bi, hi, qi: (0,)))
    kernel = functools.partial(_forward_kernel, block_k=bk, **st.kernel_args(bk, bool(seg_args)))
    row = lambda bi, hi, qi: (bi, qi, hi, 0)  # noqa: E731
    kv = lambda bi, hi, qi: (bi, 0, hi // group, 0)  # noqa: E731
    o_spec = _head_spec(bq, v.shape[3], row)
    return pallas_call(
        kernel, grid=(b, h, s_pad // bq),
        in_specs=[_head_spec(bq, q.shape[3], row), _head_spec(k.shape[1], k.shape[3], kv),
                  _head_spec(k.shape[1], v.shape[3], kv), *seg_specs, *word_specs],
        out_specs=[o_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), _dtype(st, q)),
                   jax.ShapeDtypeStruct((b, h, s_pad), jnp.float32)],
        **st.params("flash_attention_fwd"))(q, k, v, *seg_args, *word_args)


def _backward_dq(q, k, v, do, lse, delta, q_seg, k_seg, rw, cw, st: _Static):
    b, s_pad, h, _ = q.shape
    group = h // k.shape[2]
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    seg_specs, seg_args = _segment_specs(q_seg, k_seg, bq, lambda bi, hi, qi: (bi, qi),
                                         lambda bi, hi, qi: (bi, 0))
    kernel = functools.partial(_dq_kernel, block_k=bk, **st.kernel_args(bk, bool(seg_args)))
    row = lambda bi, hi, qi: (bi, qi, hi, 0)  # noqa: E731
    kv = lambda bi, hi, qi: (bi, 0, hi // group, 0)  # noqa: E731
    q_spec = _head_spec(bq, q.shape[3], row)
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
    word_specs, word_args = _word_specs(st, rw, cw, row_spec, pl.BlockSpec((k.shape[1],), lambda bi, hi, qi: (0,)))
    return pallas_call(
        kernel, grid=(b, h, s_pad // bq),
        in_specs=[q_spec, _head_spec(k.shape[1], k.shape[3], kv), _head_spec(k.shape[1], v.shape[3], kv),
                  _head_spec(bq, do.shape[3], row), row_spec, row_spec, *seg_specs, *word_specs],
        out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, _dtype(st, q)),
        **st.params("flash_attention_dq", backward=True))(q, k, v, do, lse, delta, *seg_args, *word_args)


def _backward_dkv(q, k, v, do, lse, delta, q_seg, k_seg, rw, cw, st: _Static):
    b, s_pad, g, _ = k.shape
    group = q.shape[2] // g
    q_pad = q.shape[1]
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    # the kernel reads the whole query sequence, and this program's key rows
    seg_specs, seg_args = _segment_specs(k_seg, q_seg, bk, lambda bi, gi, ki: (bi, ki),
                                         lambda bi, gi, ki: (bi, 0))
    seg_specs, seg_args = seg_specs[::-1], seg_args[::-1]
    kernel = functools.partial(_dkv_kernel, block_q=bq, group=group, **st.dkv_args(bk, bool(seg_args)))
    # Query head j of kv head gi is gi * group + j: a block of `group` heads at block index gi.
    heads = lambda d: pl.BlockSpec((None, q_pad, group, d), lambda bi, gi, ki: (bi, 0, gi, 0))  # noqa: E731
    key = lambda bi, gi, ki: (bi, ki, gi, 0)  # noqa: E731
    k_spec, v_spec = _head_spec(bk, k.shape[3], key), _head_spec(bk, v.shape[3], key)
    row_spec = pl.BlockSpec((None, group, q_pad), lambda bi, gi, ki: (bi, gi, 0))
    word_specs, word_args = _word_specs(st, rw, cw, row_spec, pl.BlockSpec((bk,), lambda bi, gi, ki: (ki,)))
    return pallas_call(
        kernel, grid=(b, g, s_pad // bk),
        in_specs=[heads(q.shape[3]), k_spec, v_spec, heads(do.shape[3]), row_spec, row_spec, *seg_specs, *word_specs],
        out_specs=[k_spec, v_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, _dtype(st, k)), jax.ShapeDtypeStruct(v.shape, _dtype(st, v))],
        **st.params("flash_attention_dkv", backward=True))(q, k, v, do, lse, delta, *seg_args, *word_args)


# Logical axis names of the operands: shard_kernel splits batch and heads over the mesh.
Q_NAMES = ("batch", None, "heads", None)
KV_NAMES = ("batch", None, "kv_heads", None)
ROW_NAMES = ("batch", "heads", None)  # lse and delta, [b, h, s]
SEGMENT_NAMES = ("batch", None)
COLUMN_NAMES = (None,)  # attention dropout's column words [t]


def _names(segments, words) -> tuple:
    """The logical names of the optional operands: segment ids (twice) and dropout's row and column words."""
    seg = None if segments is None else SEGMENT_NAMES
    return (seg, seg, *((None, None) if words is None else (ROW_NAMES, COLUMN_NAMES)))


def _sharded_forward(q, k, v, q_seg, k_seg, words, st: _Static):
    """(o, lse in log2): the forward kernel shard by shard."""
    rw, cw = (None, None) if words is None else words
    return shard_kernel(lambda q, k, v, qs, ks, rw, cw: _forward(q, k, v, qs, ks, rw, cw, st),
                        (q, k, v, q_seg, k_seg, rw, cw),
                        (Q_NAMES, KV_NAMES, KV_NAMES, *_names(q_seg, words)), (Q_NAMES, ROW_NAMES))


def _sharded_backward(q, k, v, do, lse, delta, q_seg, k_seg, words, st: _Static):
    """(dq, dk, dv): the dq and dk/dv kernels shard by shard."""
    rw, cw = (None, None) if words is None else words

    def grads(q, k, v, do, lse, delta, qs, ks, rw, cw):
        dq = _backward_dq(q, k, v, do, lse, delta, qs, ks, rw, cw, st)
        return (dq, *_backward_dkv(q, k, v, do, lse, delta, qs, ks, rw, cw, st))

    return shard_kernel(grads, (q, k, v, do, lse, delta, q_seg, k_seg, rw, cw),
                        (Q_NAMES, KV_NAMES, KV_NAMES, Q_NAMES, ROW_NAMES, ROW_NAMES, *_names(q_seg, words)),
                        (Q_NAMES, KV_NAMES, KV_NAMES))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segment_ids, words, st: _Static):
    return _sharded_forward(q, k, v, segment_ids, segment_ids, words, st)[0]


def _flash_fwd(q, k, v, segment_ids, words, st: _Static):
    o, lse = _sharded_forward(q, k, v, segment_ids, segment_ids, words, st)
    return o, (q, k, v, segment_ids, words, o, lse)


def _flash_bwd(st: _Static, res, do):
    q, k, v, segment_ids, words, o, lse = res
    # delta_i = sum_k o_ik do_ik = sum_j p_ij dp_ij: one memory-bound pass XLA fuses; doing it in the dq
    # kernel would leave the dk/dv kernel without it. (With dropout o is the dropped output, and the identity
    # holds with dp the dropped one.)
    delta = jnp.einsum("bshk,bshk->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    dq, dk, dv = _sharded_backward(q, k, v, do, lse, delta, segment_ids, segment_ids, words, st)
    # Each cotangent typed as its primal (inside the pipeline's shard_map: varying over 'data').
    return (match_varying(dq, varying_axes(q)), match_varying(dk, varying_axes(k)),
            match_varying(dv, varying_axes(v)), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    probs_dropout: AttentionDropout | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with flash attention kernels. [b,s,h,k] x [b,s,g,k], [b,s,g,k_v] ->
    [b,s,h,k_v].

    segment_ids [b, s] (int): tokens attend only within their segment (packed documents). scale defaults
    to 1/sqrt(k). block_sizes defaults to BLOCK_TABLE's entry for the wider head dim and dtype. interpret=None
    interprets on CPU and compiles on GPU. probs_dropout: attention dropout, the entries XLA's reference drops
    (kernels/dropout.py). Differentiable (custom_vjp with the backward kernels).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected q [b, s, h, k], k [b, s, g, k] and v [b, s, g, k_v]: {q.shape=} {k.shape=} "
                         f"{v.shape=}")
    b, s, h, d = q.shape
    dv = v.shape[3]
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"q and k/v must share batch, sequence (self-attention) and head dim: {q.shape=} "
                         f"{k.shape=}")
    g = k.shape[2]
    if h % g:
        raise ValueError(f"the query heads must be a multiple of the kv heads: {h=} {g=}")
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one of bfloat16, float16, float32: {q.dtype=} {k.dtype=} {v.dtype=}")
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dim {max(d, dv)} > {MAX_HEAD_DIM}: its tiles would not fit in shared memory; use "
                         "impl='xla' or 'cudnn'")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must be [b, s] = {(b, s)}: {segment_ids.shape=}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    blocks = (block_sizes or default_block_sizes(max(d, dv), q.dtype)).fit(s)

    # Pad the head dims to their parts' sum (zeros change no logit and give zero output columns) and the
    # sequence to a multiple of every block (padded keys are masked, padded query rows dropped).
    s_pad = -(-s // blocks.largest) * blocks.largest
    q, k, v = (_pad_block(x, s_pad) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = _pad_block(segment_ids, s_pad).astype(jnp.int32)
    words, rate = None, 0.0
    if probs_dropout is not None:
        positions = jnp.arange(s_pad)
        words, rate = (probs_dropout.row_words(positions), column_words(positions)), probs_dropout.rate
    out = _flash(q, k, v, segment_ids, words, _Static(bool(causal), scale, s, blocks, interpret, rate=rate))
    return out[:, :s, :, :dv]


# ----------------------------------------------------------------------------------------------------
# One block of a blockwise attention (the context-parallel ring, megajax/model/ring.py): not differentiable
# themselves; the ring's custom_vjp calls the backward. Queries and keys may differ in length when not causal.


def _block_static(q, k, v, causal: bool, scale: float, block_sizes: BlockSizes | None, interpret: bool | None,
                  drop):
    s, t = q.shape[1], k.shape[1]
    if causal and s != t:
        raise ValueError(f"a causal block is a diagonal one: queries and keys of one length, got {s} and {t}")
    blocks = (block_sizes or default_block_sizes(max(q.shape[3], v.shape[3]), q.dtype)).fit(max(s, t))
    return _Static(bool(causal), float(scale), t, blocks, interpret, q_len=s, out_dtype="float32",
                   rate=0.0 if drop is None else drop[2])


def _block_words(drop, s_pad: int, t_pad: int):
    """A block's dropout words (rows [b, h, s], columns [t]) padded to its padded queries and keys; None without."""
    return None if drop is None else (jnp.pad(drop[0], ((0, 0), (0, 0), (0, s_pad - drop[0].shape[2]))),
                                      jnp.pad(drop[1], (0, t_pad - drop[1].shape[0])))


def _pad_block(x, length: int):
    """x [b, s, ...] padded to `length` rows, and a head dim (of [b, s, h, k]) to its `head_width`."""
    if x is None:
        return None
    widths = [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    if x.ndim == 4:
        widths[3] = (0, head_width(x.shape[3]) - x.shape[3])
    return jnp.pad(x, widths) if any(w != (0, 0) for w in widths) else x


def _block_pads(st: _Static, q, k):
    unit = st.blocks.largest
    return -(-q.shape[1] // unit) * unit, -(-k.shape[1] // unit) * unit


def flash_block_forward(q, k, v, q_seg=None, k_seg=None, *, causal: bool, scale: float,
                        block_sizes: BlockSizes | None = None, interpret: bool | None = None, drop=None):
    """(o [b, s, h, k_v] fp32, lse [b, h, s] fp32, natural log) of q [b, s, h, k] over the keys k [b, t, g, k] and
    values v [b, t, g, k_v] alone, with the flash-attention forward kernel; causal only for a diagonal block
    (s == t). drop: attention dropout's (row words, column words, rate) of the block (kernels/attention.py)."""
    st = _block_static(q, k, v, causal, scale, block_sizes, interpret, drop)
    s, dv = q.shape[1], v.shape[3]
    s_pad, t_pad = _block_pads(st, q, k)
    o, lse2 = _sharded_forward(_pad_block(q, s_pad), _pad_block(k, t_pad), _pad_block(v, t_pad),
                               _pad_block(q_seg, s_pad), _pad_block(k_seg, t_pad), _block_words(drop, s_pad, t_pad), st)
    return o[:, :s, :, :dv], lse2[:, :, :s] / LOG2E


def flash_block_backward(q, k, v, do, lse, delta, q_seg=None, k_seg=None, *, causal: bool, scale: float,
                         block_sizes: BlockSizes | None = None, interpret: bool | None = None, drop=None):
    """(dq, dk, dv) in fp32 of this block's share of an attention whose log-sum-exp per query (natural log) is
    lse [b, h, s] and whose rowsum(o * do) is delta [b, h, s], both of the whole attention: the flash-attention
    dq and dk/dv kernels."""
    st = _block_static(q, k, v, causal, scale, block_sizes, interpret, drop)
    s, t, d, dv = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    s_pad, t_pad = _block_pads(st, q, k)
    rows = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - s)))  # noqa: E731  padded queries: do = 0, no share
    dq, dk, dv_ = _sharded_backward(
        _pad_block(q, s_pad), _pad_block(k, t_pad), _pad_block(v, t_pad), _pad_block(do.astype(q.dtype), s_pad),
        rows(lse * LOG2E), rows(delta), _pad_block(q_seg, s_pad), _pad_block(k_seg, t_pad),
        _block_words(drop, s_pad, t_pad), st)
    return dq[:, :s, :, :d], dk[:, :t, :, :d], dv_[:, :t, :, :dv]
