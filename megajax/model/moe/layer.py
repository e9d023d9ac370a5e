"""The MoE layer: the router, the expert MLPs on their routed rows and the shared experts (`MoE`).

Dimension letters as in megajax/model/layers.py, plus t tokens (b x s flattened), e experts, a routed assignments
(t k).

`MoE` routes its tokens (routing.py), sends them through the experts and back (`run_experts`, by the exchanges
of exchange.py), adds the always-on shared experts, and attaches the auxiliary losses and routing statistics to
the gradient (routing.py's `attach_loss` and `report`). Dropless, each expert's matmuls run on its rows only
(`expert_mlps`): the Pallas grouped GEMM of kernels/grouped_matmul.py where the step is compiled for a GPU,
`jax.lax.ragged_dot` over the groups on CPU (`model.moe_grouped_gemm` forces one of them); with a capacity,
batched matmuls over the [e, c, d] buffers. Under context parallelism a capacity's drops are decided on the whole
sequences (`kept_in_sequences`) and the kept rows run as dropless ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.config import ModelConfig
from megajax.kernels.grouped_matmul import group_of_rows, grouped_matmul
from megajax.model import context, fp8, fp8_blockwise
from megajax.model.layers import MLP, RESIDUAL, fp8_state, gather_sequence, gelu, param, swiglu
from megajax.model.moe.exchange import (capacity, combine, dispatch, exchange_capacity, exchange_dropless,
                                        exchange_folded, exchange_folded_dropless, exchange_in_force,
                                        expert_parallel_size, folds, from_buffers, kept, to_buffers)
from megajax.model.moe.routing import (ROUTER_BIAS, STATS, Routing, attach_loss, load_balancing_loss, report, route,
                                       z_loss)
from megajax.model.recipe import recipe
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain


def expert_mlps(cfg: ModelConfig, w: dict, meta, lead: str | None, xs: jax.Array,
                sizes: jax.Array | None = None) -> jax.Array:
    """The el experts' MLPs (weights `w` [el, ...] by name) on their rows: buffers [el, rows, d] (batched matmuls),
    or with `sizes` [el] rows [n, d] grouped by expert (ragged matmuls; rows past the groups are padding). Folded
    experts (lead "folded_expert") take ragged rows in blocks, one per tensor rank: [g, n, d] with sizes
    [g, el / g], block r for the experts r el / g ... `meta(name)`: an FP8 operand's delayed-scaling state."""
    cdt = jnp.dtype(cfg.compute_dtype)
    el = next(iter(w.values())).shape[0]
    fmt = "none" if cfg.fp8 == "none" else ("blockwise" if cfg.fp8_recipe == "blockwise" else cfg.fp8)
    meta = meta or (lambda name: None)

    def io_names(name):  # the logical names of a matmul's input and output dims: (embed, mlp) or (mlp, embed)
        return ("mlp", "embed") if name == "w_out" else ("embed", "mlp")

    if sizes is None:
        spec = "ecd,edf->ecf"

        def matmul(x, w, name):
            if fmt == "none":
                return jnp.einsum(spec, x, w)
            if fmt == "blockwise":  # each buffer a block of one expert's c rows
                a, z = io_names(name)
                sizes = jnp.full((el, 1), x.shape[1], jnp.int32)
                names = ((lead, None, a), (lead, None, a, z), (lead, None, z))
                return fp8_blockwise.block_ragged_dot(cfg.fp8_block, names, x, w[:, None], sizes)
            return fp8.einsum(spec, fmt, cfg.fp8_margin, x, w, meta(name), True)  # scaled (and histories) by expert

        bias = lambda b_ef: b_ef[:, None]  # noqa: E731
    else:
        blocks = sizes.ndim - 1  # 1 with folded experts

        def pick(b_ef, sizes):  # each row's bias [n, f] (a padding row's index, e, is clamped: its output is unused)
            return b_ef[group_of_rows(sizes, xs.shape[-2])]

        def matmul(x, w, name):
            w = w.reshape(*sizes.shape, *w.shape[1:])  # folded: [g, el / g, ...], block r on tensor rank r
            a, z = io_names(name)
            # the Pallas grouped GEMM, run per tensor shard (these names), or jax.lax.ragged_dot
            names = ((lead, None, a), (lead, None, a, z), (lead, None, z)) if blocks else (
                (None, a), ("expert", a, z), (None, z))
            if fmt == "blockwise":  # the block-scaled grouped kernels (on CPU their references)
                return fp8_blockwise.block_ragged_dot(cfg.fp8_block, names, x, w, sizes)
            m = meta(name) if fmt != "none" else None
            m = None if m is None else m.reshape(*sizes.shape, -1)  # delayed-scaling histories cut as the weights

            def product(grouped, x, w, sizes, m):
                if fmt != "none":
                    return fp8.ragged_dot(fmt, cfg.fp8_margin, x, w, sizes, m, grouped)
                if grouped:
                    return grouped_matmul(x, w, sizes, grouped)
                return jax.vmap(jax.lax.ragged_dot)(x, w, sizes) if blocks else jax.lax.ragged_dot(x, w, sizes)

            if cfg.moe_grouped_gemm is None:  # the grouped GEMM where XLA would lower ragged_dot to dense GEMMs
                return step_plan.platform_dependent(x, w, sizes, m, cpu=functools.partial(product, None),
                                                    default=functools.partial(product, names))
            return product(names if cfg.moe_grouped_gemm else None, x, w, sizes, m)

        def bias(b_ef):  # folded: block by block (a gather from all [el, f] would gather every block's rows)
            return jax.vmap(pick)(b_ef.reshape(*sizes.shape, -1), sizes) if blocks else pick(b_ef, sizes)

    # The routed rows stay whole on every tensor rank and the expert width is split over 'tensor', as in the dense
    # MLP: the second matmul's partial sums are its one all-reduce (no permutes of rows). With folded experts each
    # rank holds whole experts and their rows (lead), the width not split.
    xs = constrain(xs, (lead,) + (None,) * (xs.ndim - 2) + ("embed",))
    if recipe(cfg).mlp == "swiglu":
        w_gate_up = w["w_gate_up"]
        # gate and up interleaved as [..., f, 2]: with f split over 'tensor' each rank holds its own gate and up
        # columns, so the fused matmul's output splits into the two locally
        gate_up = matmul(xs, w_gate_up.reshape(el, w_gate_up.shape[1], -1).astype(cdt), "w_gate_up")
        gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
        hidden = swiglu(gate_up, gate_up.ndim - 1)
    else:
        hidden = gelu(matmul(xs, w["w_in"].astype(cdt), "w_in") + bias(w["b_in"].astype(cdt)))
    hidden = constrain(hidden, (lead,) + (None,) * (hidden.ndim - 2) + ("mlp",))
    return matmul(hidden, w["w_out"].astype(cdt), "w_out")


def kept_in_sequences(ids_btk: jax.Array, weights_btk: jax.Array, cfg: ModelConfig) -> jax.Array:
    """With context parallelism, where each rank holds part of every sequence: which of this rank's assignments
    [b, 2h, k] one device's capacity keeps, decided on the whole sequences (every rank's expert ids, and routing
    weights for the "probs" policy, gathered over 'context' in token order; no gradient)."""
    e, k = cfg.num_experts, cfg.experts_per_token
    b, s = ids_btk.shape[0], ids_btk.shape[1] * context.size()
    by_weight = cfg.moe_token_drop_policy == "probs"
    ids = context.gather(ids_btk).reshape(b * s, k)
    weights = context.gather(jax.lax.stop_gradient(weights_btk)).reshape(b * s, k) if by_weight else None
    keep = kept(ids, e, capacity(b * s, k, e, cfg.moe_capacity_factor), weights)
    return context.split(keep.reshape(b, s, k))


def run_experts(x_gtd: jax.Array, ids_gtk: jax.Array, weights_gtk: jax.Array, cfg: ModelConfig, ep: int,
                experts, keep_gtk: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The routed tokens of g groups (x [g, t, d], expert ids and routing weights [g, t, k]) through `experts` and
    back, combined: (outputs [g, t, d], assignments per expert [e], dropped assignments). One group routes the
    whole sequence (rows to ep expert ranks); g > 1 groups are the tensor ranks' sequence shards with folded
    experts (rows to ep x g ranks). Dropless, or with a capacity per group; or with keep_gtk (a capacity decided
    over the whole sequences, `kept_in_sequences`) the kept assignments run as dropless rows and the others
    contribute nothing."""
    e, k = cfg.num_experts, cfg.experts_per_token
    g, t, _ = x_gtd.shape
    routed = None
    if keep_gtk is not None:  # a dropped assignment goes to no expert (id e: sorted last, in no group) at weight 0
        routed = jnp.bincount(ids_gtk.reshape(-1), length=e).astype(jnp.int32)
        ids_gtk, weights_gtk = jnp.where(keep_gtk, ids_gtk, e), jnp.where(keep_gtk, weights_gtk, 0)
    # (the order within an expert decides a capacity's drops; kept rows run dropless, in any order)
    by_weight = cfg.moe_capacity_factor is not None and cfg.moe_token_drop_policy == "probs" and keep_gtk is None
    rows, sizes, order = jax.vmap(lambda x, i, w: dispatch(x, i, e, w if by_weight else None))(
        x_gtd, ids_gtk, weights_gtk)
    if cfg.moe_capacity_factor is None or keep_gtk is not None:  # dropless: each expert's rows, as many as were
        # routed to it (or as fit the ragged exchange's receiving buffer with parallel.expert_buffer_factor)
        if g > 1:
            out, dropped = exchange_folded_dropless(rows, sizes, k, ep, experts, exchange_in_force())
        elif ep > 1:
            out, dropped = exchange_dropless(rows[0], sizes[0], k, ep, experts, exchange_in_force())
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
    if keep_gtk is not None:  # (the assignments routed to each expert, kept or not, as a capacity counts them)
        sizes, dropped = routed[None], dropped + jnp.sum(~keep_gtk).astype(jnp.float32)
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
        if recipe(cfg).mlp == "swiglu":
            w = {"w_gate_up": param(self, "w_gate_up", (el, d, f, 2), ("expert", "embed", "mlp", None),
                                    cfg.init_std, pdt)}
        else:
            w = {"w_in": param(self, "w_in", (el, d, f), ("expert", "embed", "mlp"), cfg.init_std, pdt),
                 "b_in": param(self, "b_in", (el, f), ("expert", "mlp"), 0, pdt)}
        w["w_out"] = param(self, "w_out", (el, f, d), ("expert", "mlp", "embed"), out_std, pdt)

        state = (lambda name: fp8_state(self, name, el)) if fp8.delays(cfg) else None
        experts = functools.partial(expert_mlps, cfg, w, state, lead)

        keep = None
        if cfg.moe_capacity_factor is not None and context.size() > 1:  # (folded too: the whole sequences decide)
            keep = kept_in_sequences(ids.reshape(b, s, k), weights.reshape(b, s, k), cfg).reshape(g, -1, k)
        y, sizes, dropped = run_experts(x_gtd, ids.reshape(g, -1, k), weights.reshape(g, -1, k), cfg, ep, experts,
                                        keep)
        y = y.reshape(g, b, s // g, d).swapaxes(0, 1)  # group r back to sequence shard r
        if recipe(cfg).bias:
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
        balance = load_balancing_loss(probs, ids, step_plan.in_force().context)
        if objective_scale is not None:
            y = attach_loss(y, cfg.moe_aux_loss_coef * balance + cfg.moe_z_loss_coef * z_loss(logits),
                            objective_scale * (b * s))
        probe = param(self, STATS, (e + 3,), (None,), 0, jnp.float32)
        tokens = jnp.float32(b * s)
        stats = jnp.concatenate([sizes.astype(jnp.float32), jnp.stack([balance * tokens, tokens, dropped])])
        return report(y, probe, stats)
