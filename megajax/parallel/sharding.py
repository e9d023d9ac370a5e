"""The device mesh and the train step's manual region: its collectives' order, its reductions and the one split
of a batch into micro batches. The logical-axis table and what model code runs under the plan are step_plan's.

Mesh axes, outermost first: replica, data, expert, pipeline, context, tensor. Tensor is innermost so that its
all-reduces stay inside a node (NVLink); the data ranks are outermost so that their once-per-step gradient reduction
crosses nodes. The data-parallel ranks are 'replica' x 'data' x 'expert' (DATA): 'replica' has
parallel.num_distributed_optimizer_instances devices (hybrid sharding's instances; 1 without), 'expert' has
parallel.expert devices (1 without expert parallelism), 'data' the rest. The distributed optimizer (and ZeRO-2/3)
shards over the data ranks of one instance ('data' x 'expert', `shard_axes`) and replicates over 'replica'. The
experts are sharded over 'expert' and exchange tokens over it (all-to-all); every other weight is data-parallel over
all three. 'context' splits every sequence (megajax/model/context.py): its
ranks hold other tokens of the same samples, so their gradients are summed like the data ranks' (GRAD).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from megajax.config import ConfigError, ParallelConfig
from megajax.parallel import step_plan
from megajax.parallel.step_plan import (AXES, GRAD, REPLICA, Axis, axes_of, current_manual_axes, keep_axes, spec_axes,
                                       varying_axes)


def make_mesh(parallel: ParallelConfig, devices: Sequence | None = None) -> Mesh:
    """A (replica, data, expert, pipeline, context, tensor) mesh over `devices` (default: every device of every
    process); ParallelConfig has checked that parallel.expert x parallel.num_distributed_optimizer_instances divides
    parallel.data.

    Devices are ordered process by process, so tensor (innermost) stays inside a host and the data ranks go across.
    The data-parallel rank of a device is its replica x data x expert index (replica major), whatever
    parallel.expert and the instances are.
    """
    devices = list(jax.devices() if devices is None else devices)
    d, p, c, t, e = parallel.data, parallel.pipeline, parallel.context, parallel.tensor, parallel.expert
    if d is None or d * p * c * t != len(devices):
        raise ConfigError(
            f"mesh data x pipeline x context x tensor = {d} x {p} x {c} x {t} does not match {len(devices)} "
            "devices: resolve the layout with Config.for_devices first"
        )
    devices.sort(key=lambda dev: (dev.process_index, dev.id))
    r = parallel.num_distributed_optimizer_instances
    grid = np.array(devices, dtype=object).reshape(r, d // (e * r), e, p, c, t)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# ----------------------------------------------------------------------------------------------------
# The train step's manual region (shard_map over 'data', 'expert', 'pipeline' and 'context', 'tensor' left to
# GSPMD; step_plan.MANUAL)


def manual_spec(spec: P, manual: Sequence[str]) -> P:
    """`spec` with only the manual axes kept (shard_map's specs may name nothing else)."""
    return P(*[keep_axes(a, lambda x: x in manual) for a in spec])


class CollectiveOrder:
    """One order of completion for the collectives of a traced region, on XLA's CPU runtime.

    XLA's CPU runtime orders the collectives of a computation only by when they start, and it counts a
    conditional or a loop as started as soon as it is, not when the collectives inside it run: the next
    collective may start while the conditional's is still waiting, so a device may wait in two collectives at
    once. The CPU client keeps threads for one wait per device (max(cores, devices)); on a small machine the
    waits take every thread and the step hangs until XLA aborts it (the interleaved pipeline with tensor 2 and
    sequence parallelism, on 4 devices of 2 cores, did in most runs). So each operation this runs (`cond`,
    `switch`, `ppermute`; or any, between `before` and `after`) reads a value the one before it wrote, which the
    runtime waits for: one collective at a time on each device, in program order, the same on every device.
    GPU programs are one schedule already (and an export is for another platform): there it does nothing.
    `megajax.hlo.unordered_collectives` finds what it leaves out in a compiled CPU program (the layout tests
    check every program they run)."""

    def __init__(self, mark: jax.Array | None = None):
        self.on = step_plan.in_force().platform == "cpu"
        self._last = mark if self.on else None  # a scalar the last ordered operation wrote (or `mark`, the `mark` of
        # an order before this one: a loop's previous iteration)

    @property
    def mark(self) -> jax.Array | None:
        """A scalar written once every ordered operation so far has finished (None: off, or none yet): what a
        loop carries to the next iteration's order, and what a fence after the loop waits for without reading
        the loop's results (an element of an array sharded over an automatic axis is a collective to read)."""
        return self._last

    def before(self, x: jax.Array) -> jax.Array:
        """x, read only once the last ordered operation has finished (the same value)."""
        if not self.on or self._last is None:
            return x
        return _after(x, self._last)

    def before_if_varying(self, x: jax.Array) -> jax.Array:
        """`before`, where x varies over every manual axis the last ordered operation's output does; else x as it is
        (a value replicated over an axis the other varies over cannot wait for it without a collective, and shard_map
        would refuse it as an output replicated there)."""
        if not self.on or self._last is None or not varying_axes(x) >= varying_axes(self._last):
            return x
        return _after(x, self._last)

    def after(self, outputs, inputs=()):
        """Marks `outputs` of ordered operations as what the next one waits for (returns them): each of its
        results that is not one of its `inputs` (jax forwards a conditional's operand that every branch passes
        through, and XLA would not wait for the conditional to read it). Each result may come from a collective
        of its own (XLA moves a loop's reductions out of it), so the mark reads an element of every one."""
        if self.on:
            given = {id(a) for a in jax.tree.leaves(inputs)}
            made = [_first(a).astype(jnp.float32) for a in jax.tree.leaves(outputs) if id(a) not in given and a.size]
            if made:  # (and the mark before: outputs XLA folds to constants would end the chain)
                self._last = functools.reduce(jnp.add, made if self._last is None else [self._last, *made])
        return outputs

    def cond(self, pred, true_fn, false_fn, *operands):
        """`cond`, in order."""
        return self.after(cond(self.before(pred), true_fn, false_fn, *operands), operands)

    def switch(self, index, branches, *operands):
        """jax.lax.switch, in order."""
        return self.after(jax.lax.switch(self.before(index), branches, *operands), operands)

    def ppermute(self, x, axis_name, perm):
        """jax.lax.ppermute, in order."""
        return self.after(jax.lax.ppermute(self.before(x), axis_name, perm))


def cond(pred, true_fn, false_fn, *operands):
    """jax.lax.cond as a two-way switch whose first branch is false_fn (the pipeline's pass-through or zeros).
    jax.lax.cond lowers to a case on convert(pred), which XLA turns into a conditional on the predicate with the true
    branch first: a buffer the true branch updates in place and the false one passes through is then copied. With
    the pass-through first XLA copied less, but not never (the executor keeps its accumulators out of conditionals:
    `executor.backward`)."""
    return jax.lax.switch(jnp.asarray(pred).astype(jnp.int32), (false_fn, true_fn), *operands)


def _first(a: jax.Array) -> jax.Array:
    """a's first element, read by index: through a flattening reshape, GSPMD gathers a whole tensor-sharded array.
    A float's gradient is zeros broadcast from the cotangent (read from it, so the backward stays ordered), not
    the cotangent padded into a's first element, which on a tensor-sharded array is a collective-permute."""
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return a[(0,) * a.ndim]
    return _first_inexact(a)


@jax.custom_vjp
def _first_inexact(a: jax.Array) -> jax.Array:
    return a[(0,) * a.ndim]


def _first_fwd(a: jax.Array):
    return a[(0,) * a.ndim], jax.ShapeDtypeStruct(a.shape, a.dtype)


def _first_bwd(like, g: jax.Array):
    return (jnp.broadcast_to(jnp.where(g < -jnp.inf, g, jnp.zeros_like(g)), like.shape).astype(like.dtype),)


_first_inexact.defvjp(_first_fwd, _first_bwd)


@jax.jit
def _after(x: jax.Array, last: jax.Array) -> jax.Array:
    """x, computed from `last` too: `last < -inf` is false for every float (NaN too), but XLA's simplifier does not
    know it (a constant false behind an optimization barrier did not survive XLA's CPU passes). `megajax.divergence`
    proves it false, so the gate adds nothing to what the result may differ over. (A boolean x takes its negation
    there: `x + last` is x | last, which XLA folds to true where x is a constant true, a peeled tick's predicate.)"""
    other = jnp.logical_not(x) if x.dtype == jnp.bool_ else x + last.astype(x.dtype)
    return jnp.where(last < -jnp.inf, other, x)


def psum(x, axis: Axis):
    """psum over the mesh axes `axis` inside the train step's region, skipping those that are not manual
    (they have one device: StepPlan.manual); the identity when none is."""
    axes = tuple(a for a in axes_of(axis) if a in current_manual_axes())
    return jax.lax.psum(x, axes) if axes else x


def unsplit_data_axes(spec: P) -> tuple[str, ...]:
    """The axes of GRAD a parameter with `spec` is replicated over: those its gradient is summed over and (but
    'replica', `shard_axes`) its distributed-optimizer state is sharded over (every one for a dense weight;
    'replica', 'data' and 'context' for an expert weight, sharded over 'expert'). Megatron's data-parallel group
    with context parallelism."""
    used = spec_axes(spec)
    return tuple(a for a in GRAD if a not in used)


def shard_axes(spec: P) -> tuple[str, ...]:
    """The axes the distributed optimizer (and ZeRO-2/3) shards a parameter with `spec` over: `unsplit_data_axes`
    within one instance of hybrid sharding (without 'replica', over which the shards are replicated and their
    gradients summed once a step)."""
    return tuple(a for a in unsplit_data_axes(spec) if a != REPLICA)


def micro_batches(batch: dict, m: int, data: int = 1) -> dict:
    """The one split of a batch into m micro batches, for training, the pipeline and evaluation alike: each
    data rank's local row r goes to micro batch r // mb. Inside the train step's shard_map a rank holds its
    own rows [m * mb, ...] (data = 1); a global batch [data * m * mb, ...] (the data ranks' rows one after
    the other, as the batch sharding places them) becomes [m, data * mb, ...]: micro batch i is every
    rank's local micro batch i, so it stays split over 'data'."""
    def split(x):
        x = x.reshape(data, m, x.shape[0] // (data * m), *x.shape[1:])
        return x.swapaxes(0, 1).reshape(m, -1, *x.shape[3:])

    return jax.tree.map(split, batch)
