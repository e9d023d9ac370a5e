"""zero_bubble's split backward: 1F1B's (or interleaved's) table run with the backward split. B is the input
gradient only (and the norms' and biases' gradients), sent at once, and W the weight gradients from each weight
matmul's kept input and the output gradient B found for it (model.layers.weight_einsum's taps), run in the rank's
next tick, first in it (executor._tick). `SplitChunkActions` changes the chunk actions' (chunks.py) backward and
the linearization its recompute keeps, and adds W. Under ZeRO-2/3 each of B and W reduce-scatters the gradients
it computes onto their shards (`_reducing`). `split_linearize`, `split_weight_grads` and
`zero_taps` are also what scripts/bench_split_backward.py times.
"""

from __future__ import annotations

import flax.traverse_util
import jax
import jax.numpy as jnp

from megajax import model
from megajax.model import fp8
from megajax.model import layers as layers_lib
from megajax.parallel.pipeline.chunks import ChunkActions
from megajax.parallel.sharding import CollectiveOrder
from megajax.parallel.step_plan import vary, zeros_varying_like


def split_weights(w: dict, taps: dict) -> tuple[dict, dict]:
    """A chunk's parameters {"block": ...} as (the weights of a tapped matmul, at the taps' paths; the rest),
    flat {path: [Lc, ...]}. (An MoE layer's expert weights are not tapped: their gradients come with B.)"""
    flat = flax.traverse_util.flatten_dict(w["block"])
    tapped = set(flax.traverse_util.flatten_dict(taps))
    big = {k: val for k, val in flat.items() if k in tapped}
    return big, {k: val for k, val in flat.items() if k not in big}


def zero_taps(mcfg, w: dict, x: jax.Array, side) -> dict:
    """Zeros [Lc, ...] shaped like the taps of the chunk's layers (`split_linearize`'s, and their gradients)."""
    lc = jax.tree.leaves(w)[0].shape[0]
    shapes = model.block_tap_shapes(mcfg, jax.tree.map(lambda a: a[0], w["block"]), x, side)
    return jax.tree.map(lambda t: jnp.zeros((lc, *t.shape), t.dtype), shapes)


def split_linearize(mcfg, w: dict, x: jax.Array, taps: dict, side, ids, on):
    """The chunk's layers linearized for the split backward: (output, the pullback in (x, taps, the small
    parameters), each weight matmul's input). taps: `zero_taps`; ids, on: each slot's global layer index and
    whether it holds a layer (`ChunkActions.slots`: an empty slot runs nothing, its matmul inputs are zeros)."""
    big, small = split_weights(w, taps)

    def run(x, taps, small):
        def body(x, layer):
            w_l, l, on_l, taps_l = layer

            def block():
                y, inputs = model.block_apply_split(mcfg, w_l, taps_l, x, l, side)
                return y.astype(x.dtype), inputs

            if on_l is None:
                return block()
            def empty():
                return x, zeros_varying_like(jax.eval_shape(block)[1])

            return jax.lax.cond(on_l, block, empty)

        stacked = flax.traverse_util.unflatten_dict({**big, **small})
        return model.scan_layers(mcfg, body, x, (stacked, ids, on, taps))

    return jax.vjp(run, x, taps, small, has_aux=True)


def weight_grads_into(acc, w: dict, inputs: dict, dys: dict, mcfg, add, each=None, guard=None, mark=None):
    """W layer by layer: (`acc` after add(acc, path, l, each(path, dW)) for each tapped weight (flat path) of each
    layer l of the chunk, from its matmul's input and output gradient (in FP8 with model.fp8, with the weight's
    delayed-scaling state where it has one); `mark`). guard(layer_grads, mark) -> (layer_grads() or what stands in
    for it, mark): what runs each layer's gradients (the pipeline's tick: a conditional, in the CPU runtime's order
    that `mark` carries from layer to layer). A loop over the chunk's layers keeps one layer's weight gradients live
    at a time; all at once, a chunk held each of its layers' (2.3 GiB a layer more than the fused backward at
    Llama 3 70B's tensor 8 x 8192 tokens)."""
    big, rest = split_weights(w, dys)
    x, dy = flax.traverse_util.flatten_dict(inputs), flax.traverse_util.flatten_dict(dys)
    each = each or (lambda k, d: d)
    guard = guard or (lambda layer_grads, mark: (layer_grads(), mark))

    def layer(carry, l):
        acc, mark = carry
        at = lambda a: jax.lax.dynamic_index_in_dim(a, l, keepdims=False)  # noqa: E731

        def layer_grads():
            grads = {}
            for k, val in big.items():
                meta = rest.get(k[:-1] + (fp8.META_PREFIX + k[-1],))
                args = (at(x[k]), at(dy[k]), at(val)) + (() if meta is None else (at(meta),))
                grads[k] = each(k, layers_lib.weight_grad(k[-1], mcfg, *args))
            return grads

        grads, mark = guard(layer_grads, mark)
        for k, d in grads.items():
            acc = add(acc, k, l, d)
        return (acc, mark), None

    # (a loop over layers like the others: unrolled where model.scan_layers says)
    return model.scan_layers(mcfg, layer, (acc, mark), jnp.arange(jax.tree.leaves(big)[0].shape[0]))[0]


def split_weight_grads(w: dict, inputs: dict, dys: dict, mcfg) -> dict:
    """W: the gradients of the chunk's tapped weights, flat {path: [Lc, ...]} (`weight_grads_into`)."""
    big, _ = split_weights(w, dys)
    zeros = {k: jnp.zeros(val.shape, val.dtype) for k, val in big.items()}
    return weight_grads_into(zeros, w, inputs, dys, mcfg, lambda acc, k, l, d: {**acc, k: acc[k].at[l].set(d)})[0]


class SplitChunkActions(ChunkActions):
    """zero_bubble's chunk actions: the backward is split at every weight matmul (model.layers.weight_einsum).
    The recompute linearizes the chunk in its input, the matmuls' output taps and the small parameters (norms,
    biases) and keeps each weight matmul's input; B computes the input gradient, the small parameters'
    gradients and the taps' gradients (each weight matmul's output gradient, kept in `dys`); W turns those and
    the kept matmul inputs into the weight gradients, one matmul per weight."""

    REDUCING_PULLBACK = False  # (ZeRO-2/3: B and W reduce the gradients they compute, `_reducing`)

    def zero_dys(self):
        """Zeros shaped like the chunk's taps [Lc, ...] (their gradients, kept between B and W)."""
        row = {"f_chunk": jnp.zeros((), jnp.int32), "f_micro": jnp.zeros((), jnp.int32)}
        (w, _), (_, side) = self.chunk(row, "f_"), self.micro(row, "f_")
        return zero_taps(self.mcfg, w, jnp.zeros(self.act_shape, self.act_dtype), side)

    def linearize(self, w, x, side, at):
        """(chunk output, (the pullback in (x, taps, small parameters), each weight matmul's input))."""
        # varying over the manual axes like everything else, or their gradients would be summed over them
        taps = vary(zero_taps(self.mcfg, w, x, side))
        y, pullback, inputs = split_linearize(self.mcfg, w, x, taps, side, *self.slots(at))
        return y, (pullback, inputs)

    def backward_branch(self, final: bool):
        """(residuals, g, g_layers, dys, row) -> (the input gradient, what the backward adds, dys): the input
        gradient, the small parameters' gradients and the taps' gradients (the new dys). The small parameters'
        gradients in fp32 (flat {path: [Lc, ...]}) go to g_layers, or under ZeRO-2/3 (FINAL: every backward)
        reduced onto their shards, to g_final (`add_backward`, after the conditional)."""
        def run(res, g, g_layers, dys, row):
            pullback, _ = jax.tree.unflatten(self._res_tree, res)
            dx, dys, dsmall = pullback(g)
            if final:
                each = _reducing(self.run_reductions)
                return vary(dx.astype(g.dtype)), {k: each(k, d) for k, d in dsmall.items()}, vary(dys)
            return vary((dx.astype(g.dtype), {k: _fp32(k, d) for k, d in dsmall.items()}, dys))

        return run

    @staticmethod
    def add_backward(final: bool, g_layers, g_final, added, row):
        """(g_layers, g_final) with what `backward_branch(final)` returned added at local chunk row["b_chunk"]."""
        c = row["b_chunk"]
        if final:
            return g_layers, _added_at(g_final, added, c, lambda k, d: d)
        return {"block": _added_at(g_layers["block"], added, c, lambda k, d: d)}, g_final

    def weight_grads(self, res, dys, acc, row, on, order: CollectiveOrder, scope: str):
        """acc (g_layers, or under ZeRO-2/3 g_final) plus the weight gradients of the last backward where the tick
        runs W (`on`), layer by layer: each layer's gradients (reduce-scattered onto their shards under ZeRO-2/3,
        else in fp32) made under a two-way conditional named `scope` (zeros where `on` is false, made in its first
        branch) and added to acc after it, in place. acc passes through no conditional (`executor.backward`: XLA
        copied it, in most ticks, under one conditional over W). Each conditional in `order`, one after another."""
        _, inputs = jax.tree.unflatten(self._res_tree, res)
        c = row["w_chunk"]
        tree = acc if self.reductions is not None else vary(acc["block"])

        def guard(layer_grads, mark):
            inner = CollectiveOrder(mark)

            def skip():
                return zeros_varying_like(jax.eval_shape(layer_grads))

            with jax.named_scope(scope):
                grads = inner.cond(on, layer_grads, skip)
            return grads, inner.mark

        flat, mark = weight_grads_into(
            flax.traverse_util.flatten_dict(tree), self.chunk(row, "w_")[0], inputs, dys, self.mcfg,
            lambda acc, k, l, d: {**acc, k: acc[k].at[c, l].add(d)},
            _fp32 if self.reductions is None else _reducing(self.reductions), guard, order.mark)
        if mark is not None:
            order.after(mark)
        tree = flax.traverse_util.unflatten_dict(flat)
        return tree if self.reductions is not None else vary({"block": tree})


def _fp32(path, d: jax.Array) -> jax.Array:
    """A gradient as the fp32 accumulators add it."""
    return d.astype(jnp.float32)


def _reducing(reductions: dict):
    """each(path, gradient): the gradient in fp32 reduced by its weight's `overlap.Reduction` in `reductions` (the
    chunks' tree of them: ZeRO-2/3's reduce-scatter), varying as the reduction leaves it."""
    flat = flax.traverse_util.flatten_dict(reductions)
    return lambda k, d: vary(flat[k](_fp32(k, d)), flat[k].result_axes())


def _added_at(tree: dict, flat_grads: dict, c, each) -> dict:
    """tree (per weight [v, Lc, ...]) with each(path, gradient) of the flat {path: [Lc, ...]} gradients added at local
    chunk c."""
    flat = flax.traverse_util.flatten_dict(tree)
    for k, d in flat_grads.items():
        flat[k] = flat[k].at[c].add(each(k, d))
    return flax.traverse_util.unflatten_dict(flat)
