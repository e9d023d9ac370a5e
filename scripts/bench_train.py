"""Time megajax's train step on the devices at hand: step time, tokens/s, TFLOP/s and MFU per device, peak memory.

    python scripts/bench_train.py --config configs/gpt2-124m.yaml --set train.global_batch_size=64 \
        --steps 20 --label gpt2-124m --jsonl out.jsonl

The batch is random tokens (the step's cost does not depend on them), so no data is read and nothing is saved:
this is the step alone, as `python -m megajax.train` runs it. MFU counts model FLOPs (no recomputation) against
the device's dense datasheet peak for the compute dtype, as the train log does; the first `--warmup` steps
(compilation included) are not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from megajax import distributed, metrics, step as step_lib  # noqa: E402
from megajax.config import io as config_io  # noqa: E402
from megajax.data.loader import batch_shapes  # noqa: E402
from megajax.kernels import auto as kernel_choice  # noqa: E402


def random_batch(cfg, shardings) -> dict:
    rng = np.random.default_rng(0)
    gbs, seq = cfg.train.global_batch_size, cfg.model.seq_length
    arrays = {}
    for name, (shape, dtype) in batch_shapes(gbs, seq, cfg.data.document_fields).items():
        if name == "loss_mask":
            value = np.ones(shape, dtype)
        elif name == "sample_ids":
            value = np.arange(gbs, dtype=dtype)
        elif name in ("segment_ids", "positions"):  # one document a row
            value = np.zeros(shape, dtype) if name == "segment_ids" else np.broadcast_to(np.arange(seq, dtype=dtype),
                                                                                         shape)
        else:
            value = rng.integers(0, cfg.model.vocab_size, shape, dtype=dtype)
        arrays[name] = jax.device_put(value, shardings[name])
    return arrays


def warmed_step(setup, warmup: int):
    """(the compiled step, its state after `warmup` steps, the random batch, compile seconds) for `setup`; call
    inside its mesh (jax.set_mesh(setup.mesh))."""
    state = step_lib.init_state(setup)
    batch = random_batch(setup.cfg, setup.batch_shardings)
    t0 = time.perf_counter()
    step_fn = step_lib.compile_train_step(setup, state, batch)  # (delayed FP8: the later steps' program after one)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, _ = step_fn(state, batch)
    jax.block_until_ready(state)
    return step_fn, state, batch, compile_s


def bench(cfg, steps: int, warmup: int, devices=None) -> dict:
    """The timed step of `cfg` on `devices` (default: every device)."""
    setup = step_lib.setup_for(cfg, devices)
    cfg = setup.cfg
    with jax.set_mesh(setup.mesh):
        step_fn, state, batch, compile_s = warmed_step(setup, warmup)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, stats = step_fn(state, batch)
        loss = float(jax.device_get(stats["loss"]))
        dt = (time.perf_counter() - t0) / steps
    gbs, seq, n_dev = cfg.train.global_batch_size, cfg.model.seq_length, setup.mesh.size
    flops = metrics.step_flops(cfg.model, gbs * seq, pipelined=cfg.parallel.pipeline > 1,
                               platform=setup.plan.platform)
    peak, peak_src = metrics.device_peak(cfg.model.compute_dtype)
    mem = jax.devices()[0].memory_stats() or {}
    return {
        "device": jax.devices()[0].device_kind, "devices": n_dev, "jax": jax.__version__,
        "compile_s": compile_s, "step_s": dt, **metrics.step_rates(flops, gbs * seq, dt, n_dev, peak),
        "model_tflops_per_device": flops["model_flops"] / dt / n_dev / 1e12, "peak_source": peak_src,
        "peak_bytes_in_use": mem.get("peak_bytes_in_use"), "loss": loss,
        "micro_batches": cfg.num_micro_batches, "micro_batch_size": cfg.train.micro_batch_size,
        "ran": ran(cfg.model, setup.plan),
        "params": sum(math.prod(a.shape) for a in jax.tree.leaves(setup.param_shapes)),
    }


def ran(m, plan) -> dict:
    """What the step ran where the config says auto: its attention and norm implementations, and whether its
    layers were unrolled (the planner's checks read this back, megajax.plan.checks)."""
    kernels = kernel_choice.chosen(m.attention_impl, m.norm_impl, head_dim=m.head_dim, width=m.hidden_size,
                                   platform=plan.platform)
    return {what: impl for what, (impl, _) in kernels.items()} | {"unroll_layers": plan.unroll_layers}


def step_parser(doc: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The step benchmarks' command line: --config, --set, --steps, --warmup, --label."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--config", help="YAML preset (configs/*.yaml)")
    parser.add_argument("--set", nargs="*", default=[], action="extend", metavar="KEY=VALUE",
                        help="config overrides, as for python -m megajax.train")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    parser.add_argument("--label", default="", help="a name for this row")
    return parser


def append_row(path: str | None, row: dict) -> None:
    """Appends the row as one JSON line to `path`, if given."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = step_parser(__doc__, 10, "timed steps")
    parser.add_argument("--jsonl", help="append the row to this file")
    args = parser.parse_args(argv)
    distributed.prefer_cpu_without_gpu()
    cfg = config_io.load(args.config, args.set)
    row = {"label": args.label, "config": args.config, "set": args.set, **bench(cfg, args.steps, args.warmup)}
    print(json.dumps(row))
    append_row(args.jsonl, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
