"""Mixture of experts: a router sends each token to k of E expert MLPs (Mixtral / DeepSeek style).

Dimension letters as in layers.py, plus t tokens (b x s flattened), e experts, a routed assignments (t k).

Routing runs in fp32 (`route`): softmax over the experts, then the top k, renormalised (Mixtral; kept as they are
with model.moe_router_pre_softmax, Qwen-MoE), or DeepSeek-V3's sigmoid scores, group-limited top k and scaled
weights. The t k assignments are sorted by expert (within an expert in token
order, or by descending weight for the "probs" drop policy). Dropless (no capacity factor), each expert's matmuls
run on its rows only: the Pallas grouped GEMM of kernels/grouped_matmul.py where the step is compiled for a GPU,
`jax.lax.ragged_dot` over the groups on CPU (`model.moe_grouped_gemm` forces one of them). With `moe_capacity_factor`, each expert takes at most `capacity` rows into an [e, c,
d] buffer for batched matmuls, per rank and micro batch, as Megatron's `--moe-token-drop-policy`
(`model.moe_token_drop_policy`): "probs" keeps the assignments with the largest routing weights (ties in token
order), "position" the first ones in token order; a dropped assignment contributes nothing (the token keeps its
other experts' outputs, weights not renormalised). Then the outputs are unsorted and combined with the routing
weights.

With expert parallelism the experts live on the 'expert' ranks and the rows are exchanged by all-to-all; each
expert's width is split over 'tensor' like the dense MLP's, every tensor rank routing the whole gathered sequence.
With folded experts (parallel.expert_tensor=1, `exchange`) every expert is whole on one of the 'expert' x
'tensor' ranks: the tokens are routed in g groups, one per tensor rank's sequence shard (capacity and drops per
group, as Megatron's per-rank router), and one all-to-all over both axes carries the capacity buffers
(`exchange_folded`) or, dropless, each group's rows in fixed-size blocks (`exchange_folded_dropless`), which every
rank runs through its whole experts block by block (`expert_mlps`). Dropless, parallel.expert_all_to_all=ragged
sends the routed rows alone (`ragged_move`: XLA's ragged all-to-all, emulated on CPU), each rank's received
rows packed by source into a buffer of the most it can get, or with parallel.expert_buffer_factor of that factor
times one rank's routed rows (`ragged_plan`: what does not fit is not sent, and counts as dropped).

The load-balancing loss (Switch / GShard: E sum_e f_e P_e, f_e the fraction of assignments to expert e, P_e
its mean routing probability) and the router z-loss enter the gradient where they are computed, without
threading a second loss through the layer scan and the pipeline (Megatron's MoEAuxLossAutoScaler):
`attach_loss` is the identity on the layer output whose backward gives the loss the gradient it would get as a
term of the training objective. The objective is seed x (summed token losses), so a micro batch of T tokens
adds coef x T x loss: the token-weighted mean over micro batches, times coef, on top of the mean token loss.
The seed reaches the layer with the micro batch's side inputs (`Side.objective_scale`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.config import ModelConfig
from megajax.kernels.grouped_matmul import group_of_rows, grouped_matmul
from megajax.model import fp8
from megajax.model.layers import MLP, RESIDUAL, fp8_state, gather_sequence, param
from megajax import step_plan
from megajax.sharding import FOLDED, constrain, current_manual_axes, tensor_manual, vary, varying_axes


class Exchange(NamedTuple):
    """How the experts' rows cross the devices (parallel.expert_tensor, parallel.expert_all_to_all)."""

    folded: bool = False  # whole experts spread over 'expert' x 'tensor'
    ragged: bool = False  # dropless rows by exact counts, not fixed-size blocks
    buffer_factor: float | None = None  # ragged: receive at most this times a rank's routed rows (null: the most)


def _exchange() -> Exchange:
    """The experts' exchange of the step plan in force (step_plan.use; none outside a step)."""
    plan = step_plan.in_force()
    return Exchange(plan.moe_folds > 1, plan.moe_ragged, plan.moe_buffer_factor)


def folds() -> int:
    """The tensor ranks that route their own sequence shards and hold whole experts (parallel.expert_tensor=1):
    the step plan's moe_folds, outside a region that makes 'tensor' manual, else 1."""
    return 1 if "tensor" in current_manual_axes() else step_plan.in_force().moe_folds


@jax.custom_vjp
def attach_loss(y: jax.Array, loss: jax.Array, scale: jax.Array) -> jax.Array:
    """y, unchanged; in the backward, `loss` gets the gradient `scale` (as if scale x loss were added to the
    objective) and y's cotangent passes through."""
    return y


def _attach_fwd(y, loss, scale):
    # the loss's cotangent, typed like the loss (varying over the manual axes it varies over)
    return y, scale.astype(loss.dtype) * jnp.ones_like(loss)


def _attach_bwd(loss_cotangent, dy):
    return dy, loss_cotangent, None


attach_loss.defvjp(_attach_fwd, _attach_bwd)

# The step's routing statistics leave the layer the same way, through the backward: each MoE layer has a zero
# parameter STATS that its forward never reads, and `report` gives it the gradient `stats` (not scaled by the
# seed). The layer scan, the pipeline and the data reduction sum these over layers' micro batches and ranks
# as they sum every gradient; the train step takes them out (`step_stats`) before the optimizer, so the
# parameter stays zero. Per layer: routed assignments per expert [e], then balancing loss x tokens, tokens,
# dropped assignments.
STATS = "moe_stats"
ROUTER_BIAS = "router_bias"  # with model.moe_router_bias_update_rate: moved by the load, not by the optimizer


@jax.custom_vjp
def report(y: jax.Array, probe: jax.Array, stats: jax.Array) -> jax.Array:
    """y, unchanged; in the backward, `probe` gets the gradient `stats`."""
    return y


def _report_fwd(y, probe, stats):
    return y, vary(stats.astype(probe.dtype), tuple(varying_axes(probe)))


def _report_bwd(stats, dy):
    return dy, stats, None


report.defvjp(_report_fwd, _report_bwd)


def _named(path, name: str) -> bool:
    """Whether a pytree path (jax.tree_util) ends at the key `name`."""
    return getattr(path[-1], "key", None) == name


def step_stats(grads, num_experts: int, drops: bool) -> tuple[object, dict, dict]:
    """(grads with every STATS gradient zeroed, the step's metrics, each MoE module's assignments per expert
    [..., e] by its path): `moe_aux_loss` (the balancing loss, token mean, unscaled), `moe_load_imbalance` (per
    layer, max over mean assignments per expert over the whole step, averaged over layers) and, where the layout
    `drops` assignments (Config.drops_tokens), `moe_dropped_fraction` (of all assignments)."""
    found, loads = [], {}

    def take(path, g):
        if not _named(path, STATS):
            return g
        g_stats = g[..., :num_experts + 3]  # the distributed optimizer pads this dim
        loads[path[:-1]] = g_stats[..., :num_experts]
        found.append(g_stats.reshape(-1, num_experts + 3))
        return jnp.zeros_like(g)

    grads = jax.tree_util.tree_map_with_path(take, grads)
    if not found:
        return grads, {}, loads
    rows = jnp.concatenate(found)
    counts = rows[:, :num_experts]
    out = {"moe_aux_loss": jnp.sum(rows[:, num_experts]) / jnp.maximum(jnp.sum(rows[:, num_experts + 1]), 1.0),
           "moe_load_imbalance": jnp.mean(jnp.max(counts, axis=1) / jnp.maximum(jnp.mean(counts, axis=1), 1e-9))}
    if drops:
        out["moe_dropped_fraction"] = jnp.sum(rows[:, num_experts + 2]) / jnp.maximum(jnp.sum(counts), 1.0)
    return grads, out, loads


def update_router_bias(params, loads: dict, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every layer's routing bias moves by `rate`
    towards the experts that got fewer assignments than the mean in that step, away from those that got more."""

    def move(path, p):
        if not _named(path, ROUTER_BIAS):
            return p
        load = loads[path[:-1]]
        return p + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)

    return jax.tree_util.tree_map_with_path(move, params)


class Routing(NamedTuple):
    """How `route` turns logits into the k experts and their weights (model.moe_router_*)."""

    k: int
    renormalize: bool = True  # the k weights divided by their sum (softmax: Mixtral's; sigmoid: when k > 1)
    score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    groups: int = 1  # group-limited routing: the experts in this many groups ..
    group_k: int = 1  # .. of which each token takes its experts from this many
    scale: float = 1.0  # the weights times this (DeepSeek's routed_scaling_factor)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        sigmoid = cfg.moe_router_score_function == "sigmoid"
        return cls(cfg.experts_per_token, (cfg.experts_per_token > 1) if sigmoid else not cfg.moe_router_pre_softmax,
                   cfg.moe_router_score_function, cfg.moe_router_num_groups or 1, cfg.moe_router_group_topk or 1,
                   cfg.moe_router_topk_scaling_factor or 1.0)


def route(logits_te: jax.Array, how: Routing,
          bias_e: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 logits [t, e] -> (weights [t, k], expert ids [t, k], probabilities [t, e] for the balancing loss).

    Scores are the softmax over the experts (Mixtral) or each expert's sigmoid (DeepSeek-V3). The weights are the
    k largest scores, renormalised to sum to 1 (Mixtral; Megatron's default, a softmax over the k logits; with
    sigmoid scores when k > 1, as Megatron and DeepSeek-V3) or with `renormalize` off as they are (Qwen-MoE;
    Megatron's moe_router_pre_softmax), times `scale`. With `bias_e` (DeepSeek-V3's auxiliary-loss-free
    balancing) the k experts are chosen by score + bias, and weighted by their scores alone: the bias steers the
    choice and gets no gradient. Group-limited (DeepSeek's node-limited routing, Megatron's
    --moe-router-num-groups): a group's merit is the sum of its best k / group_k choice scores, and the k experts
    are chosen within the group_k best groups. The balancing loss sees the sigmoid scores normalised over the
    experts, as Megatron's."""
    if how.score == "sigmoid":
        scores = jax.nn.sigmoid(logits_te)
        probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    else:
        scores = probs = jax.nn.softmax(logits_te, axis=-1)
    choice = scores if bias_e is None else scores + jax.lax.stop_gradient(bias_e)
    if how.groups > 1:
        t, e = choice.shape
        per_group = choice.reshape(t, how.groups, e // how.groups)
        merit = jnp.sum(jax.lax.top_k(per_group, how.k // how.group_k)[0], axis=-1)  # [t, groups]
        _, best = jax.lax.top_k(merit, how.group_k)
        kept = jnp.any(best[:, :, None] == jnp.arange(how.groups), axis=1)  # [t, groups]
        choice = jnp.where(jnp.repeat(kept, e // how.groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), how.k)
    top = jnp.take_along_axis(scores, ids, axis=-1)
    if how.renormalize:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + (1e-20 if how.score == "sigmoid" else 0.0))
    return top * how.scale if how.scale != 1.0 else top, ids, probs


def load_balancing_loss(probs_te: jax.Array, ids_tk: jax.Array) -> jax.Array:
    """Switch / GShard: E sum_e f_e P_e (1 when perfectly balanced)."""
    e = probs_te.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(ids_tk, e, dtype=jnp.float32), axis=(0, 1))
    return e * jnp.sum(counts / ids_tk.size * jnp.mean(probs_te, axis=0))


def z_loss(logits_te: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): mean of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(logits_te, axis=-1) ** 2)


def capacity(tokens: int, k: int, e: int, factor: float) -> int:
    """Rows an expert takes with a capacity factor: factor x its even share of the t k assignments (at least 1).
    Per rank and micro batch (Megatron's per-rank dropping): t is the tokens this rank routes."""
    return max(1, math.ceil(tokens * k / e * factor))


def dispatch(x_td: jax.Array, ids_tk: jax.Array, e: int,
             weights_tk: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sorts the t k assignments by expert: (rows [a, d] grouped by expert, group sizes [e], the order a
    sorted position came from, to unsort). Within an expert in token order, or with weights_tk by descending
    weight (ties in token order)."""
    flat = ids_tk.reshape(-1)
    if weights_tk is None:
        order = jnp.argsort(flat, stable=True)
    else:
        order = jnp.lexsort((-weights_tk.reshape(-1), flat))  # (stable: ties keep token order)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    return x_td[order // ids_tk.shape[1]], sizes, order


def combine(y_ad: jax.Array, order: jax.Array, weights_tk: jax.Array) -> jax.Array:
    """Unsorts the experts' outputs and sums each token's k of them with its routing weights: [t, d]."""
    t, k = weights_tk.shape
    unsorted = jnp.zeros_like(y_ad).at[order].set(y_ad)
    return jnp.einsum("tkd,tk->td", unsorted.reshape(t, k, -1), weights_tk.astype(y_ad.dtype))


def expert_parallel_size() -> int:
    """The expert-parallel ranks this layer exchanges tokens with: the step plan's 'expert' size (manual in the
    step's region), 1 outside a step (under GSPMD the expert-sharded weights are used as global arrays)."""
    return step_plan.in_force().expert


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
    """dispatch's rows [a, d] -> (capacity buffers [e, c, d], each row's expert, slot and whether it was kept):
    an expert takes its first c rows in dispatch's order, the rest are dropped."""
    e = sizes_e.shape[0]
    expert = jnp.sort(ids_tk.reshape(-1))
    pos = jnp.arange(rows_ad.shape[0]) - (jnp.cumsum(sizes_e) - sizes_e)[expert]
    keep = pos < c
    slot = jnp.where(keep, pos, c)  # out of range: dropped by the scatter
    buf = jnp.zeros((e, c, rows_ad.shape[1]), rows_ad.dtype).at[expert, slot].set(rows_ad, mode="drop")
    return buf, (expert, slot, keep)


def from_buffers(buf_ecd: jax.Array, placed) -> jax.Array:
    """The experts' outputs [e, c, d'] back to to_buffers' rows [a, d'] (a dropped row gets zeros)."""
    expert, slot, keep = placed
    return buf_ecd[expert, jnp.minimum(slot, buf_ecd.shape[1] - 1)] * keep[:, None].astype(buf_ecd.dtype)


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
    return jnp.where(valid[..., None], rows_ad[jnp.minimum(src, a - 1)], 0), src, valid


def _regroup(counts_se: jax.Array, off_s: jax.Array, rows: int) -> jax.Array:
    """The received rows' group sizes [source rank, local expert] and where each source's rows start (ascending)
    -> the order [rows] that sorts the received rows by local expert (each expert's rows in source rank order;
    rows in no group last)."""
    p = jnp.arange(rows)
    src = jnp.sum(p[:, None] >= off_s[None, 1:], axis=1)
    local = jnp.sum((p - off_s[src])[:, None] >= jnp.cumsum(counts_se, axis=1)[src], axis=-1)  # el: no group
    return jnp.argsort(local, stable=True)


def _unsort(out_nd: jax.Array, order: jax.Array) -> jax.Array:
    return jnp.zeros_like(out_nd).at[order].set(out_nd)


def _unpack(back_rbd: jax.Array, src: jax.Array, valid: jax.Array, a: int) -> jax.Array:
    """_pack's inverse for the experts' outputs [ranks, bound, d'] -> [a, d']."""
    return jnp.zeros((a, back_rbd.shape[-1]), back_rbd.dtype).at[jnp.where(valid, src, a)].set(back_rbd, mode="drop")


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
    return out.at[jnp.where(j < recv[:, None], at[:, None] + j, out.shape[0])].set(got, mode="drop")


def _ragged_all_to_all(*args, axes):
    """The ragged all-to-all where it exists (XLA:GPU), its emulation on CPU (chosen per lowering platform, so a
    CPU machine still compiles the real one for a GPU target)."""
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(_emulated_ragged_all_to_all, axes=axes),
        default=lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axes))


def _move_fn(x, send_off, send_n, dest_off, recv_off, recv_n, rows_out: int, back: bool,
             folded: bool) -> jax.Array:
    """`ragged_move` without its VJP. Folded: x's leading dim (one block per tensor rank) is split over 'tensor' in
    a nested manual region, and the ranks are 'expert' x 'tensor'."""

    def one(x, send_off, send_n, dest_off, recv_off, recv_n, axes):
        if back:  # the rows received from s (recv_n[s] from recv_off[s]) back to where s sent them from
            args = (recv_off, recv_n, _all_to_all(send_off, axes), send_n)
        else:
            args = (send_off, send_n, dest_off, recv_n)
        out = jnp.zeros((rows_out, *x.shape[1:]), x.dtype)
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
    rows_in, sizes_in = jnp.take_along_axis(recv, order[..., None], axis=1), jnp.sum(kept, axis=1)
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
    out = _unsort(experts(recv[order], jnp.sum(counts, axis=0)), order)
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
    rows_in = jnp.take_along_axis(recv, order[..., None], axis=1)
    out = jax.vmap(_unsort)(experts(rows_in, jnp.sum(counts, axis=1)), order)
    back = folded_all_to_all(out.reshape(t, n, bound, -1))
    return jax.vmap(lambda b, s, v: _unpack(b, s, v, a))(back, src, valid), jnp.float32(0)


def expert_mlps(cfg: ModelConfig, w: dict, meta, lead: str | None, xs: jax.Array,
                sizes: jax.Array | None = None) -> jax.Array:
    """The el experts' MLPs (weights `w` [el, ...] by name) on their rows: buffers [el, rows, d] (batched matmuls),
    or with `sizes` [el] rows [n, d] grouped by expert (ragged matmuls; rows past the groups are padding). Folded
    experts (lead "folded_expert") take ragged rows in blocks, one per tensor rank: [g, n, d] with sizes
    [g, el / g], block r for the experts r el / g ... `meta(name)`: an FP8 operand's delayed-scaling state."""
    cdt = jnp.dtype(cfg.compute_dtype)
    el = next(iter(w.values())).shape[0]
    fmt = cfg.fp8
    meta = meta or (lambda name: None)
    if sizes is None:
        spec = "ecd,edf->ecf"

        def matmul(x, w, name):
            if fmt == "none":
                return jnp.einsum(spec, x, w)
            return fp8.einsum(spec, fmt, cfg.fp8_margin, x, w, meta(name), True)  # scaled (and histories) by expert

        bias = lambda b_ef: b_ef[:, None]  # noqa: E731
    else:
        blocks = sizes.ndim - 1  # 1 with folded experts

        def pick(b_ef, sizes):  # each row's bias [n, f] (a padding row's index, e, is clamped: its output is unused)
            return b_ef[group_of_rows(sizes, xs.shape[-2])]

        def matmul(x, w, name):
            w = w.reshape(*sizes.shape, *w.shape[1:])  # folded: [g, el / g, ...], block r on tensor rank r
            a, z = ("mlp", "embed") if name == "w_out" else ("embed", "mlp")
            # the Pallas grouped GEMM, run per tensor shard (these names), or jax.lax.ragged_dot
            names = ((lead, None, a), (lead, None, a, z), (lead, None, z)) if blocks else (
                (None, a), ("expert", a, z), (None, z))
            m = meta(name) if fmt != "none" else None
            m = None if m is None else m.reshape(*sizes.shape, -1)  # delayed-scaling histories cut as the weights

            def product(grouped, x, w, sizes, m):
                if fmt != "none":
                    return fp8.ragged_dot(fmt, cfg.fp8_margin, x, w, sizes, m, grouped)
                if grouped:
                    return grouped_matmul(x, w, sizes, grouped)
                return jax.vmap(jax.lax.ragged_dot)(x, w, sizes) if blocks else jax.lax.ragged_dot(x, w, sizes)

            if cfg.moe_grouped_gemm is None:  # the grouped GEMM where XLA would lower ragged_dot to dense GEMMs
                return jax.lax.platform_dependent(x, w, sizes, m, cpu=functools.partial(product, None),
                                                  default=functools.partial(product, names))
            return product(names if cfg.moe_grouped_gemm else None, x, w, sizes, m)

        def bias(b_ef):  # folded: block by block (a gather from all [el, f] would gather every block's rows)
            return jax.vmap(pick)(b_ef.reshape(*sizes.shape, -1), sizes) if blocks else pick(b_ef, sizes)

    # The routed rows stay whole on every tensor rank and the expert width is split over 'tensor', as in the dense
    # MLP: the second matmul's partial sums are its one all-reduce (no permutes of rows). With folded experts each
    # rank holds whole experts and their rows (lead), the width not split.
    xs = constrain(xs, (lead,) + (None,) * (xs.ndim - 2) + ("embed",))
    if cfg.arch == "llama":
        w_gate_up = w["w_gate_up"]
        # gate and up interleaved as [..., f, 2]: with f split over 'tensor' each rank holds its own gate and up
        # columns, so the fused matmul's output splits into the two locally
        gate_up = matmul(xs, w_gate_up.reshape(el, w_gate_up.shape[1], -1).astype(cdt), "w_gate_up")
        gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
        hidden = nn.silu(gate_up[..., 0]) * gate_up[..., 1]
    else:
        hidden = nn.gelu(matmul(xs, w["w_in"].astype(cdt), "w_in") + bias(w["b_in"].astype(cdt)), approximate=True)
    hidden = constrain(hidden, (lead,) + (None,) * (hidden.ndim - 2) + ("mlp",))
    return matmul(hidden, w["w_out"].astype(cdt), "w_out")


def run_experts(x_gtd: jax.Array, ids_gtk: jax.Array, weights_gtk: jax.Array, cfg: ModelConfig, ep: int,
                experts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The routed tokens of g groups (x [g, t, d], expert ids and routing weights [g, t, k]) through `experts` and
    back, combined: (outputs [g, t, d], assignments per expert [e], dropped assignments). One group routes the
    whole sequence (rows to ep expert ranks); g > 1 groups are the tensor ranks' sequence shards with folded
    experts (rows to ep x g ranks). Dropless, or with a capacity per group."""
    e, k = cfg.num_experts, cfg.experts_per_token
    g, t, _ = x_gtd.shape
    by_weight = cfg.moe_capacity_factor is not None and cfg.moe_token_drop_policy == "probs"
    rows, sizes, order = jax.vmap(lambda x, i, w: dispatch(x, i, e, w if by_weight else None))(
        x_gtd, ids_gtk, weights_gtk)
    if cfg.moe_capacity_factor is None:  # dropless: each expert's rows, as many as were routed to it (or as fit
        # the ragged exchange's receiving buffer with parallel.expert_buffer_factor)
        if g > 1:
            out, dropped = exchange_folded_dropless(rows, sizes, k, ep, experts, _exchange())
        elif ep > 1:
            out, dropped = exchange_dropless(rows[0], sizes[0], k, ep, experts, _exchange())
            out = out[None]
        else:
            out, dropped = experts(rows[0], sizes[0])[None], jnp.float32(0)
    else:  # a capacity: [e, c, ...] buffers, the rows past c of an expert (in dispatch's order) dropped
        c = capacity(t, k, e, cfg.moe_capacity_factor)
        buf, placed = jax.vmap(lambda r, i, s: to_buffers(r, i, s, c))(rows, ids_gtk, sizes)
        if g > 1:
            buf = exchange_folded(buf, ep, experts)
        else:
            buf = (experts(buf[0]) if ep == 1 else exchange_capacity(buf[0], ep, experts))[None]
        out = jax.vmap(from_buffers)(buf, placed)
        dropped = jnp.sum(~placed[2]).astype(jnp.float32)
    return jax.vmap(combine)(out, order, weights_gtk), jnp.sum(sizes, axis=0), dropped


class MoE(nn.Module):
    """The MLP of an MoE layer: router, expert MLPs (GeLU for gpt2, SwiGLU for llama; dropless, or with a
    capacity), and `moe_shared_experts` always-on experts as one dense MLP of that many times the expert width
    (with `moe_shared_expert_gate`, scaled per token by sigmoid(x . shared_gate), Qwen-MoE's and Megatron's)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, objective_scale: jax.Array | None = None) -> jax.Array:
        """x [b, s, d] -> [b, s, d]. objective_scale (Side.objective_scale): in a loss whose gradient is taken
        with that cotangent seed, the auxiliary losses join the gradient at that scale; None: they do not."""
        cfg = self.cfg
        d, f, e, k = cfg.hidden_size, cfg.moe_ffn_size, cfg.num_experts, cfg.experts_per_token
        pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        # With folded experts each tensor rank routes its own sequence shard (group r: rank r's tokens), else the
        # sequence is gathered and every tensor rank routes all of it (one group).
        g = folds()
        x = x_bsd if g > 1 else gather_sequence(x_bsd)
        b, s, _ = x.shape

        def groups(a):  # [b, s, ...] -> [g, b s / g, ...]
            return a.reshape(b, g, s // g, *a.shape[2:]).swapaxes(0, 1).reshape(g, b * s // g, *a.shape[2:])

        x_gtd = constrain(groups(x), ("seq", None, "embed")) if g > 1 else groups(x)
        w_router = param(self, "router", (d, e), ("embed", None), cfg.init_std, pdt)
        logits = jnp.einsum("gtd,de->gte", x_gtd.astype(jnp.float32), w_router.astype(jnp.float32)).reshape(-1, e)
        bias = (param(self, ROUTER_BIAS, (e,), (None,), 0, jnp.float32)
                if cfg.moe_router_bias_update_rate else None)
        weights, ids, probs = route(logits, Routing.of(cfg), bias)

        # The expert weights: [e, ...], or inside the train step with expert parallelism this rank's e / ep.
        ep = expert_parallel_size()
        el = e // ep
        lead = "folded_expert" if g > 1 else None  # folded: the rows sharded like the experts they go to
        if cfg.arch == "llama":
            w = {"w_gate_up": param(self, "w_gate_up", (el, d, f, 2), ("expert", "embed", "mlp", None),
                                    cfg.init_std, pdt)}
        else:
            w = {"w_in": param(self, "w_in", (el, d, f), ("expert", "embed", "mlp"), cfg.init_std, pdt),
                 "b_in": param(self, "b_in", (el, f), ("expert", "mlp"), 0, pdt)}
        w["w_out"] = param(self, "w_out", (el, f, d), ("expert", "mlp", "embed"), out_std, pdt)

        delayed = cfg.fp8 != "none" and cfg.fp8_recipe == "delayed"
        experts = functools.partial(expert_mlps, cfg, w, (lambda name: fp8_state(self, name, el)) if delayed else None,
                                    lead)

        y, sizes, dropped = run_experts(x_gtd, ids.reshape(g, -1, k), weights.reshape(g, -1, k), cfg, ep, experts)
        y = y.reshape(g, b, s // g, d).swapaxes(0, 1)  # group r back to sequence shard r
        if cfg.arch == "gpt2":
            y = y + param(self, "b_out", (d,), ("embed",), 0, pdt).astype(cdt)
        y = constrain(y.reshape(b, s, d), RESIDUAL)
        if cfg.moe_shared_experts:
            shared_cfg = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_experts * f, num_experts=0)
            shared = MLP(shared_cfg, name="shared")(x_bsd)
            if cfg.moe_shared_expert_gate:  # one sigmoid per token, on the residual's (sequence) shard
                w_gate = param(self, "shared_gate", (d,), ("embed",), cfg.init_std, pdt)
                gate = jax.nn.sigmoid(jnp.einsum("bsd,d->bs", x_bsd.astype(jnp.float32), w_gate.astype(jnp.float32)))
                shared = shared * gate[..., None].astype(shared.dtype)
            y = y + shared
        balance = load_balancing_loss(probs, ids)
        if objective_scale is not None:
            y = attach_loss(y, cfg.moe_aux_loss_coef * balance + cfg.moe_z_loss_coef * z_loss(logits),
                            objective_scale * (b * s))
        probe = param(self, STATS, (e + 3,), (None,), 0, jnp.float32)
        tokens = jnp.float32(b * s)
        stats = jnp.concatenate([sizes.astype(jnp.float32), jnp.stack([balance * tokens, tokens, dropped])])
        return report(y, probe, stats)
