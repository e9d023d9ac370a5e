"""`keeps_inputs`: a function whose backward keeps only its inputs and recomputes the rest from them.

Autodiff of an elementwise chain keeps its intermediates: the tanh GeLU five [tokens, ffn] tensors, SwiGLU four,
the jnp norms three fp32 copies of x. Megatron's fused bias-GeLU, SwiGLU and norms keep only their inputs, and so
do these.

It is a custom_vjp, not a jax.checkpoint: under an enclosing checkpoint, jax decides what every equation inside a
nested checkpoint keeps by the enclosing one's policy, so ZeRO-3's layer (which saves everything but the
gathered weights, megajax.parallel.overlap) kept all the intermediates again
(benchmarks/2026-11-26-compile-only-fsdp-layer-memory.md). What a custom_vjp keeps is its own.
"""

from __future__ import annotations

import functools

import jax


def keeps_inputs(fn=None, *, static_argnums: tuple[int, ...] = ()):
    """`fn` (arrays in, an array out; `static_argnums`: hashable non-array arguments) whose backward keeps its
    array arguments and recomputes its forward from them. Usable as a decorator, with or without arguments."""
    if fn is None:
        return functools.partial(keeps_inputs, static_argnums=static_argnums)
    static = tuple(sorted(static_argnums))

    def merge(static_args, arrays):
        """The arguments in fn's order from the static ones and the arrays."""
        s, a = iter(static_args), iter(arrays)
        return [next(s) if i in static else next(a) for i in range(len(static_args) + len(arrays))]

    @functools.partial(jax.custom_vjp, nondiff_argnums=static)
    def wrapped(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), tuple(a for i, a in enumerate(args) if i not in static)

    def bwd(*args):
        *static_args, arrays, ct = args
        _, pull = jax.vjp(lambda *xs: fn(*merge(static_args, xs)), *arrays)
        return pull(ct)

    wrapped.defvjp(fwd, bwd)
    return functools.wraps(fn)(wrapped)
