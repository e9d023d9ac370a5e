"""The data-parallel gradient reduction issued inside the backward, layer by layer (Megatron's
--overlap-grad-reduce), so that XLA's GPU scheduler runs each layer's all-reduce under the backward GEMMs of
the layers before it.

Without it the step sums its micro batches' gradients locally and reduces them once after the whole backward:
one all-reduce that nothing can overlap. Here the micro batches before the last are summed locally as before;
the last one runs with each weight behind `reducing_identity`: an identity whose backward adds the earlier micro
batches' sum and reduces over the weight's data-parallel axes. The layers run as a scan of single blocks, so the
hook sits inside the loop and its backward (one reduction per layer) inside the backward loop. The bytes and
the order of the sums are today's: (earlier micro batches + last) summed locally, then over the data ranks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from megajax import model, sharding
from megajax.config import Config


@functools.lru_cache(maxsize=None)
def reducing_identity(axes: tuple[str, ...], with_acc: bool):
    """identity(w[, acc]) -> w marked varying over `axes`; backward: psum(cotangent [+ acc], axes) for w.

    `w` is the weight as the step receives it (invariant over its data-parallel axes), so the sum's invariant
    result is a valid cotangent for it; `acc` (the earlier micro batches' local gradient) gets none."""
    if with_acc:
        @jax.custom_vjp
        def hook(w, acc):
            return sharding.vary(w, axes)

        hook.defvjp(lambda w, acc: (sharding.vary(w, axes), acc),
                    lambda acc, ct: (sharding.psum(ct + acc, axes), None))
    else:
        @jax.custom_vjp
        def hook(w):
            return sharding.vary(w, axes)

        hook.defvjp(lambda w: (sharding.vary(w, axes), None), lambda _, ct: (sharding.psum(ct, axes),))
    return hook


def _hooked(params, acc, axes):
    if acc is None:
        return jax.tree.map(lambda w, a: reducing_identity(a, False)(w), params, axes)
    return jax.tree.map(lambda w, g, a: reducing_identity(a, True)(w, g), params, acc, axes)


def reducing_loss(cfg: Config, params, acc, axes, mb: dict, seed_scale: jax.Array):
    """(seed_scale * summed token loss, summed token loss) of one micro batch, whose gradient w.r.t. `params`
    is (that micro batch's + `acc`) reduced over each weight's data-parallel `axes` (a tree of axis tuples
    shaped like params; `acc` None: nothing to add), issued per layer in the backward."""
    mcfg = cfg.model
    keys = model.dropout_keys(mcfg, cfg.train.seed, mb["sample_ids"])
    top = {k: v for k, v in params.items() if k != "layers"}
    top = _hooked(top, None if acc is None else {k: acc[k] for k in top}, {k: axes[k] for k in top})
    x = model.embed_apply(mcfg, top, mb["tokens"], keys)
    stack = params["layers"]["block"]
    stack_acc = None if acc is None else acc["layers"]["block"]
    stack_axes = axes["layers"]["block"]

    def body(x, inputs):
        w, g, layer = inputs
        w = _hooked(w, g, stack_axes)
        return model.block_apply(mcfg, w, x, layer, keys).astype(x.dtype), None

    if mcfg.recompute == "full":  # keep only each block's input, as the model's LayerStack does
        body = jax.checkpoint(body, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
    n = jax.tree.leaves(stack)[0].shape[0]
    x, _ = jax.lax.scan(body, x, (stack, stack_acc, jnp.arange(n)))
    raw = model.head_apply(mcfg, top, x, mb["targets"], mb["loss_mask"])
    return raw * seed_scale, raw
