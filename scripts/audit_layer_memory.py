"""What one more layer costs in memory: XLA's compiled H100 program (compile-only, no GPU) at 8 and 16 layers,
against the planner's memory model (megajax.plan.cost) for the same config, per recompute mode. The difference
of two depths leaves what scales with the layers: weights, gradients, optimizer state and the activations the
backward keeps.

    python scripts/audit_layer_memory.py --out benchmarks/planner/2026-11-26-layer-memory.jsonl   # 2 minutes

Per case and recompute mode, MiB per layer: XLA's peak (`xla_peak`), its temporaries (`xla_temp`: activations,
gradients, the step's casts), and the model's total, activations and gradients.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MIB = 2**20
# (name, preset, --set): Llama 3 70B's layer at tensor 8 with sequence parallelism (one micro batch of 8192
# tokens), and GPT-2 1.3B's unsharded (micro batch 4 of 2048 tokens, data 8), both with the Pallas kernels.
CASES = [
    ("llama3-70b layer, t8 sp, mb1 s8192", "configs/llama3-70b.yaml", [
        "parallel.data=1", "parallel.pipeline=1", "parallel.tensor=8", "parallel.sequence_parallel=true",
        "parallel.tp_comm_overlap=false", "parallel.schedule=1f1b", "parallel.virtual_stages=1",
        "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false", "train.global_batch_size=1",
        "train.micro_batch_size=1"]),
    ("gpt2-1.3b layer, d8, mb4 s2048", "configs/gpt2-1.3b.yaml", [
        "parallel.data=8", "parallel.tensor=1", "parallel.sequence_parallel=false", "train.global_batch_size=32",
        "train.micro_batch_size=4", "model.attention_impl=pallas", "model.norm_impl=pallas"]),
    ("llama3-8b layer, d8 zero3, mb1", "configs/llama3-8b.yaml", [
        "parallel.data=8", "parallel.pipeline=1", "parallel.tensor=1", "parallel.sequence_parallel=false",
        "parallel.tp_comm_overlap=false", "parallel.data_parallel_sharding_strategy=optim_grads_params",
        "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true", "train.global_batch_size=8",
        "train.micro_batch_size=1"]),
]
DEPTHS = (8, 16)  # (at 2 and 4 layers XLA treats the short layer loops differently: 14x the bytes a layer)


def compiled_memory(preset: str, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "megajax.audit", "--config", preset, "--target", "h100", "--devices", "8",
           "--set", *sets]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["memory_per_device"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the rows here (JSON lines)")
    parser.add_argument("--recompute", default="none,selective,full")
    parser.add_argument("--case", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    from megajax.config import io as config_io
    from megajax.plan.cost import estimate
    from megajax.plan.hardware import hardware

    hw, rows = hardware("h100"), []
    for name, preset, sets in (c for c in CASES if args.case is None or args.case in c[0]):
        for mode in args.recompute.split(","):
            xla, model = {}, {}
            for depth in DEPTHS:
                s = [*sets, f"model.num_layers={depth}", f"model.recompute={mode}"]
                xla[depth] = compiled_memory(preset, s)
                model[depth] = estimate(config_io.load(preset, s).for_devices(8), hw, 8).memory

            def per_layer(a, b):
                return round((b - a) / (DEPTHS[1] - DEPTHS[0]) / MIB, 1)

            lo, hi = DEPTHS
            row = {"case": name, "recompute": mode,
                   "xla_peak": per_layer(xla[lo]["peak_estimate_gib"] * 2**30, xla[hi]["peak_estimate_gib"] * 2**30),
                   "xla_temp": per_layer(xla[lo]["temp_bytes"], xla[hi]["temp_bytes"]),
                   "model_total": per_layer(model[lo]["total"], model[hi]["total"]),
                   "model_activations": per_layer(model[lo]["activations"], model[hi]["activations"]),
                   "model_gradients": per_layer(model[lo]["gradients"], model[hi]["gradients"]),
                   "sets": sets}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sets"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
