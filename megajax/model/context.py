"""Context parallelism: every sequence split over the 'context' ranks for every layer, attention by a ring (or
an all-gather, or all-to-alls).

Layout (Megatron-Core's, for causal balance). A sequence of s tokens is cut into 2c chunks of h = s / 2c tokens;
context rank i holds chunks i and 2c - 1 - i, one after the other (2h local tokens). With a causal mask a plain
split would give the last rank c times the attention work of the first; with this one every rank does the same
work: chunk i's queries see i + 1 key chunks, chunk 2c - 1 - i's see 2c - i, 2c + 1 in all on every rank.

Everything outside attention is per token and runs on the local tokens as it is: embeddings (at the tokens'
global `positions`), norms, the MLP, the loss (summed over 'context' like over 'data'). Dropout masks are drawn
for the whole sequence and the local rows taken (`split`), so they follow the original token order.

Ring attention (`ring_attention`). The keys and values (and their segment ids) go around the ring with ppermute,
c - 1 hops; at step n rank i holds those of rank j = i - n (mod c) and attends to them block by block, merging
the partial outputs with their log-sum-exp. With the layout above only three kinds of block occur:
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

All-to-all attention (`a2a_attention`, parallel.context_comm=a2a; DeepSpeed-Ulysses, Megatron's cp_comm_type=a2a).
One all-to-all over 'context' trades the sequence split for a split of the heads: rank i sends each rank j its
tokens' heads of group j and gets every rank's tokens of its own group, so it holds the whole sequence (its chunks
put back in token order) for heads / context of the heads and runs plain causal attention over them with any
kernel; a second all-to-all brings the output back to the sequence split. Its bytes do not grow with the context
size (each rank sends (c - 1) / c of its queries, keys, values and output), against the ring's c - 1 hops of the
keys and values, but the heads must divide over tensor x context (grouped-query keys and values whose heads do not
are repeated to the query heads first). The queries, keys and values go as one all-to-all, head part by head part
(`_a2a_by_parts`: up to 4 parts of the key-value heads each rank receives), part i + 1's under part i's attention
and part i - 1's output, so only the first part's waits.

Hierarchical attention (parallel.context_comm=a2a+ring; Megatron's a2a+p2p, MaxText's usp). The context ranks form
c / n groups of n adjacent ranks (plan.context_a2a; with tensor, inside a node). The all-to-alls run inside each
group, and group j's tokens, put in token order, are exactly chunks j and 2 (c / n) - 1 - j of the sequence cut into
2c / n: the ring layout above for c / n ranks. So the ring runs unchanged over the groups (ring rank j is 'context'
index j n + i for each i < n, `_Static.stride`) on n times the tokens and 1 / n of the heads: its hops cross nodes,
once per group, and the all-to-alls stay inside them. parallel.context_comm=a2a+all_gather runs the all-gather
exchange over the same rings instead, the form that runs under a pipeline.
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
from megajax.kernels.launch import match_varying
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain, vary, varying_axes

AXIS = "context"


def size() -> int:
    """The context-parallel size of the step plan in force (step_plan.use; 1 outside a step)."""
    return step_plan.in_force().context


def positions(s_local: int) -> jax.Array:
    """The global positions [s_local] of this rank's tokens (0 .. s_local - 1 without context parallelism)."""
    c = size()
    if c == 1:
        return jnp.arange(s_local)
    h, i = s_local // 2, jax.lax.axis_index(AXIS)
    return jnp.concatenate([i * h + jnp.arange(h), (2 * c - 1 - i) * h + jnp.arange(h)])


def split(x: jax.Array, axis: int = 1) -> jax.Array:
    """This rank's two chunks of an array holding whole sequences on `axis` (x itself without context
    parallelism)."""
    c = size()
    if c == 1:
        return x
    h, i = x.shape[axis] // (2 * c), jax.lax.axis_index(AXIS)
    first = jax.lax.dynamic_slice_in_dim(x, i * h, h, axis)
    second = jax.lax.dynamic_slice_in_dim(x, (2 * c - 1 - i) * h, h, axis)
    return jnp.concatenate([first, second], axis)


def gather(x: jax.Array) -> jax.Array:
    """Every rank's two chunks of x [b, 2h, ...] put together: whole sequences [b, 2 c h, ...] in token order
    (`split`'s inverse; x itself without context parallelism)."""
    c = size()
    if c == 1:
        return x
    return _token_order(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), c)


def split_batch(batch: dict) -> dict:
    """A batch of whole sequences ([b, s] fields; sample_ids [b] stays) cut to this rank's tokens."""
    return {k: split(v) if v.ndim >= 2 else v for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------------
# Ring attention


@dataclasses.dataclass(frozen=True)
class _Static:
    impl: str
    scale: float
    c: int  # the ring's ranks
    comm: str  # "ring" (ppermute, one hop per step) or "all_gather" (every rank's keys at once)
    stride: int = 1  # the ring's ranks lie this far apart on 'context' (a2a+ring: the all-to-all groups' size)


def _block_forward(st: _Static, q, k, v, q_seg, k_seg, causal: bool):
    if st.impl == "pallas":
        return kernels.flash_block_forward(q, k, v, q_seg, k_seg, causal=causal, scale=st.scale)
    return kernels.attention_block_forward(q, k, v, q_seg, k_seg, causal=causal, scale=st.scale)


def _block_backward(st: _Static, q, k, v, do, lse, delta, q_seg, k_seg, causal: bool):
    if st.impl == "pallas":
        return kernels.flash_block_backward(q, k, v, do, lse, delta, q_seg, k_seg, causal=causal, scale=st.scale)
    return kernels.attention_block_backward(q, k, v, do, lse, delta, q_seg, k_seg, causal=causal, scale=st.scale)


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


def _rank(st: _Static):
    """This rank's place on its ring (its 'context' index without a2a+ring)."""
    return jax.lax.axis_index(AXIS) // st.stride


def _source(st: _Static, step: int):
    """The ring rank whose keys and values this rank holds at ring step `step`."""
    return (_rank(st) - step) % st.c


def _rings(st: _Static) -> list[list[int]] | None:
    """The 'context' indices of each ring (None: one ring over every context rank)."""
    n = st.stride
    return None if n == 1 else [[j * n + i for j in range(st.c)] for i in range(n)]


def _pass(tree, st: _Static):
    """Everything in `tree` one hop along the ring (ring rank j sends to j + 1)."""
    n, c = st.stride, st.c
    perm = [(j * n + i, (j + 1) % c * n + i) for j in range(c) for i in range(n)]
    return jax.tree.map(lambda x: None if x is None else jax.lax.ppermute(x, AXIS, perm), tree,
                        is_leaf=lambda x: x is None)


def _side_by_side(*xs) -> jax.Array:
    """xs joined on their last axis in the first's dtype, so that one collective moves them all (`_apart` parts
    them again): XLA's GPU scheduler keeps at most two collectives in flight at once (xla_flags' overlap limit)."""
    return jnp.concatenate([x.astype(xs[0].dtype) for x in xs], -1)


def _apart(joined: jax.Array, *likes) -> tuple:
    """`_side_by_side`'s inverse: the pieces of `joined` as wide as `likes` on the last axis, in their dtypes."""
    edges = [0, *itertools.accumulate(like.shape[-1] for like in likes)]
    return tuple(joined[..., a:b].astype(like.dtype) for a, b, like in zip(edges, edges[1:], likes))


def _hop(k, v, seg, st: _Static):
    """The keys, values (and segment ids) one hop along the ring, the keys and values one ppermute
    (`_side_by_side`): a backward step's four apart (keys, values and their gradient buffer's two) left two waiting
    before the block they run under. Also the gradient buffer's (dk, dv)."""
    joined, seg = _pass((_side_by_side(k, v), seg), st)
    return (*_apart(joined, k, v), seg)


def _merge(o, lse, o_b, lse_b):
    """Two partial attention results over disjoint keys -> the result over both (o [b, s, h, k] fp32, lse
    [b, h, s] natural log)."""
    new = jnp.logaddexp(lse, lse_b)
    weight = lambda l: jnp.exp(l - new).transpose(0, 2, 1)[..., None]  # noqa: E731
    return o * weight(lse) + o_b * weight(lse_b), new


def _gather(tree, st: _Static):
    """Every ring rank's leaves, stacked on a new leading axis [c, ...] (the all_gather exchange)."""
    return jax.tree.map(lambda x: None if x is None else jax.lax.all_gather(x, AXIS, axis_index_groups=_rings(st)),
                        tree, is_leaf=lambda x: x is None)


def _take(tree, j):
    return jax.tree.map(lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False),
                        tree, is_leaf=lambda x: x is None)


def _forward(st: _Static, q, k, v, seg):
    c = st.c
    if st.comm == "all_gather":
        return _gathered_forward(st, q, k, v, seg)
    # ring: each hop is issued before the block that does not need it and tied to that block's result, so that it
    # runs under the block's compute (without the tie XLA's scheduler sends every hop first, then computes)
    arriving = _hop(k, v, seg, st)
    o, lse = _block_forward(st, q, k, v, seg, seg, causal=True)
    arriving, (o, lse) = jax.lax.optimization_barrier((arriving, (o, lse)))
    for step in range(1, c):
        here = arriving
        if step < c - 1:
            arriving = _hop(*here, st)
        o_b, lse_b = _step_forward(st, step, q, seg, *here)
        if step < c - 1:
            arriving, (o_b, lse_b) = jax.lax.optimization_barrier((arriving, (o_b, lse_b)))
        o, lse = _merge(o, lse, o_b, lse_b)
    return o.astype(q.dtype), lse


def _step_forward(st: _Static, step: int, q, seg, k_j, v_j, seg_j):
    """(o, lse) of ring step `step` > 0 (rows no key reaches: o 0, lse -inf): this rank's queries against the keys
    of rank j = i - step."""
    def early():  # j < i: every query, the first of j's chunks
        return vary(_block_forward(st, q, _first(k_j), _first(v_j), seg, _first(seg_j), causal=False))

    def late():  # j > i: the second query chunk, both of j's chunks
        o_b, lse_b = _block_forward(st, _second(q), k_j, v_j, _second(seg), seg_j, causal=False)
        return vary((_below(o_b, 1), jnp.concatenate([jnp.full_like(lse_b, -jnp.inf), lse_b], 2)))

    return jax.lax.cond(_source(st, step) < _rank(st), early, late)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Static, q, k, v, seg):
    return _forward(st, q, k, v, seg)[0]


def _ring_fwd(st: _Static, q, k, v, seg):
    o, lse = _forward(st, q, k, v, seg)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(st: _Static, res, do):
    q, k, v, seg, o, lse = res
    c = st.c
    delta = jnp.einsum("bshk,bshk->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    if st.comm == "all_gather":
        return _gathered_backward(st, q, k, v, seg, do, lse, delta)
    dq, dk, dv = _block_backward(st, q, k, v, do, lse, delta, seg, seg, causal=True)
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
        grads = _step_backward(st, step, q, do, lse, delta, seg, *here)
        (arriving, moving), (dq_b, dk_b, dv_b) = jax.lax.optimization_barrier(((arriving, moving), grads))
        dq = dq + dq_b
        dkv = ((moving[0].astype(jnp.float32) + dk_b).astype(k.dtype),
               (moving[1].astype(jnp.float32) + dv_b).astype(v.dtype))
    dk, dv, _ = _hop(*dkv, None, st)  # the last hop takes each buffer home
    return _cotangents(q, k, v, dq, dk, dv)


def _step_backward(st: _Static, step: int, q, do, lse, delta, seg, k_j, v_j, seg_j):
    """(dq, dk, dv) in fp32 of ring step `step` > 0: this rank's queries against the keys of rank i - step."""
    def early():  # j < i: every query, the first of j's chunks
        dq_b, dk_b, dv_b = _block_backward(st, q, _first(k_j), _first(v_j), do, lse, delta, seg, _first(seg_j),
                                           causal=False)
        return vary((dq_b, _above(dk_b, 1), _above(dv_b, 1)))

    def late():  # j > i: the second query chunk, both of j's chunks
        dq_b, dk_b, dv_b = _block_backward(st, _second(q), k_j, v_j, _second(do), _second(lse, 2), _second(delta, 2),
                                           _second(seg), seg_j, causal=False)
        return vary((_below(dq_b, 1), dk_b, dv_b))

    return jax.lax.cond(_source(st, step) < _rank(st), early, late)


def head_parts(kv_heads: int, tensor: int) -> int:
    """The parts the all_gather exchange cuts each tensor rank's share of `kv_heads` key-value heads into (at most
    4; 1 where they do not divide over `tensor`): the keys and values of part i + 1 are gathered while part i
    attends, so only the first part's gather waits."""
    local = kv_heads // tensor if kv_heads % tensor == 0 else 1
    return max(n for n in (1, 2, 3, 4) if local % n == 0)


def _head_parts(st: _Static, k) -> int:
    """`head_parts` of k's heads on each tensor rank; 1 under a2a+all_gather, whose all-to-alls lost their overlap
    to the parts' collectives (compile-only H100s, 32k tokens, groups of 2: 13.9 -> 17.2 ms exposed)."""
    return head_parts(k.shape[2], step_plan.in_force().tensor) if st.stride == 1 else 1


def _part(x, i: int, n: int, axis: int = 2):
    """Part i of n of x's heads on `axis` (q, k, v, o: 2; lse, delta: 1): each tensor rank's own heads cut n ways,
    so that every part stays split over 'tensor' as the heads are."""
    t = step_plan.in_force().tensor
    if x is None or n == 1:
        return x
    shape = x.shape
    y = x.reshape(*shape[:axis], t, n, shape[axis] // (t * n), *shape[axis + 1:])
    y = constrain(y, tuple("heads" if a == axis else None for a in range(y.ndim)))
    return jax.lax.index_in_dim(y, i, axis + 1, keepdims=False).reshape(*shape[:axis], -1, *shape[axis + 1:])


def _joined(parts: list, axis: int = 2):
    """`_part`'s inverse: the n parts back to x."""
    t, n = step_plan.in_force().tensor, len(parts)
    if n == 1:
        return parts[0]
    shape = parts[0].shape
    ys = [p.reshape(*shape[:axis], t, shape[axis] // t, *shape[axis + 1:]) for p in parts]
    y = constrain(jnp.stack(ys, axis + 1), tuple("heads" if a == axis else None for a in range(len(shape) + 2)))
    return y.reshape(*shape[:axis], n * shape[axis], *shape[axis + 1:])


def _by_parts(st: _Static, k, v, fn, after=lambda res: res) -> list:
    """[after(fn(i, n, everyone's keys and values of head part i [c, ...])) for each head part i] (`_head_parts`),
    part i + 1's all-gather issued once part i's keys have arrived and tied to part i's blocks, and after(part
    i - 1's result) (the backward's reduce-scatter) tied to them too, so that both run under them, as the ring's
    hops do. (Each gather is chained to the one before, and each scatter follows its part's blocks: XLA combines
    independent gathers or scatters into one, which would wait for all of the parts.)"""
    n = _head_parts(st, k)
    # (the keys and values of a part as one array, one collective: XLA's GPU schedule keeps one in flight)
    both = lambda i: _side_by_side(_part(k, i, n), _part(v, i, n))  # noqa: E731
    arriving = last = _gather(both(0), st)
    out, pending = [], None
    for i in range(n):
        here, nxt = arriving, None
        if i + 1 < n:  # (chained on the gathers alone, so that a recomputed forward's are the backward's own: XLA
            # merges the two)
            nxt, _ = jax.lax.optimization_barrier((both(i + 1), last))
            nxt = last = _gather(nxt, st)
        here = _apart(here, k, v)
        arriving, res, done = jax.lax.optimization_barrier((nxt, fn(i, n, here), pending))
        if i:
            out.append(done)
        pending = after(res)
    return out + [pending]


def _gathered_forward(st: _Static, q, k, v, seg):
    """The all_gather exchange's forward: every ring rank's keys and values gathered (head part by head part,
    `_by_parts`) and this rank's queries run against each rank's in turn, merged by their log-sum-exp."""
    everyone_seg = _gather(seg, st)

    def attend(i, n, everyone):
        q_i, k_i, v_i = (_part(x, i, n) for x in (q, k, v))
        o, lse = _block_forward(st, q_i, k_i, v_i, seg, seg, causal=True)
        for step in range(1, st.c):
            j = _source(st, step)
            o, lse = _merge(o, lse, *_step_forward(st, step, q_i, seg, *_take(everyone, j), _take(everyone_seg, j)))
        return o, lse

    parts = _by_parts(st, k, v, attend)
    return _joined([o for o, _ in parts]).astype(q.dtype), _joined([lse for _, lse in parts], 1)


def _gathered_backward(st: _Static, q, k, v, seg, do, lse, delta):
    """The all_gather exchange's backward: every rank's keys gathered again (head part by head part,
    `_by_parts`), each block's dk, dv added at its owner's index of a [c, ...] buffer, and one reduce-scatter over
    'context' per part hands each owner the sum (after the part's blocks, under the next part's)."""
    c, me = st.c, _rank(st)
    everyone_seg = _gather(seg, st)
    put = lambda buf, j, x: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
        buf, jax.lax.dynamic_index_in_dim(buf, j, 0, keepdims=False) + x, j, 0)

    def grads(i, n, everyone):
        q_i, k_i, v_i, do_i = (_part(x, i, n) for x in (q, k, v, do))
        lse_i, delta_i = (_part(x, i, n, axis=1) for x in (lse, delta))
        dq, dk, dv = _block_backward(st, q_i, k_i, v_i, do_i, lse_i, delta_i, seg, seg, causal=True)
        dks = put(jnp.zeros((c, *k_i.shape), jnp.float32), me, dk)
        dvs = put(jnp.zeros((c, *v_i.shape), jnp.float32), me, dv)
        for step in range(1, c):
            j = _source(st, step)
            dq_b, dk_b, dv_b = _step_backward(st, step, q_i, do_i, lse_i, delta_i, seg, *_take(everyone, j),
                                              _take(everyone_seg, j))
            dq, dks, dvs = dq + dq_b, put(dks, j, dk_b), put(dvs, j, dv_b)
        return dq, dks, dvs

    def scatter(res):  # each owner's sum of its keys' and values' gradients, in one reduce-scatter
        dq, dks, dvs = res
        both = jax.lax.psum_scatter(_side_by_side(dks, dvs).astype(k.dtype), AXIS, scatter_dimension=0,
                                    tiled=True, axis_index_groups=_rings(st))[0]
        return (dq, *_apart(both, k, v))

    parts = _by_parts(st, k, v, grads, scatter)
    return _cotangents(q, k, v, *(_joined([p[a] for p in parts]) for a in range(3)))


def _cotangents(q, k, v, dq, dk, dv):
    """Each cotangent typed as its primal (varying over the same manual axes)."""
    return (match_varying(dq.astype(q.dtype), varying_axes(q)), match_varying(dk.astype(k.dtype), varying_axes(k)),
            match_varying(dv.astype(v.dtype), varying_axes(v)), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _token_order(x: jax.Array, c: int) -> jax.Array:
    """[b, c x 2h, ...] in the context ranks' order (rank i's chunks i and 2c - 1 - i) -> the tokens' order."""
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(b, c, 2, s // (2 * c), *rest)
    return jnp.concatenate([x[:, :, 0], x[:, ::-1, 1]], axis=1).reshape(b, s, *rest)


def _ranks_order(x: jax.Array, c: int) -> jax.Array:
    """The inverse of `_token_order`."""
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(b, 2, c, s // (2 * c), *rest)
    return jnp.stack([x[:, 0], x[:, 1, ::-1]], axis=2).reshape(b, s, *rest)


def _a2a_groups(n: int, c: int) -> list[list[int]] | None:
    """The all-to-all groups: n adjacent 'context' indices each (None: one group of every context rank)."""
    return None if n == c else [[j * n + i for i in range(n)] for j in range(c // n)]


def _heads_split(x: jax.Array, n: int, c: int, t: int) -> jax.Array:
    """[b, 2h, m, k] (this rank's tokens, m heads split over 'tensor' by GSPMD) -> [b, n x 2h, m / n, k]: every
    token of this rank's all-to-all group of n context ranks (in the ranks' order) for this rank's group of heads,
    group i of each tensor rank's."""
    b, s, m, k = x.shape
    x = constrain(x.reshape(b, s, t, n, m // (t * n), k), ("batch", None, "heads", None, None, "head_dim"))
    x = jax.lax.all_to_all(x, AXIS, 3, 1, tiled=True, axis_index_groups=_a2a_groups(n, c))
    return x.reshape(b, n * s, m // n, k)


def _sequence_split(x: jax.Array, n: int, c: int, t: int) -> jax.Array:
    """The inverse of `_heads_split`: [b, n x 2h, m, k] -> [b, 2h, n x m, k]."""
    b, s, m, k = x.shape
    x = constrain(x.reshape(b, s, t, 1, m // t, k), ("batch", None, "heads", None, None, "head_dim"))
    x = jax.lax.all_to_all(x, AXIS, 1, 3, tiled=True, axis_index_groups=_a2a_groups(n, c))
    return x.reshape(b, s // n, n * m, k)


def _a2a_joined(q, k, v, c: int, t: int):
    """One all-to-all of q, k and v (`_heads_split`): each key-value head's queries side by side with its key and
    value on the last axis, so that a head's group goes to one rank with them."""
    b, s, m, d = q.shape
    grouped = q.reshape(b, s, k.shape[2], -1)  # [b, s, g, the g-th head's queries]
    q, k, v = _apart(_token_order(_heads_split(_side_by_side(grouped, k, v), c, c, t), c), grouped, k, v)
    return q.reshape(b, c * s, m // c, d), k, v


def _a2a_by_parts(q, k, v, attend, c: int, t: int):
    """The all-to-all exchange head part by head part (`head_parts` of the key-value heads each rank receives, when
    more than one): part i + 1's all-to-all (q, k, v as one, `_a2a_joined`) runs under part i's attention beside
    part i - 1's output all-to-all, so only the first part's waits (compile-only H100s, Llama 3.2 1B at 32k on
    data 2 x context 4: 18.8 -> 16.1 ms exposed in 2 parts, 32.2 -> 18.8 ms with 32 key-value heads in 4; the
    same q, k, v apart in each part: 20.0 and 22.0). In one part the three separate all-to-alls of before overlap
    more (128k on context 8: 83.5 ms exposed against 100.2 joined)."""
    n = head_parts(k.shape[2], t * c)
    send = lambda i: _a2a_joined(_part(q, i, n), _part(k, i, n), _part(v, i, n), c, t)  # noqa: E731
    arriving, out, pending = send(0), [], None
    for i in range(n):
        here, nxt = arriving, None
        if i + 1 < n:
            nxt = send(i + 1)
        o = attend(*here)
        arriving, o, done = jax.lax.optimization_barrier((nxt, o, pending))
        if i:
            out.append(done)
        pending = _sequence_split(_ranks_order(o, c), c, c, t)
    return _joined(out + [pending])


def a2a_groups(heads: int, groups: int, ranks: int) -> int:
    """The key-value heads the all-to-alls move over `ranks` (tensor x the all-to-all group's context ranks):
    `groups` where they divide, else repeated to the query `heads`."""
    return groups if groups % ranks == 0 else heads


def a2a_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                  impl: str = "xla", scale: float | None = None) -> jax.Array:
    """Causal attention of this rank's queries over the whole sequence by all-to-alls over 'context' (see the
    module docstring), or with the step plan's context_comm a2a+ring (a2a+all_gather), all-to-alls inside groups
    of context_a2a adjacent ranks and a ring (an all-gather) across the groups: the arguments and result as
    `ring_attention`'s. Inside the train step's manual region only."""
    plan = step_plan.in_force()
    c, t = size(), plan.tensor
    n = plan.context_a2a
    if c == 1 or c % n:
        raise ValueError(f"a2a_attention runs inside the train step's region with parallel.context > 1, in groups "
                         f"that divide it (context {c}, groups of {n})")
    heads, groups = q.shape[2], k.shape[2]
    if heads % (t * n):
        raise ValueError(f"all-to-all attention splits the {heads} heads over tensor x {n} context ranks = {t * n}")
    if a2a_groups(heads, groups, t * n) != groups:  # (grouped-query keys and values: each repeated to its heads)
        k, v = (jnp.repeat(x, heads // groups, axis=2) for x in (k, v))

    def gathered(segment_ids):
        return None if segment_ids is None else _token_order(jax.lax.all_gather(
            segment_ids.astype(jnp.int32), AXIS, axis=1, tiled=True, axis_index_groups=_a2a_groups(n, c)), n)

    def attend(q, k, v, segment_ids):
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, scale=scale)

    if n == c and head_parts(k.shape[2], t * c) > 1:
        segment_ids = gathered(segment_ids)
        return _a2a_by_parts(q, k, v, lambda q, k, v: attend(q, k, v, segment_ids), c, t)
    q, k, v = (_token_order(_heads_split(x, n, c, t), n) for x in (q, k, v))
    segment_ids = gathered(segment_ids)
    if n == c:
        o = attend(q, k, v, segment_ids)
    else:  # the group's tokens are chunks j and 2 (c / n) - 1 - j of the sequence: ring j of c / n
        across = plan.context_comm.removeprefix("a2a+")
        o = _ring_over(q, k, v, segment_ids, impl, scale, _Static("", 0.0, c // n, across, stride=n))
    return _sequence_split(_ranks_order(o, n), n, c, t)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
              impl: str = "xla", scale: float | None = None) -> jax.Array:
    """Context parallelism's causal attention, by the step plan's exchange (parallel.context_comm): all-to-alls
    (`a2a_attention`; a2a+ring, a2a+all_gather: in groups, with a ring or an all-gather across them), or a ring or
    an all-gather of the keys and values (`ring_attention`)."""
    if step_plan.in_force().context_comm.startswith("a2a"):
        return a2a_attention(q, k, v, segment_ids=segment_ids, impl=impl, scale=scale)
    return ring_attention(q, k, v, segment_ids=segment_ids, impl=impl, scale=scale)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                   impl: str = "xla", scale: float | None = None, exchange: str | None = None) -> jax.Array:
    """Causal attention of this rank's queries over the keys of the whole sequence, the keys and values passed
    around the 'context' ring (see the module docstring). q [b, 2h, h_q, k], k and v [b, 2h, g, k] and
    segment_ids [b, 2h] in the layout of `split`; returns [b, 2h, h_q, k]. exchange: 'ring' or 'all_gather'
    (None: the step plan's context_comm). Inside the train step's manual region only (size() > 1)."""
    c = size()
    if c == 1:
        raise ValueError("ring_attention runs inside the train step's region with parallel.context > 1")
    exchange = step_plan.in_force().context_comm if exchange is None else exchange
    if exchange not in ("ring", "all_gather"):
        raise ValueError(f"the context exchange is 'ring' or 'all_gather', got {exchange!r}")
    return _ring_over(q, k, v, segment_ids, impl, scale, _Static("", 0.0, c, exchange))


def _ring_over(q, k, v, segment_ids, impl: str, scale: float | None, ring: _Static) -> jax.Array:
    """`_ring` with `ring`'s ranks and exchange, its blocks by `impl` (auto: the Pallas kernels on GPUs, XLA's on
    CPU, megajax/kernels/auto.py) at `scale` (None: 1 / sqrt(head dim))."""
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"ring attention runs impl 'auto', 'xla' or 'pallas', got {impl!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    static = lambda impl: dataclasses.replace(ring, impl=impl, scale=scale)  # noqa: E731
    if impl == "auto":
        if attention_fallback(q.shape[-1], dropout=False):
            impl = "xla"
        else:
            return by_platform(q, k, v, cpu=lambda *a: _ring(static("xla"), *a, segment_ids),
                               gpu=lambda *a: _ring(static("pallas"), *a, segment_ids))
    return _ring(static(impl), q, k, v, segment_ids)
