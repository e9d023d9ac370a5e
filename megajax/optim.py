"""The optimizer: AdamW with Megatron's learning-rate schedule, global-norm clipping, no weight decay on
norms and biases, and fp16 dynamic loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from megajax.config import OptimConfig


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
    """Weight decay only on matrices: a parameter with at least two axes besides the stacked 'layers'
    (and pipeline 'stage') axes. Norm scales and biases are left alone, as in Megatron."""
    def is_matrix(names):
        return sum(n not in ("layers", "stage") for n in names) >= 2

    return jax.tree.map(is_matrix, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


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


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, finite: jax.Array,
                      cfg: OptimConfig) -> tuple[jax.Array, jax.Array]:
    """Dynamic loss scaling: halve on overflow, double after `loss_scale_growth_interval` good steps."""
    grow = finite & (good_steps + 1 >= cfg.loss_scale_growth_interval)
    new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), jnp.maximum(scale / 2.0, cfg.min_loss_scale))
    new_good = jnp.where(finite & ~grow, good_steps + 1, 0)
    return new_scale, new_good
