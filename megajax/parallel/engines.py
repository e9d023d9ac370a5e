"""The gradient engines of the train step, one chosen by the step plan (StepPlan.engine), and the manual region
they run in. Inside the region (shard_map over the plan's manual axes, 'tensor' left to GSPMD), an engine gives this
data rank's summed token loss and the gradients of seed_scale x that loss:

- "plain": a scan over micro batches, the gradients reduced after it (`compute_grads`);
- "overlapped": the same scan, whose last backward issues the data-parallel reductions layer by layer
  (parallel.overlap_grad_reduce; with the distributed optimizer's parallel.overlap_param_gather the weights
  gathered in the first forward);
- "sharded": ZeRO-2/3, every micro batch's gradients reduce-scattered onto the optimizer shards in its own backward;
- "pipelined": a pipeline schedule (megajax/parallel/pipeline/executor.py).

`compute_grads` wraps the chosen engine: the reductions each weight needs (`overlap.Reduction`), the manual
region, and the step's one reduction over the data ranks where the engine leaves it to after.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import model, optim
from megajax.config import Config
from megajax.parallel import overlap, sharding, step_plan
from megajax.parallel.pipeline import executor
from megajax.parallel.sharding import micro_batches
from megajax.parallel.step_plan import StepPlan

_MATMUL_WEIGHTS = {*model.layers.WEIGHT_EINSUMS, "output"}  # (the untied output layer's, which the head casts too)


def _gather_dtypes(cfg: Config, params):
    """Per parameter, the Reduction's gather_dtype and grad_dtype: a matmul weight (the model casts it to the compute
    dtype wherever it reads it) is gathered in the compute dtype, as Megatron gathers its bf16 parameters; the rest
    in its own."""
    mcfg = cfg.model
    low = mcfg.compute_dtype != mcfg.param_dtype

    def one(path, a):
        if low and getattr(path[-1], "key", None) in _MATMUL_WEIGHTS:
            return {"gather_dtype": mcfg.compute_dtype, "grad_dtype": mcfg.param_dtype}
        return {}

    return jax.tree_util.tree_map_with_path(one, params)


def accumulate_grads(cfg: Config, params, batch: dict, seed_scale: jax.Array, reductions=None):
    """Per data rank (inside shard_map): summed loss and gradients of `seed_scale * loss` over the
    micro batches, with no cross-rank communication; or with `reductions` (per weight, an
    `overlap.Reduction`) the gradients already reduced as they say, layer by layer in the last micro batch's
    backward (`overlap.reducing_loss`), and the weights that arrive as their optimizer shard all-gathered layer
    by layer in the first micro batch's forward."""
    m = step_plan.in_force().micro_batches

    def micro_loss(p, mb):
        raw = model.loss_sum(cfg.model, p, mb, model.side_inputs(cfg.model, cfg.train.seed, mb,
                                                                 objective_scale=seed_scale))
        return raw * seed_scale, raw

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def body(carry, mb):
        loss, grads = carry
        # The weights marked varying over the data axes keep the transpose from reducing per micro batch.
        g, raw = grad_fn(step_plan.vary(weights, step_plan.GRAD), mb)
        return (loss + raw, jax.tree.map(jnp.add, grads, g)), None

    mbs = micro_batches(batch, m)
    loss = step_plan.vary(jnp.zeros((), jnp.float32), step_plan.GRAD)
    weights, acc = params, None
    if reductions is None and m == 1:  # one micro batch: its gradient, without a scan and a zero accumulator
        grads, raw = grad_fn(step_plan.vary(weights, step_plan.GRAD), jax.tree.map(lambda x: x[0], mbs))
        return loss + raw, grads
    if reductions is None:
        (loss, grads), _ = jax.lax.scan(body, (loss, jax.tree.map(jnp.zeros_like, step_plan.vary(params))), mbs)
        return loss, grads
    differentiate = jax.grad(overlap.reducing_loss, has_aux=True)
    # each part below starts once the collectives of the one before have finished (CPU runtime: CollectiveOrder)
    order = sharding.CollectiveOrder()
    at = lambda idx: jax.tree.map(lambda x: order.before(x[idx]), mbs)  # noqa: E731
    if m > 1 and any(r.gather for r in jax.tree.leaves(reductions)):
        # the first micro batch gathers the weights (and keeps them whole for the rest); its gradient stays local
        local = jax.tree.map(lambda r: dataclasses.replace(r, local=True), reductions)
        acc, (raw, weights) = order.after(differentiate(overlap.sinks(params, local), cfg, params, None, local,
                                                        at(0), seed_scale))
        loss, mbs = loss + raw, jax.tree.map(lambda x: x[1:], mbs)
        reductions = jax.tree.map(lambda r: dataclasses.replace(r, gather=False), reductions)
    if jax.tree.leaves(mbs)[0].shape[0] > 1:
        if acc is None:
            acc = jax.tree.map(jnp.zeros_like, step_plan.vary(weights))
        (loss, acc), _ = order.after(jax.lax.scan(body, (loss, step_plan.vary(acc)), at(slice(None, -1))))
    grads, (raw, _) = differentiate(overlap.sinks(weights, reductions), cfg, weights, acc, reductions, at(-1),
                                    seed_scale)
    return loss + raw, grads


def sharded_grads(cfg: Config, params, batch: dict, seed_scale: jax.Array, reductions):
    """ZeRO-2 and ZeRO-3 (StepPlan.shard_grads): per data rank (inside shard_map), the summed loss and the gradients
    reduce-scattered onto the optimizer shards, each micro batch's layer by layer in its own backward
    (`overlap.reducing_loss`) and summed as shards, so that no whole gradient of a layer outlives a micro batch
    (Megatron-FSDP reduces per micro batch too). ZeRO-3 (StepPlan.shard_params) gathers each layer's weights in
    every forward and again in its backward; ZeRO-2 with parallel.overlap_param_gather gathers them in the first
    micro batch's forward and keeps them whole for the rest.

    The embedding, the final norm and the output layer: ZeRO-3 shards them like every other weight, gathered in
    every micro batch and their gradients reduce-scattered in its backward, so that nothing whole outlives a micro
    batch. ZeRO-2 sums their gradients whole on each rank and reduce-scatters them once, after the last micro
    batch, as ZeRO-1 does: their collectives sit before and after the layers' loop, where nothing runs beside
    them, and per micro batch they would be exposed for little memory (Llama 3 8B cut to 16 layers on 8 H100s,
    8 micro batches: ZeRO-3 39.8 -> 36.1 GiB for 49 -> 134 ms exposed; ZeRO-2 44.2 -> 43.3 GiB for 44 -> 108 ms).
    All the micro batches (but ZeRO-2's gathering first) run as one scan: one program, whose collectives the
    scheduler overlaps the same way in every micro batch."""
    plan = step_plan.in_force()
    differentiate = jax.grad(overlap.reducing_loss, has_aux=True)
    mbs = micro_batches(batch, plan.micro_batches)
    # each part below starts once the collectives of the one before have finished (CPU runtime: CollectiveOrder)
    order = sharding.CollectiveOrder()
    at = lambda idx: jax.tree.map(lambda x: order.before(x[idx]), mbs)  # noqa: E731
    loss = step_plan.vary(jnp.zeros((), jnp.float32), step_plan.GRAD)

    def run(mb, reductions, weights):
        return differentiate(overlap.sinks(weights, reductions), cfg, weights, None, reductions, mb, seed_scale,
                             plan.shard_params)

    if plan.micro_batches == 1:
        grads, (raw, _) = run(at(0), reductions, params)
        return loss + raw, grads

    def changed(tree, layers: bool = False, **change):
        """`tree` with `change` on the embedding's and head's reductions (and with `layers`, on the layers' too)."""
        return {k: jax.tree.map(lambda r: dataclasses.replace(r, **change), v) if k != "layers" or layers else v
                for k, v in tree.items()}

    ends_once = not plan.shard_ends  # ZeRO-2: the embedding's and head's gradients reduced after the micro batches
    if ends_once:
        reductions = changed(reductions, local=True)
    weights, grads, first = params, None, 0
    if not plan.shard_params and any(r.gather for r in jax.tree.leaves(reductions["layers"])):
        # ZeRO-2 with overlap_param_gather: the first micro batch gathers every weight (the layers' under its
        # forward), and the rest run on them whole
        grads, (raw, weights) = order.after(run(at(0), reductions, params))
        loss, first = loss + raw, 1
        reductions = changed(reductions, layers=True, gather=False)

    def body(carry, mb):
        loss, grads = carry
        g, (raw, _) = run(mb, reductions, weights)
        return (loss + raw, jax.tree.map(jnp.add, grads, g)), None

    start = overlap.sinks(weights, reductions) if grads is None else grads
    (loss, grads), _ = order.after(jax.lax.scan(body, (loss, start), at(slice(first, None))))
    if ends_once:  # the embedding's and head's summed gradients, reduced once
        grads.update({k: jax.tree.map(lambda r, g: dataclasses.replace(r, local=False)(order.before(g)),
                                      reductions[k], grads[k]) for k in params if k != "layers"})
    return loss, grads


def pipelined_grads(cfg: Config, params, batch: dict, seed_scale: jax.Array, reductions=None):
    """The pipeline schedule's gradients (megajax/parallel/pipeline/executor.py). With `reductions` the layers'
    gradients come back reduced in each chunk's last backward, and the embedding's and head's are reduced here."""
    if reductions is None:
        return executor.pipeline_grads(cfg, params, batch, seed_scale)
    loss, grads = executor.pipeline_grads(cfg, params, batch, seed_scale, reductions["layers"])
    return loss, {k: g if k == "layers" else jax.tree.map(lambda r, x: r(x), reductions[k], g)
                  for k, g in grads.items()}


# The gradient engines, one chosen by the step plan (StepPlan.engine): inside the step's manual region, each
# gives (this data rank's summed token loss, the gradients of seed_scale x that loss), the gradients already
# reduced where `reductions` (per weight, an overlap.Reduction) are given, else this rank's partial sums.
ENGINES = {"plain": accumulate_grads, "overlapped": accumulate_grads, "sharded": sharded_grads,
           "pipelined": pipelined_grads}


def in_manual_region(plan: StepPlan, mesh: jax.sharding.Mesh, fn, in_specs, out_specs):
    """fn under shard_map with the plan's manual axes ('tensor' left to GSPMD); specs may name any mesh axis
    (those that stay automatic are dropped). With none (pure tensor parallelism, or one device) there is nothing
    to make manual and fn runs under GSPMD as it is."""
    manual = plan.manual
    if not manual:
        return fn
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    only = lambda specs: jax.tree.map(lambda s: sharding.manual_spec(s, manual), specs, is_leaf=is_spec)  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=only(in_specs), out_specs=only(out_specs), axis_names=set(manual))


def compute_grads(setup, params, batch: dict, seed_scale: jax.Array):
    """(summed token loss, gradients of seed_scale * summed loss), reduced over data and pipeline. `params` are
    the model's variables (`StepSetup.variables`; `setup` is the step's step.StepSetup, which imports this module
    and is not imported here): the state's gradients carry the step's statistics out of the
    layers (megajax/model/model_state.py), reduced as the weights' are.

    The step's one gradient reduction over 'data' is an all-reduce (psum inside the shard_map), or with
    the distributed optimizer a reduce-scatter onto each parameter's optimizer shard. The latter is left
    to GSPMD: each data rank returns its partial sum on a leading 'data' axis, and summing that axis into
    the optimizer's sharding keeps the 'tensor' sharding of the gradients. With parallel.overlap_grad_reduce
    both are issued layer by layer in the last micro batch's backward instead (`overlap`).
    """
    cfg, plan = setup.cfg, setup.plan
    zero = setup.per_variable(setup.zero_dims, None)  # the state is never sharded by the optimizer
    is_none = lambda x: x is None  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    overlapped = plan.reduce_in_backward
    engine = ENGINES[plan.engine]

    def local(params, batch, seed_scale):
        batch = setup.local_batch(batch)  # packed documents; context parallelism: this rank's tokens
        loss, grads = engine(cfg, params, batch, seed_scale, reductions if overlapped else None)
        if overlapped:  # hybrid sharding: the instances' scattered shards summed, once a step
            grads = jax.tree.map(lambda r, g: r.across_instances(g), reductions, grads)
        else:
            # Each gradient is summed over the data ranks that replicate its weight (an expert's: 'data' only).
            # Distributed optimizer: the partial sums, padded to the optimizer's layout, on a leading axis over
            # those ranks.
            grads = jax.tree.map(lambda g, z, a: sharding.psum(g, a) if z is None else optim.zero_pad(g, z)[None],
                                 grads, zero, reduce_axes, is_leaf=is_none)
        return sharding.psum(loss, step_plan.GRAD), grads

    p_specs = setup.compute_param_specs()
    # per weight, the data-parallel axes its gradient is summed over
    reduce_axes = jax.tree.map(sharding.unsplit_data_axes, p_specs, is_leaf=is_spec)
    if overlapped:
        # In the backward, the distributed optimizer's gradients are scattered onto their optimizer shards,
        # except where the sharded dim is also tensor-sharded (a column-parallel bias): those few bytes are
        # all-reduced there and sliced after.
        scattered = jax.tree.map(lambda z: z is not None and z.data_only, zero, is_leaf=is_none)
        lengths = setup.per_variable(jax.tree.map(lambda a, z: None if z is None else a.shape[z.dim],
                                                   setup.param_shapes, setup.zero_dims, is_leaf=is_none), None)
        # (hybrid sharding: ZeRO-1's one reduction a step sums the instances too; ZeRO-2/3's after the micro batches)
        reductions = jax.tree.map(lambda z, sc, a, s, g, n, low: overlap.Reduction(
            a, z, s, gather=g, length=n, across=not plan.shard_grads, **low) if sc else overlap.Reduction(a),
            zero, scattered, reduce_axes, p_specs, setup.per_variable(setup.gathered_params(), False), lengths,
            _gather_dtypes(cfg, params), is_leaf=is_none)
        g_specs = jax.tree.map(lambda s, z, sc: optim.zero_spec(s, z, z.dim + 1) if sc else s, p_specs, zero,
                               scattered, is_leaf=is_none)
    else:
        g_specs = jax.tree.map(lambda s, z: s if z is None else P(sharding.unsplit_data_axes(s), *s), p_specs, zero,
                               is_leaf=is_none)
    in_specs = (setup.variable_specs(), {k: P(step_plan.DATA) for k in batch}, P())
    loss, grads = in_manual_region(plan, setup.mesh, local, in_specs, (P(), g_specs))(params, batch, seed_scale)

    def scatter(g, z, spec):
        if z is None:
            return g
        if not overlapped:
            g = jnp.sum(g, axis=0)
        target = NamedSharding(setup.mesh, optim.zero_spec(spec, z, g.ndim))
        # overlapped: reduced already, scattered (a no-op here) or whole (a local slice)
        return jax.lax.with_sharding_constraint(optim.zero_pad(g, z), target)

    return loss, jax.tree.map(scatter, grads, zero, p_specs, is_leaf=is_none)
