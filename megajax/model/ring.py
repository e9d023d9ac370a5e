"""Ring attention (`ring_attention`) over the sequence chunks of context parallelism (megajax/model/context.py: rank
i holds chunks i and 2c - 1 - i of 2c, h tokens each). The keys and values (and their segment ids) go around the
ring with ppermute, c - 1 hops; at step n rank i holds those of rank j = i - n (mod c) and attends to them block
by block, merging the partial outputs with their log-sum-exp. With that layout only three kinds of block occur:
  - n = 0 (j = i): the local causal attention over the local 2h tokens (chunk i before chunk 2c - 1 - i);
  - j < i: j's first chunk (chunk j) lies before both query chunks and every local query sees all of it; its
    second (chunk 2c - 1 - j) lies after both and no query sees it;
  - j > i: only the second query chunk (2c - 1 - i) sees j's two chunks, wholly.
So each step after the first is one unmasked block of h x 2h or 2h x h: half the work of a full block, and the
blocks above the diagonal are never computed. The backward passes the same ring again: each step adds the block's
dq locally and its dk, dv to a buffer that travels with the keys and values and reaches their owner after c hops.
Blocks run with the Pallas flash-attention kernels (model.attention_impl=pallas, megajax/kernels/flash_attention.py)
or the XLA reference (megajax/kernels/attention.py, one block of logits at a time: [2h, 2h] at most, never
[s, s]). Each ring hop is tied to the block it runs under (optimization barriers), which is what makes XLA's GPU
scheduler overlap it with that block's compute, and moves the keys and values (or their gradients) as one array
(`_hop`), so that no more hops are in flight than the scheduler allows. `exchange` /
parallel.context_comm=all_gather gathers every rank's keys and values instead (and reduce-scatters their
gradients): the exchange that runs under a pipeline. It cuts the heads into parts and gathers part i + 1 under part
i's blocks (and scatters part i's gradients under part i + 1's), so that only the first part's gather waits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp

from megajax import kernels
from megajax.kernels.auto import attention_fallback, by_platform
from megajax.kernels.dropout import AttentionDropout, column_words
from megajax.kernels.launch import match_varying
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain, vary, varying_axes

AXIS = "context"  # the mesh axis of context parallelism (context.AXIS)


@dataclasses.dataclass(frozen=True)
class Ring:
    """A ring's ranks and exchange, and how its blocks run (static: the ring's custom_vjp's nondiff argument)."""

    impl: str
    scale: float
    c: int  # the ring's ranks
    comm: str  # "ring" (ppermute, one hop per step) or "all_gather" (every rank's keys at once)
    stride: int = 1  # the ring's ranks lie this far apart on 'context' (a2a+ring: the all-to-all groups' size)
    rate: float = 0.0  # attention dropout's


def _block_forward(st: Ring, q, k, v, q_seg, k_seg, causal: bool, rows=None, cols=None):
    """(o, lse) of q over one block of keys; with attention dropout, rows and cols are the block's queries' and
    keys' words (dropout.py)."""
    drop = None if rows is None else (rows, cols, st.rate)
    if st.impl == "pallas":
        return kernels.flash_block_forward(q, k, v, q_seg, k_seg, causal=causal, scale=st.scale, drop=drop)
    return kernels.attention_block_forward(q, k, v, q_seg, k_seg, causal=causal, scale=st.scale, drop=drop)


def _block_backward(st: Ring, q, k, v, do, lse, delta, q_seg, k_seg, causal: bool, rows=None, cols=None):
    drop = None if rows is None else (rows, cols, st.rate)
    if st.impl == "pallas":
        return kernels.flash_block_backward(q, k, v, do, lse, delta, q_seg, k_seg, causal=causal, scale=st.scale,
                                            drop=drop)
    return kernels.attention_block_backward(q, k, v, do, lse, delta, q_seg, k_seg, causal=causal, scale=st.scale,
                                            drop=drop)


def _halves(x, axis: int):
    h = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, h, axis=axis), jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)


def _second(x, axis: int = 1):
    return None if x is None else _halves(x, axis)[1]


def _first(x, axis: int = 1):
    return None if x is None else _halves(x, axis)[0]


def _below(x, axis: int):
    """x with zeros before it on `axis` (a second-half result in whole-length form)."""
    return jnp.concatenate([jnp.zeros_like(x), x], axis)


def _above(x, axis: int):
    """x with zeros after it on `axis` (a first-half result in whole-length form)."""
    return jnp.concatenate([x, jnp.zeros_like(x)], axis)


def _rank(st: Ring):
    """This rank's place on its ring (its 'context' index without a2a+ring)."""
    return jax.lax.axis_index(AXIS) // st.stride


def _source(st: Ring, step: int):
    """The ring rank whose keys and values this rank holds at ring step `step`."""
    return (_rank(st) - step) % st.c


def chunk_positions(j, c: int, h: int) -> jax.Array:
    """The global positions [2h] of the tokens of rank j of c (context ranks, or a ring's): its chunks j and
    2c - 1 - j of h tokens."""
    return jnp.concatenate([j * h + jnp.arange(h), (2 * c - 1 - j) * h + jnp.arange(h)])


def _words(st: Ring, q, drop: AttentionDropout | None):
    """Attention dropout's row words [b, h, 2h] of this rank's queries, and a function from a ring rank j to the
    column words [2h] of its keys; (None, None) without dropout."""
    if drop is None:
        return None, lambda j: None
    h = q.shape[1] // 2
    return drop.row_words(chunk_positions(_rank(st), st.c, h)), lambda j: column_words(chunk_positions(j, st.c, h))


def _rings(st: Ring) -> list[list[int]] | None:
    """The 'context' indices of each ring (None: one ring over every context rank)."""
    n = st.stride
    return None if n == 1 else [[j * n + i for j in range(st.c)] for i in range(n)]


def _pass(tree, st: Ring):
    """Everything in `tree` one hop along the ring (ring rank j sends to j + 1)."""
    n, c = st.stride, st.c
    perm = [(j * n + i, (j + 1) % c * n + i) for j in range(c) for i in range(n)]
    return jax.tree.map(lambda x: None if x is None else jax.lax.ppermute(x, AXIS, perm), tree,
                        is_leaf=lambda x: x is None)


def side_by_side(*xs) -> jax.Array:
    """xs joined on their last axis in the first's dtype, so that one collective moves them all (`apart` parts
    them again): XLA's GPU scheduler keeps at most two collectives in flight at once (xla_flags' overlap limit)."""
    return jnp.concatenate([x.astype(xs[0].dtype) for x in xs], -1)


def apart(joined: jax.Array, *likes) -> tuple:
    """`side_by_side`'s inverse: the pieces of `joined` as wide as `likes` on the last axis, in their dtypes."""
    edges = [0, *itertools.accumulate(like.shape[-1] for like in likes)]
    return tuple(joined[..., a:b].astype(like.dtype) for a, b, like in zip(edges, edges[1:], likes))


def _hop(k, v, seg, st: Ring):
    """The keys, values (and segment ids) one hop along the ring, the keys and values one ppermute
    (`side_by_side`): a backward step's four apart (keys, values and their gradient buffer's two) left two waiting
    before the block they run under. Also the gradient buffer's (dk, dv)."""
    joined, seg = _pass((side_by_side(k, v), seg), st)
    return (*apart(joined, k, v), seg)


def _merge(o, lse, o_b, lse_b):
    """Two partial attention results over disjoint keys -> the result over both (o [b, s, h, k] fp32, lse
    [b, h, s] natural log)."""
    new = jnp.logaddexp(lse, lse_b)
    weight = lambda l: jnp.exp(l - new).transpose(0, 2, 1)[..., None]  # noqa: E731
    return o * weight(lse) + o_b * weight(lse_b), new


def _gather(tree, st: Ring):
    """Every ring rank's leaves, stacked on a new leading axis [c, ...] (the all_gather exchange)."""
    return jax.tree.map(lambda x: None if x is None else jax.lax.all_gather(x, AXIS, axis_index_groups=_rings(st)),
                        tree, is_leaf=lambda x: x is None)


def _take(tree, j):
    return jax.tree.map(lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False),
                        tree, is_leaf=lambda x: x is None)


def _forward(st: Ring, q, k, v, seg, drop):
    c = st.c
    if st.comm == "all_gather":
        return _gathered_forward(st, q, k, v, seg, drop)
    rows, cols = _words(st, q, drop)
    # ring: each hop is issued before the block that does not need it and tied to that block's result, so that it
    # runs under the block's compute (without the tie XLA's scheduler sends every hop first, then computes)
    arriving = _hop(k, v, seg, st)
    o, lse = _block_forward(st, q, k, v, seg, seg, True, rows, cols(_rank(st)))
    arriving, (o, lse) = jax.lax.optimization_barrier((arriving, (o, lse)))
    for step in range(1, c):
        here = arriving
        if step < c - 1:
            arriving = _hop(*here, st)
        o_b, lse_b = _step_forward(st, step, q, seg, *here, rows, cols(_source(st, step)))
        if step < c - 1:
            arriving, (o_b, lse_b) = jax.lax.optimization_barrier((arriving, (o_b, lse_b)))
        o, lse = _merge(o, lse, o_b, lse_b)
    return o.astype(q.dtype), lse


def _step_forward(st: Ring, step: int, q, seg, k_j, v_j, seg_j, rows=None, cols_j=None):
    """(o, lse) of ring step `step` > 0 (rows no key reaches: o 0, lse -inf): this rank's queries against the keys
    of rank j = i - step (rows, cols_j: attention dropout's words of the queries and of j's keys)."""
    def early():  # j < i: every query, the first of j's chunks
        return vary(_block_forward(st, q, _first(k_j), _first(v_j), seg, _first(seg_j), False, rows,
                                   _first(cols_j, 0)))

    def late():  # j > i: the second query chunk, both of j's chunks
        o_b, lse_b = _block_forward(st, _second(q), k_j, v_j, _second(seg), seg_j, False, _second(rows, 2), cols_j)
        return vary((_below(o_b, 1), jnp.concatenate([jnp.full_like(lse_b, -jnp.inf), lse_b], 2)))

    return jax.lax.cond(_source(st, step) < _rank(st), early, late)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: Ring, q, k, v, seg, drop):
    return _forward(st, q, k, v, seg, drop)[0]


def _ring_fwd(st: Ring, q, k, v, seg, drop):
    o, lse = _forward(st, q, k, v, seg, drop)
    return o, (q, k, v, seg, drop, o, lse)


def _ring_bwd(st: Ring, res, do):
    q, k, v, seg, drop, o, lse = res
    c = st.c
    delta = jnp.einsum("bshk,bshk->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    if st.comm == "all_gather":
        return _gathered_backward(st, q, k, v, seg, drop, do, lse, delta)
    rows, cols = _words(st, q, drop)
    dq, dk, dv = _block_backward(st, q, k, v, do, lse, delta, seg, seg, True, rows, cols(_rank(st)))
    # As in the forward, every hop is tied to the block it runs under: the keys and values of the next step, and
    # the gradient buffer of this step's keys (it travels with them, one hop behind, and reaches their owner
    # after c hops), which the block does not need until it adds its share.
    arriving = _hop(k, v, seg, st)
    arriving, (dq, dk, dv) = jax.lax.optimization_barrier((arriving, (dq, dk, dv)))
    dkv = (dk.astype(k.dtype), dv.astype(v.dtype))
    for step in range(1, c):
        here = arriving  # the keys and values of rank i - step
        if step < c - 1:
            arriving = _hop(*here, st)
        moving = _hop(*dkv, None, st)  # their gradient buffer, with the shares of ranks i - step .. i - 1
        grads = _step_backward(st, step, q, do, lse, delta, seg, *here, rows, cols(_source(st, step)))
        (arriving, moving), (dq_b, dk_b, dv_b) = jax.lax.optimization_barrier(((arriving, moving), grads))
        dq = dq + dq_b
        dkv = ((moving[0].astype(jnp.float32) + dk_b).astype(k.dtype),
               (moving[1].astype(jnp.float32) + dv_b).astype(v.dtype))
    dk, dv, _ = _hop(*dkv, None, st)  # the last hop takes each buffer home
    return _cotangents(q, k, v, dq, dk, dv)


def _step_backward(st: Ring, step: int, q, do, lse, delta, seg, k_j, v_j, seg_j, rows=None, cols_j=None):
    """(dq, dk, dv) in fp32 of ring step `step` > 0: this rank's queries against the keys of rank i - step."""
    def early():  # j < i: every query, the first of j's chunks
        dq_b, dk_b, dv_b = _block_backward(st, q, _first(k_j), _first(v_j), do, lse, delta, seg, _first(seg_j),
                                           False, rows, _first(cols_j, 0))
        return vary((dq_b, _above(dk_b, 1), _above(dv_b, 1)))

    def late():  # j > i: the second query chunk, both of j's chunks
        dq_b, dk_b, dv_b = _block_backward(st, _second(q), k_j, v_j, _second(do), _second(lse, 2), _second(delta, 2),
                                           _second(seg), seg_j, False, _second(rows, 2), cols_j)
        return vary((_below(dq_b, 1), dk_b, dv_b))

    return jax.lax.cond(_source(st, step) < _rank(st), early, late)


def head_parts(kv_heads: int, tensor: int) -> int:
    """The parts the all_gather exchange cuts each tensor rank's share of `kv_heads` key-value heads into (at most
    4; 1 where they do not divide over `tensor`): the keys and values of part i + 1 are gathered while part i
    attends, so only the first part's gather waits."""
    local = kv_heads // tensor if kv_heads % tensor == 0 else 1
    return max(n for n in (1, 2, 3, 4) if local % n == 0)


def _head_parts(st: Ring, k) -> int:
    """`head_parts` of k's heads on each tensor rank; 1 under a2a+all_gather, whose all-to-alls lost their overlap
    to the parts' collectives (compile-only H100s, 32k tokens, groups of 2: 13.9 -> 17.2 ms exposed)."""
    return head_parts(k.shape[2], step_plan.in_force().tensor) if st.stride == 1 else 1


def part(x, i: int, n: int, axis: int = 2):
    """Part i of n of x's heads on `axis` (q, k, v, o: 2; lse, delta: 1): each tensor rank's own heads cut n ways,
    so that every part stays split over 'tensor' as the heads are."""
    t = step_plan.in_force().tensor
    if x is None or n == 1:
        return x
    shape = x.shape
    y = x.reshape(*shape[:axis], t, n, shape[axis] // (t * n), *shape[axis + 1:])
    y = constrain(y, tuple("heads" if a == axis else None for a in range(y.ndim)))
    return jax.lax.index_in_dim(y, i, axis + 1, keepdims=False).reshape(*shape[:axis], -1, *shape[axis + 1:])


def joined(parts: list, axis: int = 2):
    """`part`'s inverse: the n parts back to x."""
    t, n = step_plan.in_force().tensor, len(parts)
    if n == 1:
        return parts[0]
    shape = parts[0].shape
    ys = [p.reshape(*shape[:axis], t, shape[axis] // t, *shape[axis + 1:]) for p in parts]
    y = constrain(jnp.stack(ys, axis + 1), tuple("heads" if a == axis else None for a in range(len(shape) + 2)))
    return y.reshape(*shape[:axis], n * shape[axis], *shape[axis + 1:])


def _by_parts(st: Ring, k, v, fn, after=lambda res: res) -> list:
    """[after(fn(i, n, everyone's keys and values of head part i [c, ...])) for each head part i] (`_head_parts`),
    part i + 1's all-gather issued once part i's keys have arrived and tied to part i's blocks, and after(part
    i - 1's result) (the backward's reduce-scatter) tied to them too, so that both run under them, as the ring's
    hops do. (Each gather is chained to the one before, and each scatter follows its part's blocks: XLA combines
    independent gathers or scatters into one, which would wait for all of the parts.)"""
    n = _head_parts(st, k)
    # (the keys and values of a part as one array, one collective: XLA's GPU schedule keeps one in flight)
    both = lambda i: side_by_side(part(k, i, n), part(v, i, n))  # noqa: E731
    arriving = last = _gather(both(0), st)
    out, pending = [], None
    for i in range(n):
        here, nxt = arriving, None
        if i + 1 < n:  # (chained on the gathers alone, so that a recomputed forward's are the backward's own: XLA
            # merges the two)
            nxt, _ = jax.lax.optimization_barrier((both(i + 1), last))
            nxt = last = _gather(nxt, st)
        here = apart(here, k, v)
        arriving, res, done = jax.lax.optimization_barrier((nxt, fn(i, n, here), pending))
        if i:
            out.append(done)
        pending = after(res)
    return out + [pending]


def _gathered_forward(st: Ring, q, k, v, seg, drop):
    """The all_gather exchange's forward: every ring rank's keys and values gathered (head part by head part,
    `_by_parts`) and this rank's queries run against each rank's in turn, merged by their log-sum-exp."""
    everyone_seg = _gather(seg, st)
    rows, cols = _words(st, q, drop)

    def attend(i, n, everyone):
        q_i, k_i, v_i = (part(x, i, n) for x in (q, k, v))
        rows_i = part(rows, i, n, axis=1)
        o, lse = _block_forward(st, q_i, k_i, v_i, seg, seg, True, rows_i, cols(_rank(st)))
        for step in range(1, st.c):
            j = _source(st, step)
            o, lse = _merge(o, lse, *_step_forward(st, step, q_i, seg, *_take(everyone, j), _take(everyone_seg, j),
                                                   rows_i, cols(j)))
        return o, lse

    parts = _by_parts(st, k, v, attend)
    return joined([o for o, _ in parts]).astype(q.dtype), joined([lse for _, lse in parts], 1)


def _gathered_backward(st: Ring, q, k, v, seg, drop, do, lse, delta):
    """The all_gather exchange's backward: every rank's keys gathered again (head part by head part,
    `_by_parts`), each block's dk, dv added at its owner's index of a [c, ...] buffer, and one reduce-scatter over
    'context' per part hands each owner the sum (after the part's blocks, under the next part's)."""
    c, me = st.c, _rank(st)
    everyone_seg = _gather(seg, st)
    rows, cols = _words(st, q, drop)
    put = lambda buf, j, x: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
        buf, jax.lax.dynamic_index_in_dim(buf, j, 0, keepdims=False) + x, j, 0)

    def grads(i, n, everyone):
        q_i, k_i, v_i, do_i = (part(x, i, n) for x in (q, k, v, do))
        lse_i, delta_i, rows_i = (part(x, i, n, axis=1) for x in (lse, delta, rows))
        dq, dk, dv = _block_backward(st, q_i, k_i, v_i, do_i, lse_i, delta_i, seg, seg, True, rows_i, cols(me))
        dks = put(jnp.zeros((c, *k_i.shape), jnp.float32), me, dk)
        dvs = put(jnp.zeros((c, *v_i.shape), jnp.float32), me, dv)
        for step in range(1, c):
            j = _source(st, step)
            dq_b, dk_b, dv_b = _step_backward(st, step, q_i, do_i, lse_i, delta_i, seg, *_take(everyone, j),
                                              _take(everyone_seg, j), rows_i, cols(j))
            dq, dks, dvs = dq + dq_b, put(dks, j, dk_b), put(dvs, j, dv_b)
        return dq, dks, dvs

    def scatter(res):  # each owner's sum of its keys' and values' gradients, in one reduce-scatter
        dq, dks, dvs = res
        both = jax.lax.psum_scatter(side_by_side(dks, dvs).astype(k.dtype), AXIS, scatter_dimension=0,
                                    tiled=True, axis_index_groups=_rings(st))[0]
        return (dq, *apart(both, k, v))

    parts = _by_parts(st, k, v, grads, scatter)
    return _cotangents(q, k, v, *(joined([p[a] for p in parts]) for a in range(3)))


def _cotangents(q, k, v, dq, dk, dv):
    """Each cotangent typed as its primal (varying over the same manual axes)."""
    return (match_varying(dq.astype(q.dtype), varying_axes(q)), match_varying(dk.astype(k.dtype), varying_axes(k)),
            match_varying(dv.astype(v.dtype), varying_axes(v)), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                   impl: str = "xla", scale: float | None = None, exchange: str | None = None,
                   probs_dropout: AttentionDropout | None = None) -> jax.Array:
    """Causal attention of this rank's queries over the keys of the whole sequence, the keys and values passed
    around the 'context' ring (see the module docstring). q [b, 2h, h_q, k], k and v [b, 2h, g, k] and
    segment_ids [b, 2h] in the layout of context.split; returns [b, 2h, h_q, k]. exchange: 'ring' or 'all_gather'
    (None: the step plan's context_comm). probs_dropout: attention dropout, the entries one device drops
    (kernels/dropout.py). Inside the train step's manual region only (parallel.context > 1)."""
    c = step_plan.in_force().context
    if c == 1:
        raise ValueError("ring_attention runs inside the train step's region with parallel.context > 1")
    exchange = step_plan.in_force().context_comm if exchange is None else exchange
    if exchange not in ("ring", "all_gather"):
        raise ValueError(f"the context exchange is 'ring' or 'all_gather', got {exchange!r}")
    return ring_over(q, k, v, segment_ids, impl, scale, Ring("", 0.0, c, exchange), probs_dropout)


def ring_over(q, k, v, segment_ids, impl: str, scale: float | None, ring: Ring,
              drop: AttentionDropout | None = None) -> jax.Array:
    """`_ring` with `ring`'s ranks and exchange, its blocks by `impl` (auto: the Pallas kernels on GPUs, XLA's on
    CPU, megajax/kernels/auto.py) at `scale` (None: 1 / sqrt(head dim))."""
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"ring attention runs impl 'auto', 'xla' or 'pallas', got {impl!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    rate = 0.0 if drop is None else drop.rate
    static = lambda impl: dataclasses.replace(ring, impl=impl, scale=scale, rate=rate)  # noqa: E731
    if impl == "auto":
        if attention_fallback(q.shape[-1]):
            impl = "xla"
        else:
            return by_platform(q, k, v, cpu=lambda *a: _ring(static("xla"), *a, segment_ids, drop),
                               gpu=lambda *a: _ring(static("pallas"), *a, segment_ids, drop))
    return _ring(static(impl), q, k, v, segment_ids, drop)
