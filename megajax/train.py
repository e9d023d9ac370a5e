"""`python -m megajax.train --config configs/tiny.yaml [--set key=value ...]`

The train state, the jitted train and eval steps, and the loop. The step is

    shard_map(data, pipeline and context manual, tensor left to GSPMD):
        micro-batch loop (or a pipeline schedule) -> summed gradients on each data rank
        one reduction over 'data' (all-reduce, or reduce-scatter with the distributed optimizer)
    GSPMD: unscale, global norm, AdamW update, non-finite steps skipped

The micro-batch loop runs with 'data' manual even without a pipeline: with 'data' left to GSPMD, XLA
reduces the gradient over 'data' once per micro batch instead of once per step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import config as config_lib, config_io
from megajax import metrics as metrics_lib
from megajax import model, optim, overlap, sharding, step_plan, xla_flags
from megajax.model import context, fp8, moe
from megajax.step_plan import StepPlan
from megajax.pipeline import executor, layout
from megajax.config import Config, InputError
from megajax import distributed
from megajax.data.loader import micro_batches


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken (skipped steps count too)
    params: Any
    opt_state: Any
    loss_scale: jax.Array  # f32 scalar; 1.0 unless compute_dtype is float16
    good_steps: jax.Array  # int32: finite steps since the loss scale last changed
    bad_steps: jax.Array  # int32: non-finite steps in a row


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """Everything the step needs that follows from (config, mesh); no arrays."""

    cfg: Config
    mesh: jax.sharding.Mesh
    plan: StepPlan  # every parallel decision of the step (megajax/step_plan.py)
    logical: Any  # logical axis names per parameter (canonical layout)
    tx: optax.GradientTransformation
    abstract_state: TrainState
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    zero_dims: Any  # per parameter: where the distributed optimizer shards its state (optim.ZeroDim or None)
    eod: int | None = None  # the end-of-document token, where packed documents are separated (data.reset_*)

    def whole_batch(self, batch: dict) -> dict:
        """A batch of whole sequences with what the model reads besides tokens: the packed documents' segment ids
        and positions (data.reset_attention_mask, data.reset_position_ids)."""
        d = self.cfg.data
        if not (d.reset_attention_mask or d.reset_position_ids):
            return batch
        out = model.documents(batch, self.eod, d.reset_position_ids)
        return out if d.reset_attention_mask else {k: v for k, v in out.items() if k != "segment_ids"}

    def local_batch(self, batch: dict) -> dict:
        """Inside the step's manual region: `whole_batch`, cut to this context rank's tokens of every sequence."""
        return context.split_batch(self.whole_batch(batch))

    def zero_sharded_fraction(self) -> float:
        """Fraction of the parameters whose optimizer state the distributed optimizer shards over 'data'."""
        sizes = jax.tree.map(lambda a, z: (math.prod(a.shape), z is not None), self.abstract_state.params,
                             self.zero_dims, is_leaf=lambda x: x is None)
        pairs = jax.tree.leaves(sizes, is_leaf=lambda x: isinstance(x, tuple))
        total = sum(n for n, _ in pairs)
        return sum(n for n, sharded in pairs if sharded) / max(total, 1)

    def param_specs(self):
        """The PartitionSpec of every parameter in the train state."""
        return jax.tree.map(lambda s: s.spec, self.state_shardings.params)

    def compute_param_specs(self):
        """The PartitionSpec of every parameter as the model computes with it: the train state's, except for the
        weights the state keeps as their optimizer shard (`gathered_params`)."""
        return jax.tree.map(lambda n: _layout_spec(self.plan, n), self.logical, is_leaf=lambda x: isinstance(x, tuple))

    def gathered_params(self):
        """Per parameter: True where the train state keeps only its distributed-optimizer shard and the step
        all-gathers it in its first forward (parallel.overlap_param_gather)."""
        return _gathered(self.cfg, self.plan, self.abstract_state.params, self.zero_dims)

    def optimizer_bytes_per_device(self) -> int:
        """Bytes of optimizer state one device holds (the distributed optimizer divides it by data)."""
        return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(
            jax.tree.leaves(self.abstract_state.opt_state), jax.tree.leaves(self.state_shardings.opt_state)))


def _layout_spec(plan: StepPlan, names: tuple) -> P:
    """The parameter's PartitionSpec as the model computes with it (staged layer layout under a pipeline)."""
    return sharding.param_spec(layout.layout_names(names, plan.pipelined), plan.moe_folds > 1)


def _gathered(cfg: Config, plan: StepPlan, params, zero_dims):
    """StepSetup.gathered_params: with parallel.overlap_param_gather, every weight whose optimizer shard is an
    unpadded slice over the data ranks alone (not a tensor-sharded dim split further); with a pipeline, of the
    layers only (the schedule gathers those in its ticks; the embedding and head are read by the first and last
    ranks' first ticks, with nothing to hide a gather under)."""
    gathered = jax.tree.map(lambda a, z: bool(cfg.parallel.overlap_param_gather and z is not None and z.data_only
                                              and z.size == a.shape[z.dim]),
                            params, zero_dims, is_leaf=lambda x: x is None)
    if plan.pipelined:
        gathered = {k: g if k == "layers" else jax.tree.map(lambda _: False, g) for k, g in gathered.items()}
    return gathered


def _gather_dtypes(cfg: Config, params):
    """Per parameter, the Reduction's gather_dtype and grad_dtype: a matmul weight (the model casts it to the compute
    dtype wherever it reads it) is gathered in the compute dtype, as Megatron gathers its bf16 parameters; the rest
    in its own."""
    mcfg = cfg.model
    low = mcfg.compute_dtype != mcfg.param_dtype

    def one(path, a):
        if low and getattr(path[-1], "key", None) in model.layers.WEIGHT_EINSUMS:
            return {"gather_dtype": mcfg.compute_dtype, "grad_dtype": mcfg.param_dtype}
        return {}

    return jax.tree_util.tree_map_with_path(one, params)


def build(cfg: Config, mesh: jax.sharding.Mesh) -> StepSetup:
    """Derives shapes and shardings of the state and batch (with jax.eval_shape: nothing is allocated)."""
    plan = StepPlan.resolve(cfg)
    boxed = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    logical = model.logical_axes(boxed)
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps, logical)

    def named(spec):
        return NamedSharding(mesh, spec)

    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    is_none = lambda x: x is None  # noqa: E731
    param_specs = jax.tree.map(lambda n: _layout_spec(plan, n), logical, is_leaf=is_names)
    params = jax.eval_shape(lambda b: _staged(cfg, nn.unbox(b)), boxed)  # the train state's param shapes
    if cfg.parallel.distributed_optimizer and cfg.parallel.data * cfg.parallel.context > 1:
        lead = layout.lead_dims(plan.pipelined)  # stacked-layer dims: never the one padded
        zero_dims = jax.tree.map(lambda a, s, n: optim.zero_dim(a.shape, s, lead if n[:1] == ("layers",) else 0,
                                                                dict(mesh.shape)), params, param_specs, logical,
                                 is_leaf=is_names)
    else:
        zero_dims = jax.tree.map(lambda _: None, params)
    abstract_state = jax.eval_shape(lambda: _fresh_state(cfg, tx, zero_dims, jax.random.key(0)))
    opt_specs = jax.tree.map(lambda a, s, z: optim.zero_spec(s, z, a.ndim), params, param_specs, zero_dims,
                             is_leaf=is_none)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: named(s), abstract_state.opt_state, opt_specs,
        transform_non_params=lambda _: named(P()), is_leaf=lambda x: isinstance(x, P))
    # parallel.overlap_param_gather: those weights live in the state as their optimizer shard
    state_param_specs = jax.tree.map(lambda z, s, g: optim.zero_spec(s, z, z.dim + 1) if g else s, zero_dims,
                                     param_specs, _gathered(cfg, plan, params, zero_dims), is_leaf=is_none)
    state_shardings = TrainState(
        step=named(P()), params=jax.tree.map(named, state_param_specs, is_leaf=lambda x: isinstance(x, P)),
        opt_state=opt_shardings, loss_scale=named(P()), good_steps=named(P()), bad_steps=named(P()))
    batch_shardings = {k: named(P(sharding.DATA)) for k in ("tokens", "targets", "loss_mask", "sample_ids")}
    eod = None
    if cfg.data.reset_attention_mask or cfg.data.reset_position_ids:
        from megajax.data.tokenizers import eod_of

        eod = eod_of(cfg.data.tokenizer)
    return StepSetup(cfg, mesh, plan, logical, tx, abstract_state, state_shardings, batch_shardings, zero_dims, eod)


def setup_for(cfg: Config, devices=None) -> StepSetup:
    """The step's setup on `devices` (default: every device of every process): the layout resolved for
    their number (Config.for_devices), the mesh, and build()."""
    devices = jax.devices() if devices is None else list(devices)
    cfg = cfg.for_devices(len(devices))
    return build(cfg, sharding.make_mesh(cfg.parallel, devices))


def _fresh_params(cfg: Config, rng: jax.Array):
    return _staged(cfg, nn.unbox(model.init_params(cfg.model, rng)))


def _staged(cfg: Config, params):
    """Canonical params ([L, ...] layers) in the train state's layout."""
    if cfg.parallel.pipeline > 1:
        params = layout.to_stages(params, cfg.parallel.pipeline, cfg.parallel.virtual_stages)
    return params


def _zero_layout(tree, zero_dims):
    """Parameter-shaped values in the optimizer's layout (padded where the distributed optimizer pads)."""
    return jax.tree.map(lambda x, z: optim.zero_pad(x, z), tree, zero_dims, is_leaf=lambda x: x is None)


def _fresh_state(cfg: Config, tx: optax.GradientTransformation, zero_dims, rng: jax.Array) -> TrainState:
    return _state_from(cfg, tx, zero_dims, _fresh_params(cfg, rng))


def _state_from(cfg: Config, tx: optax.GradientTransformation, zero_dims, params) -> TrainState:
    """Step 0 with these (staged) params and a fresh optimizer state."""
    scale = cfg.optim.initial_loss_scale if cfg.model.compute_dtype == "float16" else 1.0
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(_zero_layout(params, zero_dims)),
                      loss_scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                      bad_steps=jnp.zeros((), jnp.int32))


def init_state(setup: StepSetup, params=None) -> TrainState:
    """A fresh state, created directly in its shardings (no host copy of the full model), with parameters
    drawn from train.seed; or from `params` (canonical layout, e.g. NumPy arrays: compiles no random init)."""
    cfg = setup.cfg
    with jax.set_mesh(setup.mesh):
        if params is None:
            return jax.jit(lambda key: _fresh_state(cfg, setup.tx, setup.zero_dims, key),
                           out_shardings=setup.state_shardings)(jax.random.key(cfg.train.seed))
        return jax.jit(lambda p: _state_from(cfg, setup.tx, setup.zero_dims, _staged(cfg, p)),
                       out_shardings=setup.state_shardings)(params)


def load_initial_params(setup: StepSetup, directory: str):
    """Params from a params-only or training checkpoint (megajax.checkpoint.find_params), restored onto
    the train state's shardings: canonical [L, ...] layers, staged to [v, p, L / (p v), ...] under a pipeline."""
    from megajax import checkpoint

    cfg, mesh = setup.cfg, setup.mesh
    source = checkpoint.find_params(directory)
    checkpoint.check_same_model(source.config.model, cfg.model, directory)
    canonical = model.abstract_params(cfg.model)
    target = jax.tree.map(lambda names, a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, sharding.param_spec(names, cfg.parallel.folded_experts))),
        setup.logical, canonical, is_leaf=lambda x: isinstance(x, tuple))
    params = checkpoint.load_params(source, target)
    if cfg.parallel.pipeline > 1:
        p, v = cfg.parallel.pipeline, cfg.parallel.virtual_stages
        params = jax.jit(lambda x: layout.to_stages(x, p, v), out_shardings=setup.state_shardings.params)(params)
    return params


def accumulate_grads(cfg: Config, params, batch: dict, seed_scale: jax.Array, reductions=None):
    """Per data rank (inside shard_map): summed loss and gradients of `seed_scale * loss` over the
    micro batches, with no cross-rank communication; or with `reductions` (per weight, an
    `overlap.Reduction`) the gradients already reduced as they say, layer by layer in the last micro batch's
    backward (`overlap.reducing_loss`), and the weights that arrive as their optimizer shard all-gathered layer
    by layer in the first micro batch's forward."""
    m = cfg.num_micro_batches

    def micro_loss(p, mb):
        raw = model.loss_sum(cfg.model, p, mb, model.side_inputs(cfg.model, cfg.train.seed, mb,
                                                                 objective_scale=seed_scale))
        return raw * seed_scale, raw

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def body(carry, mb):
        loss, grads = carry
        # The weights marked varying over the data axes keep the transpose from reducing per micro batch.
        g, raw = grad_fn(sharding.vary(weights, sharding.GRAD), mb)
        return (loss + raw, jax.tree.map(jnp.add, grads, g)), None

    mbs = micro_batches(batch, m)
    loss = sharding.vary(jnp.zeros((), jnp.float32), sharding.GRAD)
    weights, acc = params, None
    if reductions is None:
        (loss, grads), _ = jax.lax.scan(body, (loss, jax.tree.map(jnp.zeros_like, sharding.vary(params))), mbs)
        return loss, grads
    differentiate = jax.grad(overlap.reducing_loss, has_aux=True)
    at = lambda idx: jax.tree.map(lambda x: x[idx], mbs)  # noqa: E731
    if m > 1 and any(r.gather for r in jax.tree.leaves(reductions)):
        # the first micro batch gathers the weights (and keeps them whole for the rest); its gradient stays local
        local = jax.tree.map(lambda r: dataclasses.replace(r, local=True), reductions)
        acc, (raw, weights) = differentiate(overlap.sinks(params, local), cfg, params, None, local, at(0), seed_scale)
        loss, mbs = loss + raw, jax.tree.map(lambda x: x[1:], mbs)
        reductions = jax.tree.map(lambda r: dataclasses.replace(r, gather=False), reductions)
    if jax.tree.leaves(mbs)[0].shape[0] > 1:
        if acc is None:
            acc = jax.tree.map(jnp.zeros_like, sharding.vary(weights))
        (loss, acc), _ = jax.lax.scan(body, (loss, sharding.vary(acc)), jax.tree.map(lambda x: x[:-1], mbs))
    grads, (raw, _) = differentiate(overlap.sinks(weights, reductions), cfg, weights, acc, reductions, at(-1),
                                    seed_scale)
    return loss + raw, grads


def _in_manual_region(setup: StepSetup, fn, in_specs, out_specs):
    """fn under shard_map with the plan's manual axes ('tensor' left to GSPMD); specs may name any mesh axis
    (those that stay automatic are dropped). With none (pure tensor parallelism, or one device) there is nothing
    to make manual and fn runs under GSPMD as it is."""
    manual, mesh = setup.plan.manual, setup.mesh
    if not manual:
        return fn
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    only = lambda specs: jax.tree.map(lambda s: sharding.manual_spec(s, manual), specs, is_leaf=is_spec)  # noqa: E731
    return jax.shard_map(fn, mesh=mesh, in_specs=only(in_specs), out_specs=only(out_specs), axis_names=set(manual))


def compute_grads(setup: StepSetup, params, batch: dict, seed_scale: jax.Array):
    """(summed token loss, gradients of seed_scale * summed loss), reduced over data and pipeline.

    The step's one gradient reduction over 'data' is an all-reduce (psum inside the shard_map), or with
    the distributed optimizer a reduce-scatter onto each parameter's optimizer shard. The latter is left
    to GSPMD: each data rank returns its partial sum on a leading 'data' axis, and summing that axis into
    the optimizer's sharding keeps the 'tensor' sharding of the gradients. With parallel.overlap_grad_reduce
    both are issued layer by layer in the last micro batch's backward instead (`overlap`).
    """
    cfg, plan = setup.cfg, setup.plan
    zero = setup.zero_dims
    is_none = lambda x: x is None  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    overlapped = plan.reduce_in_backward

    def local(params, batch, seed_scale):
        batch = setup.local_batch(batch)  # packed documents; context parallelism: this rank's tokens
        if plan.pipelined and overlapped:
            # the layers' gradients reduced in each chunk's last backward; the embedding's and head's here
            loss, grads = executor.pipeline_grads(cfg, params, batch, seed_scale, reductions["layers"])
            grads = {k: g if k == "layers" else jax.tree.map(lambda r, x: r(x), reductions[k], g)
                     for k, g in grads.items()}
            return sharding.psum(loss, sharding.GRAD), grads
        if plan.pipelined:
            loss, grads = executor.pipeline_grads(cfg, params, batch, seed_scale)
        elif overlapped:
            loss, grads = accumulate_grads(cfg, params, batch, seed_scale, reductions)
            return sharding.psum(loss, sharding.GRAD), grads
        else:
            loss, grads = accumulate_grads(cfg, params, batch, seed_scale)
        # Each gradient is summed over the data ranks that replicate its weight (an expert's: 'data' only).
        # Distributed optimizer: the partial sums, padded to the optimizer's layout, on a leading axis over
        # those ranks.
        grads = jax.tree.map(lambda g, z, a: sharding.psum(g, a) if z is None else optim.zero_pad(g, z)[None],
                             grads, zero, reduce_axes, is_leaf=is_none)
        return sharding.psum(loss, sharding.GRAD), grads

    p_specs = setup.compute_param_specs()
    # per weight, the data-parallel axes its gradient is summed over
    reduce_axes = jax.tree.map(sharding.unsplit_data_axes, p_specs, is_leaf=is_spec)
    if overlapped:
        # In the backward, the distributed optimizer's gradients are scattered onto their optimizer shards,
        # except where the sharded dim is also tensor-sharded (a column-parallel bias): those few bytes are
        # all-reduced there and sliced after.
        scattered = jax.tree.map(lambda z: z is not None and z.data_only, zero, is_leaf=is_none)
        reductions = jax.tree.map(lambda z, sc, a, s, g, low: overlap.Reduction(a, z, s, gather=g, **low) if sc
                                  else overlap.Reduction(a), zero, scattered, reduce_axes, p_specs,
                                  setup.gathered_params(), _gather_dtypes(cfg, params), is_leaf=is_none)
        g_specs = jax.tree.map(lambda s, z, sc: optim.zero_spec(s, z, z.dim + 1) if sc else s, p_specs, zero,
                               scattered, is_leaf=is_none)
    else:
        g_specs = jax.tree.map(lambda s, z: s if z is None else P(sharding.unsplit_data_axes(s), *s), p_specs, zero,
                               is_leaf=is_none)
    loss, grads = _in_manual_region(setup, local, (setup.param_specs(), {k: P(sharding.DATA) for k in batch}, P()),
                                    (P(), g_specs))(params, batch, seed_scale)

    def scatter(g, z, spec):
        if z is None:
            return g
        if not overlapped:
            g = jnp.sum(g, axis=0)
        target = NamedSharding(setup.mesh, optim.zero_spec(spec, z, g.ndim))
        # overlapped: reduced already, scattered (a no-op here) or whole (a local slice)
        return jax.lax.with_sharding_constraint(optim.zero_pad(g, z), target)

    return loss, jax.tree.map(scatter, grads, zero, p_specs, is_leaf=is_none)


def train_step(setup: StepSetup, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """One optimizer step on one global batch. Non-finite loss or gradients leave the weights and the
    optimizer state untouched (the step is counted as skipped)."""
    cfg = setup.cfg
    total = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    with step_plan.use(setup.plan):  # what the model reads while the step is traced
        loss_sum, grads = compute_grads(setup, state.params, batch, state.loss_scale / total)
    grads, moe_stats, moe_loads = moe.step_stats(grads, cfg.model.num_experts, drops=cfg.drops_tokens)
    grads, fp8_seen = fp8.take_meta_grads(grads)
    grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
    loss = loss_sum / total
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # With the distributed optimizer, grads are already in its layout (padded, sharded over 'data'); the
    # params follow (a local slice), and the updates come back to the params' shape (the all-gather).
    updates, opt_state = setup.tx.update(grads, state.opt_state, _zero_layout(state.params, setup.zero_dims))
    updates = jax.tree.map(lambda u, p: optim.zero_unpad(u, p.shape), updates, state.params)
    params = optax.apply_updates(state.params, updates)
    if cfg.model.moe_router_bias_update_rate:
        params = moe.update_router_bias(params, moe_loads, cfg.model.moe_router_bias_update_rate)
    if fp8_seen:
        params = fp8.update_meta(params, fp8_seen, cfg.model.fp8_amax_history)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    if cfg.model.compute_dtype == "float16":
        # An overflowing gradient is routine with fp16: skip the step and back off the loss scale. A non-finite
        # loss, or an overflow at the smallest scale (nothing left to back off), counts towards
        # train.max_bad_steps.
        loss_scale, good = optim.update_loss_scale(state.loss_scale, state.good_steps, finite, cfg.optim)
        healthy = jnp.isfinite(loss) & (finite | (state.loss_scale > cfg.optim.min_loss_scale))
    else:
        loss_scale, good, healthy = state.loss_scale, state.good_steps + 1, finite
    new_state = TrainState(
        step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
        loss_scale=loss_scale, good_steps=good, bad_steps=jnp.where(healthy, 0, state.bad_steps + 1))
    stats = {
        "loss": loss, "lr": optim.applied_lr(cfg.optim, cfg.train.steps, state.opt_state),
        "grad_norm": grad_norm, "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(fp8.without_meta(new_state.params)), "finite": finite,
        "loss_scale": state.loss_scale,
        "bad_steps": new_state.bad_steps, **moe_stats,
    }
    return new_state, stats


def eval_loss(setup: StepSetup, params, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(summed token loss, token count) of a batch, forward only: micro batch by micro batch under GSPMD, or in
    the train step's manual region with a pipeline (through it, never gathering the layers), context parallelism
    or expert parallelism (the experts' rows exchanged as in training, not every expert's partial outputs
    all-reduced)."""
    cfg, plan = setup.cfg, setup.plan
    m = plan.micro_batches
    with step_plan.use(plan):
        if plan.pipelined or plan.context > 1 or plan.expert > 1:
            def local(params, batch):
                batch = setup.local_batch(batch)
                if plan.pipelined:
                    return sharding.psum(executor.pipeline_loss(cfg, params, batch), sharding.GRAD)
                loss, _ = jax.lax.scan(lambda total, mb: (total + model.loss_sum(
                    cfg.model, params, mb, model.side_inputs(cfg.model, 0, mb, False)), None),
                    sharding.vary(jnp.zeros((), jnp.float32), sharding.GRAD), micro_batches(batch, m))
                return sharding.psum(loss, sharding.GRAD)

            # (the weights as the model computes with them: whole where the state keeps their optimizer shard)
            specs = (setup.compute_param_specs(), {k: P(sharding.DATA) for k in batch})
            loss = _in_manual_region(setup, local, specs, P())(params, batch)
        else:
            def body(total, mb):
                return total + model.loss_sum(cfg.model, params, mb, model.side_inputs(cfg.model, 0, mb, False)), None

            loss, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                   micro_batches(setup.whole_batch(batch), m, cfg.parallel.data))
    return loss, jnp.sum(batch["loss_mask"])


def jit_train_step(setup: StepSetup):
    return jax.jit(lambda s, b: train_step(setup, s, b),
                   in_shardings=(setup.state_shardings, setup.batch_shardings),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


def jit_eval_step(setup: StepSetup):
    return jax.jit(lambda p, b: eval_loss(setup, p, b),
                   in_shardings=(setup.state_shardings.params, setup.batch_shardings))


# ----------------------------------------------------------------------------------------------------
# The loop


class _StopRequest:
    """SIGTERM/SIGINT: finish the current step, save, exit 0 (Megatron's exit-signal handler)."""

    def __init__(self):
        self.signal = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name


def config_changes(cfg: Config, meta: dict) -> list[tuple[str, Any, Any, bool]]:
    """(key, in the checkpoint, now, changes the run) for every config key that differs from the checkpoint's
    config; `changes the run`: the resumed run differs from an uninterrupted one (other hyperparameters, other
    batches, a schedule over other steps)."""
    def flat(tree):  # {section: {key: value}} -> {"section.key": value}
        return {f"{section}.{key}": value for section, keys in tree.items() for key, value in keys.items()}

    old, new = flat(meta.get("config", {})), flat(cfg.to_dict())
    out = []
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            # train.steps only sets how long the run goes once the decay has its own length
            same = config_lib.may_change_on_resume(key) or (key == "train.steps" and cfg.optim.decay_steps is not None)
            out.append((key, old[key], new[key], not same))
    return out


def _report_config_changes(cfg: Config, meta: dict, log) -> None:
    """Says which config keys differ from the checkpoint's, flagging those that make the run differ."""
    changes = config_changes(cfg, meta)
    if not changes:
        return
    log.info(f"resuming with {len(changes)} config key(s) changed since the checkpoint:")
    for key, before, now, changes_run in changes:
        note = "  <- the run differs from an uninterrupted one" if changes_run else ""
        log.info(f"  {key}: {before!r} -> {now!r}{note}")


def _meta(cfg: Config, step: int, consumed: int) -> dict:
    return {"step": step, "consumed_samples": consumed, "seed": cfg.train.seed, "config": cfg.to_dict(),
            "layout": {"data": cfg.parallel.data, "pipeline": cfg.parallel.pipeline,
                       "context": cfg.parallel.context, "tensor": cfg.parallel.tensor,
                       "virtual_stages": cfg.parallel.virtual_stages}}


def run(cfg: Config) -> dict:
    """Trains for cfg.train.steps (resuming from the newest checkpoint if there is one).

    Returns a summary: last logged metrics, eval loss, steps run in this process. The run holds its output and
    checkpoint directories (megajax.runlock): a second run on them exits naming this one.
    """
    from megajax import checkpoint, runlock

    setup = setup_for(cfg)
    with runlock.hold(setup.cfg.train.output_dir, checkpoint.checkpoint_dir(setup.cfg)):
        return _run(setup)


def _run(setup: StepSetup) -> dict:
    from megajax import checkpoint
    from megajax.data.loader import BatchLoader, batch_shapes, build_datasets

    cfg, mesh = setup.cfg, setup.mesh
    gbs, steps = cfg.train.global_batch_size, cfg.train.steps
    is_main = jax.process_index() == 0
    metrics_lib.setup_logging(jax.process_index())
    wandb = None
    if cfg.train.wandb_project:
        metrics_lib.require_wandb()
        wandb = dict(project=cfg.train.wandb_project, name=cfg.train.wandb_exp_name, config=cfg.to_dict())
    log = metrics_lib.MetricsLogger(cfg.train.output_dir, enabled=is_main, wandb=wandb)
    num_eval = cfg.train.eval_batches * gbs if cfg.train.eval_every else 0
    datasets = build_datasets(cfg, {"train": steps * gbs, **({"valid": num_eval} if num_eval else {})})

    mgr = checkpoint.manager_for(cfg)
    start, consumed = 0, 0
    restored = checkpoint.restore_newest_readable(mgr, setup.abstract_state, setup.state_shardings, cfg, log)
    if restored is not None:
        fields, meta = restored
        state = TrainState(**fields)
        start, consumed = int(meta["step"]), int(meta["consumed_samples"])
        log.info(f"resumed from {checkpoint.checkpoint_dir(cfg)} step {start} ({consumed} samples consumed, "
                 f"written with layout {meta.get('layout')})")
        _report_config_changes(cfg, meta, log)
    else:
        state = init_state(setup)
        if cfg.checkpoint.load_from:  # a converted or exported model: its params, a fresh optimizer
            state = state.replace(params=load_initial_params(setup, cfg.checkpoint.load_from))
            log.info(f"loaded params from {cfg.checkpoint.load_from} (checkpoint.load_from; fresh optimizer state)")

    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(setup.abstract_state.params))
    p = cfg.parallel
    log.info(f"megajax: {n_params / 1e6:.2f}M parameters, {jax.device_count()} devices "
             f"(data={p.data} pipeline={p.pipeline}{f' context={p.context}' if p.context > 1 else ''} "
             f"tensor={p.tensor}"
             f"{' sp' if p.sequence_parallel else ''}), {cfg.num_micro_batches} micro batches of "
             f"{cfg.train.micro_batch_size}, global batch {gbs} x {cfg.model.seq_length} tokens")

    if p.distributed_optimizer and p.data > 1 and setup.zero_sharded_fraction() < 1:
        log.info(f"warning: the distributed optimizer shards {setup.zero_sharded_fraction():.0%} of the optimizer "
                 f"state over data={p.data}; the rest has no dimension divisible by {p.data} and stays replicated")
    step_fn, eval_fn = jit_train_step(setup), jit_eval_step(setup)
    peak, peak_src = metrics_lib.device_peak(cfg.model.compute_dtype)
    log.info(f"peak for MFU: {peak / 1e12:.4g} TFLOP/s per device ({peak_src})")
    # reads ahead on a background thread from here on, while the step compiles
    loader = BatchLoader(datasets["train"], gbs, setup.batch_shardings, consumed, steps * gbs, cfg.data.prefetch)
    abstract_batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=setup.batch_shardings[k])
                      for k, (shape, dtype) in batch_shapes(gbs, cfg.model.seq_length).items()}
    with jax.set_mesh(mesh), loader:
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, abstract_batch).compile()
        log.info(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
        try:
            with _saving(cfg.train.output_dir, "the run's output"):  # metrics.jsonl, TensorBoard
                return _loop(cfg, setup, compiled, eval_fn, state, datasets, start, consumed, loader, mgr, log, peak)
        finally:  # a checkpoint started in the background completes even when the loop stops on an error
            try:
                with _saving(mgr.directory):
                    mgr.wait_until_finished()
            finally:
                mgr.close()
                with _saving(cfg.train.output_dir, "the run's output"):  # TensorBoard's last flush
                    log.close()


def _any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (a one-element allgather over the job's processes)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def _evaluate(cfg, setup, eval_fn, params, dataset) -> float:
    from megajax.data.loader import global_batch

    gbs = cfg.train.global_batch_size
    total, count = 0.0, 0.0
    for i in range(cfg.train.eval_batches):
        batch = global_batch(dataset, i * gbs, gbs, setup.batch_shardings)
        s, c = eval_fn(params, batch)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def _loop(cfg, setup, step_fn, eval_fn, state, datasets, start, consumed, loader, mgr, log, peak) -> dict:
    gbs, steps, seq = cfg.train.global_batch_size, cfg.train.steps, cfg.model.seq_length
    flops = metrics_lib.step_flops(cfg.model, gbs * seq, pipelined=cfg.parallel.pipeline > 1)
    n_dev = jax.device_count()
    stop = _StopRequest()
    stop.install()
    deadline = None if cfg.train.exit_after_minutes is None else time.time() + 60 * cfg.train.exit_after_minutes
    record: dict = {}
    eval_loss_value = None
    pending = None  # (step, stats) of the previous step: read after the next one is dispatched
    wait_last = loader.wait_s  # seconds spent waiting for input, at the last log
    t_last, step_last, t_start = time.perf_counter(), start, time.perf_counter()
    step = start
    first, last = cfg.train.profile_start, cfg.train.profile_start + cfg.train.profile_steps  # traced: [first, last)
    tracing = False
    for step in range(start, steps):
        if first <= step < last and not tracing:
            jax.profiler.start_trace(os.path.join(cfg.train.output_dir, "profile"))
            tracing = True
        batch = next(loader)
        state, stats = step_fn(state, batch)
        consumed += gbs
        if pending is not None:
            _check_health(cfg, *pending, log, on_fatal=lambda: _save(mgr, step + 1, state, cfg, consumed, log))
        pending = (step, stats)
        done = step + 1
        if tracing and (done == last or done == steps):
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            tracing = False
            log.info(f"profiled steps {max(first, start) + 1}-{done}: {cfg.train.output_dir}/profile (TensorBoard's "
                     "profile tab, or Perfetto)")
        if done % cfg.train.log_every == 0 or done == steps:
            host = jax.device_get(stats)
            now = time.perf_counter()
            dt = (now - t_last) / max(done - step_last, 1)
            data_wait, wait_last = (loader.wait_s - wait_last) / max(done - step_last, 1), loader.wait_s
            t_last, step_last = now, done
            record = {
                "step": done, "loss": float(host["loss"]), "lr": float(host["lr"]),
                "grad_norm": float(host["grad_norm"]), "param_norm": float(host["param_norm"]),
                "update_norm": float(host["update_norm"]), "loss_scale": float(host["loss_scale"]),
                "step_time_s": dt, **metrics_lib.step_rates(flops, gbs * seq, dt, n_dev, peak),
                "consumed_samples": consumed,
                "data_wait_s": data_wait,
                **{k: float(v) for k, v in host.items() if k.startswith("moe_")},
            }
            eta = metrics_lib.format_eta((steps - done) * dt)
            moe_line = "".join(f" | {k[4:].replace('_', ' ')} {record[k]:.4f}" for k in record if k.startswith("moe_"))
            log.log(record, f"step {done}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                            f"grad norm {record['grad_norm']:.3f}{moe_line} | {record['tokens_per_s']:.0f} tok/s | "
                            f"{record['tflops_per_device']:.4f} TFLOP/s/dev | MFU {record['mfu']:.1%} | "
                            f"eta {eta}")
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == steps) and "valid" in datasets:
            eval_loss_value = _evaluate(cfg, setup, eval_fn, state.params, datasets["valid"])
            log.log({"step": done, "eval_loss": eval_loss_value, "eval_ppl": math.exp(min(eval_loss_value, 50))},
                    f"eval at step {done}: loss {eval_loss_value:.4f} | ppl {math.exp(min(eval_loss_value, 50)):.2f}")
        timed_out = deadline is not None and time.time() > deadline
        stopping = bool(stop.signal) or timed_out
        if jax.process_count() > 1:  # every process stops at the same step: agreed at each log step
            stopping = done % cfg.train.log_every == 0 and _any_process(stopping)
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == steps or stopping:
            log.log({"step": done, "checkpoint_blocking_s": _save(mgr, done, state, cfg, consumed, log)})
        if stopping:
            why = stop.signal or ("train.exit_after_minutes" if timed_out else "a stop request on another process")
            log.info(f"stopping after step {done} ({why}): checkpoint saved")
            break
    if pending is not None:
        _check_health(cfg, *pending, log, on_fatal=lambda: _save(mgr, step + 1, state, cfg, consumed, log))
    return {"last": record, "eval_loss": eval_loss_value, "steps_run": step + 1 - start,
            "wall_s": time.perf_counter() - t_start}


def _save(mgr, step: int, state: TrainState, cfg: Config, consumed: int, log) -> float:
    """Starts a checkpoint save; returns the seconds the loop was blocked (the async part is not counted)."""
    from megajax import checkpoint

    saved = mgr.all_steps() or []
    if step in saved:  # this timeline's own (a rollback moves the abandoned one's later steps aside)
        log.info(f"checkpoint step {step} is already in {mgr.directory}: kept as it is")
        return 0.0
    bad = int(jax.device_get(state.bad_steps))
    if bad and saved and max(saved) >= step - bad:
        # a skipped step leaves the weights as they were: a checkpoint at or after the last good step holds them,
        # and more saves would only rotate the good ones out of checkpoint.keep
        log.info(f"checkpoint at step {step} not written: the last {bad} steps were skipped as non-finite, and step "
                 f"{max(saved)} holds the same weights")
        return 0.0
    t0 = time.perf_counter()
    with _saving(mgr.directory):  # a background save's failure surfaces at the next save
        checkpoint.save(mgr, step, state, _meta(cfg, step, consumed))
    blocked = time.perf_counter() - t0
    log.info(f"checkpoint at step {step} -> {mgr.directory} ({blocked * 1e3:.0f} ms blocking"
             f"{', writing in the background' if cfg.checkpoint.async_ else ''})")
    return blocked


class NonFiniteError(RuntimeError):
    pass


class CheckpointSaveError(RuntimeError):
    """A checkpoint the filesystem refused (full, over quota, not writable): the run stops with one line."""


@contextlib.contextmanager
def _saving(directory, what: str = "a checkpoint"):
    """Turns a write that the filesystem refused into CheckpointSaveError (one line: what, the directory and the
    cause); any other error passes as it is."""
    from megajax import checkpoint

    try:
        yield
    except CheckpointSaveError:
        raise
    except Exception as e:  # noqa: BLE001  (Orbax and TensorStore wrap the OSError in their own types)
        cause = checkpoint.write_failure(e)
        if cause is None:
            raise
        raise CheckpointSaveError(f"{what} could not be written to {directory}: {cause}. The earlier "
                                  "checkpoints are intact and a rerun resumes from the newest; free space or set "
                                  "train.output_dir / checkpoint.dir") from None


def _check_health(cfg: Config, step: int, stats: dict, log, on_fatal=None) -> None:
    """Logs a skipped (non-finite) step; after train.max_bad_steps in a row saves the (last good) weights
    and stops with an error."""
    finite, bad, scale = jax.device_get((stats["finite"], stats["bad_steps"], stats["loss_scale"]))
    if not finite:
        scale, floor = float(scale), cfg.optim.min_loss_scale
        if int(bad) == 0:  # fp16: the loss was fine, the scaled gradient overflowed
            log.info(f"step {step + 1}: gradient overflow at loss scale {scale:g}: skipped, loss scale now "
                     f"{max(scale / 2, floor):g}")
            return
        at_floor = cfg.model.compute_dtype == "float16" and scale <= floor
        why = (f"the gradient overflowed at the smallest loss scale {scale:g} (optim.min_loss_scale)" if at_floor
               else "a non-finite loss or gradient")
        log.info(f"warning: step {step + 1} had {why}: skipped (weights unchanged; {int(bad)} in a row)")
        if int(bad) >= cfg.train.max_bad_steps:
            if on_fatal is not None:
                on_fatal()
            raise NonFiniteError(
                f"{int(bad)} non-finite steps in a row (train.max_bad_steps={cfg.train.max_bad_steps}): stopping. "
                "Lower optim.lr, check the data, or use bfloat16; the last checkpoint is intact.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.train", description=__doc__.split("\n\n")[0])
    config_io.add_cli_arguments(parser)
    args = parser.parse_args(argv)
    from megajax import checkpoint

    checkpoint.quiet_write_failures()  # a refused save: one line, not Orbax's and TensorStore's tracebacks
    xla_flags.install()  # before the first backend starts
    distributed.prefer_cpu_without_gpu()
    if args.config is None:
        print("no --config: the built-in defaults (a 2-layer GPT-2 on the bundled corpus; --help lists every key, "
              "configs/tiny.yaml is the tiny preset)")
    try:
        cfg = config_io.load(args.config, args.set)
        distributed.initialize()
        distributed.check_backend()
        run(cfg)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteError, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
