"""Every parallel decision of one train step, made once: `StepPlan.resolve(cfg)`.

The step reads its layout from this one frozen value and nothing else: step.py's gradient engine (pipelined or
not, which reductions and gathers run inside the backward), the pipeline executor and its tick tables, the overlap
code, the audit, and the model. The model reads the plan in force while a step is traced (`use`, `current`):
the one context variable of megajax, kept because passing the plan explicitly would thread it through every
layer of every architecture. Outside a step (generation, a test that applies a module) no plan is in force and
the model runs on one device's terms: no constraint, no exchange, whole sequences.

This module is all of parallel/ that the model and the kernels see: the plan in force, the one table from logical
axis names to mesh axes that the plan applies (`param_spec`, `constrain`), and the typing of values inside the step's
manual region (`vary`, `varying_axes`, `tensor_manual`). The mesh, the region's collectives and their order are
sharding.py's, below the model.

What the plan holds, and who reads it:

| field | the decision | read by |
|---|---|---|
| replica, data, expert, pipeline, context, tensor | the mesh's sizes | everything below |
| manual | the axes the step's shard_map region makes manual (each of MANUAL with more than one device) | step, engines |
| pipelined, engine, schedule, virtual_stages, micro_batches, stage_split | the gradient engine: a schedule, or a scan over micro batches; the layers of each pipeline chunk | engines, executor, gpipe, ticks |
| vocab_over_pipeline | the embedding and output layer split over the pipeline ranks, run in lock step | `param_spec`, pipeline |
| sequence_parallel | the residual stream sharded over 'tensor' (the activation rules) | `constrain` |
| context_comm, context_a2a | how attention crosses the context ranks: ring, all_gather, a2a, a2a+ring or a2a+all_gather (and the all-to-all groups) | model/context.py, model/ring.py |
| tp_overlap | sequence parallelism's collectives as rings ("ring"), chunks ("chunks", in a pipeline) or plain (None) | model/collective_matmul.py |
| moe_folds, moe_ragged, moe_buffer_factor | the experts' exchange (parallel folding, ragged all-to-all) | model/moe/exchange.py |
| shard_optimizer, zero_stage | ZeRO-1: the optimizer state sharded over the data (and context) ranks of an instance ('replica': hybrid sharding); zero_stage 0-3 | step.build, ticks |
| overlap_param_gather | with the distributed optimizer, the weights kept as their optimizer shard where it is unpadded | step |
| overlap_comm_ratio | the most layers an idle pipeline tick reduces and gathers (0: no cap) | ticks |
| reduce_in_backward | the data-parallel gradient reductions issued layer by layer in the backward | step, ticks, overlap |
| gather_in_forward | the weights kept as optimizer shards, gathered under the next forward | step, ticks |
| shard_grads | ZeRO-2/3: every micro batch's gradients reduce-scattered in its backward, summed as shards | step |
| shard_params | ZeRO-3: the weights kept as shards, gathered by layer in each forward and backward | step, overlap |
| shard_ends | ZeRO-3 without a pipeline: the embedding and head sharded like the layers, in every micro batch | engines, step, the planner's memory |
| platform | the platform of the mesh's devices ("cpu", "gpu"), set by `step.build`; None where the step is lowered for another (an export) | `platform_dependent`: the kernels, collective matmuls, MoE, the loss; `sharding.CollectiveOrder` (CPU) |
| unroll_layers | every loop over layers unrolled in the program (model.scan_layers, or its auto rule) | model.scan_layers, the planner |
| fp8_histories_only | delayed FP8 scales from the amax histories alone: the program of every step but a run's first (`step.compile_train_step`) | model/fp8.py |

A mesh axis of size 1 is never manual: XLA rejects a reduction over a manual axis of size 1 when every manual axis
has size 1 (jax 0.10.2: "Cross-partition allreduce must be in (partial) manual partitioning mode"), and such an
axis has nothing to reduce. So "is 'context' manual" and "context > 1" are the same question; the plan answers
both, and `sharding.psum` skips an axis that is not manual.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.config import Config, StageSplit

MANUAL = ("replica", "data", "expert", "pipeline", "context")  # the axes the step may make manual (not 'tensor')


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The resolved layout of one train step (see the module docstring for who reads which field)."""

    replica: int = 1  # the mesh's 'replica' axis: hybrid sharding's instances
    data: int = 1  # the mesh's 'data' axis: data-parallel ranks / (expert x replica)
    expert: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    manual: tuple[str, ...] = ()
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    stage_split: StageSplit | None = None  # the layers of each pipeline chunk (config.pipeline_split)
    vocab_over_pipeline: bool = False  # the embedding and output layer vocab-parallel over pipeline x tensor
    sequence_parallel: bool = False
    context_comm: str = "ring"  # "ring", "all_gather", "a2a", "a2a+ring" or "a2a+all_gather" (auto resolved)
    # the adjacent context ranks of one all-to-all group: context under a2a, parallel.context_a2a_size under
    # a2a+ring and a2a+all_gather, 1 (none) under ring and all_gather
    context_a2a: int = 1
    tp_overlap: str | None = None  # "ring", "chunks" or None
    moe_folds: int = 1  # tensor ranks that route their own sequence shard and hold whole experts (expert_tensor=1)
    moe_ragged: bool = False  # dropless rows exchanged by exact counts (parallel.expert_all_to_all=ragged)
    moe_buffer_factor: float | None = None  # ragged: a rank receives at most this times one rank's routed rows
    shard_optimizer: bool = False  # the distributed optimizer (ZeRO-1), where there are data or context ranks
    overlap_param_gather: bool = False  # parallel.overlap_param_gather
    overlap_comm_ratio: float = 0.0  # parallel.overlap_comm_ratio
    reduce_in_backward: bool = False  # parallel.overlap_grad_reduce, where there are data ranks to reduce over
    gather_in_forward: bool = False  # parallel.overlap_param_gather (with the distributed optimizer), or ZeRO-3
    shard_grads: bool = False  # data_parallel_sharding_strategy optim_grads or optim_grads_params, with data ranks
    shard_params: bool = False  # data_parallel_sharding_strategy optim_grads_params, with data ranks
    platform: str | None = None  # the devices' platform (step.build, from the mesh): see `platform_dependent`
    unroll_layers: bool = False  # model.scan_layers=false, or null on a layout `_unrolls` keeps in memory
    fp8_histories_only: bool = False  # no delayed FP8 scale from an operand's own amax (after a run's first step)

    @property
    def data_ranks(self) -> int:
        """The ranks a batch is split over: 'replica' x 'data' x 'expert' (experts and instances divide the
        data-parallel ranks)."""
        return self.replica * self.data * self.expert

    @property
    def zero_stage(self) -> int:
        """0: nothing sharded over the data ranks; 1: the optimizer state; 2: also the gradients; 3: also the
        weights."""
        return 3 if self.shard_params else 2 if self.shard_grads else 1 if self.shard_optimizer else 0

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1

    @property
    def shard_ends(self) -> bool:
        """ZeRO-3 without a pipeline: the embedding, final norm and output layer gathered in every micro batch and
        their gradients reduce-scattered in its backward, like the layers' (else summed whole over the micro batches
        and reduced once, engines.sharded_grads; a pipeline keeps them whole on the ranks that use them)."""
        return self.shard_params and not self.pipelined

    @property
    def engine(self) -> str:
        """The gradient engine (engines.ENGINES): "pipelined" (a schedule), "sharded" (ZeRO-2/3: a scan over micro
        batches each of whose backwards reduce-scatters its gradients layer by layer), "overlapped" (a scan over
        micro batches whose last backward issues the data-parallel reductions layer by layer) or "plain" (a scan,
        reduced after)."""
        if self.pipelined:
            return "pipelined"
        return "sharded" if self.shard_grads else "overlapped" if self.reduce_in_backward else "plain"

    @classmethod
    def resolve(cls, cfg: Config, platform: str | None = None) -> StepPlan:
        """The plan of `cfg`, resolved for its devices (Config.for_devices), on the mesh sharding.make_mesh builds
        from it, whose devices are of `platform` ("cpu", "gpu"; None: not known, as in an export)."""
        par = cfg.parallel
        if par.data is None:
            raise ValueError("StepPlan.resolve needs the layout resolved for the devices: call Config.for_devices")
        r = par.num_distributed_optimizer_instances
        shape = {"replica": r, "data": par.data // (par.expert * r), "expert": par.expert, "pipeline": par.pipeline,
                 "context": par.context, "tensor": par.tensor}
        pipelined = shape["pipeline"] > 1
        comm = par.context_comm if par.context_comm != "auto" else "all_gather" if pipelined else "ring"
        # the ranks the optimizer state is sharded over ('data' x 'expert' x 'context', one instance's): ZeRO needs
        # some
        zero_ranks = par.shard_ranks > 1
        shards = par.shards_grads and zero_ranks
        reduce = (par.overlap_grad_reduce and par.data > 1) or shards
        plan = cls(
            replica=r, data=shape["data"], expert=shape["expert"], pipeline=shape["pipeline"], context=shape["context"],
            tensor=shape["tensor"], manual=tuple(a for a in MANUAL if shape[a] > 1), schedule=par.schedule,
            virtual_stages=par.virtual_stages, micro_batches=cfg.num_micro_batches, stage_split=cfg.stage_split,
            # (null: not with the idle ticks' data-parallel reductions, whose order beside the lock step's collectives
            # XLA's CPU runtime does not keep: docs/features/pipeline-schedules.md#limits)
            vocab_over_pipeline=par.vocab_over_pipeline if par.vocab_over_pipeline is not None else (
                pipelined and cfg.model.padded_vocab_size % (par.pipeline * par.tensor) == 0 and
                not (par.overlap_grad_reduce and not par.shards_grads) and
                _tables_outweigh_moves(cfg.model, cfg.train.micro_batch_size, cfg.num_micro_batches, par.tensor,
                                       par.context, par.sequence_parallel)),
            sequence_parallel=par.sequence_parallel,
            context_comm=comm, context_a2a=par.context if comm == "a2a" else cfg.context_a2a_size or 1,
            # a ppermute inside the pipeline's per-rank branches deadlocks: chunked collectives there
            tp_overlap=("chunks" if pipelined else "ring") if par.tp_comm_overlap and shape["tensor"] > 1 else None,
            moe_folds=shape["tensor"] if par.folded_experts else 1, moe_ragged=par.expert_all_to_all == "ragged",
            moe_buffer_factor=par.expert_buffer_factor, shard_optimizer=par.shards_optimizer and zero_ranks,
            overlap_param_gather=par.overlap_param_gather, overlap_comm_ratio=par.overlap_comm_ratio,
            reduce_in_backward=reduce,
            gather_in_forward=(reduce and par.overlap_param_gather and par.shards_optimizer)
            or (shards and par.shards_params),
            shard_grads=shards, shard_params=shards and par.shards_params, platform=platform)
        scan = cfg.model.scan_layers
        return dataclasses.replace(plan, unroll_layers=plan._unrolls() if scan is None else not scan)

    def _unrolls(self) -> bool:
        """model.scan_layers=null's rule: unroll the layers where the step runs on GPUs and no collective can be
        scheduled among its layers. Unrolled, a loop's copies of each layer's residuals and bf16 weights into and
        out of [layers, ...] stacks go (8-16% of a one-GPU step), and on one GPU or data parallelism over micro
        batches the peak falls. But XLA's scheduler moves the collectives of straight-line code, with the buffers
        they fill, across layers: those inside the layers (benchmarks/2026-11-27-compile-only-scan-layers.md: the
        8B preset's rings 46 -> 61 GiB, 70B FSDP 55 -> 262 GiB), and the data-parallel reduction of a step of one
        micro batch, which no loop over micro batches then keeps after the backward (the SC21 GPT 1.7B on 32 GPUs
        35 -> 67 GiB, benchmarks/2026-11-28-compile-only-fast-defaults.md). On CPU the loop compiles faster."""
        inside = (self.pipelined or self.tensor > 1 or self.context > 1 or self.expert > 1 or self.moe_folds > 1
                  or self.reduce_in_backward or self.gather_in_forward or self.shard_grads)
        reduction_beside = self.data_ranks > 1 and self.micro_batches == 1
        return self.platform not in (None, "cpu") and not inside and not reduction_beside


def _tables_outweigh_moves(m, micro_batch: int, micro_batches: int, tensor: int, context: int,
                           sequence_parallel: bool) -> bool:
    """parallel.vocab_over_pipeline=null's rule (where the padded vocabulary divides over pipeline x tensor): split
    the embedding and output layer over the pipeline ranks where the bytes it frees on a rank (their fp32 weights
    and gradients, 8 bytes a parameter over 'tensor') exceed the bytes it moves a step (four all-reduces over the
    pipeline ranks of each micro batch's bf16 [tokens, hidden] activation, its tokens split over 'tensor' with
    sequence parallelism): DeepSeek-V3 in DeepSeek's layout (a 129k vocabulary untied, no tensor parallelism, 48
    micro batches of 4096 tokens) frees 14.8 GB for 11.3 GB moved; Llama 3.1 405B's preset (tensor 8 with sequence
    parallelism, 64 micro batches of 8192) would free 4.2 GB for 8.6 GB."""
    tables = 8 * m.padded_vocab_size * m.hidden_size * (1 if m.tied else 2) / tensor
    tokens = micro_batch * m.seq_length / context / (tensor if sequence_parallel else 1)
    return tables > 4 * 2 * micro_batches * tokens * m.hidden_size


_PLAN: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar("megajax_step_plan", default=None)


@contextlib.contextmanager
def use(plan: StepPlan | None):
    """While a step (or its eval) is traced, the model reads `plan` (`current`); then the plan in force before."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def current() -> StepPlan | None:
    """The plan of the step being traced (inside `use`), else None: one device's terms."""
    return _PLAN.get()


ONE_DEVICE = StepPlan()  # what the model reads where no plan is in force


def in_force() -> StepPlan:
    """`current()`, or ONE_DEVICE outside a step."""
    return _PLAN.get() or ONE_DEVICE


def platform_dependent(*args, cpu, default):
    """`cpu(*args)` on CPU, else `default(*args)`: chosen when the step is traced, by the platform of the step in
    force (StepPlan.platform). Outside a step, or in a step exported for another platform (platform None), the
    choice is `lax.platform_dependent`'s, made when the program is lowered; its conditional stays in the jaxpr,
    and XLA's GPU scheduler hid less around it (59% of a pipeline's chunked reduce-scatters under GEMMs, against
    89% without: tests/test_audit.py::test_tp_comm_overlap_hides_the_tensor_collectives_in_a_pipeline_on_h100)."""
    platform = in_force().platform
    if platform is None:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return (cpu if platform == "cpu" else default)(*args)


# ----------------------------------------------------------------------------------------------------
# The one table from logical axis names to mesh axes, and the plan in force applied to an activation.
#
# Logical names (one vocabulary for parameters and activations):
#   batch, seq, embed, heads, kv_heads, head_dim, mlp, vocab, layers (and chunk, stage under a pipeline)
# Parameters and activations have separate rules: the sequence axis of the residual stream is sharded over
# 'tensor' only with sequence parallelism, and only activations are sharded over 'data'.

AXES = ("replica", "data", "expert", "pipeline", "context", "tensor")
REPLICA = "replica"  # hybrid sharding's instances (parallel.num_distributed_optimizer_instances)
DATA = ("replica", "data", "expert")  # the data-parallel ranks: the batch is split over all three
GRAD = (*DATA, "context")  # the ranks that see other tokens of the batch: gradients and losses are summed over them

Axis = str | tuple[str, ...] | None

# logical name -> mesh axis (None: replicated)
PARAM_RULES: dict[str, Axis] = {
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "expert",
    "layers": None,
    "chunk": None,  # the staged pipeline layout [chunk, stage, layers, ...] (megajax.parallel.pipeline.layout)
    "stage": "pipeline",
}
VOCAB_OVER_PIPELINE = ("pipeline", "tensor")  # the vocabulary's ranks with StepPlan.vocab_over_pipeline
FOLDED = ("expert", "tensor")  # the experts' ranks with parallel.expert_tensor=1 (Megatron's MoE parallel folding)


def activation_rules(sequence_parallel: bool) -> dict[str, Axis]:
    return {
        "batch": DATA,
        "seq": "tensor" if sequence_parallel else None,
        "embed": None,
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "mlp": "tensor",
        "vocab": "tensor",
        "folded_expert": FOLDED,  # the folded experts' buffers (parallel.expert_tensor=1): one expert rank a device
    }


def current_activation_rules() -> dict[str, Axis]:
    """The activation rules of the step plan in force (`use`), else those without sequence parallelism."""
    return activation_rules(in_force().sequence_parallel)


def axes_of(axis: Axis) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def spec_axes(spec: P) -> set[str]:
    """Every mesh axis a PartitionSpec splits over."""
    return {a for entry in spec for a in axes_of(entry)}


def keep_axes(axis: Axis, keep) -> Axis:
    """One PartitionSpec entry with only the mesh axes for which keep(axis) holds (None when none does)."""
    kept = tuple(a for a in axes_of(axis) if keep(a))
    return None if not kept else kept[0] if len(kept) == 1 else kept


def spec_for(names: Sequence[str | None], rules: dict[str, Axis]) -> P:
    """Logical names -> PartitionSpec. A mesh axis is used at most once (later dims fall back to None)."""
    used, out = set(), []
    for name in names:
        axis = keep_axes(rules.get(name) if name is not None else None, lambda a: a not in used)
        used.update(axes_of(axis))
        out.append(axis)
    return P(*out)


def param_spec(names: Sequence[str | None], folded_experts: bool = False, vocab_over_pipeline: bool = False) -> P:
    """A parameter's PartitionSpec. With folded_experts (parallel.expert_tensor=1) the experts are spread over
    'expert' x 'tensor' and each one stays whole (its 'mlp' dim falls back to None: 'tensor' is taken). With
    vocab_over_pipeline (StepPlan's) the vocabulary is split over 'pipeline' x 'tensor' (pipeline/vocab.py)."""
    rules = dict(PARAM_RULES)
    if folded_experts:
        rules["expert"] = FOLDED
    if vocab_over_pipeline:
        rules["vocab"] = VOCAB_OVER_PIPELINE
    return spec_for(names, rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by logical names (while a step plan is in force, `use`; else a no-op).

    Mesh axes that are manual in the surrounding shard_map (data and pipeline inside the pipeline) or
    absent from the mesh are dropped, so the same model code runs under GSPMD and inside shard_map.
    """
    plan = current()
    if plan is None:
        return x
    rules = activation_rules(plan.sequence_parallel)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = set(getattr(mesh, "manual_axes", ()))
    live = {k: keep_axes(v, lambda a: a in mesh.axis_names and a not in manual and mesh.shape[a] > 1)
            for k, v in rules.items()}
    return jax.lax.with_sharding_constraint(x, spec_for(names, live))


# ----------------------------------------------------------------------------------------------------
# The step's manual region, as model code sees it (shard_map over MANUAL's axes with more than one device)

def current_manual_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(getattr(mesh, "manual_axes", ()))


def varying_axes(x) -> frozenset:
    """The manual mesh axes x (an array, or its abstract value: a remat policy's arguments) varies over."""
    aval = x if hasattr(x, "manual_axis_type") else jax.typeof(x)
    return frozenset(aval.manual_axis_type.varying)


def vary(tree, axes: Sequence[str] | None = None):
    """Marks every leaf as varying over `axes` (default: every manual axis of the current region): scan
    carries, switch branches and vjp cotangents inside shard_map must agree on their varying axes."""
    want = current_manual_axes() if axes is None else tuple(a for a in axes if a in current_manual_axes())

    def one(x):
        need = tuple(a for a in want if a not in varying_axes(x))
        return jax.lax.pcast(x, need, to="varying") if need else x

    return jax.tree.map(one, tree)


def zeros_varying_like(shapes):
    """Zeros shaped, typed and varying like each leaf of `shapes` (arrays, or jax.eval_shape's): what a branch that
    runs nothing returns in place of the other branch's results."""
    return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype), varying_axes(a)), shapes)


def tensor_manual(fn, args, in_specs, out_spec):
    """fn(*args) with 'tensor' manual (a shard_map nested in the train step's region), without jax's varying-axes
    checks inside: under the train step's manual 'data', they add input-free equations (pvary of literals) that a
    layer scan's linearization moves out of the region as residual inputs, to which jax 0.10.2 gives a sharding
    XLA rejects ("manual axis tensor after free axis data"). The results vary over every outer manual axis the
    arguments vary over, as checked ones would. jax 0.10.2 cannot differentiate such a region: its callers give
    it a custom VJP."""
    mesh = jax.sharding.get_abstract_mesh()
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, axis_names={"tensor"},
                        check_vma=False)(*args)
    return vary(out, sorted(set().union(*map(varying_axes, args))))
