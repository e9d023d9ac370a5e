"""The train step: its state, its setup (shapes, shardings and the step plan, derived once from the config and the
mesh), the gradient engine the plan chooses, and the jitted train and eval steps. The step is

    shard_map(the plan's manual axes: data, expert, pipeline and context where split; tensor left to GSPMD):
        the gradient engine: a scan over micro batches, or a pipeline schedule -> this data rank's gradients
        one reduction over the data ranks (all-reduce, or reduce-scatter with the distributed optimizer),
        after the engine or, overlapped, layer by layer inside its last backward
    GSPMD: unscale, global norm, AdamW update, non-finite steps skipped

The micro-batch loop runs with 'data' manual even without a pipeline: with 'data' left to GSPMD, XLA
reduces the gradient over 'data' once per micro batch instead of once per step. The loop that runs the step
(resume, logging, checkpoints, signals, the CLI) is megajax/train.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import model, optim
from megajax.config import Config
from megajax.model import context, fp8, model_state
from megajax.parallel import engines, sharding, step_plan
from megajax.parallel.pipeline import gpipe, layout
from megajax.parallel.sharding import micro_batches
from megajax.parallel.step_plan import StepPlan


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken (skipped steps count too)
    params: Any  # the weights: what the optimizer updates
    model_state: Any  # the model's non-trainable state, moved by its own rules (megajax/model/model_state.py)
    opt_state: Any
    loss_scale: jax.Array  # f32 scalar; 1.0 unless compute_dtype is float16
    good_steps: jax.Array  # int32: finite steps since the loss scale last changed
    bad_steps: jax.Array  # int32: non-finite steps in a row


# A batch's fields (megajax/data/loader.py), each split over the data ranks by its rows, and the packed documents'
# where data.reset_attention_mask / data.reset_position_ids ask for them (DataConfig.document_fields)
BATCH_FIELDS = ("tokens", "targets", "loss_mask", "sample_ids")


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """Everything the step needs that follows from (config, mesh); no arrays."""

    cfg: Config
    mesh: jax.sharding.Mesh
    plan: StepPlan  # every parallel decision of the step (megajax/parallel/step_plan.py)
    logical: Any  # logical axis names per model variable, weights and state (canonical layout)
    tx: optax.GradientTransformation
    abstract_state: TrainState
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    zero_dims: Any  # per parameter: where the distributed optimizer shards its state (optim.ZeroDim or None)
    param_shapes: Any  # per parameter, its jax.ShapeDtypeStruct as the model computes with it (no ZeRO-3 padding)

    def whole_batch(self, batch: dict) -> dict:
        """A batch of whole sequences with what the model reads besides tokens: the packed documents' segment ids
        and positions (data.reset_attention_mask, data.reset_position_ids: the data loader's, Megatron-Core's
        GPTDataset's attention mask and position ids), the multi-token prediction modules' inputs
        (model.mtp_num_layers)."""
        depths = self.cfg.model.mtp_num_layers  # each module's inputs (from whole sequences, in their documents)
        out = model.mtp_batch(batch, depths) if depths else batch
        return out if self.cfg.data.reset_attention_mask else {k: v for k, v in out.items() if k != "segment_ids"}

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

    def variables(self, state: TrainState):
        """The model's variables (weights and state) of a train state, as the step reads them: a weight the state
        keeps as its shard (`gathered_params`) as that shard, with ZeRO-3's padding."""
        return model_state.merge(state.params, state.model_state)

    def model_variables(self, state: TrainState):
        """`variables` as the model computes with them: ZeRO-3's zero padding sliced off (under jit, GSPMD
        gathers the shards where the model reads them)."""
        params = jax.tree.map(lambda p, a: optim.zero_unpad(p, a.shape), state.params, self.param_shapes)
        return model_state.merge(params, state.model_state)

    def per_variable(self, per_param, state_value):
        """A per-parameter tree extended to every model variable, with `state_value` at the state's."""
        return model_state.merge(per_param, jax.tree.map(lambda _: state_value, self.abstract_state.model_state))

    def variable_specs(self):
        """The PartitionSpec of every model variable in the train state."""
        return jax.tree.map(lambda s: s.spec, self.variables(self.state_shardings))

    def compute_param_specs(self):
        """The PartitionSpec of every model variable as the model computes with it: the train state's, except for
        the weights the state keeps as their optimizer shard (`gathered_params`)."""
        return jax.tree.map(lambda n: _layout_spec(self.plan, n), self.logical, is_leaf=lambda x: isinstance(x, tuple))

    def kept_zero_dims(self):
        """Per parameter, its optim.ZeroDim where the train state keeps it as its (padded) shard, else None."""
        return _kept(self.zero_dims, self.gathered_params())

    def gathered_params(self):
        """Per parameter: True where the train state keeps only its distributed-optimizer shard and the step
        all-gathers it in its first forward (parallel.overlap_param_gather)."""
        return _gathered(self.plan, self.param_shapes, self.zero_dims)

    def parameter_bytes_per_device(self) -> int:
        """Bytes of weights one device keeps in the train state (ZeRO-3, and overlap_param_gather, keep shards)."""
        return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(
            jax.tree.leaves(self.abstract_state.params), jax.tree.leaves(self.state_shardings.params)))

    def gradient_bytes_per_device(self) -> int:
        """Bytes of the gradient one device accumulates over a step's micro batches (in the weights' dtype): the
        whole gradient of the weights it computes with, or with ZeRO-2 and ZeRO-3 (StepPlan.shard_grads) the
        layers' optimizer shards, and the embedding's and head's too where StepPlan.shard_ends (else those are
        summed whole)."""
        mesh = dict(self.mesh.shape)
        is_none = lambda x: x is None  # noqa: E731

        def one(path, a, z, names):
            spec = _layout_spec(self.plan, names)
            sharded = getattr(path[0], "key", "") == "layers" or self.plan.shard_ends
            if self.plan.shard_grads and z is not None and z.data_only and sharded:
                spec = optim.zero_spec(spec, z, a.ndim)
                shape = list(a.shape)
                shape[z.dim] = z.size
            else:
                shape = list(a.shape)
            for i, axis in enumerate(list(spec) + [None] * (len(shape) - len(spec))):
                shape[i] //= math.prod(mesh[x] for x in step_plan.axes_of(axis))
            return math.prod(shape) * a.dtype.itemsize

        param_logical, _ = model_state.split(self.logical)
        sizes = jax.tree_util.tree_map_with_path(one, self.param_shapes, self.zero_dims, param_logical,
                                                 is_leaf=is_none)
        return sum(jax.tree.leaves(sizes))

    def optimizer_bytes_per_device(self) -> int:
        """Bytes of optimizer state one device holds (the distributed optimizer divides it by data)."""
        return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(
            jax.tree.leaves(self.abstract_state.opt_state), jax.tree.leaves(self.state_shardings.opt_state)))


def _layout_spec(plan: StepPlan, names: tuple) -> P:
    """The parameter's PartitionSpec as the model computes with it (staged layer layout under a pipeline)."""
    return step_plan.param_spec(layout.layout_names(names, plan.pipelined), plan.moe_folds > 1,
                               plan.vocab_over_pipeline)


def _gathered(plan: StepPlan, params, zero_dims):
    """StepSetup.gathered_params: with ZeRO-3 (plan.shard_params), every weight whose optimizer shard is a slice
    over the data ranks alone (not of a tensor-sharded dim split further), kept with its padding; with
    parallel.overlap_param_gather, those whose shard is unpadded; with a pipeline, of the layers only (the
    schedule gathers those in its ticks; the embedding and head are read by the first and last ranks' first
    ticks, with nothing to hide a gather under)."""
    def one(a, z):
        if z is None or not z.data_only:
            return False
        return plan.shard_params or bool(plan.overlap_param_gather and z.size == a.shape[z.dim])

    gathered = jax.tree.map(one, params, zero_dims, is_leaf=lambda x: x is None)
    if plan.pipelined:
        gathered = {k: g if k == "layers" else jax.tree.map(lambda _: False, g) for k, g in gathered.items()}
    return gathered


def _kept(zero_dims, gathered):
    """The zero dims of the weights the train state keeps as their (padded) shards (`gathered`), else None."""
    return jax.tree.map(lambda z, g: z if g else None, zero_dims, gathered, is_leaf=lambda x: x is None)


def build(cfg: Config, mesh: jax.sharding.Mesh) -> StepSetup:
    """Derives shapes and shardings of the state and batch (with jax.eval_shape: nothing is allocated)."""
    plan = StepPlan.resolve(cfg, platform=mesh.devices.flat[0].platform)
    boxed = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    logical = model.logical_axes(boxed)
    param_logical, _ = model_state.split(logical)
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps, param_logical)

    def named(spec):
        return NamedSharding(mesh, spec)

    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    is_none = lambda x: x is None  # noqa: E731
    param_specs, state_specs = model_state.split(jax.tree.map(lambda n: _layout_spec(plan, n), logical,
                                                              is_leaf=is_names))
    # the train state's param shapes
    params, _ = model_state.split(jax.eval_shape(lambda b: _staged(cfg, nn.unbox(b)), boxed))
    if plan.shard_optimizer:
        lead = layout.lead_dims(plan.pipelined)  # stacked-layer dims: never the one padded
        zero_dims = jax.tree.map(lambda a, s, n: optim.zero_dim(a.shape, s, lead if n[:1] == ("layers",) else 0,
                                                                dict(mesh.shape)), params, param_specs,
                                 param_logical, is_leaf=is_names)
    else:
        zero_dims = jax.tree.map(lambda _: None, params)
    gathered = _gathered(plan, params, zero_dims)
    abstract_state = jax.eval_shape(lambda: _fresh_state(cfg, tx, zero_dims, _kept(zero_dims, gathered),
                                                         jax.random.key(0)))
    opt_specs = jax.tree.map(lambda a, s, z: optim.zero_spec(s, z, a.ndim), params, param_specs, zero_dims,
                             is_leaf=is_none)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: named(s), abstract_state.opt_state, opt_specs,
        transform_non_params=lambda _: named(P()), is_leaf=lambda x: isinstance(x, P))
    # parallel.overlap_param_gather: those weights live in the state as their optimizer shard
    state_param_specs = jax.tree.map(lambda z, s, g: optim.zero_spec(s, z, z.dim + 1) if g else s, zero_dims,
                                     param_specs, gathered, is_leaf=is_none)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    state_shardings = TrainState(
        step=named(P()), params=jax.tree.map(named, state_param_specs, is_leaf=is_spec),
        model_state=jax.tree.map(named, state_specs, is_leaf=is_spec), opt_state=opt_shardings,
        loss_scale=named(P()), good_steps=named(P()), bad_steps=named(P()))
    batch_shardings = {k: named(P(step_plan.DATA)) for k in BATCH_FIELDS + cfg.data.document_fields}
    return StepSetup(cfg, mesh, plan, logical, tx, abstract_state, state_shardings, batch_shardings, zero_dims,
                     params)


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
        params = layout.to_stages(params, cfg.stage_split, cfg.parallel.pipeline)
    return params


def _zero_layout(tree, zero_dims):
    """Parameter-shaped values in the optimizer's layout (padded where the distributed optimizer pads)."""
    return jax.tree.map(lambda x, z: optim.zero_pad(x, z), tree, zero_dims, is_leaf=lambda x: x is None)


def _fresh_state(cfg: Config, tx: optax.GradientTransformation, zero_dims, kept, rng: jax.Array) -> TrainState:
    return _state_from(cfg, tx, zero_dims, kept, _fresh_params(cfg, rng))


def _state_from(cfg: Config, tx: optax.GradientTransformation, zero_dims, kept, variables) -> TrainState:
    """Step 0 with these (staged) model variables and a fresh optimizer state; the weights the state keeps as
    their shards (`kept`: their zero dims) zero-padded as the optimizer pads them."""
    scale = cfg.optim.initial_loss_scale if cfg.model.compute_dtype == "float16" else 1.0
    params, state = model_state.split(variables)
    params = _zero_layout(params, kept)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=state,
                      opt_state=tx.init(_zero_layout(params, zero_dims)),
                      loss_scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                      bad_steps=jnp.zeros((), jnp.int32))


def init_state(setup: StepSetup, params=None) -> TrainState:
    """A fresh state, created directly in its shardings (no host copy of the full model), with parameters
    drawn from train.seed; or from `params`, the model's variables (canonical layout, e.g. NumPy arrays or
    `load_initial_params`: compiles no random init)."""
    cfg = setup.cfg
    with jax.set_mesh(setup.mesh):
        if params is None:
            return jax.jit(lambda key: _fresh_state(cfg, setup.tx, setup.zero_dims, setup.kept_zero_dims(), key),
                           out_shardings=setup.state_shardings)(jax.random.key(cfg.train.seed))
        return jax.jit(lambda p: _state_from(cfg, setup.tx, setup.zero_dims, setup.kept_zero_dims(), _staged(cfg, p)),
                       out_shardings=setup.state_shardings)(params)


def load_initial_params(setup: StepSetup, directory: str):
    """The model's variables from a params-only or training checkpoint (megajax.checkpoint.find_params), restored
    in the canonical layout ([L, ...] layers) onto this mesh, for `init_state`."""
    from megajax import checkpoint

    cfg, mesh = setup.cfg, setup.mesh
    source = checkpoint.find_params(directory)
    checkpoint.check_same_model(source.config.model, cfg.model, directory)
    canonical = model.abstract_params(cfg.model)
    target = jax.tree.map(lambda names, a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, step_plan.param_spec(names, setup.plan.moe_folds > 1,
                                                          setup.plan.vocab_over_pipeline))),
        setup.logical, canonical, is_leaf=lambda x: isinstance(x, tuple))
    return checkpoint.load_params(source, target)


def train_step(setup: StepSetup, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """One optimizer step on one global batch. Non-finite loss or gradients leave the weights and the
    optimizer state untouched (the step is counted as skipped)."""
    cfg = setup.cfg
    total = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    with step_plan.use(setup.plan):  # what the model reads while the step is traced
        loss_sum, grads = engines.compute_grads(setup, setup.variables(state), batch, state.loss_scale / total)
    grads, state_grads = model_state.split(grads)
    mcfg = cfg.model
    moved, moe_stats = model_state.step_update(state.model_state, state_grads, mcfg.num_experts, cfg.drops_tokens,
                                               mcfg.moe_router_bias_update_rate, mcfg.fp8_amax_history)
    if cfg.model.compute_dtype == "float16":  # (else the scale is 1: no pass over the gradients)
        grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
    loss = loss_sum / total
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # With the distributed optimizer, grads are already in its layout (padded, sharded over 'data'); the
    # params follow (a local slice), and the updates come back to the params' shape (the all-gather).
    updates, opt_state = setup.tx.update(grads, state.opt_state, _zero_layout(state.params, setup.zero_dims))
    updates = jax.tree.map(lambda u, p: optim.zero_unpad(u, p.shape), updates, state.params)
    params = optax.apply_updates(state.params, updates)
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
        step=state.step + 1, params=keep(params, state.params), model_state=keep(moved, state.model_state),
        opt_state=keep(opt_state, state.opt_state),
        loss_scale=loss_scale, good_steps=good, bad_steps=jnp.where(healthy, 0, state.bad_steps + 1))
    stats = {
        "loss": loss, "lr": optim.applied_lr(cfg.optim, cfg.train.steps, state.opt_state),
        "grad_norm": grad_norm, "param_norm": optax.tree.norm(new_state.params), "finite": finite,
        "loss_scale": state.loss_scale,
        "bad_steps": new_state.bad_steps, **moe_stats,
    }
    if cfg.train.log_update_norm:  # (the updates then leave the optimizer's fused pass: about 5% more bytes on CPU)
        stats["update_norm"] = optax.tree.norm(updates)
    return new_state, stats


def eval_loss(setup: StepSetup, params, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(summed token loss, token count) of a batch with the model's variables `params`, forward only: micro batch
    by micro batch under GSPMD, or in the train step's manual region with a pipeline (through it, never gathering
    the layers), context parallelism or expert parallelism (the experts' rows exchanged as in training, not every
    expert's partial outputs all-reduced)."""
    cfg, plan = setup.cfg, setup.plan
    m = plan.micro_batches
    with step_plan.use(plan):
        if plan.pipelined or plan.context > 1 or plan.expert > 1:
            def local(params, batch):
                batch = setup.local_batch(batch)
                if plan.pipelined:
                    return sharding.psum(gpipe.pipeline_loss(cfg, params, batch), step_plan.GRAD)
                loss, _ = jax.lax.scan(lambda total, mb: (total + model.loss_sum(
                    cfg.model, params, mb, model.side_inputs(cfg.model, 0, mb, False)), None),
                    step_plan.vary(jnp.zeros((), jnp.float32), step_plan.GRAD), micro_batches(batch, m))
                return sharding.psum(loss, step_plan.GRAD)

            # (the weights as the model computes with them: whole where the state keeps their optimizer shard)
            specs = (setup.compute_param_specs(), {k: P(step_plan.DATA) for k in batch})
            loss = engines.in_manual_region(plan, setup.mesh, local, specs, P())(params, batch)
        else:
            def body(total, mb):
                return total + model.loss_sum(cfg.model, params, mb, model.side_inputs(cfg.model, 0, mb, False)), None

            loss, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                   micro_batches(setup.whole_batch(batch), m, plan.data_ranks))
    return loss, jnp.sum(batch["loss_mask"])


def jit_train_step(setup: StepSetup):
    return jax.jit(lambda s, b: train_step(setup, s, b),
                   in_shardings=(setup.state_shardings, setup.batch_shardings),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)


@dataclasses.dataclass
class TrainSteps:
    """The compiled train step(s) of a run, called as fn(state, batch): `programs[0]` runs the run's first step and
    the last one every step after it. Two with delayed FP8 scaling (model/fp8.py): the first step's, where an
    operand without an amax history takes its own scale, and the later steps', whose scales come from the histories
    alone (StepPlan.fp8_histories_only: no cast waits for a reduction over its operand)."""
    programs: list
    steps: int = 0

    def __call__(self, state, batch):
        program = self.programs[min(self.steps, len(self.programs) - 1)]
        self.steps += 1
        return program(state, batch)


def compile_train_step(setup: StepSetup, state, batch, compiler_options: dict | None = None) -> TrainSteps:
    """The run's train step(s) lowered for `state` and `batch` (arrays or ShapeDtypeStructs) and compiled."""
    programs = [jit_train_step(setup).lower(state, batch).compile(compiler_options)]
    if fp8.delays(setup.cfg.model):
        programs.append(jit_train_step(later_steps(setup)).lower(state, batch).compile(compiler_options))
    return TrainSteps(programs)


def later_steps(setup: StepSetup) -> StepSetup:
    """The setup of every step but a run's first (`TrainSteps`): delayed FP8 scales from the histories alone."""
    return dataclasses.replace(setup, plan=dataclasses.replace(setup.plan, fp8_histories_only=True))


def jit_eval_step(setup: StepSetup):
    """eval_loss of a train state's variables on a batch: fn(state, batch) (the optimizer state goes unused)."""
    return jax.jit(lambda s, b: eval_loss(setup, setup.model_variables(s), b),
                   in_shardings=(setup.state_shardings, setup.batch_shardings))
