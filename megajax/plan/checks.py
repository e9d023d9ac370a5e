"""`python -m megajax.plan.checks [--json FILE]`: the planner's predictions against measurements, as the docs show
them (docs/guides/choosing-a-layout.md, benchmarks/2026-11-27-planner.md) and tests/test_plan.py checks them.

- `h100_steps`: the single-H100 train steps measured by scripts/bench_train.py (benchmarks/h100/train.jsonl and
  the dated runs beside it), each predicted for its config.
- `table1`: the ten rows of Narayanan et al. (SC21) Table 1 on A100s (benchmarks/sc21-table1.json), each at the
  paper's own layout: predicted TFLOP/s per GPU against the measured.
The paper's runs are predicted with the paper's bubble, (p - 1) / (v m), as Megatron-LM runs them
(`estimate(..., simulate=False, framework="megatron")`): Megatron's schedules, whose recompute sits on the critical
path, not megajax's executor; no layer-stack copies; gradient accumulation fused into the GEMMs.
- `choices`: the planner's pick for each row, in the paper's feature space (Megatron of 2021: no sequence
  parallelism, no distributed optimizer, full recomputation, no overlaps, no zero-bubble schedule) or in megajax's
  whole one, against the paper's layout.
- `takeaways`: at a fixed GPU count, the best predicted throughput per tensor size and per pipeline size.
- `compiled_memory`: programs compiled for compile-only H100s (benchmarks/compile-only/): XLA's peak against the
  model's memory, and which side of XLA's scheduling limit (`memory.scheduling_limit`) each puts the program on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from pathlib import Path

from megajax.config import io as config_io
from megajax.plan.cost import estimate
from megajax.plan.hardware import A100_GEMM_CALIBRATION, hardware
from megajax.plan.memory import scheduling_limit
from megajax.plan.search import KEYS, search

ROOT = Path(__file__).resolve().parents[2]
# The features of the paper's Megatron (2021), held fixed so that the search varies what the paper chose.
PAPER_SPACE = {"parallel.sequence_parallel": False, "model.recompute": "full",
               "parallel.data_parallel_sharding_strategy": "no_shard",
               "parallel.tp_comm_overlap": False, "parallel.overlap_grad_reduce": False,
               "parallel.overlap_param_gather": False, "parallel.schedule": ("1f1b", "interleaved"),
               "parallel.vocab_over_pipeline": None}
# The paper's runs had no fused attention (Megatron-LM's baddbmm and fused softmax over the [s, s] scores, with
# dropout on them): its configs are scored with the unfused one, which megajax's presets no longer run.
PAPER_SETS = ["model.attention_impl=xla"]


def _paper() -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "sc21-table1.json").read_text())["rows"]


# The single-H100 steps the planner is checked against: the newest GPU session's, measured on the code it models
# (the earlier sessions' rows, benchmarks/h100/train.jsonl and 2026-11-26*, ran code 7-19% slower).
STEPS = "benchmarks/h100/2026-11-27/train.jsonl"


def h100_steps(files: list[Path] | None = None) -> list[dict]:
    """Each measured single-H100 step (scripts/bench_train.py rows; by default `STEPS`) and its prediction
    (seconds)."""
    hw = hardware("h100")
    files = files or [ROOT / STEPS]
    out = []
    for path in map(Path, files):
        where = path.resolve()
        name = str(where.relative_to(ROOT) if where.is_relative_to(ROOT) else path)
        for line in path.read_text().splitlines():
            r = json.loads(line)
            cfg = config_io.load(ROOT / r["config"], _as_run(r) + r["set"]).for_devices(r["devices"])
            e = estimate(cfg, hw, 8)
            out.append({"file": name, "label": r["label"], "config": r["config"], "set": r["set"],
                        "measured_s": r["step_s"], "predicted_s": e.step_s, "error": e.step_s / r["step_s"] - 1,
                        "predicted_gib": e.memory["total"] / 2**30, "measured_gib": r["peak_bytes_in_use"] / 2**30})
    return out


# The model's uncertainty on a predicted step, by target: its largest miss, either way, on the steps measured on that
# kind of GPU (`h100_steps` for the H100 and H200; the SC21 paper's A100 runs, `table1`, as steps), rounded up to a
# percent. tests/test_plan.py recomputes it from the checks, so it moves with the model and the measurements.
ERROR = {"h100": 0.14, "h200": 0.14, "a100": 0.09}
ERROR_SOURCE = {"h100": "the 9 single-H100 steps measured", "h200": "the 9 single-H100 steps measured",
                "a100": "the SC21 paper's 10 A100 runs, each left out of the GEMM rate's fit"}


def largest_miss(target: str) -> float:
    """The largest relative miss of the predicted step on the measured rows of `target`'s kind of GPU. On A100s,
    whose GEMM rate is fitted to the same rows (`a100_calibration`), each row's miss is left out of its own fit: the
    rate fitted to the other nine."""
    if target == "a100":  # a TFLOP/s over-prediction of e is a step under-prediction of 1 / (1 + e) - 1
        rows = list(range(len(_paper())))
        return max(abs(1 / (1 + _a100_errors(a100_calibration([j for j in rows if j != i]))[i]) - 1)
                   for i in rows)
    return max(abs(r["error"]) for r in h100_steps())


def _a100_errors(factor: float) -> list[float]:
    """Each Table 1 run's predicted TFLOP/s error with the A100's GEMM rate at `factor` times its best-shape
    estimate (in place of hardware.A100_GEMM_CALIBRATION)."""
    hw = hardware("a100")
    scale = factor / A100_GEMM_CALIBRATION
    hw = dataclasses.replace(hw, gemm_flops={k: v * scale for k, v in hw.gemm_flops.items()})
    out = []
    for row in _paper():
        cfg = _paper_config(row)
        e = estimate(cfg, hw, 8, simulate=False, framework="megatron")
        out.append(paper_flops(cfg) / e.step_s / row["gpus"] / 1e12 / row["measured_tflops_per_gpu"] - 1)
    return out


def a100_calibration(rows: list[int] | None = None) -> float:
    """The factor on the A100's best-shape GEMM rate that leaves the Table 1 runs `rows` (indices; all of them by
    default) predicted with a geometric-mean error of zero, to 0.001 (bisection: a higher rate predicts more)."""
    rows = list(range(len(_paper()))) if rows is None else rows
    low, high = 0.5, 1.5
    while high - low > 1e-3:
        mid = (low + high) / 2
        errors = _a100_errors(mid)
        if sum(math.log1p(errors[i]) for i in rows) > 0:
            high = mid
        else:
            low = mid
    return round((low + high) / 2, 3)


# What a row's step ran where the row does not say (bench_train rows before the kernels and the layer loop were
# chosen by platform): XLA's attention and norms, the layers looped, unless its keys set them.
BEFORE_AUTO = ["model.attention_impl=xla", "model.norm_impl=xla", "model.scan_layers=true"]


def _as_run(row: dict) -> list[str]:
    """Keys that make a measured row's config compute what its step ran (its `ran` field, else BEFORE_AUTO)."""
    ran = row.get("ran")
    if ran is None:
        return BEFORE_AUTO
    return [f"model.attention_impl={ran['attention']}", f"model.norm_impl={ran['norms']}",
            f"model.scan_layers={str(not ran['unroll_layers']).lower()}"]


def _paper_config(row: dict):
    return _config_on(row["config"], row["gpus"])


@functools.lru_cache(maxsize=None)
def _config_on(path: str, gpus: int):
    """The config at `path` (from the repository's root) on `gpus` GPUs, loaded once (the fits estimate each row
    many times)."""
    return config_io.load(ROOT / path, PAPER_SETS).for_devices(gpus)


def table1() -> list[dict]:
    """Each Table 1 row at the paper's layout: predicted TFLOP/s per GPU (the paper's FLOPs formula, eq. 3,
    over the predicted step) against the measured."""
    hw = hardware("a100")
    out = []
    for row in _paper():
        cfg = _paper_config(row)
        e = estimate(cfg, hw, 8, simulate=False, framework="megatron")
        tflops = paper_flops(cfg) / e.step_s / row["gpus"] / 1e12
        out.append({**row, "predicted_tflops_per_gpu": tflops, "error": tflops / row["measured_tflops_per_gpu"] - 1,
                    "predicted_step_s": e.step_s, "bubble_fraction": e.bubble_fraction,
                    "memory_gib": e.memory["total"] / 2**30})
    return out


def paper_flops(cfg) -> float:
    """The paper's FLOPs per step (eq. 3, full recomputation): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    m = cfg.model
    B, s, ell, h, V = cfg.train.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    return 96 * B * s * ell * h**2 * (1 + s / (6 * h) + V / (16 * ell * h))


def choices(space: dict | None = None, paper_data: bool = True) -> list[dict]:
    """The planner's pick for each Table 1 row (in `space`, the fixed keys; the paper's by default) and its
    predicted throughput against the paper's layout's. `paper_data`: hold the data-parallel size at the paper's
    (Table 1 is a weak-scaling series: data 32 up to 76B, the model-parallel size growing with the GPUs)."""
    space = PAPER_SPACE if space is None else space
    hw = hardware("a100")
    out = []
    for row in _paper():
        base = config_io.load(ROOT / row["config"], PAPER_SETS)
        fixed = {**space, "parallel.data": row["gpus"] // (row["tensor"] * row["pipeline"])} if paper_data else space
        result = search(base, hw, row["gpus"], 8, dict(fixed), clock=False)
        best = result["ranked"][0]
        paper = estimate(_paper_config(row), hw, 8, simulate=False)
        out.append({"config": row["config"], "gpus": row["gpus"], "paper": (row["tensor"], row["pipeline"]),
                    "chosen": (best.settings["parallel.tensor"], best.settings["parallel.pipeline"]),
                    "chosen_settings": best.settings, "speedup_over_paper": paper.step_s / best.step_s,
                    "seconds": result["seconds"]})
    return out


def takeaways(config: str, gpus: int, space: dict | None = None) -> dict:
    """The best predicted step for each tensor size and, at tensor 8, each pipeline size (in the paper's space):
    {"tensor": {t: (step_s, fits)}, "pipeline": {p: step_s}}."""
    space = PAPER_SPACE if space is None else space
    hw = hardware("a100")
    base = config_io.load(ROOT / config, PAPER_SETS)
    ranked = search(base, hw, gpus, 8, dict(space), keep=0, clock=False)["ranked"]
    by_t: dict[int, float] = {}
    by_p: dict[int, float] = {}
    for c in ranked:
        t, p = c.settings["parallel.tensor"], c.settings["parallel.pipeline"]
        by_t[t] = min(by_t.get(t, float("inf")), c.step_s)
        if t == 8:
            by_p[p] = min(by_p.get(p, float("inf")), c.step_s)
    return {"tensor": dict(sorted(by_t.items())), "pipeline": dict(sorted(by_p.items()))}


# The paper's section 5.4-5.5 sweeps on 64 A100s (Megatron-LM examples/sc21/run_figure_1[3-6].sh: micro batch 1
# unless swept, 1F1B, full recomputation, data 1 unless swept), and what the paper found.
FIGURES = {
    "13": {"model": {"num_layers": 32, "hidden_size": 20480, "num_heads": 128}, "batches": (32, 128),
           "layouts": [{"tensor": t, "pipeline": 64 // t, "data": 1} for t in (32, 16, 8, 4, 2)],
           "found": "the best (t, p) is (8, 8): tensor parallelism up to the node, pipeline across"},
    "14": {"model": {"num_layers": 32, "hidden_size": 3840, "num_heads": 32}, "batches": (32, 512),
           "layouts": [{"tensor": 1, "pipeline": p, "data": 64 // p} for p in (2, 4, 8, 16, 32)],
           "found": "throughput falls as the pipeline grows (data parallelism shrinks)"},
    "15": {"model": {"num_layers": 32, "hidden_size": 3840, "num_heads": 32}, "batches": (32, 128, 512),
           "layouts": [{"tensor": t, "pipeline": 1, "data": 64 // t} for t in (2, 4, 8, 16, 32)],
           "found": "throughput falls as tensor parallelism grows (data parallelism shrinks)"},
    "16": {"model": {"num_layers": 32, "hidden_size": 15360, "num_heads": 128}, "batches": (128, 512),
           "layouts": [{"tensor": 8, "pipeline": 8, "data": 1, "micro_batch_size": b} for b in (1, 2, 4, 8)],
           "found": "the best micro batch size is 2"},
}


def figures() -> dict:
    """Each sweep's predicted TFLOP/s per GPU (the paper's FLOPs over the predicted step), per batch and layout."""
    hw = hardware("a100")
    out = {}
    for name, fig in FIGURES.items():
        rows = []
        for batch in fig["batches"]:
            for layout in fig["layouts"]:
                b = layout.get("micro_batch_size", 1)
                sets = [f"model.{k}={v}" for k, v in fig["model"].items()] + [
                    f"parallel.{k}={v}" for k, v in layout.items() if k != "micro_batch_size"] + [
                    f"train.global_batch_size={batch}", f"train.micro_batch_size={b}", "parallel.schedule=1f1b",
                    "parallel.virtual_stages=1", *PAPER_SETS]
                cfg = config_io.load(ROOT / "configs/paper/gpt-1.7b.yaml", sets).for_devices(64)
                e = estimate(cfg, hw, 8, simulate=False, framework="megatron")
                rows.append({"batch": batch, **layout, "micro_batch_size": b,
                             "tflops_per_gpu": paper_flops(cfg) / e.step_s / 64 / 1e12})
        out[name] = {"found": fig["found"], "rows": rows}
    return out


# The presets and the GPU counts they were written for.
PRESETS = {"tiny": 8, "tiny-moe": 8, "gpt2-124m": 8, "gpt2-1.3b": 64, "llama-1b": 8, "llama3.2-1b": 8,
           "llama3.2-1b-long": 8, "llama3-8b": 8, "llama3-70b": 64, "mixtral-8x7b": 64, "llama3.1-405b": 1024,
           "deepseek-v3": 1024}


def _own_settings(cfg) -> dict:
    """A resolved config's values of the searched keys."""
    out = {}
    for key in KEYS:
        section, name = key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    return out


def presets(target: str = "h100") -> list[dict]:
    """For each preset at its GPU count: its own layout scored, and the planner's pick (the model alone)."""
    hw = hardware(target)
    out = []
    for name, gpus in PRESETS.items():
        base = config_io.load(ROOT / "configs" / f"{name}.yaml")
        own = _own_settings(base.for_devices(gpus))
        mine = search(base, hw, gpus, 8, own)
        scored = (mine["ranked"] or mine["too_big"])[0]
        best = search(base, hw, gpus, 8, {})["ranked"][0]
        out.append({"preset": name, "gpus": gpus, "own_step_s": scored.step_s, "own_gib": scored.memory_gib,
                    "own_fits": scored.fits, "best": best.settings, "best_step_s": best.step_s,
                    "best_gib": best.memory_gib})
    return out


# Llama 3 8B on 8 H100s with data 8 alone and no overlaps (benchmarks/2026-11-26-compile-only-fsdp.md's base)
NO_OVERLAPS = ["parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.tp_comm_overlap=false",
               "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false", "parallel.data=8"]
_HALF = NO_OVERLAPS + ["model.num_layers=16", "train.global_batch_size=64"]
_FSDP_70B = ["parallel.data=8", "parallel.pipeline=1", "parallel.tensor=8", "model.recompute=none",
             "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true", "parallel.schedule=1f1b",
             "parallel.virtual_stages=1", "parallel.data_parallel_sharding_strategy=optim_grads_params"]
_PRESETS, _FSDP = "2026-11-26-presets-after-activations", "2026-11-26-fsdp-after-keeps-inputs"
_PIPELINES = "2026-11-27-pipeline-forward-in-place"  # (the pipelines compiled again after the forward's change)
_ZERO3 = "2026-11-29-fsdp-embedding"  # (ZeRO-3 compiled again with the embedding and head sharded per micro batch)
_70B_1F1B = ["parallel.schedule=1f1b", "parallel.virtual_stages=1"]
# (the 70B preset and its layout under the zero-bubble schedule, the accumulators outside the ticks' conditionals)
_ZB = "2026-12-06-accumulators-outside-conditionals/after"
_ZB_SETS = ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"]
# Programs compiled for 8 or 64 compile-only H100s, on both sides of XLA's scheduling limit: (the folder under
# benchmarks/compile-only/, the row, the preset, GPUs, --set). Each report has its command.
COMPILED = [
    (_PRESETS, "llama3-8b", "llama3-8b", 8, []),
    (_PRESETS, "llama3-8b-no-overlaps", "llama3-8b", 8,
     ["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"]),
    (_PRESETS, "llama3-8b-t2", "llama3-8b", 8, ["parallel.tensor=2", "parallel.data=4"]),
    (_PRESETS, "llama3-8b-t8", "llama3-8b", 8, ["parallel.tensor=8", "parallel.data=1"]),
    (_ZB, "llama3-70b", "llama3-70b", 64, []),
    (_PIPELINES, "llama3-70b-1f1b-p4", "llama3-70b", 64, _70B_1F1B),
    (_PIPELINES, "llama3-70b-p2", "llama3-70b", 64, ["parallel.pipeline=2", "parallel.data=4"]),
    (_PRESETS, "llama3-70b-p1", "llama3-70b", 64, ["parallel.pipeline=1", "parallel.data=8", *_70B_1F1B]),
    (_FSDP, "llama3-8b-16layers-zero1", "llama3-8b", 8, _HALF + ["parallel.data_parallel_sharding_strategy=optim"]),
    (_FSDP, "llama3-8b-16layers-zero1-overlapped", "llama3-8b", 8, _HALF + [
        "parallel.data_parallel_sharding_strategy=optim", "parallel.overlap_grad_reduce=true",
        "parallel.overlap_param_gather=true"]),
    (_FSDP, "llama3-8b-16layers-zero2", "llama3-8b", 8, _HALF + [
        "parallel.data_parallel_sharding_strategy=optim_grads", "parallel.overlap_param_gather=true"]),
    (_ZERO3, "llama3-8b-16layers-zero3", "llama3-8b", 8,
     _HALF + ["parallel.data_parallel_sharding_strategy=optim_grads_params"]),
    (_FSDP, "llama3-8b-32layers-zero1", "llama3-8b", 8,
     NO_OVERLAPS + ["parallel.data_parallel_sharding_strategy=optim"]),
    (_FSDP, "llama3-8b-32layers-zero1-full", "llama3-8b", 8,
     NO_OVERLAPS + ["parallel.data_parallel_sharding_strategy=optim", "model.recompute=full"]),
    (_ZERO3, "llama3-8b-32layers-zero3", "llama3-8b", 8,
     NO_OVERLAPS + ["parallel.data_parallel_sharding_strategy=optim_grads_params"]),
    (_ZERO3, "llama3-8b-32layers-zero3-full", "llama3-8b", 8,
     NO_OVERLAPS + ["parallel.data_parallel_sharding_strategy=optim_grads_params", "model.recompute=full"]),
    (_ZERO3, "llama3-70b-64gpus-d8t8-fsdp-mb1", "llama3-70b", 64, _FSDP_70B + ["train.micro_batch_size=1"]),
    (_ZERO3, "llama3-70b-64gpus-d8t8-fsdp-mb2", "llama3-70b", 64, _FSDP_70B + ["train.micro_batch_size=2"]),
    *[(_ZB, f"llama3-70b-zero_bubble-{s}", "llama3-70b", 64,
       _ZB_SETS + ["parallel.schedule=zero_bubble", f"parallel.data_parallel_sharding_strategy={s}"])
      for s in ("optim", "optim_grads", "optim_grads_params")],
    (_ZB, "llama3-70b-interleaved-optim_grads", "llama3-70b", 64,
     _ZB_SETS + ["parallel.data_parallel_sharding_strategy=optim_grads"]),
]


# The audit's peak (arguments + outputs - aliases + temporaries) is not quite XLA's own count: a program this close
# above the limit is one XLA fitted under it (it warned of no rematerialization short of the limit: the 32-layer
# ZeRO-3 row, 60.71 GiB against 60.67)
AT_LIMIT = 0.002


def compiled_memory() -> list[dict]:
    """For each COMPILED row: XLA's peak (arguments + outputs - aliases + temporaries) and its scheduling limit
    (from the program's own inputs and outputs) against the model's memory (less its reserve, which XLA's count
    leaves out) and limit, and whether each puts the program above the limit. GiB."""
    hw = hardware("h100")
    out = []
    for folder, row, preset, gpus, sets in COMPILED:
        xla = json.loads((ROOT / "benchmarks/compile-only" / folder / f"{row}.json").read_text())["memory_per_device"]
        io = xla["argument_bytes"] + xla["output_bytes"] - xla["alias_bytes"]
        limit = scheduling_limit(io, hw.memory_bytes)
        cfg = config_io.load(ROOT / "configs" / f"{preset}.yaml", sets).for_devices(gpus)
        e = estimate(cfg, hw, 8)
        model = e.memory["total"] - e.memory["reserve"]
        out.append({"row": row, "report_rows": f"benchmarks/compile-only/{folder}/{row}.json", "gpus": gpus,
                    "set": sets, "pipeline": cfg.parallel.pipeline, "xla_peak_gib": xla["peak_estimate_gib"],
                    "model_gib": model / 2**30, "xla_limit_gib": limit / 2**30,
                    "model_limit_gib": e.memory["scheduling_limit"] / 2**30,
                    "xla_scheduled_for_memory": xla["peak_estimate_gib"] * 2**30 > limit * (1 + AT_LIMIT),
                    "model_scheduled_for_memory": e.scheduled_for_memory})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.plan.checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write every row here")
    parser.add_argument("--steps", metavar="JSONL", nargs="+",
                        help="only the step table, for these scripts/bench_train.py rows (scripts/gpu_check.sh plan)")
    args = parser.parse_args(argv)
    steps = h100_steps(args.steps)
    print("| H100 step | measured s | predicted s | error | measured GiB | predicted GiB |\n|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['label']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['error']:+.1%} | "
              f"{r['measured_gib']:.1f} | {r['predicted_gib']:.1f} |")
    if args.steps:
        return 0
    rows, picks, figs = table1(), choices(), figures()
    print("\n| Table 1 model | GPUs | t, p, micro batch, chunks | measured TFLOP/s | predicted | error | "
          "planner's t, p | predicted gain |\n|---|---|---|---|---|---|---|---|")
    for r, c in zip(rows, picks):
        print(f"| {Path(r['config']).stem} | {r['gpus']} | {r['tensor']}, {r['pipeline']}, {r['micro_batch']}, "
              f"{r['virtual_stages']} | {r['measured_tflops_per_gpu']} | {r['predicted_tflops_per_gpu']:.0f} | "
              f"{r['error']:+.1%} | {c['chosen'][0]}, {c['chosen'][1]} | {c['speedup_over_paper'] - 1:+.1%} |")
    for name, fig in figs.items():
        key = {"13": "tensor", "14": "pipeline", "15": "tensor", "16": "micro_batch_size"}[name]
        print(f"\nFig. {name} ({fig['found']}), predicted TFLOP/s per GPU by {key}:")
        for batch in sorted({r["batch"] for r in fig["rows"]}):
            cells = ", ".join(f"{r[key]}: {r['tflops_per_gpu']:.0f}" for r in fig["rows"] if r["batch"] == batch)
            print(f"- batch {batch}: {cells}")
    memory = compiled_memory()
    print("\n| compiled H100 program | GPUs | XLA's peak GiB | model GiB | error | XLA's scheduling limit GiB | "
          "above it: XLA, model |\n|---|---|---|---|---|---|---|")
    for r in memory:
        print(f"| {r['row']} | {r['gpus']} | {r['xla_peak_gib']:.1f} | {r['model_gib']:.1f} | "
              f"{r['model_gib'] / r['xla_peak_gib'] - 1:+.1%} | {r['xla_limit_gib']:.2f} | "
              f"{'yes' if r['xla_scheduled_for_memory'] else 'no'}, "
              f"{'yes' if r['model_scheduled_for_memory'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"h100_steps": steps, "table1": rows, "choices": picks,
                                               "figures": figs, "compiled_memory": memory}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
