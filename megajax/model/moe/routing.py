"""Routing: a router's logits -> each token's k experts and their weights, and the losses and statistics of it.

Dimension letters as in megajax/model/layers.py, plus t tokens (b x s flattened), e experts, a routed assignments
(t k).

Routing runs in fp32 (`route`): softmax over the experts, then the top k, renormalised (Mixtral; kept as they are
with model.moe_router_pre_softmax, Qwen-MoE), or DeepSeek-V3's sigmoid scores, group-limited top k and scaled
weights.

The load-balancing loss (Switch / GShard: E sum_e f_e P_e, f_e the fraction of assignments to expert e, P_e
its mean routing probability) and the router z-loss enter the gradient where they are computed, without
threading a second loss through the layer scan and the pipeline (Megatron's MoEAuxLossAutoScaler):
`attach_loss` is the identity on the layer output whose backward gives the loss the gradient it would get as a
term of the training objective. The objective is seed x (summed token losses), so a micro batch of T tokens
adds coef x T x loss: the token-weighted mean over micro batches, times coef, on top of the mean token loss.
The seed reaches the layer with the micro batch's side inputs (`Side.objective_scale`).

The step's routing statistics leave the layer through the backward as well (`STATS`, `report`, `step_stats`),
and with model.moe_router_bias_update_rate they move each layer's routing bias after the step
(`update_router_bias`, DeepSeek-V3's auxiliary-loss-free balancing).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from megajax.config import ModelConfig
from megajax.parallel.step_plan import vary, varying_axes


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


def load_balancing_loss(probs_te: jax.Array, ids_tk: jax.Array, context: int = 1) -> jax.Array:
    """Switch / GShard: E sum_e f_e P_e (1 when perfectly balanced). With context parallelism (`context` ranks,
    each holding part of every sequence) the assignments and probabilities are summed over 'context' first, so
    that a sequence's tokens are balanced together, as on one device."""
    e = probs_te.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(ids_tk, e, dtype=jnp.float32), axis=(0, 1))
    probs = jnp.sum(probs_te, axis=0)
    if context > 1:
        counts, probs = jax.lax.psum((counts, probs), "context")
    return e * jnp.sum(counts / (ids_tk.size * context) * probs / (probs_te.shape[0] * context))


def z_loss(logits_te: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): mean of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(logits_te, axis=-1) ** 2)


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
# state variable STATS (megajax/model/model_state.py) that its forward never reads, and `report` gives it the
# gradient `stats` (not scaled by the seed). The layer scan, the pipeline and the data reduction sum these over
# layers' micro batches and ranks as they sum every gradient; after the step `step_stats` reads them, and the
# variable stays zero. Per layer: routed assignments per expert [e], then balancing loss x tokens, tokens,
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


def step_stats(grads, num_experts: int, drops: bool) -> tuple[dict, dict]:
    """(the step's metrics, each MoE module's assignments per expert [..., e] by its path) from the gradients of
    the STATS variables (any tree holding them): `moe_aux_loss` (the balancing loss, token mean, unscaled),
    `moe_load_imbalance` (per layer, max over mean assignments per expert over the whole step, averaged over layers)
    and, where the layout `drops` assignments (Config.drops_tokens), `moe_dropped_fraction` (of all assignments)."""
    found, loads = [], {}

    def take(path, g):
        if _named(path, STATS):
            loads[path[:-1]] = g[..., :num_experts]
            found.append(g.reshape(-1, num_experts + 3))

    jax.tree_util.tree_map_with_path(take, grads)
    if not found:
        return {}, loads
    rows = jnp.concatenate(found)
    counts = rows[:, :num_experts]
    out = {"moe_aux_loss": jnp.sum(rows[:, num_experts]) / jnp.maximum(jnp.sum(rows[:, num_experts + 1]), 1.0),
           "moe_load_imbalance": jnp.mean(jnp.max(counts, axis=1) / jnp.maximum(jnp.mean(counts, axis=1), 1e-9))}
    if drops:
        out["moe_dropped_fraction"] = jnp.sum(rows[:, num_experts + 2]) / jnp.maximum(jnp.sum(counts), 1.0)
    return out, loads


def update_router_bias(state, loads: dict, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every layer's routing bias moves by `rate`
    towards the experts that got fewer assignments than the mean in that step, away from those that got more."""

    def move(path, p):
        if not _named(path, ROUTER_BIAS):
            return p
        load = loads[path[:-1]]
        return p + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)

    return jax.tree_util.tree_map_with_path(move, state)
