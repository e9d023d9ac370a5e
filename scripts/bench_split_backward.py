"""What the zero_bubble schedule's actions cost on the device at hand: one pipeline chunk's forward (F),
its fused backward (input and weight gradients at once, as 1F1B runs it), and the split backward, B (input
gradient, from the chunk linearized in its input, taps and small parameters) and W (the weight gradients, one
matmul per weight), each in units of F.

    python scripts/bench_split_backward.py [--hidden 4096 --heads 32 --layers 2 --seq 2048 --mb 1] [--json out]

The schedule's accounting assumes F = R = B = W = 1 and a fused backward of 2; this measures them. Times are
jitted calls of each piece alone (medians after a warm-up): B and the fused backward include the forward
that linearizes the chunk, so F is subtracted from them. On CPU the shapes are cut down (--hidden etc.) and
the numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_kernels import print_rows, time_fn  # noqa: E402 - the timing and printing of the kernel benchmark

from megajax import model  # noqa: E402
from megajax.config import ModelConfig  # noqa: E402
from megajax.parallel.pipeline.zero_bubble import split_linearize, split_weight_grads, zero_taps  # noqa: E402


def measure(arch: str, hidden: int, heads: int, layers: int, seq: int, mb: int, attention: str) -> dict:
    cfg = ModelConfig(arch=arch, num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=seq,
                      compute_dtype="bfloat16", param_dtype="float32", attention_impl=attention)
    w = nn.unbox(model.init_params(cfg, jax.random.key(0)))["layers"]
    x = jax.random.normal(jax.random.key(1), (mb, seq, hidden), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (mb, seq, hidden), jnp.bfloat16)
    taps = zero_taps(cfg, w, x, None)

    def forward(w, x):
        return model.layers_apply(cfg, w, x, None)

    def fused(w, x, g):
        return jax.vjp(forward, w, x)[1](g)

    def split_b(w, x, g):
        _, pullback, inputs = split_linearize(cfg, w, x, taps, None, jnp.arange(layers), None)
        dx, dys, dsmall = pullback(g)
        return dx, dys, dsmall, inputs

    _, dys, _, inputs = jax.jit(split_b)(w, x, g)
    t_f = time_fn(jax.jit(forward), w, x)
    t_fused = time_fn(jax.jit(fused), w, x, g) - t_f
    t_b = time_fn(jax.jit(split_b), w, x, g) - t_f
    t_w = time_fn(jax.jit(lambda w, inputs, dys: split_weight_grads(w, inputs, dys, cfg)), w, inputs, dys)
    return {"arch": arch, "hidden": hidden, "layers": layers, "seq": seq, "mb": mb, "device": jax.devices()[0].device_kind,
            "F_ms": 1e3 * t_f, "fused_backward_ms": 1e3 * t_fused, "B_ms": 1e3 * t_b, "W_ms": 1e3 * t_w,
            "fused_over_F": t_fused / t_f, "B_over_F": t_b / t_f, "W_over_F": t_w / t_f,
            "split_over_fused": (t_b + t_w) / t_fused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--attention", default="xla", choices=("xla", "pallas", "cudnn"))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(args.arch, args.hidden, args.heads, args.layers, args.seq, mb, args.attention) for mb in args.mb]
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
