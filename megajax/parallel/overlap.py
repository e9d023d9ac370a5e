"""The data-parallel gradient reduction issued inside the backward, layer by layer (Megatron's
--overlap-grad-reduce), so that XLA's GPU scheduler runs each layer's reduction under the backward GEMMs of
the layers before it.

Without it the step sums its micro batches' gradients locally and reduces them once after the whole backward:
one all-reduce (or reduce-scatter with the distributed optimizer) that nothing can overlap. Here the micro
batches before the last are summed locally as before; the last one runs with each weight behind
`reducing_identity`: an identity whose backward adds the earlier micro batches' sum and reduces over the
weight's data-parallel axes: an all-reduce, or with the distributed optimizer a reduce-scatter onto the
weight's optimizer shard. The reduced gradient is handed to a `sink` (zeros shaped like the reduced gradient)
as its cotangent, so the step differentiates the sinks and gets each gradient in the shape its reduction leaves
(a reduce-scatter's shard is not shaped like the weight). The layers run as a scan of single blocks, so the
hook sits inside the loop and its backward (one reduction per layer) inside the backward loop. The bytes and
the order of the sums are the plain path's: (earlier micro batches + last) summed locally, then over the data
ranks.

Under a pipeline the chunk's backward is a pullback the schedule keeps between ticks, and the earlier micro
batches' sum lives in the schedule's accumulator: `tapped_identity` hands it to each layer's reduction as the
cotangent of a tap the layer emits, and the pipeline executor runs the reducing backward as the last backward of
each chunk of a rank that has no idle tick to reduce in.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax import model, optim
from megajax.config import Config
from megajax.parallel import sharding, step_plan


def _tensor_manual(fn, x: jax.Array, spec: P) -> jax.Array:
    """fn(x) for a data-parallel collective on x (a weight or its gradient with PartitionSpec `spec`), with
    'tensor' made manual around it: left to GSPMD, XLA gathers a tensor-sharded operand over 'tensor' before a
    scatter or gather over the data ranks (t times the bytes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.shape.get("tensor", 1) == 1:
        return fn(x)
    spec = P(*[step_plan.keep_axes(a, lambda x: x == "tensor") for a in spec])
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"tensor"})(x)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How one weight's gradient is reduced in the backward: summed over the data-parallel `axes`; with `zero`
    (the distributed optimizer's optim.ZeroDim) zero-padded as the optimizer pads it and scattered over zero.axes
    along zero.dim, which leaves each data rank its optimizer shard, to be summed over the rest of `axes` (hybrid
    sharding's instances) once a step (`across_instances`). `gather`: the weight arrives as that shard
    (parallel.overlap_param_gather) and is all-gathered where it is first used; `gather_dtype`: in that dtype (a
    matmul weight, which the model casts to the compute dtype anyway: half the bytes in bf16, as Megatron gathers
    its bf16 parameters), its gradient then cast back to `grad_dtype` (the parameter's) before the reduction.
    `local`: a micro batch before the last, whose gradient stays on its rank (not reduced). `length`: the
    weight's own size along zero.dim (its shard may hold the distributed optimizer's zero padding past it: ZeRO-3
    keeps padded shards), which a gather slices back to. `across`: the scattered shard also summed over hybrid
    sharding's instances here (a reduction that runs once a step, under the last backward: ZeRO-1's), not by
    `across_instances` after the micro batches (ZeRO-2/3 scatter in every one)."""

    axes: tuple[str, ...]
    zero: optim.ZeroDim | None = None
    spec: P = P()  # the weight's PartitionSpec ('tensor' is all the collectives read of it)
    gather: bool = False
    local: bool = False
    gather_dtype: str | None = None
    grad_dtype: str | None = None
    length: int | None = None
    across: bool = False

    def per_layer(self, lead: int = 1) -> "Reduction":
        """The reduction of a stacked weight's slice with its first `lead` dims dropped: one layer of [layers, ...]
        (1) or of the pipeline's staged [chunk, stage, layers, ...] (3), or a run of the staged weight's layers
        (2)."""
        if self.zero is None:
            return self
        return dataclasses.replace(self, zero=dataclasses.replace(self.zero, dim=self.zero.dim - lead),
                                   spec=P(*self.spec[lead:]))

    def _manual(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a in step_plan.current_manual_axes())

    def _scattered(self) -> tuple[str, ...]:
        """The manual axes the gradient is scattered over and the weight gathered over: those of the optimizer
        shard (one instance's data ranks: not hybrid sharding's 'replica')."""
        return tuple(a for a in self._manual() if a in self.zero.axes)

    def _instances(self) -> tuple[str, ...]:
        """The axes of `axes` a scattered gradient is still to be summed over: hybrid sharding's 'replica'."""
        return tuple(a for a in self.axes if a not in self.zero.axes)

    def across_instances(self, g: jax.Array) -> jax.Array:
        """A gradient scattered onto its optimizer shard, summed over hybrid sharding's instances ('replica'):
        once a step, after every micro batch's scatter inside an instance. The identity without instances, and
        for a gradient all-reduced over every data rank already (no `zero`), summed `across` in its reduction, or
        kept local."""
        if self.zero is None or self.local or self.across:
            return g
        return sharding.psum(g, self._instances())

    def __call__(self, g: jax.Array) -> jax.Array:
        if self.grad_dtype is not None:  # (the gradient of a weight gathered in a lower precision)
            g = g.astype(self.grad_dtype)
        if self.local:
            return g
        if self.zero is None:
            return sharding.psum(g, self.axes)
        g = optim.zero_pad(g, self.zero)
        axes = self._scattered()
        if axes:
            g = _tensor_manual(functools.partial(jax.lax.psum_scatter, axis_name=axes,
                                                 scatter_dimension=self.zero.dim, tiled=True), g, self.spec)
        return sharding.psum(g, self._instances()) if self.across else g

    def result_axes(self) -> tuple[str, ...]:
        """The manual axes a gradient reduced in a region where everything varies (the pipeline's) varies over:
        all of them but the summed axes after an all-reduce; all of them after a reduce-scatter (the shards), but
        the instances it is summed `across`."""
        summed = self.axes if self.zero is None else self._instances() if self.across else ()
        return tuple(a for a in step_plan.current_manual_axes() if a not in summed)

    def gathered(self, w: jax.Array) -> jax.Array:
        """The whole weight from its optimizer shard (`gather`), or w as it is."""
        axes = self._scattered() if self.gather else ()
        if not axes:
            return w
        if self.gather_dtype is not None:
            w = w.astype(self.gather_dtype)
        w = _tensor_manual(functools.partial(jax.lax.all_gather, axis_name=axes, axis=self.zero.dim, tiled=True),
                           w, self.spec)
        if self.length is not None and self.length < w.shape[self.zero.dim]:  # (the padding of a ZeRO-3 shard)
            w = jax.lax.slice_in_dim(w, 0, self.length, axis=self.zero.dim)
        return w

    def sink(self, w: jax.Array) -> jax.Array:
        """Zeros shaped (and varying) as this reduction leaves the gradient of w (the weight as it arrives)
        inside the step's shard_map."""
        shape, axes = list(w.shape), tuple(step_plan.varying_axes(w))
        if self.zero is not None and self.local and self.gather:  # the whole weight, gathered from its shard
            shape[self.zero.dim] = self.length or self.zero.size
        elif self.zero is not None and not self.local:  # the optimizer shard
            mesh = jax.sharding.get_abstract_mesh()
            shape[self.zero.dim] = self.zero.size // math.prod(mesh.shape[a] for a in self._scattered())
        if self.local:
            axes += self.axes
        elif self.zero is not None:  # (a shard: varies over the data ranks, but the instances it is summed across)
            axes += tuple(a for a in self.axes if not (self.across and a in self._instances()))
        return step_plan.vary(jnp.zeros(shape, self.grad_dtype or w.dtype), axes)


@functools.lru_cache(maxsize=None)
def reducing_identity(r: Reduction):
    """identity(w, acc, sink) -> w marked varying over r.axes; backward: r(cotangent [+ acc]) as the cotangent
    of `sink` (none for w, whose gradient the caller does not take, nor for acc, the earlier micro batches'
    local gradient, None when there are none)."""
    @jax.custom_vjp
    def hook(w, acc, sink):
        return step_plan.vary(w, r.axes)

    def bwd(acc, ct):
        return None, None, r(ct if acc is None else ct.astype(acc.dtype) + acc)

    hook.defvjp(lambda w, acc, sink: (step_plan.vary(w, r.axes), acc), bwd)
    return hook


@functools.lru_cache(maxsize=None)
def tapped_identity(r: Reduction, reduce: bool):
    """The pipeline's hook on one layer's weight: identity(w, sink) -> (w, tap), tap fp32 zeros shaped like w.
    Backward: the accumulated gradient of the earlier micro batches arrives as the cotangent of the tap (so
    that it needs no room in the residuals the schedule carries between ticks); with `reduce` (the chunk's
    last backward) r(gradient + that) becomes the cotangent of `sink`, else the gradient goes to w as usual.
    The forward does not depend on `reduce`: one linearization serves both backwards."""
    def primal(w):
        return w, step_plan.vary(jnp.zeros(w.shape, jnp.float32), step_plan.varying_axes(w))

    @jax.custom_vjp
    def hook(w, sink):
        return primal(w)

    def bwd(_, cts):
        ct_w, acc = cts
        if not reduce:
            return ct_w, None
        return None, step_plan.vary(r(ct_w.astype(jnp.float32) + acc), r.result_axes())

    hook.defvjp(lambda w, sink: (primal(w), None), bwd)
    return hook


def _hooked(params, acc, sinks, reductions):
    if acc is None:
        acc = jax.tree.map(lambda _: None, params)
    return jax.tree.map(lambda w, g, s, r: reducing_identity(r)(w, g, s), params, acc, sinks, reductions,
                        is_leaf=lambda x: x is None)


def sinks(params, reductions):
    """The sinks of `reducing_loss`: per weight, zeros shaped as its reduced gradient (stacked layers: each
    layer's, stacked)."""
    top = {k: v for k, v in params.items() if k != "layers"}
    out = jax.tree.map(lambda w, r: r.sink(w), top, {k: reductions[k] for k in top})
    stack, stack_r = params["layers"]["block"], reductions["layers"]["block"]

    def stacked(w, r):
        one = r.per_layer().sink(w[0])
        return jnp.broadcast_to(one, (w.shape[0], *one.shape))

    out["layers"] = {"block": jax.tree.map(stacked, stack, stack_r)}
    return out


@functools.lru_cache(maxsize=None)
def gathering_identity(r: Reduction):
    """ZeRO-3's hook on one layer's weight shard: gather(w, sink) -> the whole weight (`Reduction.gathered`),
    marked varying over r.axes; backward: r(cotangent), the reduce-scatter onto the shard, as the cotangent of
    `sink`. One custom_vjp whose primal all-gathers: what `_leaves_gathers_out` keeps out of the residuals."""
    def primal(w):
        return step_plan.vary(r.gathered(w), r.axes)

    @jax.custom_vjp
    def hook(w, sink):
        return primal(w)

    hook.defvjp(lambda w, sink: (primal(w), None), lambda _, ct: (None, r(ct)))
    return hook


def _all_gathers(jaxpr) -> bool:
    """Whether a jaxpr (or one nested in it: a shard_map over 'tensor') all-gathers."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "all_gather":
            return True
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # (a ClosedJaxpr's jaxpr, or a Jaxpr)
            if hasattr(inner, "eqns") and _all_gathers(inner):
                return True
    return False


def _leaves_gathers_out(axes: tuple[str, ...]):
    """A remat policy for ZeRO-3's layers: every value is saveable but the whole weights, so that the backward
    gathers them again. A whole weight is an all-gather over the data-parallel `axes` (whether the gather shows
    as itself or as the `gathering_identity` around it depends on when jax linearizes), or a value computed from
    values all of which are the same on every data rank (a slice, cast or marking of a gathered weight; the
    activations vary over the data ranks).

    jax applies this policy to the equations inside any checkpoint nested in the layer too, which would save
    what that checkpoint recomputes; the layer's recomputing activations and norms are therefore custom_vjps
    (`kernels.keeps_inputs`), which keep what they say. Selective recomputation's attention core is a nested
    jax.checkpoint: with the unfused (xla) attention this policy keeps its scores."""
    def saveable(prim, *avals, **params) -> bool:
        if prim.name == "all_gather":
            return not set(step_plan.axes_of(params["axis_name"])) & set(axes)
        if prim.name == "custom_vjp_call" and _all_gathers(params["call_jaxpr"].jaxpr):
            return False
        arrays = [a for a in avals if getattr(a, "ndim", 0)]
        return not arrays or any(set(axes) & step_plan.varying_axes(a) for a in arrays)

    return saveable


def _regathered_layers(mcfg, side, x, stack, stack_sink, stack_r):
    """ZeRO-3's layers: each one's weights all-gathered from their shards inside the layer, which runs under a
    jax.checkpoint that saves every residual but those gathered weights (with recompute=full, none but the
    layer's input), so that the backward gathers them again instead of keeping every layer's whole weights
    alive between the forward and the backward."""
    def layer(x, w, s, i):
        whole = jax.tree.map(lambda r, v, sink: gathering_identity(r)(v, sink) if r.gather
                             else reducing_identity(r)(v, None, sink), stack_r, w, s)
        return model.block_apply(mcfg, whole, x, i, side).astype(x.dtype)

    axes = tuple(a for a in step_plan.GRAD if a in step_plan.current_manual_axes())
    # FP8 recomputes the whole layer: with FP8's custom_vjp matmuls under a policy that saves anything, the step's
    # losses came out NaN (jax 0.10.2; without the checkpoint, or saving nothing, they equal one device's)
    keep = model.KEEP_INPUTS if mcfg.fp8 != "none" else _leaves_gathers_out(axes)
    layer = model.recomputed(mcfg, layer, keep=keep)
    n = jax.tree.leaves(stack)[0].shape[0]
    x, _ = model.scan_layers(mcfg, lambda x, inputs: (layer(x, *inputs), None), x, (stack, stack_sink, jnp.arange(n)))
    return x


def _reducing_layers(mcfg, side, x, params, acc, sink, reductions, regather: bool):
    """`reducing_loss`'s stack of layers: (its output, the layers' weights as the step goes on with them: gathered
    whole where they arrived as shards and stay gathered). params, acc, sink, reductions: the step's whole trees."""
    stack = params["layers"]["block"]
    stack_acc = None if acc is None else acc["layers"]["block"]
    stack_sink = sink["layers"]["block"]
    stack_r = jax.tree.map(Reduction.per_layer, reductions["layers"]["block"])

    def layer(x, w, g, s, i):
        return model.block_apply(mcfg, _hooked(w, g, s, stack_r), x, i, side).astype(x.dtype)

    layer = model.recomputed(mcfg, layer)  # (full: only each block's input kept, as the model's LayerStack)
    n = jax.tree.leaves(stack)[0].shape[0]
    if regather:
        x = _regathered_layers(mcfg, side, x, stack, stack_sink, stack_r)
        kept = params["layers"]
    elif not any(r.gather for r in jax.tree.leaves(stack_r)):
        x, _ = model.scan_layers(mcfg, lambda x, inputs: (layer(x, *inputs), None), x,
                                 (stack, stack_acc, stack_sink, jnp.arange(n)))
        kept = params["layers"]
    else:
        fetch = lambda w: jax.tree.map(lambda r, v: r.gathered(v), stack_r, w)  # noqa: E731
        at = lambda tree, idx: None if tree is None else jax.tree.map(lambda v: v[idx], tree)  # noqa: E731

        def body(carry, inputs):
            x, w = carry
            ahead, g, s, i = inputs
            return (layer(x, w, g, s, i), fetch(ahead)), w

        (x, w_last), ws = model.scan_layers(mcfg, body, (x, fetch(at(stack, 0))), (
            at(stack, slice(1, None)), at(stack_acc, slice(None, -1)), at(stack_sink, slice(None, -1)),
            jnp.arange(n - 1)))
        x = layer(x, w_last, at(stack_acc, -1), at(stack_sink, -1), n - 1)
        kept = {"block": jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ws, w_last)}
    return x, kept


def reducing_loss(sink, cfg: Config, params, acc, reductions, mb: dict, seed_scale: jax.Array,
                  regather: bool = False):
    """(seed_scale * summed token loss, (summed token loss, the whole weights)) of one micro batch, whose
    gradient w.r.t. `sink` (`sinks(params, reductions)`) is, per weight, (that micro batch's gradient + `acc`)
    reduced as its `Reduction` says, issued per layer in the backward (`acc` None: nothing to add). Weights that
    arrive as their optimizer shard (Reduction.gather) are all-gathered layer by layer, each layer's gather
    issued one layer ahead, under the forward of the layer before it; with `regather` (ZeRO-3: `acc` None),
    inside each layer and again in its backward (`_regathered_layers`), and "the whole weights" returned are
    the layers' shards."""
    mcfg = cfg.model
    side = model.side_inputs(mcfg, cfg.train.seed, mb, objective_scale=seed_scale)
    top = {k: v for k, v in params.items() if k != "layers"}
    pick = lambda tree: None if tree is None else {k: tree[k] for k in top}  # noqa: E731
    top = jax.tree.map(lambda r, w: r.gathered(w), pick(reductions), top)
    whole = dict(top)
    top = _hooked(top, pick(acc), pick(sink), pick(reductions))

    def run_layers(x):  # the stack, with its gathers and reductions
        x, whole["layers"] = _reducing_layers(mcfg, side, x, params, acc, sink, reductions, regather)
        return x

    raw = model.forward_loss(mcfg, top, mb, side, run_layers)
    return raw * seed_scale, (raw, whole)
