"""GEMM rates on the device at hand, for the choices FP8 training and mixture-of-experts depend on.

    python scripts/bench_matmul.py [--json out.json]

- dense: bf16 x bf16 and float8_e4m3fn x float8_e4m3fn (fp32 accumulation, per-tensor scales applied around
  the dot, as an FP8 linear layer does) at square and at the 1.3B preset's layer shapes; TFLOP/s of each.
- grouped (MoE): E experts, T tokens routed k at a time, as `jax.lax.ragged_dot` over tokens sorted by expert
  vs a capacity-padded batched matmul [E, C, d] x [E, d, f]; TFLOP/s counted on the routed tokens only.
On CPU the shapes are cut down and the numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import print_rows, time_fn  # noqa: E402 - the timing and printing of the kernel benchmark


def fp8_dot(x, w, sx, sw):
    """x [m, k] @ w [k, n] in e4m3 with per-tensor scales, output bf16."""
    xq = (x / sx).astype(jnp.float8_e4m3fn)
    wq = (w / sw).astype(jnp.float8_e4m3fn)
    out = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * (sx * sw)).astype(jnp.bfloat16)


def dense_rows(scale: int) -> list[dict]:
    shapes = [("square 8192", 8192, 8192, 8192), ("1.3b qkv (mb4 s2048)", 8192, 2048, 6144),
              ("1.3b mlp-in", 8192, 2048, 8192), ("1.3b mlp-out", 8192, 8192, 2048)]
    rows = []
    for name, m, k, n in shapes:
        m, k, n = m // scale, k // scale, n // scale
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        flops = 2 * m * k * n
        bf16 = time_fn(jax.jit(lambda x, w: x @ w), x, w)
        sx, sw = jnp.float32(0.5), jnp.float32(0.25)
        fp8 = time_fn(jax.jit(fp8_dot), x, w, sx, sw)
        rows.append({"op": "dense", "shape": name, "m_k_n": [m, k, n], "bf16_tflops": flops / bf16 / 1e12,
                     "fp8_tflops": flops / fp8 / 1e12, "fp8_speedup": bf16 / fp8})
    return rows


def grouped_rows(scale: int) -> list[dict]:
    rows = []
    # (name, tokens, hidden, expert ffn, experts, top-k): Mixtral-like at a micro batch of 4 x 2048 tokens.
    for name, t, d, f, e, k in [("mixtral-like", 8192, 4096, 14336, 8, 2), ("fine-grained", 8192, 2048, 1408, 64, 6)]:
        t, d, f = t // scale, d // scale, f // scale
        rng = np.random.default_rng(0)
        routed = t * k
        expert_of = np.sort(rng.integers(0, e, routed))
        sizes = np.bincount(expert_of, minlength=e).astype(np.int32)
        x = jax.random.normal(jax.random.key(0), (routed, d), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (e, d, f), jnp.bfloat16) / np.sqrt(d)
        flops = 2 * routed * d * f
        ragged = time_fn(jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g)), x, w, jnp.asarray(sizes))
        capacity = int(np.ceil(1.25 * routed / e))  # a capacity factor of 1.25
        xc = jax.random.normal(jax.random.key(2), (e, capacity, d), jnp.bfloat16)
        batched = time_fn(jax.jit(lambda x, w: jnp.einsum("ecd,edf->ecf", x, w)), xc, w)
        rows.append({"op": "grouped", "shape": name, "tokens_x_k": routed, "hidden": d, "ffn": f, "experts": e,
                     "ragged_dot_tflops": flops / ragged / 1e12, "capacity_1.25_batched_tflops": flops / batched / 1e12,
                     "ragged_ms": 1e3 * ragged, "batched_ms": 1e3 * batched})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    scale = 1 if jax.default_backend() == "gpu" else 16
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, shapes / {scale}")
    rows = dense_rows(scale) + grouped_rows(scale)
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
