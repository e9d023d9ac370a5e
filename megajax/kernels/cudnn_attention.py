"""cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) under any mesh.

JAX partitions the cuDNN call with its own custom partitioning rules, and inside the train step those fail to
compile (jax 0.10.2, H100 target: an AssertionError in the partitioner at data 8, "'GSPMDSharding' object has no
attribute 'spec'" at tensor 2). Here the call runs shard by shard instead, as the Pallas kernels do
(launch.shard_kernel: batch over 'data', heads over 'tensor'), so XLA never partitions it: a custom_vjp whose
forward and backward each open their own shard_map. JAX exposes no cuDNN backward that takes saved statistics, so
the forward takes the call's own vjp on each shard and returns the pullback's residuals (cuDNN's softmax statistics)
stacked over the shards (launch.SHARDS); the backward rebuilds the shard's pullback around them. Residuals that are
the inputs or the output are not saved twice, and the forward traced again to rebuild the pullback is dead code
that XLA drops: the compiled H100 step runs one cuDNN forward and one backward a layer, as the Pallas kernels do.

`sharded_core` takes the per-shard attention as an argument, so that the partitioning and the gradients are tested
on CPU with the jnp reference in cuDNN's place (cuDNN runs on NVIDIA GPUs only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from megajax.kernels.launch import SHARDS, match_varying, shard_kernel, strip_varying
from megajax.parallel.step_plan import varying_axes

Q_NAMES = ("batch", None, "heads", None)
KV_NAMES = ("batch", None, "kv_heads", None)


@dataclasses.dataclass(frozen=True)
class CudnnCore:
    """cuDNN's causal (or full) attention of one shard: [b, s, h, k] x [b, t, g, k] -> [b, s, h, k]."""

    causal: bool
    scale: float | None

    def __call__(self, q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=self.scale, is_causal=self.causal,
                                            implementation="cudnn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sharded_core(core, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """core(q, k, v) run shard by shard under the mesh in force; `core` is hashable (a frozen dataclass)."""
    return shard_kernel(lambda q, k, v: (core(q, k, v),), (q, k, v), (Q_NAMES, KV_NAMES, KV_NAMES), (Q_NAMES,))[0]


def _pullback(core, q, k, v):
    """(core's output o, its pullback on this shard, and per leaf of the pullback which of (q, k, v, o) it is, or
    None for a residual of its own: the leaves that are the inputs or the output are not saved twice)."""
    o, pull = jax.vjp(core, q, k, v)
    known = (q, k, v, o)
    return o, pull, [next((i for i, x in enumerate(known) if leaf is x), None) for leaf in jax.tree.leaves(pull)]


def _forward(core, q, k, v):
    """(the output, (q, k, v, o and each shard's own residuals of core's vjp, stacked on a leading dim split over the
    shards))."""
    def local(q, k, v):
        o, pull, which = _pullback(core, q, k, v)
        return (o, *[r[None] for r, w in zip(jax.tree.leaves(pull), which) if w is None])

    n = len(jax.eval_shape(local, q, k, v)) - 1
    o, *res = shard_kernel(local, (q, k, v), (Q_NAMES, KV_NAMES, KV_NAMES), (Q_NAMES, *[(SHARDS,)] * n))
    return o, (q, k, v, o, tuple(res))


def _backward(core, saved, do):
    q, k, v, o, res = saved

    def grads(*args):  # (untyped: in the unchecked shard_map the cotangent must be typed as the output)
        q, k, v, o, do, *res = map(strip_varying, args)
        # the shard's pullback from the saved values (the forward traced here to rebuild it is dead code)
        _, pull, which = _pullback(core, q, k, v)
        own = iter(res)
        leaves = [(q, k, v, o)[w] if w is not None else next(own)[0] for w in which]
        return jax.tree.unflatten(jax.tree.structure(pull), leaves)(do)

    dq, dk, dv = shard_kernel(grads, (q, k, v, o, do, *res),
                              (Q_NAMES, KV_NAMES, KV_NAMES, Q_NAMES, Q_NAMES, *[(SHARDS,)] * len(res)),
                              (Q_NAMES, KV_NAMES, KV_NAMES))
    # each cotangent typed as its primal (inside the step's shard_map: varying over the manual axes)
    return tuple(match_varying(d, varying_axes(x)) for d, x in ((dq, q), (dk, k), (dv, v)))


sharded_core.defvjp(_forward, _backward)


def as_wide_as_keys(v: jax.Array, k: jax.Array) -> jax.Array:
    """Values [b, t, g, k_v] zero-padded to the keys' head dim: `jax.nn.dot_product_attention` (cuDNN's here, XLA's
    for the KV cache) takes values only as wide as the keys, and multi-latent attention's are narrower. The
    padding's output columns are zero; the caller slices them off."""
    extra = k.shape[-1] - v.shape[-1]
    return jnp.pad(v, ((0, 0),) * 3 + ((0, extra),)) if extra else v


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    scale: float | None = None) -> jax.Array:
    """cuDNN's fused attention, [b, s, h, k] x [b, t, g, k], [b, t, g, k_v] -> [b, s, h, k_v], shard by shard under
    any mesh (values narrower than the keys through `as_wide_as_keys`)."""
    return sharded_core(CudnnCore(causal, scale), q, k, as_wide_as_keys(v, k))[..., :v.shape[-1]]
