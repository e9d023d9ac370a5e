"""The optimizer: AdamW with Megatron's learning-rate schedule, global-norm clipping, no weight decay on
norms and biases, fp16 dynamic loss scaling, and the distributed optimizer's layout.

The distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer) keeps each parameter's
optimizer state sharded over the data-parallel ranks that replicate it (all of them; an expert weight's
'data' ranks only; with hybrid sharding those of one instance, the instances holding replicas), at any data
size: the state of a parameter is stored with one dim zero-padded to a multiple of that many ranks (of
tensor x those where that dim is also tensor-sharded) and split over them. Gradients are padded the same way
and reduce-scattered onto that layout, AdamW runs on each rank's shard (the padding holds zero gradients, zero
moments and zero updates), and the updates are sliced back and all-gathered. As Megatron's padded flat
buffer, this shards 100% of the state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from megajax.config import OptimConfig
from megajax.parallel import sharding


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to lr over warmup_steps, then cosine or linear decay to min_lr at decay_steps."""
    decay_steps = cfg.decay_steps or total_steps
    warmup = cfg.warmup_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.lr * (step + 1) / max(warmup, 1)
        frac = jnp.clip((step - warmup) / max(decay_steps - warmup, 1), 0.0, 1.0)
        if cfg.decay == "cosine":
            decayed = cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + jnp.cos(jnp.pi * frac))
        elif cfg.decay == "linear":
            decayed = cfg.lr - (cfg.lr - cfg.min_lr) * frac
        else:
            decayed = jnp.asarray(cfg.lr, jnp.float32)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def decay_mask(logical_axes) -> dict:
    """Weight decay only on matrices: a parameter with at least two axes besides the stacked 'layers' axis
    (the canonical layout's names). Norm scales and biases are left alone, as in Megatron."""
    return jax.tree.map(lambda names: sum(n != "layers" for n in names) >= 2, logical_axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(cfg: OptimConfig, total_steps: int, logical_axes) -> optax.GradientTransformation:
    parts = []
    if cfg.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_grad))
    parts += [
        optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(logical_axes)),
        optax.scale_by_learning_rate(lr_schedule(cfg, total_steps)),
    ]
    return optax.chain(*parts)


def applied_lr(cfg: OptimConfig, total_steps: int, opt_state) -> jax.Array:
    """The learning rate the next update applies: the schedule at optax's own step count, which a
    skipped (non-finite) step does not advance."""
    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=_is_schedule_state)
              if _is_schedule_state(s)]
    return lr_schedule(cfg, total_steps)(counts[0])


def _is_schedule_state(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, finite: jax.Array,
                      cfg: OptimConfig) -> tuple[jax.Array, jax.Array]:
    """Dynamic loss scaling: halve on overflow, double after `loss_scale_growth_interval` good steps."""
    grow = finite & (good_steps + 1 >= cfg.loss_scale_growth_interval)
    new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), jnp.maximum(scale / 2.0, cfg.min_loss_scale))
    new_good = jnp.where(finite & ~grow, good_steps + 1, 0)
    return new_scale, new_good


@dataclasses.dataclass(frozen=True)
class ZeroDim:
    """Where the distributed optimizer shards one parameter's state: dim `dim`, padded to `size`,
    split over the mesh axes `axes`: the data-parallel axes of one instance that replicate the parameter
    (sharding.shard_axes: ('data', 'expert'), or ('data',) for an expert weight; never 'replica'), after 'tensor'
    for a dim already tensor-sharded."""

    dim: int
    size: int
    axes: tuple[str, ...]

    @property
    def data_only(self) -> bool:
        """The shard is a slice over the data ranks alone (not of a tensor-sharded dim split further): the
        gradient can be reduce-scattered onto it, and the weight all-gathered from it, over the data ranks."""
        return "tensor" not in self.axes


def zero_dim(shape: tuple[int, ...], spec: P, lead: int, mesh_shape: dict) -> ZeroDim | None:
    """The dim that shards a parameter's optimizer state over its data-parallel ranks.

    The largest dim that is not tensor-sharded, else the largest tensor-sharded one, never one of the
    `lead` stacked-layer dims: the choice depends only on the model, so a checkpoint moves between data
    sizes (and pipeline layouts) by padding or slicing that one dim."""
    spec = list(spec) + [None] * (len(shape) - len(spec))
    free = [i for i in range(lead, len(shape)) if spec[i] is None]
    split = [i for i in range(lead, len(shape)) if spec[i] == "tensor"]
    candidates = free or split
    if not candidates:
        return None
    dim = max(candidates, key=lambda i: (shape[i], -i))
    data = sharding.shard_axes(P(*spec))
    axes = data if spec[dim] is None else ("tensor", *data)
    ways = math.prod(mesh_shape[a] for a in axes)
    return ZeroDim(dim, ways * math.ceil(shape[dim] / ways), axes)


def zero_spec(spec: P, z: ZeroDim | None, ndim: int) -> P:
    """The optimizer-state PartitionSpec of a parameter with spec `spec`."""
    if z is None:
        return spec
    parts = list(spec) + [None] * (ndim - len(spec))
    parts[z.dim] = z.axes if len(z.axes) > 1 else z.axes[0]
    return P(*parts)


def zero_pad(x: jax.Array, z: ZeroDim | None) -> jax.Array:
    """A parameter (or its gradient) in the optimizer's layout: dim z.dim zero-padded to z.size."""
    if z is None or x.shape[z.dim] == z.size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[z.dim] = (0, z.size - x.shape[z.dim])
    return jnp.pad(x, widths)


def zero_unpad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Back from the optimizer's layout to the parameter's shape."""
    return x if x.shape == tuple(shape) else x[tuple(slice(0, n) for n in shape)]
