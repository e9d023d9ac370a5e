"""Measures the pipeline bubble with one process per pipeline rank, each pinned to its own CPU core.

In one process the 8 fake devices share the cores and an idle tick costs nothing, so the bubble cannot
show. Here p = 2 processes (scripts/launch_local.sh --pin), one device each, so a rank waiting for its
neighbour is really idle. For each schedule and number of micro batches m the step time is compared with
the ideal: the same model and batch on one process without a pipeline (half its time per rank, since each
rank holds half the layers). The 1F1B executor recomputes each chunk's forward in its backward, so the
single-process run uses model.recompute=full and the pipelined runs model.recompute=none: both then run
one forward, one recomputed forward and one backward per micro batch.

    python scripts/bench_pipeline.py [--steps 6] [--out bench_pipeline.json]

Measured bubble = T_pipeline / (T_single / p) - 1, against the paper's (p - 1) / (v m) ((p - 1) / (2 m) for
zero_bubble) and the schedule's own (`Schedule.bubble_fraction`: unit costs, pairwise waits). What the
schedule does not explain is divided by its ticks: the executor's fixed cost per tick (the sends, the buffer
writes, the conditionals), which interleaving pays more often.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from megajax.parallel.pipeline import schedule as schedule_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.num_layers=8", "model.hidden_size=256", "model.num_heads=4", "model.seq_length=128",
         "model.vocab_size=257", "train.micro_batch_size=4", "train.log_every=1",
         "train.eval_every=0", "checkpoint.every=0", "optim.warmup_steps=1"]


def run(cmd: list[str], out_dir: str, steps: int) -> float:
    """Median step time (s) over the steps after the first two, from the run's metrics.jsonl."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f if '"step_time_s"' in line]
    return statistics.median(times[2:steps])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="*", default=["1f1b", "interleaved", "zero_bubble"],
                        choices=[name for name in schedule_lib.SCHEDULES if name != "gpipe"])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    p = 2
    rows = []
    for m in args.micro_batches:
        common = MODEL + [f"train.steps={args.steps}", f"train.global_batch_size={4 * m}"]
        with tempfile.TemporaryDirectory() as tmp:
            single = run(["taskset", "-c", "0", sys.executable, "-m", "megajax.train", "--config",
                          "configs/tiny.yaml", "--set", *common, f"train.output_dir={tmp}/single",
                          "parallel.data=1", "model.recompute=full"], f"{tmp}/single", args.steps)
            for schedule in args.schedules:
                v = 2 if schedule == "interleaved" else 1
                out = f"{tmp}/{schedule}"
                t = run(["bash", "scripts/launch_local.sh", "-n", str(p), "-d", "1", "--pin", "--",
                         sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *common,
                         f"train.output_dir={out}", "parallel.data=1", f"parallel.pipeline={p}",
                         "model.recompute=none",
                         f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}"], out, args.steps)
                ideal = single / p
                formula = schedule_lib.formula(schedule, p, v, m)
                sched = schedule_lib.build(schedule, p, v, m)
                planned = sched.bubble_fraction()
                rows.append({"schedule": schedule, "v": v, "m": m, "step_s": t, "ideal_s": ideal,
                             "single_process_s": single, "measured_bubble": t / ideal - 1,
                             "formula_bubble": formula, "schedule_bubble": planned, "ticks": sched.ticks,
                             "overhead_per_tick_ms": 1e3 * (t - ideal * (1 + planned)) / sched.ticks})
                r = rows[-1]
                print(f"{schedule:12s} v={v} m={m}: step {t:.3f} s, ideal {ideal:.3f} s, bubble measured "
                      f"{r['measured_bubble']:.3f} vs schedule {planned:.3f} (formula {formula:.3f}); "
                      f"{sched.ticks} ticks, {r['overhead_per_tick_ms']:.1f} ms per tick beyond the schedule",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
