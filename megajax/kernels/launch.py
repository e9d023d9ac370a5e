"""Where and how a Pallas kernel runs: the platform (compiled on GPU, interpreted on CPU) and the mesh.

Two concerns every kernel in this package shares, kept out of the kernels themselves:

1. **Platform.** `pallas_call` wraps `pl.pallas_call` in `step_plan.platform_dependent`: the CPU branch runs
   the kernel in Pallas interpret mode (the tests), every other platform compiles it (Triton on CUDA). The
   choice is the step's platform (its mesh's devices), or where no step names one (a kernel called alone, an
   export) `lax.platform_dependent`'s when the program is lowered; never `jax.default_backend()`'s, so a
   CPU-only machine can still compile the train step for compile-only GPUs or `jax.export(...,
   platforms=["cuda"])` it and get the real Triton custom calls.
2. **Partitioning.** A pallas_call is an opaque custom call that GSPMD cannot split. `shard_kernel` runs
   kernels shard by shard in a nested `jax.shard_map` over the mesh axes still left to GSPMD ('tensor'
   inside the train step's manual 'data'/'pipeline' region; every axis under plain jit), each operand
   split by its logical axis names (megajax.parallel.step_plan's activation rules: heads over 'tensor', the sequence
   over 'tensor' with sequence parallelism, batch over 'data') and replicated over the other axes, which
   costs no communication.

The custom_vjp of each kernel stays outside these shard_maps: its forward and backward each call
`shard_kernel`, so the shard_maps are never differentiated. That is what makes `check_vma=False` safe
here (a nested unchecked shard_map cannot be transposed inside the train step's checked one), and an
unchecked region is what Pallas' interpreter needs (it cannot evaluate a kernel on values typed as varying
over manual axes). Outputs get back the varying axes of the inputs, so the custom_vjp sees proper types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from megajax.parallel import step_plan

Names = Sequence[str | None]
# The logical name of a dim that stacks one block per shard (split over every axis `shard_kernel` makes manual):
# what a kernel saves for its backward where it has no logical names of its own.
SHARDS = "shards"


def pallas_call(kernel: Callable, *, interpret: bool | None = None, **params: Any) -> Callable:
    """`pl.pallas_call(kernel, **params)` that interprets on CPU and compiles elsewhere.

    interpret=None picks per lowering platform; True or False forces one (True: debug a kernel on GPU).
    """
    out_shape = params.pop("out_shape")

    def call(*args):
        # In a shard_map that checks varying axes and has nothing left to make manual (shard_kernel could
        # not open an unchecked region), Pallas needs the outputs' varying axes: those of the inputs.
        axes = frozenset().union(*(step_plan.varying_axes(a) for a in jax.tree.leaves(args)))
        shapes = jax.tree.map(lambda s: _struct(s.shape, s.dtype, axes), out_shape)
        compiled = pl.pallas_call(kernel, interpret=False, out_shape=shapes, **params)

        def interpreted(*a):
            return pl.pallas_call(kernel, interpret=True, out_shape=shapes, **params)(*map(strip_varying, a))

        if interpret is not None:
            return (interpreted if interpret else compiled)(*args)
        # Integer operands (segment ids) are stripped for both branches: a stripped value saved for the backward by
        # one branch and a typed one by the other would give the two branches different residual types under
        # partial evaluation ("branches_known" in JAX's cond). Integers have no tangents to keep typed.
        args = [strip_varying(a) if jnp.issubdtype(a.dtype, jnp.integer) else a for a in args]
        return step_plan.platform_dependent(*args, cpu=interpreted, default=compiled)

    return call


def shard_kernel(fn: Callable, args: Sequence[jax.Array | None], in_names: Sequence[Names | None],
                 out_names: Sequence[Names], *, summed: Sequence[int] = ()) -> tuple:
    """fn(*args) -> tuple of outputs, run shard by shard; never differentiate through it.

    in_names[i] names the dims of args[i] (None for an argument that is None), out_names[j] those of output
    j. Outputs listed in `summed` are partial sums over the rows fn saw (a norm's dscale): they are summed
    over every axis that split an input and is absent from their names. Outside a mesh, fn runs as is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto, in_specs, out_specs = kernel_specs(args, in_names, out_names)
    if not auto:
        return tuple(fn(*args))
    split = sorted(set().union(*(step_plan.spec_axes(spec) for spec in in_specs if spec is not None)))

    def local(*a):
        out = list(fn(*a))
        for j in summed:
            axes = tuple(ax for ax in split if ax not in step_plan.spec_axes(out_specs[j]))
            out[j] = jax.lax.psum(out[j], axes) if axes else out[j]
        return tuple(out)

    # Every automatic axis becomes manual: the operands are replicated over those that split nothing.
    out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=auto,
                        check_vma=False)(*args)
    axes = frozenset().union(*(step_plan.varying_axes(a) for a in jax.tree.leaves(args)))
    return tuple(match_varying(o, axes) for o in out)


def kernel_specs(args: Sequence[jax.Array | None], in_names: Sequence[Names | None],
                 out_names: Sequence[Names]) -> tuple[set, tuple, tuple]:
    """(the mesh axes left to GSPMD, the in_specs and out_specs that split `args` and the outputs over them by
    their logical axis names): `shard_kernel`'s shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    auto = set() if mesh.empty else set(mesh.axis_names) - manual
    if not auto:
        return auto, (), ()
    # The activation rules of the plan in force, else the defaults (no sequence parallelism).
    rules = step_plan.current_activation_rules()
    live = {k: step_plan.keep_axes(v, lambda a: a in auto and mesh.shape[a] > 1) for k, v in rules.items()}
    # An axis that does not divide every dim it would split (flax's init traces the model on a batch of
    # one) is dropped from all specs, so that, e.g., query and kv heads are always split together.
    for arg, names in zip(args, in_names):
        for size, name in zip([] if arg is None else arg.shape, names or ()):
            axes = step_plan.axes_of(live.get(name) if name is not None else None)
            if axes and size % math.prod(mesh.shape[a] for a in axes):
                live = {k: step_plan.keep_axes(v, lambda a: a not in axes) for k, v in live.items()}
    live[SHARDS] = tuple(a for a in sorted(auto) if mesh.shape[a] > 1) or None
    in_specs = tuple(None if n is None else step_plan.spec_for(n, live) for n in in_names)
    out_specs = tuple(step_plan.spec_for(n, live) for n in out_names)
    return auto, in_specs, out_specs


def match_varying(x: jax.Array | None, axes: frozenset) -> jax.Array | None:
    """x typed to vary over exactly `axes`: pcast where it lacks one, psum where it has one too many (the
    cotangent of a value that was broadcast over that axis). Only for code that is not differentiated."""
    if x is None:
        return None
    have = step_plan.varying_axes(x)
    if have - axes:
        x = jax.lax.psum(x, tuple(sorted(have - axes)))
    if axes - have:
        x = jax.lax.pcast(x, tuple(sorted(axes - have)), to="varying")
    return x


def strip_varying(x: jax.Array) -> jax.Array:
    """x without varying-axis types (in an unchecked shard_map any op drops them); exact, and XLA removes
    the multiply. Pallas' interpreter fails on typed values."""
    return x * jnp.ones((), x.dtype)


def _struct(shape, dtype, varying: frozenset) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """In a kernel: a and b contracted over dims (contract[0] of a, contract[1] of b), accumulated in fp32. Two
    different FP8 formats (e4m3 x e5m2: the backward of hybrid FP8) are multiplied in bf16, which holds both
    exactly: Triton's dot takes one operand type."""
    if a.dtype != b.dtype and jnp.dtype(a.dtype).itemsize == 1 and jnp.dtype(b.dtype).itemsize == 1:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=jnp.float32)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()

