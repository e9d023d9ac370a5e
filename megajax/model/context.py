"""Context parallelism: every sequence split over the 'context' ranks for every layer, attention by all-to-alls (or a
ring, or an all-gather: megajax/model/ring.py).

Layout (Megatron-Core's, for causal balance). A sequence of s tokens is cut into 2c chunks of h = s / 2c tokens;
context rank i holds chunks i and 2c - 1 - i, one after the other (2h local tokens). With a causal mask a plain
split would give the last rank c times the attention work of the first; with this one every rank does the same
work: chunk i's queries see i + 1 key chunks, chunk 2c - 1 - i's see 2c - i, 2c + 1 in all on every rank.

Everything outside attention is per token and runs on the local tokens as it is: embeddings (at the tokens'
global `positions`), norms, the MLP, the loss (summed over 'context' like over 'data'). Dropout masks are a hash of
where each element lies (a token's global position and feature; a probability's head and query and key positions:
megajax/kernels/dropout.py), so each rank draws its own tokens' alone and every exchange drops the entries one
device drops.

Ring attention (`ring_attention`, parallel.context_comm=ring) and the all-gather exchange (all_gather) pass or
gather the keys and values and attend block by block: megajax/model/ring.py.

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
index j n + i for each i < n, `ring.Ring.stride`) on n times the tokens and 1 / n of the heads: its hops cross nodes,
once per group, and the all-to-alls stay inside them. parallel.context_comm=a2a+all_gather runs the all-gather
exchange over the same rings instead, the form that runs under a pipeline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megajax import kernels
from megajax.kernels.dropout import AttentionDropout
from megajax.model.ring import (AXIS, Ring, apart, chunk_positions, head_parts, joined, part, ring_attention,
                                ring_over, side_by_side)
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain

__all__ = ["AXIS", "a2a_attention", "a2a_groups", "attention", "gather", "head_parts", "positions", "ring_attention",
           "size", "split", "split_batch"]


def size() -> int:
    """The context-parallel size of the step plan in force (step_plan.use; 1 outside a step)."""
    return step_plan.in_force().context


def positions(s_local: int) -> jax.Array:
    """The global positions [s_local] of this rank's tokens (0 .. s_local - 1 without context parallelism)."""
    c = size()
    if c == 1:
        return jnp.arange(s_local)
    return chunk_positions(jax.lax.axis_index(AXIS), c, s_local // 2)


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
    q, k, v = apart(_token_order(_heads_split(side_by_side(grouped, k, v), c, c, t), c), grouped, k, v)
    return q.reshape(b, c * s, m // c, d), k, v


def _group_dropout(drop: AttentionDropout | None, n: int, t: int, i: int = 0,
                   parts: int = 1) -> AttentionDropout | None:
    """Attention dropout over the heads this rank attends to: head part i of `parts` (`part`), then its group of
    `_heads_split`'s (the global head indices follow the queries'); None without dropout."""
    if drop is None:
        return None
    mine = jax.lax.axis_index(AXIS) % n
    heads = part(drop.heads, i, parts, axis=0).reshape(t, n, -1)
    return drop.with_heads(jax.lax.dynamic_index_in_dim(heads, mine, 1, keepdims=False).reshape(-1))


def _a2a_by_parts(q, k, v, attend, c: int, t: int, drop: AttentionDropout | None):
    """The all-to-all exchange head part by head part (`head_parts` of the key-value heads each rank receives, when
    more than one): part i + 1's all-to-all (q, k, v as one, `_a2a_joined`) runs under part i's attention beside
    part i - 1's output all-to-all, so only the first part's waits (compile-only H100s, Llama 3.2 1B at 32k on
    data 2 x context 4: 18.8 -> 16.1 ms exposed in 2 parts, 32.2 -> 18.8 ms with 32 key-value heads in 4; the
    same q, k, v apart in each part: 20.0 and 22.0). In one part the three separate all-to-alls of before overlap
    more (128k on context 8: 83.5 ms exposed against 100.2 joined)."""
    n = head_parts(k.shape[2], t * c)
    send = lambda i: _a2a_joined(part(q, i, n), part(k, i, n), part(v, i, n), c, t)  # noqa: E731
    arriving, out, pending = send(0), [], None
    for i in range(n):
        here, nxt = arriving, None
        if i + 1 < n:
            nxt = send(i + 1)
        o = attend(*here, _group_dropout(drop, c, t, i, n))
        arriving, o, done = jax.lax.optimization_barrier((nxt, o, pending))
        if i:
            out.append(done)
        pending = _sequence_split(_ranks_order(o, c), c, c, t)
    return joined(out + [pending])


def a2a_groups(heads: int, groups: int, ranks: int) -> int:
    """The key-value heads the all-to-alls move over `ranks` (tensor x the all-to-all group's context ranks):
    `groups` where they divide, else repeated to the query `heads`."""
    return groups if groups % ranks == 0 else heads


def a2a_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                  impl: str = "xla", scale: float | None = None,
                  probs_dropout: AttentionDropout | None = None) -> jax.Array:
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

    def attend(q, k, v, segment_ids, drop):
        return kernels.attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, scale=scale,
                                 probs_dropout=drop)

    if n == c and head_parts(k.shape[2], t * c) > 1:
        segment_ids = gathered(segment_ids)
        return _a2a_by_parts(q, k, v, lambda q, k, v, drop: attend(q, k, v, segment_ids, drop), c, t, probs_dropout)
    q, k, v = (_token_order(_heads_split(x, n, c, t), n) for x in (q, k, v))
    segment_ids, drop = gathered(segment_ids), _group_dropout(probs_dropout, n, t)
    if n == c:
        o = attend(q, k, v, segment_ids, drop)
    else:  # the group's tokens are chunks j and 2 (c / n) - 1 - j of the sequence: ring j of c / n
        across = plan.context_comm.removeprefix("a2a+")
        o = ring_over(q, k, v, segment_ids, impl, scale, Ring("", 0.0, c // n, across, stride=n), drop)
    return _sequence_split(_ranks_order(o, n), n, c, t)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
              impl: str = "xla", scale: float | None = None,
              probs_dropout: AttentionDropout | None = None) -> jax.Array:
    """Context parallelism's causal attention, by the step plan's exchange (parallel.context_comm): all-to-alls
    (`a2a_attention`; a2a+ring, a2a+all_gather: in groups, with a ring or an all-gather across them), or a ring or
    an all-gather of the keys and values (`ring_attention`)."""
    fn = a2a_attention if step_plan.in_force().context_comm.startswith("a2a") else ring_attention
    return fn(q, k, v, segment_ids=segment_ids, impl=impl, scale=scale, probs_dropout=probs_dropout)
