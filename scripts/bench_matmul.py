"""GEMM rates on the device at hand, for the choices FP8 training and mixture-of-experts depend on.

    python scripts/bench_matmul.py [--json out.json]

- dense: at square and at the 1.3B preset's layer shapes, TFLOP/s of bf16 x bf16; of float8_e4m3fn x
  float8_e4m3fn alone (operands already in FP8, the weight in the [n, k] layout the FP8 GEMM reads, the unscaling
  in its epilogue: the rate the planner's FP8 constant is), and with the casts of both operands timed too (as an
  FP8 linear layer given its scales runs it); beside them the planner's model of each (megajax.plan.hardware).
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
    """x [m, k] @ w [k, n] in e4m3 with per-tensor scales, output bf16 (the casts included)."""
    xq = (x / sx).astype(jnp.float8_e4m3fn)
    wq = (w / sw).astype(jnp.float8_e4m3fn)
    return fp8_gemm(xq, wq.T, sx * sw)


def fp8_gemm(xq, wq_t, scale):
    """xq [m, k] @ wq_t [n, k]^T in e4m3, fp32 accumulation, unscaled to bf16: one FP8 GEMM on sm_90, the
    unscaling in its epilogue."""
    out = jax.lax.dot_general(xq, wq_t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(jnp.bfloat16)


def dense_rows(scale: int) -> list[dict]:
    from megajax.plan.hardware import hardware

    model = hardware("h100")
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
        with_casts = time_fn(jax.jit(fp8_dot), x, w, sx, sw)
        xq, wq_t = (x / sx).astype(jnp.float8_e4m3fn), (w.T / sw).astype(jnp.float8_e4m3fn)
        gemm = time_fn(jax.jit(fp8_gemm), xq, wq_t, sx * sw)
        rows.append({"op": "dense", "shape": name, "m_k_n": [m, k, n], "bf16_tflops": flops / bf16 / 1e12,
                     "fp8_tflops": flops / gemm / 1e12, "fp8_with_casts_tflops": flops / with_casts / 1e12,
                     "fp8_speedup": bf16 / gemm,
                     "h100_model_tflops": {dt: flops / model.gemm_seconds(m, k, n, dt) / 1e12
                                           for dt in ("bfloat16", "float8")}})
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
