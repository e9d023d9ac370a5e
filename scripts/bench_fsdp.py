"""ZeRO-3 against ZeRO-1 on one mesh of CPU devices: step time and XLA's peak memory per device, side by side.

    python scripts/bench_fsdp.py [--devices 8] [--rounds 3] [--steps 6] [--json out.jsonl]

The model: Llama (RMSNorm, SwiGLU, RoPE), 4 layers of 256 with 4 heads, an MLP of 768, sequence 128, a
vocabulary of 4096, fp32, 16 sequences a step in micro batches of 1 per data rank (2 per rank at data 8), on
`--devices` fake CPU devices, all of them data-parallel. Each strategy is compiled once in this process (XLA's
memory analysis of the compiled step gives the per-device arguments, temp and peak), then the strategies take
turns, `--rounds` times, each timing `--steps` steps after one warm-up step; the report gives each one's median
step time and the ratio. The 8 fake devices share the machine's cores, so a step's time is the work of all of them:
the ratio, not the time, is what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

STRATEGIES = {"zero1": ["parallel.data_parallel_sharding_strategy=optim"],
              "zero3": ["parallel.data_parallel_sharding_strategy=optim_grads_params"]}
MODEL = ["model.arch=llama", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.ffn_hidden_size=768", "model.seq_length=128", "model.vocab_size=4096",
         "model.compute_dtype=float32", "train.global_batch_size=16", "train.micro_batch_size=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="append one JSON row per strategy here")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    from megajax import step
    from megajax.config import io as config_io

    runs = {}
    for name, sets in STRATEGIES.items():
        cfg = config_io.load(None, MODEL + sets + [f"parallel.data={args.devices}"])
        setup = step.setup_for(cfg, jax.devices()[:args.devices])
        state = step.init_state(setup)
        rng = np.random.default_rng(0)
        gbs, s = setup.cfg.train.global_batch_size, setup.cfg.model.seq_length
        tokens = rng.integers(0, setup.cfg.model.vocab_size, (gbs, s + 1)).astype(np.int32)
        batch = jax.device_put({"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                                "loss_mask": np.ones((gbs, s), np.float32),
                                "sample_ids": np.arange(gbs, dtype=np.int32)}, setup.batch_shardings)
        with jax.set_mesh(setup.mesh):
            compiled = step.jit_train_step(setup).lower(state, batch).compile()
        mem = compiled.memory_analysis()
        state, stats = compiled(state, batch)  # the warm-up step
        jax.block_until_ready(stats["loss"])
        runs[name] = {"compiled": compiled, "state": state, "batch": batch, "times": [], "memory": {
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes}}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                run["state"], stats = run["compiled"](run["state"], run["batch"])
            jax.block_until_ready(stats["loss"])
            run["times"].append((time.perf_counter() - start) / args.steps)
    rows = []
    for name, run in runs.items():
        rows.append({"strategy": name, "devices": args.devices, "median_step_s": statistics.median(run["times"]),
                     "step_s_per_round": run["times"], **run["memory"], "jax": jax.__version__,
                     "model": MODEL, "sets": STRATEGIES[name]})
        m = run["memory"]
        print(f"{name}: median step {rows[-1]['median_step_s']:.3f} s, per device: arguments "
              f"{m['argument_bytes'] / 2**20:.1f} MiB, temp {m['temp_bytes'] / 2**20:.1f} MiB, peak "
              f"{m['peak_bytes'] / 2**20:.1f} MiB")
    print(f"zero3 / zero1 step time: {rows[1]['median_step_s'] / rows[0]['median_step_s']:.3f}; peak memory: "
          f"{rows[1]['peak_bytes'] / rows[0]['peak_bytes']:.3f}")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
