"""The routed rows' way to the experts and back: sorted by expert, dropless or into capacity buffers, across the
expert ranks, and combined.

Dimension letters as in megajax/model/layers.py, plus t tokens (b x s flattened), e experts, a routed assignments
(t k).

The t k assignments are sorted by expert (`dispatch`: within an expert in token order, or by descending weight for
the "probs" drop policy). Dropless (no capacity factor), each expert takes all its rows (layer.py's `expert_mlps`
runs its matmuls on them alone). With `moe_capacity_factor`, each expert takes at most `capacity` rows into an
[e, c, d] buffer for batched matmuls (`to_buffers`), per rank and micro batch, as Megatron's
`--moe-token-drop-policy` (`model.moe_token_drop_policy`): "probs" keeps the assignments with the largest routing
weights (ties in token order), "position" the first ones in token order; a dropped assignment contributes nothing
(the token keeps its other experts' outputs, weights not renormalised). Then the outputs are unsorted and combined
with the routing weights (`combine`).

With expert parallelism the experts live on the 'expert' ranks and the rows are exchanged by all-to-all; each
expert's width is split over 'tensor' like the dense MLP's, every tensor rank routing the whole gathered sequence.
With folded experts (parallel.expert_tensor=1, `folds`) every expert is whole on one of the 'expert' x
'tensor' ranks: the tokens are routed in g groups, one per tensor rank's sequence shard (capacity and drops per
group, as Megatron's per-rank router), and one all-to-all over both axes carries the capacity buffers
(`exchange_folded`) or, dropless, each group's rows in fixed-size blocks (`exchange_folded_dropless`), which every
rank runs through its whole experts block by block (layer.py's `expert_mlps`). Dropless,
parallel.expert_all_to_all=ragged sends the routed rows alone (`ragged_move`: XLA's ragged all-to-all, emulated
on CPU), each rank's received rows packed by source into a buffer of the most it can get, or with
parallel.expert_buffer_factor of that factor times one rank's routed rows (`ragged_plan`: what does not fit is not
sent, and counts as dropped).

Which exchange runs is the step plan's (megajax.parallel.step_plan.in_force(): `Exchange`, `folds`,
`expert_parallel_size`); outside a step, none (the expert-sharded weights are used as global arrays).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.parallel import step_plan
from megajax.parallel.step_plan import FOLDED, constrain, current_manual_axes, tensor_manual, vary, varying_axes


class Exchange(NamedTuple):
    """How the experts' rows cross the devices (parallel.expert_tensor, parallel.expert_all_to_all)."""

    folded: bool = False  # whole experts spread over 'expert' x 'tensor'
    ragged: bool = False  # dropless rows by exact counts, not fixed-size blocks
    buffer_factor: float | None = None  # ragged: receive at most this times a rank's routed rows (null: the most)


def exchange_in_force() -> Exchange:
    """The experts' exchange of the step plan in force (step_plan.use; none outside a step)."""
    plan = step_plan.in_force()
    return Exchange(plan.moe_folds > 1, plan.moe_ragged, plan.moe_buffer_factor)


def folds() -> int:
    """The tensor ranks that route their own sequence shards and hold whole experts (parallel.expert_tensor=1):
    the step plan's moe_folds, outside a region that makes 'tensor' manual, else 1."""
    return 1 if "tensor" in current_manual_axes() else step_plan.in_force().moe_folds


def expert_parallel_size() -> int:
    """The expert-parallel ranks this layer exchanges tokens with: the step plan's 'expert' size (manual in the
    step's region), 1 outside a step (under GSPMD the expert-sharded weights are used as global arrays)."""
    return step_plan.in_force().expert


def capacity(tokens: int, k: int, e: int, factor: float) -> int:
    """Rows an expert takes with a capacity factor: factor x its even share of the t k assignments (at least 1).
    Per rank and micro batch (Megatron's per-rank dropping): t is the tokens this rank routes."""
    return max(1, math.ceil(tokens * k / e * factor))


def buffer_rows(tokens: int, k: int, e: int, ranks: int, capacity_factor: float | None,
                buffer_factor: float | None = None) -> int:
    """Rows a rank's experts run for one routing group of `tokens` tokens, the experts on `ranks` ranks: e capacity
    buffers (`capacity`) with a capacity factor; dropless, the routed rows on one rank, and across ranks the
    receiving buffer (`receive_rows`: the most a rank can get, or with the ragged exchange buffer_factor x the routed
    rows)."""
    if capacity_factor is not None:
        return e * capacity(tokens, k, e, capacity_factor)
    if ranks == 1:
        return tokens * k
    return receive_rows(tokens * k, dropless_bound(tokens, k, e, ranks), ranks, buffer_factor)


def _place(into: jax.Array, at, rows: jax.Array) -> jax.Array:
    """`into` with rows written at the indices `at`, which are unique (rows at an index past `into` dropped). Said
    unique to JAX: otherwise its scatter's derivative scatters an id per element to find which update won and keeps
    [rows, d] masks for the backward (on DeepSeek-V3's experts 1.75 GiB a layer of 4,096 tokens), where a scatter
    of unique indices differentiates as a scatter and transposes as a gather."""
    return into.at[at].set(rows, mode="drop", unique_indices=True)


def _take(rows: jax.Array, at) -> jax.Array:
    """The rows at the unique indices `at` (zeros past the end): `_place`'s transpose, which its own transposes
    back into a scatter of unique indices (no atomic adds)."""
    return rows.at[at].get(mode="fill", fill_value=0, unique_indices=True)


def dispatch(x_td: jax.Array, ids_tk: jax.Array, e: int,
             weights_tk: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sorts the t k assignments by expert: (rows [a, d] grouped by expert, group sizes [e], the order a
    sorted position came from, to unsort). Within an expert in token order, or with weights_tk by descending
    weight (ties in token order)."""
    order = _order(ids_tk, weights_tk)
    sizes = jnp.bincount(ids_tk.reshape(-1), length=e).astype(jnp.int32)
    return x_td[order // ids_tk.shape[1]], sizes, order


def _order(ids_tk: jax.Array, weights_tk: jax.Array | None) -> jax.Array:
    """dispatch's order of the t k assignments: by expert, within one in token order or by descending weight."""
    flat = ids_tk.reshape(-1)
    if weights_tk is None:
        return jnp.argsort(flat, stable=True)
    return jnp.lexsort((-weights_tk.reshape(-1), flat))  # (stable: ties keep token order)


def _places(expert: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """Each sorted assignment's place among its expert's (expert: the sorted assignments' experts)."""
    return jnp.arange(expert.shape[0]) - (jnp.cumsum(sizes_e) - sizes_e)[expert]


def kept(ids_tk: jax.Array, e: int, c: int, weights_tk: jax.Array | None = None) -> jax.Array:
    """Which of the t k assignments the experts keep at capacity c [t, k]: each expert its first c in dispatch's
    order (by weight with weights_tk), as `to_buffers` places them."""
    flat = ids_tk.reshape(-1)
    order = _order(ids_tk, weights_tk)
    keep = _places(flat[order], jnp.bincount(flat, length=e)) < c
    return jnp.zeros(flat.shape, bool).at[order].set(keep, unique_indices=True).reshape(ids_tk.shape)


def combine(y_ad: jax.Array, order: jax.Array, weights_tk: jax.Array) -> jax.Array:
    """Unsorts the experts' outputs and sums each token's k of them with its routing weights: [t, d]."""
    t, k = weights_tk.shape
    unsorted = _place(jnp.zeros_like(y_ad), order, y_ad)
    return jnp.einsum("tkd,tk->td", unsorted.reshape(t, k, -1), weights_tk.astype(y_ad.dtype))


def _all_to_all(x: jax.Array, axes="expert") -> jax.Array:
    """Block i of x's leading dim (one per rank of `axes`) to rank i; block j of the result came from j."""
    return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)


def exchange_capacity(buf_ecd: jax.Array, ep: int, experts) -> jax.Array:
    """Capacity buffers [e, c, d] of this rank's routed rows -> the experts' outputs [e, c, d'], with the experts
    on `ep` ranks: each rank sends every rank the buffers of that rank's e / ep experts (all-to-all), runs its
    experts on [e / ep, ep c, d] with `experts`, and sends the outputs back (all-to-all)."""
    e, c, d = buf_ecd.shape
    el = e // ep
    recv = _all_to_all(buf_ecd.reshape(ep, el, c, d))  # [source rank, local expert, c, d]
    out = experts(recv.transpose(1, 0, 2, 3).reshape(el, ep * c, d))
    out = out.reshape(el, ep, c, -1).transpose(1, 0, 2, 3)
    return _all_to_all(out).reshape(e, c, -1)


def to_buffers(rows_ad: jax.Array, ids_tk: jax.Array, sizes_e: jax.Array, c: int):
    """dispatch's rows [a, d] -> (capacity buffers [e, c, d], each row's expert, its place among the expert's rows
    and whether it was kept): an expert takes its first c rows in dispatch's order, the rest are dropped."""
    e = sizes_e.shape[0]
    expert = jnp.sort(ids_tk.reshape(-1))
    pos = _places(expert, sizes_e)
    keep = pos < c
    # a dropped row's slot is past c, each its own (a row's expert and position are unique), so the scatter drops it
    buf = _place(jnp.zeros((e, c, rows_ad.shape[1]), rows_ad.dtype), (expert, pos), rows_ad)
    return buf, (expert, pos, keep)


def from_buffers(buf_ecd: jax.Array, placed) -> jax.Array:
    """The experts' outputs [e, c, d'] back to to_buffers' rows [a, d'] (a dropped row gets zeros)."""
    expert, pos, _ = placed
    return _take(buf_ecd, (expert, pos))


def _folded_all_to_all_fn(x: jax.Array) -> jax.Array:
    axes = tuple(a for a in FOLDED if a == "tensor" or a in current_manual_axes())

    def run(block):
        return jax.lax.all_to_all(block, axes, 1, 1, tiled=True)

    spec = P("tensor", *[None] * (x.ndim - 1))
    return tensor_manual(run, (x,), (spec,), spec)


@jax.custom_vjp
def folded_all_to_all(x: jax.Array) -> jax.Array:
    """x [t, n, ...] with dim 0 on 'tensor' (one block per tensor rank) and n = 'expert' x 'tensor' ranks: block j
    of dim 1 goes to folded rank j (expert rank major); dim 1 of the result is the rank each block came from. Its
    own transpose (jax 0.10.2 cannot differentiate the nested shard_map, hence the custom VJP)."""
    return _folded_all_to_all_fn(x)


folded_all_to_all.defvjp(lambda x: (_folded_all_to_all_fn(x), None), lambda _, ct: (_folded_all_to_all_fn(ct),))


def exchange_folded(buf_gecd: jax.Array, ep: int, experts) -> jax.Array:
    """Capacity buffers [t, e, c, d] of the t tensor ranks' sequence shards -> the experts' outputs [t, e, c, d'],
    with whole experts spread over ep x t ranks (parallel.expert_tensor=1): each rank sends every folded rank the
    buffers of its e / (ep t) experts (one all-to-all over 'expert' x 'tensor'), runs its experts on
    [e / (ep t), ep t c, d] and sends the outputs back."""
    t, e, c, d = buf_gecd.shape
    n = ep * t
    el = e // n
    recv = folded_all_to_all(buf_gecd.reshape(t, n, el, c, d))  # [holding rank, source rank, local expert, c, d]
    out = experts(recv.transpose(0, 2, 1, 3, 4).reshape(t * el, n * c, d))
    out = out.reshape(t, el, n, c, -1).transpose(0, 2, 1, 3, 4)
    return folded_all_to_all(out).reshape(t, e, c, -1)


def dropless_bound(tokens: int, k: int, e: int, ep: int) -> int:
    """Rows one rank sends each expert rank dropless: the most it can get, a token picking k distinct experts
    of which e / ep live there (min(k, e / ep) rows a token)."""
    return tokens * min(k, e // ep)


def _pack(rows_ad: jax.Array, sizes_e: jax.Array, ranks: int, bound: int):
    """Rows [a, d] sorted by expert (group sizes [e]) -> (send buffers [ranks, bound, d]: block r holds the rows of
    rank r's e / ranks experts, zeros past them; where each sent row sits in rows_ad [ranks, bound]; which are
    rows [ranks, bound])."""
    a = rows_ad.shape[0]
    per_rank = jnp.sum(sizes_e.reshape(ranks, -1), axis=1)
    j = jnp.arange(bound)
    src = (jnp.cumsum(per_rank) - per_rank)[:, None] + j
    valid = j < per_rank[:, None]
    return _take(rows_ad, jnp.where(valid, src, _past(a, src))), src, valid


def _regroup(counts_se: jax.Array, off_s: jax.Array, rows: int) -> jax.Array:
    """The received rows' group sizes [source rank, local expert] and where each source's rows start (ascending)
    -> the order [rows] that sorts the received rows by local expert (each expert's rows in source rank order;
    rows in no group last)."""
    p = jnp.arange(rows)
    src = jnp.sum(p[:, None] >= off_s[None, 1:], axis=1)
    local = jnp.sum((p - off_s[src])[:, None] >= jnp.cumsum(counts_se, axis=1)[src], axis=-1)  # el: no group
    return jnp.argsort(local, stable=True)


def _unsort(out_nd: jax.Array, order: jax.Array) -> jax.Array:
    return _place(jnp.zeros_like(out_nd), order, out_nd)


def _unpack(back_rbd: jax.Array, src: jax.Array, valid: jax.Array, a: int) -> jax.Array:
    """_pack's inverse for the experts' outputs [ranks, bound, d'] -> [a, d'] (the padding rows each to its own
    place past a, dropped)."""
    return _place(jnp.zeros((a, back_rbd.shape[-1]), back_rbd.dtype), jnp.where(valid, src, _past(a, src)), back_rbd)


def _past(a: int, like: jax.Array) -> jax.Array:
    """An index past a for each element of `like`, each its own (so that indices stay unique)."""
    return a + jnp.arange(like.size, dtype=like.dtype).reshape(like.shape)


def _emulated_ragged_all_to_all(x, out, in_off, send, out_off, recv, axes):
    """jax.lax.ragged_all_to_all as its documentation defines it, by fixed-size all-to-alls (XLA:CPU has no
    ragged all-to-all): slice j (send[j] rows of x from in_off[j]) goes to rank j, padded to x's rows, and
    is written there at out_off[j]; recv[s] rows come from rank s."""
    rows = x.shape[0]
    j = jnp.arange(rows)
    trail = (1,) * (x.ndim - 1)
    blocks = jnp.where((j < send[:, None]).reshape(*send.shape, rows, *trail),
                       x[jnp.minimum(in_off[:, None] + j, rows - 1)], 0)
    got = _all_to_all(blocks, axes)  # [source rank, rows, ...]
    at = _all_to_all(out_off, axes)
    to = at[:, None] + j
    return _place(out, jnp.where(j < recv[:, None], to, _past(out.shape[0], to)), got)


def _ragged_all_to_all(*args, axes):
    """The ragged all-to-all where it exists (XLA:GPU), its emulation on CPU (chosen per lowering platform, so a
    CPU machine still compiles the real one for a GPU target)."""
    return step_plan.platform_dependent(
        *args, cpu=functools.partial(_emulated_ragged_all_to_all, axes=axes),
        default=lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axes))


def _zeros_after(shape: tuple, dtype, x: jax.Array) -> jax.Array:
    """Zeros made once x is there: the exchange's receiving buffer, which it writes in place. A plain jnp.zeros is
    one value to XLA wherever it appears, so every exchange of the step wrote into a copy of one shared zeros, and
    XLA made the copies early and held them: 3.3 GiB of the DeepSeek-V3 preset's peak. (The same for the layer's
    scatters into zeros saves 1.6 GiB more there but leaves 0.4-0.7 s more of the exchange exposed.)"""
    return jax.lax.optimization_barrier((jnp.zeros(shape, dtype), x))[0]


def _move_fn(x, send_off, send_n, dest_off, recv_off, recv_n, rows_out: int, back: bool,
             folded: bool) -> jax.Array:
    """`ragged_move` without its VJP. Folded: x's leading dim (one block per tensor rank) is split over 'tensor' in
    a nested manual region, and the ranks are 'expert' x 'tensor'."""

    def one(x, send_off, send_n, dest_off, recv_off, recv_n, axes):
        if back:  # the rows received from s (recv_n[s] from recv_off[s]) back to where s sent them from
            args = (recv_off, recv_n, _all_to_all(send_off, axes), send_n)
        else:
            args = (send_off, send_n, dest_off, recv_n)
        out = _zeros_after((rows_out, *x.shape[1:]), x.dtype, x)
        out = out if folded else vary(out, sorted(varying_axes(x) | set(axes)))
        return _ragged_all_to_all(x, out, *args, axes=axes)

    args = (x, send_off, send_n, dest_off, recv_off, recv_n)
    if not folded:
        return one(*(a[0] for a in args), ("expert",))[None]
    axes = tuple(a for a in FOLDED if a == "tensor" or a in current_manual_axes())
    spec = lambda a: P("tensor", *[None] * (a.ndim - 1))  # noqa: E731
    return tensor_manual(lambda *a: one(*(b[0] for b in a), axes)[None], args, tuple(map(spec, args)), spec(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def ragged_move(x: jax.Array, send_off: jax.Array, send_n: jax.Array, dest_off: jax.Array, recv_off: jax.Array,
                recv_n: jax.Array, rows_out: int, back: bool, folded: bool) -> jax.Array:
    """The dropless rows' exchange by exact counts (parallel.expert_all_to_all=ragged), for blocks [g, rows, d]
    (one over 'expert'; folded, one per tensor rank over 'expert' x 'tensor', `folded`), every offset and size
    [g, n ranks] (`ragged_plan`). Forward: send_n[j] rows from send_off[j] to rank j, written there from
    dest_off[j]; recv_n[s] rows arrive from s at recv_off[s] of [rows_out, d]. back=True is its transpose: the rows
    received go back where they came from (into zeros [rows_out, d]: rows never sent get zeros). Each direction is
    the other's VJP."""
    return _move_fn(x, send_off, send_n, dest_off, recv_off, recv_n, rows_out, back, folded)


def _move_fwd(x, send_off, send_n, dest_off, recv_off, recv_n, rows_out, back, folded):
    out = _move_fn(x, send_off, send_n, dest_off, recv_off, recv_n, rows_out, back, folded)
    return out, (send_off, send_n, dest_off, recv_off, recv_n, x.shape[1])


def _move_bwd(rows_out, back, folded, res, ct):
    *plan, rows_in = res
    return (_move_fn(ct, *plan, rows_in, not back, folded),) + (None,) * 5


ragged_move.defvjp(_move_fwd, _move_bwd)


def receive_rows(rows: int, bound: int, ranks: int, factor: float | None) -> int:
    """The rows of a rank's receiving buffer for the ragged exchange: the most it can get (ranks x bound), or with
    parallel.expert_buffer_factor that factor times one rank's routed rows (the mean a rank receives), at most
    the most."""
    return ranks * bound if factor is None else min(ranks * bound, math.ceil(factor * rows))


def ragged_plan(per_rank: jax.Array, rows_out: int):
    """Where the ragged exchange's rows go: the blocks' rows for each rank per_rank [g, n] (g blocks on this
    device: 1, or folded the tensor ranks' (GSPMD), ranks expert-major) -> (send_off, send_n, dest_off, recv_off,
    recv_n), each [g, n], as `ragged_move` takes them. A receiving buffer of rows_out rows holds the sources' rows
    in source rank order; what does not fit is not sent (the higher sources' last rows first)."""
    g, n = per_rank.shape
    if "expert" in current_manual_axes():  # every block's counts: [sources, destinations]
        every = jax.lax.all_gather(per_rank, "expert", tiled=True)
        me = jax.lax.axis_index("expert") * g + jnp.arange(g)
    else:
        every, me = per_rank, jnp.arange(g)
    # whole on every device: a cumulative sum over the blocks split over 'tensor' would be a chain of
    # collective-permutes, which deadlock inside a pipeline's per-rank branches
    every = constrain(every, (None, None))
    before = jnp.cumsum(every, axis=0) - every  # [s, j]: rows sources before s send j
    dest_off = before[me]
    send_n = jnp.clip(rows_out - dest_off, 0, per_rank)
    recv_off = before[:, me].T
    recv_n = jnp.clip(rows_out - recv_off, 0, every[:, me].T)
    return jnp.cumsum(per_rank, axis=1) - per_rank, send_n, dest_off, recv_off, recv_n


def _ragged_exchange(rows_gad, sizes_ge, counts_gse, ranks: int, bound: int, factor, experts, folded: bool):
    """The ragged exchange of g blocks of rows [g, a, d] sorted by expert (group sizes [g, e]; the group sizes
    each block receives from each source [g, n, e / n]) through `experts` and back: (outputs [g, a, d'], rows
    dropped for want of room)."""
    g, a, _ = rows_gad.shape
    rows_out = receive_rows(a, bound, ranks, factor)
    plan = ragged_plan(jnp.sum(sizes_ge.reshape(g, ranks, -1), axis=2), rows_out)
    recv = ragged_move(rows_gad, *plan, rows_out, False, folded)
    recv_off, recv_n = plan[3], plan[4]
    kept = jnp.clip(recv_n[..., None] - (jnp.cumsum(counts_gse, axis=2) - counts_gse), 0, counts_gse)
    order = jax.vmap(lambda c, o: _regroup(c, o, rows_out))(kept, recv_off)
    rows_in, sizes_in = jax.vmap(_take)(recv, order), jnp.sum(kept, axis=1)
    out = experts(rows_in, sizes_in) if folded else experts(rows_in[0], sizes_in[0])[None]
    out = jax.vmap(_unsort)(out, order)
    dropped = jnp.sum(sizes_ge) - jnp.sum(plan[1])
    return ragged_move(out, *plan, a, True, folded), dropped.astype(jnp.float32)


def exchange_dropless(rows_ad: jax.Array, sizes_e: jax.Array, k: int, ep: int, experts,
                      how: Exchange = Exchange()) -> tuple[jax.Array, jax.Array]:
    """Dropless rows [a, d] sorted by expert (group sizes [e]) -> (the experts' outputs [a, d'], rows dropped), with
    the experts on `ep` ranks. Each expert rank gets the rows of its e / ep experts in a buffer of the most it can
    get (a token picks k distinct experts, so min(k, e / ep) rows a token). The padded all-to-all is fixed-size,
    so it moves ep x min(k, e / ep) / k times the routed rows (the capacity path moves capacity_factor times);
    `how.ragged` moves the routed rows alone (`ragged_move`), into a smaller buffer with `how.buffer_factor`
    (dropping what does not fit). The received rows are regrouped by local expert for
    `experts(rows, group sizes [e / ep])` (padding rows last, in no group, their outputs unused), and the outputs
    go back the same way."""
    a, d = rows_ad.shape
    el = sizes_e.shape[0] // ep
    bound = dropless_bound(a // k, k, sizes_e.shape[0], ep)
    counts = _all_to_all(sizes_e.reshape(ep, el))  # [source rank, local expert]
    if how.ragged:
        out, dropped = _ragged_exchange(rows_ad[None], sizes_e[None], counts[None], ep, bound, how.buffer_factor,
                                        experts, False)
        return out[0], dropped
    send, src, valid = _pack(rows_ad, sizes_e, ep, bound)
    recv = _all_to_all(send).reshape(ep * bound, d)
    order = _regroup(counts, jnp.arange(ep) * bound, ep * bound)
    out = _unsort(experts(_take(recv, order), jnp.sum(counts, axis=0)), order)
    back = _all_to_all(out.reshape(ep, bound, -1))  # [destination rank, bound, d'], in the order the rows were sent
    return _unpack(back, src, valid, a), jnp.float32(0)


def exchange_folded_dropless(rows_gad: jax.Array, sizes_ge: jax.Array, k: int, ep: int, experts,
                             how: Exchange = Exchange()) -> tuple[jax.Array, jax.Array]:
    """exchange_dropless for folded experts (parallel.expert_tensor=1): the rows [t, a, d] of the t tensor ranks'
    sequence shards (group sizes [t, e]) -> (their outputs [t, a, d'], rows dropped), the experts whole on ep x t
    ranks. One all-to-all over 'expert' x 'tensor' carries each rank's rows to the n = ep t folded ranks
    (n x min(k, e / n) rows a token padded, the routed rows alone with `how.ragged`); every folded rank runs its
    e / n experts on its received rows with `experts(rows [t, rows, d], group sizes [t, e / n])`, and the outputs
    go back the same way."""
    t, a, d = rows_gad.shape
    e = sizes_ge.shape[1]
    n = ep * t
    bound = dropless_bound(a // k, k, e, n)
    # the group sizes travel with the rows (as floats: the all-to-all's custom VJP wants a differentiable type)
    counts = folded_all_to_all(sizes_ge.reshape(t, n, e // n).astype(jnp.float32)).astype(jnp.int32)
    if how.ragged:
        return _ragged_exchange(rows_gad, sizes_ge, counts, n, bound, how.buffer_factor, experts, True)
    send, src, valid = jax.vmap(lambda r, s: _pack(r, s, n, bound))(rows_gad, sizes_ge)
    recv = folded_all_to_all(send).reshape(t, n * bound, d)
    order = jax.vmap(lambda c: _regroup(c, jnp.arange(n) * bound, n * bound))(counts)
    rows_in = jax.vmap(_take)(recv, order)
    out = jax.vmap(_unsort)(experts(rows_in, jnp.sum(counts, axis=1)), order)
    back = folded_all_to_all(out.reshape(t, n, bound, -1))
    return jax.vmap(lambda b, s, v: _unpack(b, s, v, a))(back, src, valid), jnp.float32(0)
