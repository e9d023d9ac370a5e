"""Tensor-parallel matmuls with their sequence-parallel collectives broken into a ring under the GEMMs
(`parallel.tp_comm_overlap`, Megatron's --tp-comm-overlap; Wang et al., "Overlap Communication with Dependent
Computation via Decomposition", ASPLOS 2023).

With sequence parallelism a column-parallel matmul all-gathers its input over 'tensor' first and a row-parallel
one reduce-scatters its output after: XLA runs each collective whole, with nothing to overlap it in the layer.
Here 'tensor' is made manual around the matmul and the collective becomes t - 1 ring steps (ppermute to the
neighbour), each step's transfer independent of that step's GEMM, so the GPU's latency-hiding scheduler runs
them side by side:
  gather_matmul: y[:, block j] = x_j w for the t sequence blocks x_j, computing on the block in hand while the
    next one comes around the ring;
  matmul_scatter: each output block's partial sum travels the ring, gaining this rank's term h[:, block] w at
    every hop, and ends on its own rank.
Each backward is a custom VJP (jax 0.10.2 cannot differentiate a shard_map nested in the train step's manual
region) built from the same two rings: gather_matmul's reduce-scatters the input gradient and brings the input's
blocks round again for the weight gradient (as Megatron re-gathers it, rather than keeping the gathered input);
matmul_scatter's brings the output gradient's blocks round for both gradients. An optimization barrier between
ring steps keeps XLA's dot merger from fusing a ring's GEMMs into one that waits for every transfer. The same
bytes cross 'tensor' as the all-gather and reduce-scatter move; the sum's order differs (partials added around
the ring).

Inside a pipeline the layers run in per-rank conditionals, where a ppermute waits for every device of the mesh
(deadlock on the CPU runtime: its peers are every device, not the ranks of one 'tensor' group). There the
collectives are split into chunks instead (the step plan's tp_overlap="chunks"), which wait only for their own group, as
GSPMD's do in the branches: each rank's sequence block is cut into t chunks;
  gather_matmul multiplies its own block while chunk 0 of the other blocks is all-gathered, then chunk c of the
    others while chunk c + 1 comes;
  matmul_scatter computes its term for chunk c of the other blocks and reduce-scatters it while the next chunk's
    term is computed, its own block's term last.
Optimization barriers order the steps as in the ring, and chain the collectives: left alone, XLA's combiner made
one all-gather of a matmul's chunks before its first GEMM and one reduce-scatter after its last. The same bytes
and FLOPs as the ring.

With model.fp8 the products are the FP8 matmul's (megajax/model/fp8.py), its operands quantized before they travel:
the blocks a ring gathers cross 'tensor' in FP8, the partial sums in the compute dtype. With blockwise scaling
(megajax/model/fp8_blockwise.py) each step's products are blockwise on the piece in hand, which travels in the
compute dtype (the weight gradient tiles its tokens B x 1, the forward 1 x B: one copy serves both). With the zero_bubble
schedule the backward is split: B's VJP leaves the weight gradients out and W (`weight_grad`) gathers for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.model import fp8, fp8_blockwise
from megajax.parallel import step_plan
from megajax.parallel.step_plan import tensor_manual

def _mode() -> str | None:
    """The step plan's tp_overlap: "ring", "chunks" (inside a pipeline's per-rank branches) or None."""
    return step_plan.in_force().tp_overlap


def active() -> bool:
    """Whether the model's tensor-parallel matmuls run with their collectives decomposed here: the step plan's
    tp_overlap (parallel.tp_comm_overlap with sequence parallelism and 'tensor' > 1), outside a region that
    makes 'tensor' manual."""
    return _mode() is not None and "tensor" not in step_plan.current_manual_axes()


def _letters(spec: str, w_names) -> tuple[str, str, str, set[str]]:
    """(input, weight and output letters of the einsum `spec`, the letters of the weight's dims split over
    'tensor')."""
    x, w, out = _subscripts(spec)
    split = {c for c, axis in zip(w, step_plan.param_spec(w_names)) if "tensor" in step_plan.axes_of(axis)}
    return x, w, out, split


def _subscripts(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    return (*inputs.split(","), out)


def _spec(letters: str, split: set[str]) -> P:
    return P(*["tensor" if c in split else None for c in letters])


def _seq_spec(ndim: int) -> P:
    return P(*[("tensor" if i == 1 else None) for i in range(ndim)])


def _rank() -> tuple[int, jax.Array]:
    """(t, this rank's index on 'tensor')."""
    return jax.lax.axis_size("tensor"), jax.lax.axis_index("tensor")


def _mod(r: jax.Array, offset: int, t: int) -> jax.Array:
    """(r + offset) mod t for 0 <= r < t, as one lax.rem (the offset made non-negative here)."""
    return jax.lax.rem(r + offset % t, t)


def _gather_ring(a: jax.Array, step) -> list:
    """Inside the manual region: [step(block, j)] in ring order for the t sequence blocks of a ([b, n, ...] here,
    block j of the whole sequence on rank j), this rank's first; the next block is in flight during each step."""
    t, r = _rank()
    shift = [(j, (j - 1) % t) for j in range(t)]  # rank r receives rank r + 1's block
    block, out = a, []
    for i in range(t):
        nxt = jax.lax.ppermute(block, "tensor", shift) if i < t - 1 else None
        y = step(block, _mod(r, i, t))
        if nxt is not None:  # the next step's GEMMs wait for this one's: XLA would merge them into one GEMM after
            nxt, y = jax.lax.optimization_barrier((nxt, y))  # the transfer (its dot merger), hiding nothing
        out.append(y)
        block = nxt
    return out


def _in_order(pieces: list) -> jax.Array:
    """The ring-ordered sequence blocks (`_gather_ring`'s, the first this rank's) as one array, blocks in sequence
    order along dim 1."""
    t, r = _rank()
    twice = jnp.stack(pieces + pieces)  # piece i is block (r + i) mod t: block j is piece (j - r) mod t
    blocks = jax.lax.dynamic_slice_in_dim(twice, jax.lax.rem(t - r, t), t, axis=0)
    return jnp.moveaxis(blocks, 0, 1).reshape(blocks.shape[1], -1, *blocks.shape[3:])


def _scatter_ring(a, part) -> jax.Array:
    """Inside the manual region: the sum over ranks of part(j, a) for this rank's block j = r, built as each block's
    partial sum travels the ring (block r - 1 - i's passes rank r at step i), the next term computed meanwhile from
    `a` (the arrays part reads)."""
    t, r = _rank()
    shift = [(j, (j + 1) % t) for j in range(t)]
    acc = part(_mod(r, -1, t), a)
    for i in range(1, t):
        acc, a = jax.lax.optimization_barrier((acc, a))  # the next term after this one (no merged GEMMs)
        acc = jax.lax.ppermute(acc, "tensor", shift) + part(_mod(r, -1 - i, t), a)
    return acc


def _block(a: jax.Array, j, n: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=1)


def _chunks(n: int) -> int:
    """How many chunks a rank's sequence block of n rows is cut into: t, or the largest divisor of n below it."""
    t = jax.lax.axis_size("tensor")
    return max(c for c in range(1, t + 1) if n % c == 0)


def _rotate(blocks: jax.Array, back: bool = False) -> jax.Array:
    """[b, t, ...] blocks in sequence order -> this rank's first (block i is (r + i) mod t), or `back` again."""
    t, r = _rank()
    start = jax.lax.rem(t - r, t) if back else r
    return jax.lax.dynamic_slice_in_dim(jnp.concatenate([blocks, blocks], axis=1), start, t, axis=1)


def _others_chunk(whole: jax.Array, c: int, m: int) -> jax.Array:
    """Of a whole-sequence array [b, s, ...] (t blocks of m chunks): chunk c of the other ranks' blocks, [b, (t -
    1) s / (t m), ...], in ring order (rank r + 1's first)."""
    t = jax.lax.axis_size("tensor")
    blocks = _rotate(whole.reshape(whole.shape[0], t, m, -1, *whole.shape[2:])[:, :, c])
    return blocks[:, 1:].reshape(whole.shape[0], -1, *whole.shape[2:])


def _gather_chunks(a: jax.Array, step) -> list:
    """Inside the manual region: step(a, -1) on this rank's block ([b, n, ...]) while the first chunk comes,
    then [step(chunk c of the other ranks' blocks, c)] for the m chunks of a block (`_others_chunk`'s rows), each
    all-gathered over 'tensor' during the step before."""
    t = jax.lax.axis_size("tensor")
    m = _chunks(a.shape[1])
    n = a.shape[1] // m

    def gather(a, c):
        chunk = jax.lax.all_gather(a[:, c * n:(c + 1) * n], "tensor", axis=1, tiled=False)  # [b, t, n / m, ...]
        return _rotate(chunk)[:, 1:].reshape(a.shape[0], (t - 1) * n, *a.shape[2:])

    piece, j, out = a, -1, []
    for c in range(m + 1):
        nxt = gather(a, c) if c < m else None
        y = step(piece, j)
        if nxt is not None:  # as in the ring: the next step's GEMMs are not merged with this one's; and the gather
            # after next reads a from here, so XLA's combiner cannot make one all-gather of them all before step 0
            nxt, y, a = jax.lax.optimization_barrier((nxt, y, a))
        out.append(y)
        piece, j = nxt, c
    return out


def _chunks_in_order(pieces: list) -> jax.Array:
    """`_gather_chunks`' pieces (this rank's block, then chunk c of the others' in ring order) as one array in
    sequence order along dim 1."""
    own, chunks = pieces[0], pieces[1:]
    t = jax.lax.axis_size("tensor")
    split = [p.reshape(p.shape[0], t - 1, -1, *p.shape[2:]) for p in chunks]  # [b, other block, rows, ...]
    others = jnp.stack(split, axis=2).reshape(own.shape[0], t - 1, *own.shape[1:])  # [b, other block, n, ...]
    whole = _rotate(jnp.concatenate([own[:, None], others], axis=1), back=True)
    return whole.reshape(own.shape[0], -1, *own.shape[2:])


def _scatter_chunks(a, part, n: int) -> jax.Array:
    """Inside the manual region: this rank's block [b, n, ...] of the sum over ranks of the whole-sequence terms:
    part(rows, a) gives this rank's term for the rows rows(whole) picks of a whole-sequence array. Chunk c of the
    other ranks' blocks (`_others_chunk`) is reduce-scattered over 'tensor' while the next chunk's term is computed,
    this rank's own block's term last."""
    t, r = _rank()
    m = _chunks(n)
    out = []
    for c in range(m):
        term = part(lambda whole: _others_chunk(whole, c, m), a)  # [b, (t - 1) n / m, ...], rank r + 1's first
        term, a = jax.lax.optimization_barrier((term, a))  # the next term after this one (no merged GEMMs)
        if out:  # each reduce-scatter after the one before: XLA's combiner cannot make one of them all at the end
            term, out[-1] = jax.lax.optimization_barrier((term, out[-1]))
        blocks = term.reshape(term.shape[0], t - 1, -1, *term.shape[2:])
        blocks = _rotate(jnp.concatenate([jnp.zeros_like(blocks[:, :1]), blocks], axis=1), back=True)
        out.append(_reduce_scatter(blocks)[:, 0])
    own = part(lambda whole: _block(whole, r, n), a)
    return jnp.concatenate(out, axis=1) + own


def _reduce_scatter(blocks: jax.Array) -> jax.Array:
    """psum_scatter of blocks [b, t, ...] over 'tensor' along dim 1. On CPU a bf16 or fp16 one is summed in fp32:
    XLA's CPU compiler aborts on a half-precision reduce-scatter issued here ("Invalid binary instruction opcode
    copy": its reducer's root is left a copy, which the pass after dot_decomposer cannot clone as a binary op).
    Other platforms reduce in the dtype given (step_plan.platform_dependent)."""
    def scatter(x):
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)

    if blocks.dtype == jnp.float32:
        return scatter(blocks)
    return step_plan.platform_dependent(blocks, cpu=lambda x: scatter(x.astype(jnp.float32)).astype(x.dtype),
                                        default=scatter)


def _gather_plan(a: jax.Array):
    """How the blocks of a ([b, n, ...], sequence-sharded) come round: (gather(step), the pieces step(piece, j)
    for its t blocks (the ring) or this rank's block and the others' chunks; rows(whole, j), a whole-sequence
    array's rows that go with piece j; in_order(pieces), whole-sequence pieces joined in sequence order)."""
    n = a.shape[1]
    if _mode() == "ring":
        return (lambda step: _gather_ring(a, step)), (lambda whole, j: _block(whole, j, n)), _in_order
    m = _chunks(n)

    def rows(whole, j):
        return _block(whole, _rank()[1], n) if j < 0 else _others_chunk(whole, j, m)

    return (lambda step: _gather_chunks(a, step)), rows, _chunks_in_order


def _scattered(a, part, s: int) -> jax.Array:
    """The reduce-scatter over the sequence (s rows) of the terms part(rows, a), rows(whole) giving a
    whole-sequence array's rows of one block (the ring) or chunk."""
    n = s // jax.lax.axis_size("tensor")
    if _mode() == "ring":
        return _scatter_ring(a, lambda j, a: part(lambda whole: _block(whole, j, n), a))
    return _scatter_chunks(a, part, n)


def _quantized(fp8_fmt, x, w, meta):
    """(x and w as the rings multiply them, the backward's quantization state): themselves (state None; also with
    blockwise FP8, whose products quantize each piece), or with per-tensor FP8 ((format, margin)) their FP8 copies
    and scales, quantized here, before the collectives, with the amax of the whole tensor as the FP8 matmul's: the
    sequence blocks then cross 'tensor' in FP8, half the bytes of bf16 (Transformer Engine's FP8 all-gather)."""
    if fp8_fmt is None or _tile_width(fp8_fmt):
        return x, w, None
    xq, sx, wq, sw, dy_counters, seen = fp8.quantize_operands(*fp8_fmt, x, w, meta)
    return xq, wq, (sx, sw, dy_counters, seen)


def _quantized_grad(fp8_fmt, dy, state):
    """(dy as the rings multiply it, its scale, meta's gradient): dy itself, or its FP8 copy (`fp8.einsum`'s)."""
    if state is None:
        return dy, None, None
    return fp8.quantize_gradient(*fp8_fmt, dy, state[2], state[3])


def _inverse(*scales):
    """1 / the product of the operands' scales (the FP8 product's unscaling; none in the compute dtype)."""
    return () if scales[0] is None else (1.0 / functools.reduce(jnp.multiply, scales),)


def _backward_operands(fp8_fmt, dy, wq, state):
    """A backward's (dy as multiplied, meta's gradient, (input gradient's dtype, weight gradient's), (the input
    gradient's unscaling, the weight gradient's))."""
    dyq, s_dy, g_meta = _quantized_grad(fp8_fmt, dy, state)
    invs = (_inverse(s_dy, state[1]), _inverse(state[0], s_dy)) if state else ((), ())
    return dyq, g_meta, _grad_dtypes(dy, wq, state), invs


def _grad_dtypes(dy, wq, state):
    """(the input gradient's dtype, the weight gradient's): einsum's (None) and w's, or with FP8 (weights taken in
    the compute dtype) dy's both, as `fp8.einsum`'s."""
    return (dy.dtype, dy.dtype) if state else (None, wq.dtype)


def _mul(spec: str, a: jax.Array, b: jax.Array, inv: tuple, dtype) -> jax.Array:
    """einsum(spec, a, b) as `dtype` (None: einsum's): of the compute-dtype operands, or (inv = (1 / their scales'
    product,)) of FP8 operands, accumulated in fp32 and unscaled (`fp8.dot`)."""
    if not inv:
        return jnp.einsum(spec, a, b, preferred_element_type=dtype)
    return fp8.dot(spec, a, b, inv[0], dtype)


def _tile_width(fp8_fmt) -> int | None:
    """The tile width of blockwise FP8 (fp8_fmt ("blockwise", block)), else None."""
    return fp8_fmt[1] if fp8_fmt is not None and fp8_fmt[0] == "blockwise" else None


@dataclasses.dataclass(frozen=True)
class _Products:
    """The three products of a ring step for the layer einsum `spec`: in the compute dtype or per-tensor FP8 (inv:
    1 / the operands' scales' product, `_mul`), or with `block` blockwise FP8 (fp8_blockwise's local products)."""

    spec: str
    block: int | None = None

    def forward(self, x, w, inv, dtype):
        if self.block:
            return fp8_blockwise.local_forward(self.spec, self.block, x, w)
        return _mul(self.spec, x, w, inv, dtype)

    def input_grad(self, dy, w, inv, dtype):
        if self.block:
            return fp8_blockwise.local_input_grad(self.spec, self.block, dy, w)
        xl, wl, ol = _subscripts(self.spec)
        return _mul(f"{ol},{wl}->{xl}", dy, w, inv, dtype)

    def weight_term(self, x, dy, inv):
        """A term of the weight gradient, in fp32."""
        if self.block:
            return fp8_blockwise.local_weight_grad(self.spec, self.block, x, dy)
        xl, wl, ol = _subscripts(self.spec)
        return _mul(f"{xl},{ol}->{wl}", x, dy, inv, jnp.float32)


def _ring_sum(pieces: list, dtype) -> jax.Array:
    """The sum of a weight gradient's fp32 terms (one per block or chunk), as `dtype`: rounded once, as the
    gathered GEMM's single fp32 accumulation is."""
    return functools.reduce(jnp.add, pieces).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 6))
def gather_matmul(spec: str, x: jax.Array, w: jax.Array, w_names, fp8_fmt: tuple | None = None,
                  meta: jax.Array | None = None, weights: bool = True) -> jax.Array:
    """einsum(spec, all_gather(x over the sequence), w) for x [b, s / t, ...] sequence-sharded over 'tensor' and a
    column-parallel w (logical names `w_names`): the result has the whole sequence (dim 1) and w's split dims.
    Backward: the input gradient reduce-scattered by the ring (or chunks) while the weight gradient's GEMMs run on
    the x blocks coming round again (Megatron gathers the input again in the backward too, rather than keeping it
    whole). With fp8_fmt ((model.fp8, model.fp8_margin); `meta`: the delayed-scaling state) the products are
    `fp8.einsum`'s, on FP8 blocks; with ("blockwise", block) blockwise on each piece. With `weights` off (the zero-bubble schedule's B) the backward leaves the
    weight gradient (zeros) to `weight_grad` (its W)."""
    return _gather_matmul_fwd(spec, x, w, w_names, fp8_fmt, meta, weights)[0]


def _gather_matmul_fwd(spec, x, w, w_names, fp8_fmt, meta, weights):
    xl, wl, ol, split = _letters(spec, w_names)
    xq, wq, state = _quantized(fp8_fmt, x, w, meta)
    inv = _inverse(*state[:2]) if state else ()

    products = _Products(spec, _tile_width(fp8_fmt))

    def run(x, w, *inv):
        gather, _, in_order = _gather_plan(x)
        return in_order(gather(lambda piece, j: products.forward(piece, w, inv, out_dtype)))

    out_dtype = x.dtype if state else None
    y = tensor_manual(run, (xq, wq, *inv), (_seq_spec(x.ndim), _spec(wl, split), *[P()] * len(inv)), _spec(ol, split))
    return y, (xq, wq, state)


def _gather_matmul_bwd(spec, w_names, fp8_fmt, weights, res, dy):
    xq, wq, state = res
    xl, wl, ol, split = _letters(spec, w_names)
    dyq, g_meta, (x_dtype, w_dtype), (inv_x, inv_w) = _backward_operands(fp8_fmt, dy, wq, state)

    products = _Products(spec, _tile_width(fp8_fmt))

    def run(x, w, dy, *invs):
        inv_w, inv_x = invs[:len(invs) // 2], invs[len(invs) // 2:]
        dw = _gathered_input_dw(products, x, dy, inv_w, w_dtype) if weights else jnp.zeros(w.shape, w_dtype)
        dx = _scattered((dy, w), lambda rows, a: products.input_grad(rows(a[0]), a[1], inv_x, x_dtype), dy.shape[1])
        return dx, dw

    invs = (*inv_w, *inv_x)
    specs = (_seq_spec(xq.ndim), _spec(wl, split))
    dx, dw = tensor_manual(run, (xq, wq, dyq, *invs), (*specs, _spec(ol, split), *[P()] * len(invs)), specs)
    return dx, dw, g_meta


gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 6))
def matmul_scatter(spec: str, h: jax.Array, w: jax.Array, w_names, fp8_fmt: tuple | None = None,
                   meta: jax.Array | None = None, weights: bool = True) -> jax.Array:
    """reduce_scatter(einsum(spec, h, w) over the sequence) for a row-parallel w (its contracted dims split over
    'tensor', as are h's): the result [b, s / t, ...] is sequence-sharded over 'tensor'. Backward: the output
    gradient's blocks (or chunks) come round, each giving its rows of h's gradient and a term of w's; with
    fp8_fmt in FP8 (the output gradient quantized before it travels), and `weights`, as `gather_matmul`."""
    return _matmul_scatter_fwd(spec, h, w, w_names, fp8_fmt, meta, weights)[0]


def _matmul_scatter_fwd(spec, h, w, w_names, fp8_fmt, meta, weights):
    hl, wl, ol, split = _letters(spec, w_names)
    hq, wq, state = _quantized(fp8_fmt, h, w, meta)
    inv = _inverse(*state[:2]) if state else ()

    products = _Products(spec, _tile_width(fp8_fmt))

    def run(h, w, *inv):
        return _scattered((h, w), lambda rows, a: products.forward(rows(a[0]), a[1], inv, out_dtype), h.shape[1])

    out_dtype = h.dtype if state else None
    y = tensor_manual(run, (hq, wq, *inv), (_spec(hl, split), _spec(wl, split), *[P()] * len(inv)), _seq_spec(len(ol)))
    return y, (hq, wq, state)


def _matmul_scatter_bwd(spec, w_names, fp8_fmt, weights, res, dy):
    hq, wq, state = res
    hl, wl, ol, split = _letters(spec, w_names)
    dyq, g_meta, (h_dtype, w_dtype), (inv_h, inv_w) = _backward_operands(fp8_fmt, dy, wq, state)

    products = _Products(spec, _tile_width(fp8_fmt))

    def run(h, w, dy, *invs):
        inv_h, inv_w = invs[:len(invs) // 2], invs[len(invs) // 2:]
        gather, rows, in_order = _gather_plan(dy)
        pieces = gather(lambda piece, j: (products.input_grad(piece, w, inv_h, h_dtype),
                                          products.weight_term(rows(h, j), piece, inv_w) if weights else None))
        dw = _ring_sum([dw for _, dw in pieces], w_dtype) if weights else jnp.zeros(w.shape, w_dtype)
        return in_order([dh for dh, _ in pieces]), dw

    invs = (*inv_h, *inv_w)
    specs = (_spec(hl, split), _spec(wl, split))
    dh, dw = tensor_manual(run, (hq, wq, dyq, *invs), (*specs, _seq_spec(dy.ndim), *[P()] * len(invs)), specs)
    return dh, dw, g_meta


matmul_scatter.defvjp(_matmul_scatter_fwd, _matmul_scatter_bwd)


def _gathered_input_dw(products: _Products, x, dy, inv, w_dtype) -> jax.Array:
    """Inside the manual region: gather_matmul's weight gradient, x's blocks (or chunks) gathered again under the
    GEMMs of their terms with dy's rows."""
    gather, rows, _ = _gather_plan(x)
    return _ring_sum(gather(lambda piece, j: products.weight_term(piece, rows(dy, j), inv)), w_dtype)


def _gathered_grad_dw(products: _Products, h, dy, inv, w_dtype) -> jax.Array:
    """Inside the manual region: matmul_scatter's weight gradient, dy's blocks (or chunks) gathered under the GEMMs
    of their terms with h's rows."""
    gather, rows, _ = _gather_plan(dy)
    return _ring_sum(gather(lambda piece, j: products.weight_term(rows(h, j), piece, inv)), w_dtype)


def weight_grad(spec: str, column: bool, a: jax.Array, dy: jax.Array, w: jax.Array, w_names,
                fp8_fmt: tuple | None = None, meta: jax.Array | None = None) -> jax.Array:
    """The zero-bubble schedule's W for a weight whose B ran with `weights` off: the gradient of w (its dtype) from
    the matmul's input `a` and output gradient dy, its GEMMs under the same collectives as the fused backward's:
    a column-parallel matmul's (`gather_matmul`: a sequence-sharded) gathers a's blocks again, a row-parallel one's
    (`matmul_scatter`: dy sequence-sharded) gathers dy's, which B gathered too (W runs later, and keeping dy whole
    between them would cost t times its memory). In FP8 with fp8_fmt (quantized before the gathers)."""
    al, wl, ol, split = _letters(spec, w_names)
    if fp8_fmt is None or _tile_width(fp8_fmt):
        ops, inv = (a, dy), ()
    else:
        aq, s_a, dyq, s_dy = fp8.weight_grad_operands(*fp8_fmt, a, dy, meta)
        ops, inv = (aq, dyq), _inverse(s_a, s_dy)
    dtype = w.dtype
    products = _Products(spec, _tile_width(fp8_fmt))

    def run(a, dy, *inv):
        return (_gathered_input_dw if column else _gathered_grad_dw)(products, a, dy, inv, dtype)

    specs = (_seq_spec(a.ndim), _spec(ol, split)) if column else (_spec(al, split), _seq_spec(dy.ndim))
    return tensor_manual(run, (*ops, *inv), (*specs, *[P()] * len(inv)), _spec(wl, split))
