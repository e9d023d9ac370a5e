"""How many copies of a loop-carried f32[2^20] XLA's GPU compiler makes when a two-way conditional adds to a slice
of it in one branch and passes it through in the other (compile-only H100; run from the repository root with the
gpu-audit extra: JAX_PLATFORMS=cpu python <this file>). Prints one JSON row per form."""

import json
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import audit

N = 1 << 20


def copies(fn) -> int:
    devices = audit._gpu_devices("h100", 1)
    shard = NamedSharding(jax.sharding.Mesh(devices, ("x",)), P())
    args = [jax.ShapeDtypeStruct((N,), jnp.float32, sharding=shard)] * 2
    text = jax.jit(fn, donate_argnums=(0,)).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    return len(re.findall(rf"= f32\[{N}\]\{{[^}}]*\}} copy\(", text))


def add(acc, y, k):  # the update branch: adds to a slice of acc in place
    return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, (k * 8,), (8,)) + y[:8], (k * 8,))


FORMS = {
    "lax.cond(pred, update, pass)": lambda acc, y, k: jax.lax.cond(
        k % 2 == 1, lambda a, y: add(a, y, k), lambda a, y: a, acc, y),
    "lax.switch(int(pred), [pass, update])": lambda acc, y, k: jax.lax.switch(
        (k % 2 == 1).astype(jnp.int32), [lambda a, y: a, lambda a, y: add(a, y, k)], acc, y),
    "lax.switch(int(pred), [update, pass])": lambda acc, y, k: jax.lax.switch(
        (k % 2 == 1).astype(jnp.int32), [lambda a, y: add(a, y, k), lambda a, y: a], acc, y),
    "update outside: acc + (lax.switch(int(pred), [zeros, slice]))": lambda acc, y, k: jax.lax.dynamic_update_slice(
        acc, jax.lax.dynamic_slice(acc, (k * 8,), (8,)) + jax.lax.switch(
            (k % 2 == 1).astype(jnp.int32), [lambda y: jnp.zeros((8,)), lambda y: y[:8]], y), (k * 8,)),
}

if __name__ == "__main__":
    for name, body in FORMS.items():
        def step(acc, y, body=body):
            return jax.lax.scan(lambda a, k: (body(a, y, k), None), acc, jnp.arange(4))[0]

        print(json.dumps({"form": name, "copies_of_the_carry": copies(step)}))
