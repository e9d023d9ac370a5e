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
(deadlock on the CPU runtime): the config refuses tp_comm_overlap with a pipeline.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax import sharding

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("megajax_tp_comm_overlap", default=False)


@contextlib.contextmanager
def enable(on: bool):
    """Within this context (and `sharding.activation_sharding` with sequence parallelism) the model's tensor-
    parallel matmuls run as rings."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def active() -> bool:
    """Whether the ring runs here: asked for, sequence-parallel rules in force, 'tensor' > 1 and not manual."""
    if not _ON.get() or sharding.current_activation_rules().get("seq") != "tensor":
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (not mesh.empty and mesh.shape.get("tensor", 1) > 1
            and "tensor" not in getattr(mesh, "manual_axes", ()))


def _letters(spec: str, w_names) -> tuple[str, str, str, set[str]]:
    """(input, weight and output letters of the einsum `spec`, the letters of the weight's dims split over
    'tensor')."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    split = {c for c, axis in zip(w, sharding.param_spec(w_names)) if "tensor" in sharding.axes_of(axis)}
    return x, w, out, split


def _spec(letters: str, split: set[str]) -> P:
    return P(*["tensor" if c in split else None for c in letters])


def _manual(fn, args, in_specs, out_spec):
    """fn(*args) with 'tensor' manual, without jax's varying-axes checks inside: under the train step's manual
    'data', they add input-free equations (pvary of literals) that a layer scan's linearization moves out of the
    region as residual inputs, to which jax 0.10.2 gives a sharding XLA rejects ("manual axis tensor after free
    axis data"). The results vary over every outer manual axis the arguments vary over, as checked ones would."""
    mesh = jax.sharding.get_abstract_mesh()
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, axis_names={"tensor"},
                        check_vma=False)(*args)
    return sharding.vary(out, sorted(set().union(*map(sharding.varying_axes, args))))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def gather_matmul(spec: str, x: jax.Array, w: jax.Array, w_names) -> jax.Array:
    """einsum(spec, all_gather(x over the sequence), w) for x [b, s / t, ...] sequence-sharded over 'tensor' and a
    column-parallel w (logical names `w_names`): the result has the whole sequence (dim 1) and w's split dims.
    Backward: the input gradient reduce-scattered by the ring while the weight gradient's GEMMs run on the x blocks
    coming round again (Megatron gathers the input again in the backward too, rather than keeping it whole)."""
    xl, wl, ol, split = _letters(spec, w_names)

    def ring(x, w):
        return _in_order(_gather_ring(x, lambda block, j: jnp.einsum(spec, block, w)))

    return _manual(ring, (x, w), (_seq_spec(x.ndim), _spec(wl, split)), _spec(ol, split))


def _keeping_inputs(ring_matmul):
    """A custom VJP's forward rule for a ring matmul (spec, a, w, w_names): its result, with (a, w) kept."""
    return lambda spec, a, w, w_names: (ring_matmul(spec, a, w, w_names), (a, w))


def _gather_matmul_bwd(spec, w_names, res, dy):
    x, w = res
    xl, wl, ol, split = _letters(spec, w_names)

    def ring(x, w, dy):
        n = x.shape[1]
        dw = sum(_gather_ring(x, lambda block, j: jnp.einsum(f"{xl},{ol}->{wl}", block, _block(dy, j, n))))
        dx = _scatter_ring((dy, w), lambda j, a: jnp.einsum(f"{ol},{wl}->{xl}", _block(a[0], j, n), a[1]))
        return dx, dw

    out_specs = (_seq_spec(x.ndim), _spec(wl, split))
    return _manual(ring, (x, w, dy), (_seq_spec(x.ndim), _spec(wl, split), _spec(ol, split)), out_specs)


gather_matmul.defvjp(_keeping_inputs(gather_matmul), _gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def matmul_scatter(spec: str, h: jax.Array, w: jax.Array, w_names) -> jax.Array:
    """reduce_scatter(einsum(spec, h, w) over the sequence) for a row-parallel w (its contracted dims split over
    'tensor', as are h's): the result [b, s / t, ...] is sequence-sharded over 'tensor'. Backward: the output
    gradient's blocks come round the ring, each giving its block of h's gradient and a term of w's."""
    hl, wl, ol, split = _letters(spec, w_names)

    def ring(h, w):
        n = h.shape[1] // jax.lax.axis_size("tensor")
        return _scatter_ring((h, w), lambda j, a: jnp.einsum(spec, _block(a[0], j, n), a[1]))

    return _manual(ring, (h, w), (_spec(hl, split), _spec(wl, split)), _seq_spec(len(ol)))


def _matmul_scatter_bwd(spec, w_names, res, dy):
    h, w = res
    hl, wl, ol, split = _letters(spec, w_names)

    def ring(h, w, dy):
        n = dy.shape[1]
        pieces = _gather_ring(dy, lambda block, j: (jnp.einsum(f"{ol},{wl}->{hl}", block, w),
                                                    jnp.einsum(f"{hl},{ol}->{wl}", _block(h, j, n), block)))
        return _in_order([dh for dh, _ in pieces]), sum(dw for _, dw in pieces)

    specs = (_spec(hl, split), _spec(wl, split))
    return _manual(ring, (h, w, dy), (*specs, _seq_spec(dy.ndim)), specs)


matmul_scatter.defvjp(_keeping_inputs(matmul_scatter), _matmul_scatter_bwd)
