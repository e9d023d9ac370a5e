"""Benchmark (on a GPU) or check (on CPU) megajax's Pallas kernels against the alternatives.

    python scripts/bench_kernels.py            # GPU: forward+backward timings; CPU: correctness sweep
    python scripts/bench_kernels.py --json out.json

On a GPU, for attention at GPT-2 and Llama shapes it times forward + backward of impl="xla" (the jnp
reference), impl="pallas" (megajax's flash kernels), impl="cudnn", and jax.experimental.pallas.ops.gpu's
Triton flash attention (`mha`, no grouped-query support: kv heads are repeated for it), and xla and pallas with
attention dropout 0.1 (the hashed mask's cost beside the same kernel without it), and prints TFLOP/s and the
fraction of the device's dense peak. For LayerNorm and RMSNorm it prints GB/s against the HBM
bandwidth (norms are memory-bound). Attention FLOPs are the flash-attention convention: 4 b h s^2 k
forward (halved when causal), backward 2.5x the forward.

On CPU the kernels run in Pallas interpret mode, which says nothing about speed: the script instead runs a
small sweep of shapes against the jnp references and prints the errors (and the interpret-mode time).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from megajax import kernels  # noqa: E402
from megajax.kernels import flash_attention as fa  # noqa: E402
from megajax.kernels import fused_norm  # noqa: E402
from megajax.kernels.dropout import AttentionDropout  # noqa: E402
from megajax.metrics import PEAK_FLOPS  # noqa: E402

HBM_BYTES_PER_S = {"A100": 2.04e12, "H100": 3.35e12, "H200": 4.8e12}  # SXM datasheets

# (name, batch, seq, heads, kv heads, head dim): the attention of the presets in configs/ at their micro
# batch, plus a long-sequence Llama case.
ATTENTION_SHAPES = [
    ("gpt2-124m", 8, 1024, 12, 12, 64),
    ("gpt2-1.3b", 4, 2048, 16, 16, 128),
    ("llama-1b", 4, 2048, 32, 8, 64),
    ("llama-8k", 1, 8192, 32, 8, 128),
]
# (name, rows, width): b * s tokens of the residual stream.
NORM_SHAPES = [("gpt2-124m", 8 * 1024, 768), ("gpt2-1.3b", 4 * 2048, 2048), ("llama-8b", 4 * 2048, 4096)]


def time_fn(fn: Callable, *args, iters: int = 20, repeats: int = 3) -> float:
    """Seconds per call of a jitted fn as the device runs it back to back: after a warm-up call that compiles,
    `iters` calls are queued without waiting (JAX dispatches asynchronously) and only the last is waited for, so
    neither the host's dispatch nor the wait's round trip is counted (for a kernel longer than a dispatch, some
    tens of microseconds); the best of `repeats` such runs."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def fwd_bwd(attend: Callable) -> Callable:
    """jit of forward + backward (the gradients of sum(o * do) with respect to q, k, v)."""
    def run(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        return vjp(do)

    return jax.jit(run)


def jax_ops_mha(q, k, v, *, causal: bool):
    """jax's own Pallas Triton flash attention: repeats kv heads (it has no grouped-query path)."""
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    r = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    return jax_attention.mha(q, k, v, None, sm_scale=1.0 / np.sqrt(q.shape[-1]), causal=causal)


def with_dropout(impl: str, rate: float = 0.1) -> Callable:
    """megajax's attention by `impl` with attention dropout at `rate` (the hashed mask of kernels/dropout.py): its
    cost beside the same impl without, in one run."""
    def attend(q, k, v):
        keys = jax.random.split(jax.random.key(1), q.shape[0])
        drop = AttentionDropout.of(keys, 1, rate, q.shape[2])
        return kernels.attention(q, k, v, causal=True, impl=impl, probs_dropout=drop)

    return attend


def attention_impls() -> dict[str, Callable]:
    causal = True
    return {
        "xla": functools.partial(kernels.attention, causal=causal, impl="xla"),
        "pallas": functools.partial(kernels.attention, causal=causal, impl="pallas"),
        "cudnn": functools.partial(kernels.attention, causal=causal, impl="cudnn"),
        "jax-pallas-ops": functools.partial(jax_ops_mha, causal=causal),
        "xla dropout 0.1": with_dropout("xla"),
        "pallas dropout 0.1": with_dropout("pallas"),
    }


def device_name() -> str:
    kind = jax.devices()[0].device_kind.upper()
    return next((name for name in PEAK_FLOPS if name in kind), kind)


def attention_inputs(b: int, s: int, h: int, g: int, d: int, dtype) -> tuple[jax.Array, ...]:
    """Random q [b, s, h, d], k and v [b, s, g, d], and an output gradient like q."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), dtype)
    k, v = (jax.random.normal(key, (b, s, g, d), dtype) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (b, s, h, d), dtype)


def bench_attention(dtype=jnp.bfloat16) -> list[dict]:
    device = device_name()
    peak = PEAK_FLOPS.get(device, {}).get(jnp.dtype(dtype).name, float("nan"))
    rows = []
    for name, b, s, h, g, d in ATTENTION_SHAPES:
        q, k, v, do = attention_inputs(b, s, h, g, d, dtype)
        flops = 3.5 * 4 * b * h * s * s * d / 2  # causal: half the blocks
        for impl, attend in attention_impls().items():
            try:
                seconds = time_fn(fwd_bwd(attend), q, k, v, do)
            except Exception as e:  # noqa: BLE001 - an impl that cannot run this shape is reported, not fatal
                rows.append({"op": "attention", "shape": name, "impl": impl, "error": str(e).splitlines()[0]})
                continue
            rows.append({"op": "attention", "shape": name, "impl": impl, "ms": 1e3 * seconds,
                         "tflops": flops / seconds / 1e12, "of_peak": flops / seconds / peak})
    return rows


# One shape per BLOCK_TABLE head-dim bucket that --tune searches (the presets' attention at their micro batch).
TUNE_SHAPES = [("llama-1b", 4, 2048, 32, 8, 64), ("gpt2-1.3b", 4, 2048, 16, 16, 128)]


def tune_attention(dtype=jnp.bfloat16) -> list[dict]:
    """A search of the flash kernels' BlockSizes on this GPU: first the forward's tiles and launch
    parameters (forward alone), then the backward's with that forward (forward + backward). Rows carry the
    times; the best of each shape is marked best=True."""
    rows = []
    for name, b, s, h, g, d in TUNE_SHAPES:
        q, k, v, do = attention_inputs(b, s, h, g, d, dtype)
        base = fa.default_block_sizes(d, dtype)

        def timed(blocks, backward):
            attend = functools.partial(fa.flash_attention, causal=True, block_sizes=blocks)
            fn = fwd_bwd(attend) if backward else jax.jit(attend)
            try:
                return time_fn(fn, q, k, v, *((do,) if backward else ()), iters=10, repeats=1)
            except Exception:  # noqa: BLE001 - tiles that do not fit (shared memory) are skipped
                return float("inf")

        fwd = [(timed(base, False), base)]
        for bq, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            blocks = dataclasses.replace(base, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
            fwd.append((timed(blocks, False), blocks))
        fwd_s, best = min(fwd, key=lambda t: t[0])
        rows.append({"op": "tune-fwd", "shape": name, "ms": 1e3 * fwd_s, "default_ms": 1e3 * timed(base, False),
                     "blocks": dataclasses.asdict(best), "tried": len(fwd)})
        bwd = [(timed(best, True), best)]
        for (bq_dq, bk_dq), (bq_dkv, bk_dkv), warps, stages in itertools.product(
                [(64, 32), (64, 64), (128, 32), (128, 64)], [(32, 64), (64, 64), (32, 128), (64, 128)], (4, 8),
                (2, 3)):
            blocks = dataclasses.replace(best, block_q_dq=bq_dq, block_k_dq=bk_dq, block_q_dkv=bq_dkv,
                                         block_k_dkv=bk_dkv, bwd_num_warps=warps, bwd_num_stages=stages)
            bwd.append((timed(blocks, True), blocks))
        total_s, best = min(bwd, key=lambda t: t[0])
        flops = 3.5 * 4 * b * h * s * s * d / 2
        rows.append({"op": "tune-fwd-bwd", "shape": name, "ms": 1e3 * total_s,
                     "default_ms": 1e3 * timed(base, True), "tflops": flops / total_s / 1e12,
                     "blocks": dataclasses.asdict(best), "tried": len(bwd)})
    return rows


def bench_norms(dtype=jnp.bfloat16) -> list[dict]:
    bandwidth = HBM_BYTES_PER_S.get(device_name(), float("nan"))
    rows = []
    for name, n, d in NORM_SHAPES:
        x = jax.random.normal(jax.random.key(0), (n, d), dtype)
        dy = jnp.ones_like(x)
        w = jnp.ones((d,), jnp.float32)
        # forward reads x, writes y; backward reads x and dy, writes dx (statistics and weights are noise)
        moved = 5 * n * d * jnp.dtype(dtype).itemsize
        for impl in ("xla", "pallas"):
            for norm in ("layer_norm", "rms_norm"):
                if norm == "layer_norm":
                    f = functools.partial(kernels.layer_norm, impl=impl, out_dtype=dtype)
                    args = (w, w)
                else:
                    f = functools.partial(kernels.rms_norm, impl=impl, out_dtype=dtype)
                    args = (w,)

                def run(x, dy, *params, f=f):
                    y, vjp = jax.vjp(lambda x, *p: f(x, *p), x, *params)
                    return vjp(dy)

                seconds = time_fn(jax.jit(run), x, dy, *args)
                rows.append({"op": norm, "shape": name, "impl": impl, "ms": 1e3 * seconds,
                             "gb_per_s": moved / seconds / 1e9, "of_peak": moved / seconds / bandwidth})
    return rows


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def error_sweep(large: bool = False) -> list[dict]:
    """The kernels (interpret mode on CPU, compiled on a GPU) against the references: max relative error of
    outputs and gradients. `large` adds preset-sized cases (for a GPU)."""
    rows = []
    cases = [(1, 64, 4, 1, 32, True, jnp.float32), (1, 48, 4, 2, 24, False, jnp.float32),
             (2, 64, 8, 2, 64, True, jnp.bfloat16), (1, 100, 4, 4, 16, True, jnp.float16)]
    if large:
        cases += [(2, 1024, 12, 12, 64, True, jnp.bfloat16), (1, 2048, 16, 4, 128, True, jnp.bfloat16),
                  (1, 1000, 8, 2, 128, False, jnp.float32)]
    for b, s, h, g, d, causal, dtype in cases:
        keys = jax.random.split(jax.random.key(s), 4)
        q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(dtype)
        k, v = (jax.random.normal(key, (b, s, g, d), jnp.float32).astype(dtype) for key in keys[1:3])
        do = jax.random.normal(keys[3], (b, s, h, d), jnp.float32).astype(dtype)

        def grads(attend):
            return jax.jit(lambda *a: (attend(*a[:3]), *jax.vjp(attend, *a[:3])[1](a[3])))

        shape = f"b{b} s{s} h{h} g{g} k{d} causal={causal}"
        try:
            start = time.perf_counter()
            got = jax.block_until_ready(grads(functools.partial(fa.flash_attention, causal=causal))(q, k, v, do))
            seconds = time.perf_counter() - start
            want = grads(functools.partial(kernels.attention_reference, causal=causal))(q, k, v, do)
        except Exception as e:  # noqa: BLE001 - a case that fails is reported, the sweep goes on
            rows.append({"op": "attention", "shape": shape, "dtype": jnp.dtype(dtype).name,
                         "error": str(e).splitlines()[0]})
            continue
        errors = {n: rel_err(a, w) for n, a, w in zip(["out", "dq", "dk", "dv"], got, want)}
        rows.append({"op": "attention", "shape": shape, "dtype": jnp.dtype(dtype).name, "first_call_s": seconds,
                     **errors})
    for n, d, dtype in [(64, 96, jnp.float32), (30, 768, jnp.bfloat16)]:
        x = 3 * jax.random.normal(jax.random.key(n), (n, d), jnp.float32).astype(dtype) + 1
        w = jnp.linspace(0.5, 1.5, d)
        for norm, kernel, ref, params in [("layer_norm", fused_norm.layer_norm_pallas, kernels.layer_norm_reference,
                                           (w, w)),
                                          ("rms_norm", fused_norm.rms_norm_pallas, kernels.rms_norm_reference, (w,))]:
            def value_and_grads(f):
                def run(x, *p):
                    y, vjp = jax.vjp(lambda x, *p: f(x, *p, 1e-5), x, *p)
                    return (y, *vjp(jnp.cos(y)))  # a cotangent that varies along the row

                return jax.jit(run)

            start = time.perf_counter()
            got = jax.block_until_ready(value_and_grads(kernel)(x, *params))
            seconds = time.perf_counter() - start
            want = value_and_grads(ref)(x, *params)
            errors = {k: rel_err(a, b) for k, a, b in zip(["y", "dx", "dscale", "dbias"], got, want)}
            rows.append({"op": norm, "shape": f"{n}x{d}", "dtype": jnp.dtype(dtype).name, "first_call_s": seconds,
                         **errors})
    return rows


def print_rows(rows: list[dict], json_path: str | None = None) -> None:
    """One line per row; with json_path, also the rows as JSON in that file."""
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--tune", action="store_true", help="GPU: search the flash kernels' block sizes instead")
    args = parser.parse_args(argv)
    if args.tune:
        rows = tune_attention()
    elif jax.default_backend() == "gpu":
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
        rows = error_sweep(large=True) + bench_attention() + bench_norms()
    else:
        print(f"no GPU ({jax.default_backend()}): interpret-mode correctness sweep, not a benchmark")
        rows = error_sweep()
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
