"""GPipe and evaluation: the forward-only pipeline `_forward_rounds`, in which each local chunk's round streams
the micro batches through the p ranks, one tick per hop. GPipe's gradients (`gpipe_grads`, which
executor.pipeline_grads calls for the "gpipe" schedule) are autodiff of it, stashing every tick's residuals: memory
grows with m, the simple baseline. Evaluation (`pipeline_loss`) runs the same rounds without gradients. Both run
inside the train step's shard_map, like executor.pipeline_grads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megajax import model
from megajax.config import Config
from megajax.parallel import step_plan
from megajax.parallel.pipeline import layout, vocab
from megajax.parallel.pipeline.chunks import shared_params, run_slots
from megajax.parallel.pipeline.layout import local_chunks
from megajax.parallel.pipeline.schedule import perm_pairs
from megajax.parallel.sharding import CollectiveOrder, micro_batches
from megajax.parallel.step_plan import vary


def gpipe_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """GPipe: every forward (`_forward_rounds`), then autodiff runs the backward, stashing every tick's
    residuals (memory grows with m: the simple baseline)."""
    mbs = vary(micro_batches(batch, step_plan.in_force().micro_batches))

    def loss_fn(layers, shared):
        loss = _forward_rounds(cfg, local_chunks(layers), shared, mbs, train=True, objective_scale=seed_scale)
        return loss * seed_scale, loss

    layers = vary(params["layers"])
    shared = shared_params(params)
    (g_layers, g_shared), loss = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(layers, shared)
    grads = vocab.sum_shared(g_shared, step_plan.in_force().vocab_over_pipeline)
    grads["layers"] = g_layers
    return jax.lax.psum(loss, "pipeline"), grads


def pipeline_loss(cfg: Config, params: dict, batch: dict) -> jax.Array:
    """Forward only (evaluation): the summed token loss of this data rank's rows, run through the
    pipeline without gathering the layers. Inside the train step's shard_map, like `executor.pipeline_grads`."""
    layers = vary(local_chunks(params["layers"]))
    shared = shared_params(params)
    loss = _forward_rounds(cfg, layers, shared, vary(micro_batches(batch, step_plan.in_force().micro_batches)),
                           train=False)
    return jax.lax.psum(loss, "pipeline")


def _forward_rounds(cfg: Config, layers, shared, mbs, train: bool, objective_scale=None) -> jax.Array:
    """The forward pipeline: for each local chunk i in turn (a "round"), the micro batches flow GPipe-style
    through the p ranks, one tick per hop; rank 0 keeps what comes back around the ring from rank p - 1 as
    the input of the next round. Returns this rank's part of the summed token loss (rank p - 1 holds it).
    layers: this rank's chunks [v, Lc, ...]; mbs: micro batches [m, mb, ...]; train: dropout on; objective_scale:
    the seed of the loss being differentiated (Side.objective_scale)."""
    plan, mcfg = step_plan.in_force(), cfg.model
    p, v, m = plan.pipeline, plan.virtual_stages, plan.micro_batches
    rank = jax.lax.axis_index("pipeline")
    lc = jax.tree.leaves(layers)[0].shape[1]
    split = plan.stage_split
    starts, units = (jnp.asarray(a) for a in layout.chunk_tables(split, p))
    shape = (*mbs["tokens"].shape[1:], mcfg.hidden_size)
    dtype = jnp.dtype(mcfg.compute_dtype)
    returned = vary(jnp.zeros((m, *shape), dtype)) if v > 1 else None  # rank 0: the last round's outputs
    loss = vary(jnp.zeros((), jnp.float32))
    for i in range(v):
        w = jax.tree.map(lambda x: x[i], layers)

        def tick(carry, t, w=w, i=i):
            x_in, returned, loss = carry
            k = t - rank  # the micro batch this rank works on
            active = (k >= 0) & (k < m)
            at = lambda j: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, jnp.clip(j, 0, m - 1),  # noqa: E731
                                                                                keepdims=False), mbs)
            mb = at(k)
            side = model.side_inputs(mcfg, cfg.train.seed, mb, dropout=train, objective_scale=objective_scale)
            order = CollectiveOrder()  # (each conditional and the send waits for the one before: CPU runtime)
            if i == 0 and plan.vocab_over_pipeline:  # every rank looks up rank 0's micro batch t (vocab.py)
                rows = order.cond(t < m, lambda: vocab.rows(mcfg, shared, at(t)["tokens"]),
                                  lambda: vary(jnp.zeros(shape, dtype)))
                embed = lambda: vocab.embed_apply(mcfg, shared, rows, mb["tokens"], side)  # noqa: E731
            elif i == 0:
                embed = lambda: model.embed_apply(mcfg, shared, mb["tokens"], side)  # noqa: E731
            if i == 0:
                first = lambda: vary(embed().astype(dtype))  # noqa: E731
            else:  # the micro batch that came back around the ring
                first = lambda: jax.lax.dynamic_index_in_dim(returned, jnp.clip(k, 0, m - 1),  # noqa: E731
                                                             keepdims=False)
            x = order.cond(rank == 0, first, lambda: x_in)

            def run(x=x, side=side, w=w, i=i):
                if split.even:
                    return model.layers_apply(mcfg, w, x, side, (i * p + rank) * lc).astype(dtype)
                slot = jnp.arange(lc)  # the empty slots run nothing; full recompute as model.LayerStack's
                return run_slots(mcfg, w, x, side, starts[i, rank] + slot, slot < units[i, rank],
                                 recompute=True).astype(dtype)

            y = order.cond(active, run, lambda: x)
            if i == v - 1 and plan.vocab_over_pipeline:  # every rank's slice of rank p - 1's head (vocab.py)
                last = t - (p - 1)
                head_mb = at(last)
                head_side = model.side_inputs(mcfg, cfg.train.seed, head_mb, dropout=train,
                                              objective_scale=objective_scale)
                loss = loss + order.cond((last >= 0) & (last < m),
                                         lambda: vary(vocab.head_loss(mcfg, shared, vocab.broadcast(y, p - 1),
                                                                      head_mb, head_side)),
                                         lambda: vary(jnp.zeros((), jnp.float32)))
            elif i == v - 1:
                loss = loss + order.cond(active & (rank == p - 1),
                                         lambda: vary(model.head_loss(mcfg, shared, y, mb, side)),
                                         lambda: vary(jnp.zeros((), jnp.float32)))
            recv = order.ppermute(y, "pipeline", perm_pairs(p, v, roles=False, parity=0)[0])
            if returned is not None:  # the micro batch rank p - 1 just finished reaches rank 0 around the ring
                back = t - (p - 1)
                keep = (rank == 0) & (back >= 0) & (back < m)
                returned = jnp.where(keep, returned.at[jnp.clip(back, 0, m - 1)].set(recv), returned)
            return (recv, returned, loss), None

        init = (vary(jnp.zeros(shape, dtype)), returned, loss)
        (_, returned, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return loss

