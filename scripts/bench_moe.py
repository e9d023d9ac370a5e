"""One MoE layer's forward and backward on the device at hand, dropless (the Pallas grouped GEMM of
kernels/grouped_matmul.py, and `jax.lax.ragged_dot`) against a capacity factor ([E, c, d] buffers and batched
matmuls), with the FLOPs counted on the routed tokens only.

    python scripts/bench_moe.py [--tokens 4096 --hidden 4096 --ffn 14336 --experts 8 --k 2] [--fp8] [--json out]

Each dropless row with the Pallas GEMM also gives its error against the ragged_dot row (output and the
gradients of the input and the parameters, the largest relative error of each, `bench_kernels.rel_err`).
--fp8 adds the dropless rows with model.fp8=hybrid (e4m3 forward, e5m2 gradients, current scaling).

The layer is megajax.model.moe.MoE (router, dispatch, expert MLPs, combine) in bf16 with fp32 parameters;
TFLOP/s = 3 x 2 x tokens x k x (3 matmuls of d x f for SwiGLU) / time (forward + backward). On CPU cut the
sizes down; the numbers then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_kernels import print_rows, rel_err, time_fn  # noqa: E402 - the timing and printing of the kernel benchmark

from megajax.config import ModelConfig  # noqa: E402
from megajax.model import moe  # noqa: E402


def measure(tokens: int, hidden: int, ffn: int, experts: int, k: int, factor: float | None,
            gemm: str = "pallas", fp8: str = "none", oracle: dict | None = None) -> tuple[dict, object]:
    """One row, and the forward + backward's results (for the next row's errors against them)."""
    seq = min(tokens, 2048)
    cfg = ModelConfig(arch="llama", hidden_size=hidden, num_heads=hidden // 128, seq_length=seq, num_experts=experts,
                      experts_per_token=k, moe_ffn_hidden_size=ffn, moe_capacity_factor=factor,
                      moe_grouped_gemm=gemm == "pallas", fp8=fp8, compute_dtype="bfloat16", param_dtype="float32")
    layer = moe.MoE(cfg)
    x = jax.random.normal(jax.random.key(0), (tokens // seq, seq, hidden), jnp.bfloat16)
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(1), x)["params"])
    g = jax.random.normal(jax.random.key(2), x.shape, jnp.bfloat16)

    def fwd_bwd(params, x, g):
        y, vjp = jax.vjp(lambda p, x: layer.apply({"params": p}, x, mutable=True)[0], params, x)
        return y, vjp(g)

    run = jax.jit(fwd_bwd)
    seconds = time_fn(run, params, x, g)
    flops = 3 * 2 * tokens * k * 3 * hidden * ffn
    mode = f"dropless ({'Pallas grouped GEMM' if gemm == 'pallas' else 'ragged_dot'})" if factor is None \
        else f"capacity {factor} (batched)"
    row = {"mode": mode + ("" if fp8 == "none" else f", fp8 {fp8}"), "tokens": tokens, "hidden": hidden,
           "ffn": ffn, "experts": experts, "k": k, "device": jax.devices()[0].device_kind,
           "fwd_bwd_ms": 1e3 * seconds, "routed_tflops": flops / seconds / 1e12}
    results = run(params, x, g)
    if oracle is not None:
        y, (dp, dx) = results
        y0, (dp0, dx0) = oracle
        row["err_out"], row["err_dx"] = rel_err(y, y0), rel_err(dx, dx0)
        row["err_dparams"] = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)))
    return row, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--factors", type=float, nargs="*", default=[1.0, 1.25])
    parser.add_argument("--fp8", action="store_true", help="also the dropless rows with model.fp8=hybrid")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    shape = (args.tokens, args.hidden, args.ffn, args.experts, args.k)
    rows = []

    def done(row: dict) -> None:  # each row printed and saved as it finishes: a timeout keeps the rows before it
        rows.append(row)
        print_rows([row], None)
        sys.stdout.flush()
        if args.json:
            _save(rows, args.json)

    for f in args.factors:
        done(measure(*shape, f)[0])
    for fp8 in ["none", "hybrid"] if args.fp8 else ["none"]:
        row, oracle = measure(*shape, None, gemm="ragged", fp8=fp8)
        done(row)
        done(measure(*shape, None, gemm="pallas", fp8=fp8, oracle=oracle)[0])
        del oracle
    return 0


def _save(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
