"""`python -m megajax.plan --config MODEL --target h100 --gpus 64 [--gpus-per-node 8] [--global-batch 512]
[--seq-length S] [--set KEY=VALUE ...] [--compile N] [--top K] [--json FILE|-] [--write FILE]`

Picks the layout for a model on a cluster: enumerates every valid layout (tensor, pipeline, context, expert and
data sizes, schedule and virtual stages, micro batch size, recomputation, sequence parallelism and
tp_comm_overlap, the distributed optimizer or FSDP, the data-parallel overlaps), prunes those whose memory
(analytical) does not fit, ranks the rest by a predicted step time, compiles the closest few for the target GPU
(XLA's memory and the communication its scheduled program leaves exposed), and prints a table and why the winner
wins. Keys given with --set are held fixed: with every layout key fixed it scores that one layout.
MODEL is a preset (configs/*.yaml) or a Hugging Face config.json (or its folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

import yaml

from megajax.config import Config, InputError
from megajax.config.base import check
from megajax.plan.checks import ERROR, ERROR_SOURCE
from megajax.plan.hardware import GIB, hardware
from megajax.plan.search import KEYS, Candidate, compile_candidate, own_layout, rank, search

TARGETS = ("a100", "h100", "h200")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megajax.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True, help="a preset YAML, or a Hugging Face config.json (or its folder)")
    parser.add_argument("--target", choices=TARGETS, required=True, help="the GPU kind")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink inside, network across)")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: the config's)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence (default: the config's)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides; layout keys given here are held fixed (e.g. parallel.tensor=8)")
    parser.add_argument("--compile", type=int, default=4, metavar="N",
                        help="compile at most N of the best layouts whose predictions are within --separate of the "
                             "best, for XLA's memory and overlap (needs the gpu-audit extra; 0: the model alone)")
    parser.add_argument("--compile-budget", type=float, default=240.0, metavar="SECONDS",
                        help="start no further compile once the compiles so far and one more as long as the last "
                             "would pass this (a 3,072-GPU step compiles in about 2.5 minutes on 2 cores)")
    parser.add_argument("--separate", type=float, default=0.03,
                        help="the predicted step-time margin within which the model cannot separate layouts")
    parser.add_argument("--memory-margin", type=float, default=0.15, metavar="FRACTION",
                        help="the share of GPU memory the model's estimate must leave free for a layout to count as "
                             "fitting before it is compiled (the model's activation count runs low at scale; a "
                             "compiled layout is judged by XLA's memory alone)")
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    parser.add_argument("--json", metavar="FILE", help="write the ranked rows as JSON here ('-': stdout, no table)")
    parser.add_argument("--write", metavar="FILE", help="write the best layout as a ready preset (every key set)")
    return parser


def _base(args) -> tuple[Config, dict, dict]:
    """(the config with --set applied, the preset's raw YAML (or the HF model as a section), the fixed keys)."""
    from megajax.config import io as config_io

    path = Path(args.config)
    sets = list(args.set)
    if args.global_batch:
        sets.append(f"train.global_batch_size={args.global_batch}")
    if args.seq_length:
        sets.append(f"model.seq_length={args.seq_length}")
    if path.name == "config.json" or (path.is_dir() and (path / "config.json").exists()):
        from megajax.hf.configs import model_config_from_hf, read_hf_config

        model = model_config_from_hf(read_hf_config(path if path.is_dir() else path.parent))
        default = type(model)()
        raw = {"model": {k: v for k, v in model.__dict__.items() if v != getattr(default, k)}}
        base = config_io.override(config_io.from_dict(raw), config_io.parse_overrides(sets))
    else:
        base = config_io.load(path, sets)
        raw = yaml.safe_load(path.read_text()) or {}
    given = config_io.parse_overrides(args.set)
    for old, (new, _) in config_io.OLD_KEYS.items():  # an old key fixes what its new one says (in `base` already)
        if old in given and new not in given:
            section, name = new.split(".")
            given[new] = getattr(getattr(base, section), name)
    fixed = {k: v for k, v in given.items() if k in KEYS}
    return base, raw, fixed


def _label(s: dict) -> str:
    parts = [f"d{s['parallel.data']} p{s['parallel.pipeline']} t{s['parallel.tensor']}"]
    if s["parallel.context"] > 1:
        comm, n = s.get("parallel.context_comm"), s.get("parallel.context_a2a_size")
        across = {"a2a+ring": "ring", "a2a+all_gather": "ag"}.get(comm)
        parts.append(f"c{s['parallel.context']}" + ("a2a" if comm == "a2a" else f"a2a{n}+{across}" if across else ""))
    if s["parallel.expert"] > 1:
        parts.append(f"e{s['parallel.expert']}")
    if s["parallel.pipeline"] > 1:
        parts.append(s["parallel.schedule"] + (f" v{s['parallel.virtual_stages']}"
                                               if s["parallel.virtual_stages"] > 1 else ""))
    flags = [name for key, name in (("parallel.sequence_parallel", "sp"), ("parallel.tp_comm_overlap", "tpo"),
                                    ("parallel.overlap_grad_reduce", "ogr"), ("parallel.vocab_over_pipeline", "vp"))
             if s.get(key)]
    shard = s["parallel.data_parallel_sharding_strategy"]
    flags.append({"optim": "zero1", "optim_grads_params": "fsdp"}.get(shard, ""))
    instances = s.get("parallel.num_distributed_optimizer_instances", 1)
    if instances > 1:  # hybrid sharding: that many instances, each sharding over its share of the data ranks
        flags[-1] += f"/{instances}"
    return " ".join(parts + [f for f in flags if f])


def row(c: Candidate, rank: int, peak: float) -> dict:
    """One ranked layout as --json writes it."""
    e, s = c.estimate, c.settings
    out = {"rank": rank, "layout": _label(s), "settings": dict(s),
           "parallel": {k.split(".")[1]: v for k, v in s.items() if k.startswith("parallel.")},
           "micro_batch_size": s["train.micro_batch_size"], "recompute": s["model.recompute"],
           "micro_batches": c.cfg.num_micro_batches, "predicted_step_s": c.step_s,
           "tflops_per_gpu": e.hardware_flops / c.step_s / 1e12, "mfu": e.model_flops / c.step_s / peak,
           "memory_gib_per_gpu": c.memory_gib, "fits": c.fits, "bubble_fraction": e.bubble_fraction,
           "exposed_comm_s": dict(e.exposed_s), "compute_s": dict(e.compute_s),
           "memory_gib": {k: v / GIB for k, v in e.memory.items()}, "compiled": c.compiled,
           "compile_error": c.compile_error}
    return out


def _why(ranked: list[Candidate], too_big: list[Candidate]) -> list[str]:
    """Why the winner wins: against the best layout of each other (tensor, pipeline) pair, the terms that differ
    most; and the smallest layouts that did not fit."""
    best = ranked[0]
    lines = []
    seen = {(best.settings["parallel.tensor"], best.settings["parallel.pipeline"])}
    for c in ranked[1:]:
        key = (c.settings["parallel.tensor"], c.settings["parallel.pipeline"])
        if key in seen:
            continue
        seen.add(key)
        terms = _terms(c)
        mine = _terms(best)
        diffs = sorted(((terms[k] - mine[k], k) for k in terms), reverse=True)
        big = [(d, k) for d, k in diffs if abs(d) > 0.005 * best.step_s]
        said = ", ".join(f"{k} {d:+.2f} s" for d, k in [x for x in big if x[0] > 0][:3] + [x for x in big if x[0] < 0][-2:])
        model = " (the model's)" if best.compiled and not c.compiled else ""
        lines.append(f"  vs t={key[0]} p={key[1]} ({_label(c.settings)}){model}: {c.step_s / best.step_s - 1:+.1%}"
                     + (f": {said}" if said else ""))
        if len(lines) == 4:
            break
    notes = []  # the two best that do not fit (layouts the label does not tell apart said once)
    for c in [c for c in too_big if not c.compiled]:
        note = (f"  {_label(c.settings)} mb {c.settings['train.micro_batch_size']} recompute "
                f"{c.settings['model.recompute']} would need {c.estimate.memory['total'] / GIB:.1f} GiB")
        if note not in notes:
            notes.append(note)
        if len(notes) == 2:
            break
    return lines + notes


def _own(own: Candidate | None, best: Candidate, band: float = 0.0) -> str:
    """Where the config's own layout stands against the best, with the numbers its table row has where it has one
    (compiled, or the model's with what the compiles taught it), else the model's alone."""
    if own is None:
        return "the config's own layout does not run on this many GPUs"
    s = own.settings
    what = (f"the config's own layout ({_label(s)}, mb {s['train.micro_batch_size']}, recompute "
            f"{s['model.recompute']})")
    if not own.fits:
        return f"{what} does not fit: the model says {own.memory_gib:.1f} GiB"
    if own.settings == best.settings:
        return f"{what} is the best"
    within = f", within the model's +-{band:.0%}" if band and _within(own, best, band) else ""
    how = "compiled" if own.compiled else "by the model"
    return (f"{what}: {own.step_s:.4g} s a step {how}, {own.step_s / best.step_s - 1:+.1%} against the "
            f"best{within}, {own.memory_gib:.1f} GiB")


def _terms(c: Candidate) -> dict:
    e = c.estimate
    return {"GEMMs": e.compute_s["gemm"], "attention": e.compute_s["attention"], "recompute": e.compute_s["recompute"],
            "memory-bound": e.compute_s["memory_bound"], "output layer": e.compute_s["head"],
            "optimizer": e.compute_s["optimizer"], "bubble": e.bubble_s,
            **{f"{k} comm": v for k, v in e.exposed_s.items()}}


LEGEND = ("layout: d data, p pipeline, t tensor, c context (a2a: parallel.context_comm=a2a; a2aN+ring, a2aN+ag: "
          "a2a+ring, a2a+all_gather in groups of N), e expert ranks; the "
          "pipeline's schedule, v its chunks a stage; sp sequence parallelism, tpo tensor-parallel collective "
          "matmuls (parallel.tp_comm_overlap), ogr the gradient reduction in the backward "
          "(parallel.overlap_grad_reduce), vp the embedding and output layer split over the pipeline ranks "
          "(parallel.vocab_over_pipeline), zero1 the distributed optimizer, fsdp ZeRO-3 (/N: over N hybrid-sharding "
          "instances). mb: micro batch size; step s: predicted (the compiled program's memory and exposed "
          "communication where compiled)")


def _odd_count(gpus: int, per_node: int) -> str | None:
    """A note on a GPU count that leaves a node part-filled (every layout's ranks must multiply to it)."""
    if gpus % per_node == 0 or gpus < 2:
        return None
    return (f"note: {gpus} GPUs is not a multiple of {per_node} a node, so the layouts are those whose ranks multiply "
            f"to {gpus} exactly (a prime count leaves one axis all of it); a count a multiple of the node's keeps "
            "tensor parallelism inside a node")


def _within(c: Candidate, best: Candidate, band: float) -> bool:
    """Whether `c` is predicted within the model's error `band` of `best` (the model cannot order the two)."""
    return c.step_s <= best.step_s * (1 + band)


def _uncertainty(ranked: list[Candidate], target: str) -> str:
    """What the model's error means for this table: which rows it cannot order."""
    band = ERROR[target]
    n = sum(_within(c, ranked[0], band) for c in ranked)
    said = (f"predictions carry +-{band:.0%}, the model's largest miss on {ERROR_SOURCE[target]}. ")
    if n == 1:
        return said + "The best is ahead of every other layout by more than that."
    return (said + f"{n} layouts (~ in the table) are predicted within it of the first; the model alone does not order "
            "them, and a compile (--compile) or a measured step decides between them.")


def _table(ranked: list[Candidate], peak: float, top: int, band: float = 0.0) -> str:
    head = (f"{'#':>4} {'layout':<40} {'mb':>3} {'recompute':<9} {'GiB':>6} {'step s':>8} {'TFLOP/s':>7} {'MFU':>5} "
            f"{'bubble':>6}  exposed s: tensor data pipe expert context")
    lines = [head]
    for i, c in enumerate(ranked[:top], 1):
        r = row(c, i, peak)
        x = r["exposed_comm_s"]
        close = "~" if band and i > 1 and _within(c, ranked[0], band) else " "
        lines.append(f"{i:>3}{close} {r['layout']:<40} {r['micro_batch_size']:>3} {r['recompute']:<9} "
                     f"{r['memory_gib_per_gpu']:>6.1f} {r['predicted_step_s']:>8.4g} {r['tflops_per_gpu']:>7.1f} "
                     f"{r['mfu']:>5.1%} {r['bubble_fraction']:>6.1%}  {x['tensor']:.2f} {x['data']:.2f} "
                     f"{x['pipeline']:.2f} {x['expert']:.2f} {x['context']:.2f}"
                     + ("  (compiled)" if r["compiled"] else "  (compile failed)" if r["compile_error"] else ""))
    return "\n".join(lines)


def write_preset(path: str, raw: dict, best: Candidate, argv: list[str]) -> None:
    """The preset of the best layout: the input preset's keys with every searched key set, and a header saying
    how it was planned and what it predicts."""
    out = json.loads(json.dumps(raw))  # a copy
    for key, value in best.settings.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    out.setdefault("train", {})["global_batch_size"] = best.cfg.train.global_batch_size
    out.setdefault("model", {})["seq_length"] = best.cfg.model.seq_length
    head = (f"# Planned by: python -m megajax.plan {' '.join(argv)}\n"
            f"# {_label(best.settings)}, micro batch {best.settings['train.micro_batch_size']}, recompute "
            f"{best.settings['model.recompute']}: predicted {best.step_s:.4g} s a step, {best.memory_gib:.1f} GiB a GPU\n")
    Path(path).write_text(head + yaml.safe_dump(out, sort_keys=False))


def _learn(ranked: list[Candidate], compiled: Candidate, too_big: list[Candidate]) -> None:
    """A compiled layout corrects the model for its uncompiled neighbours: XLA's activations (the model's count
    is the weak term of its memory) for those with the same recompute mode, and the communication the program leaves exposed for those with the same sharding, pipelining and ring overlap.
    Those that then do not fit leave the ranking."""
    memory = compiled.learned_scale()
    exposure = compiled.compiled["exposed_s"] / compiled.model_exposed_s if compiled.model_exposed_s > 0 else 1.0
    shape = lambda c: (c.settings["parallel.data_parallel_sharding_strategy"],  # noqa: E731
                       c.settings["parallel.pipeline"] > 1, c.settings["parallel.tp_comm_overlap"])
    for c in list(ranked):
        if c.compiled is not None:
            continue
        if shape(c) == shape(compiled):
            c.exposure_scale = exposure
        if c.settings["model.recompute"] == compiled.settings["model.recompute"]:
            c.activation_scale = max(c.activation_scale, memory)
            if not c.fits:
                ranked.remove(c)
                too_big.append(c)


def _compile(result: dict, target: str, n: int, margin: float, budget: float) -> list[str]:
    """Compiles layouts best first until `n` that fit are compiled, the best of them is not clearly behind (by
    `margin`) the best uncompiled one, or another compile (as long as the last) would pass `budget` seconds. One
    compile per parallel layout: its micro batch, recompute and overlap variants keep the model's numbers. XLA's
    memory replaces the model's: a layout XLA finds too big moves to the too-big list. Both correct the model for
    the uncompiled neighbours (`_learn`). The communication the program leaves exposed
    replaces the model's. Returns notes for the user."""
    ranked = result["ranked"]
    if not ranked or n <= 0:
        return []
    from megajax import audit

    audit.compile_only_backend()
    notes, tried = [], set()
    core = lambda c: tuple(v for k, v in c.settings.items() if "overlap" not in k and k not in (  # noqa: E731
        "model.recompute", "train.micro_batch_size"))
    fitting, start, last = 0, time.perf_counter(), 0.0
    for _ in range(3 * n):  # (compiles that fail or do not fit do not count against n; at most 3 n are tried)
        if fitting == n:
            break
        if last and time.perf_counter() - start + last > budget:
            notes.append(f"  stopped compiling: another compile would pass --compile-budget {budget:.0f} s")
            break
        done = [c for c in ranked if c.compiled]
        todo = [c for c in ranked if not c.compiled and not c.compile_error and core(c) not in tried]
        if not todo or done and done[0].step_s * (1 - margin) <= todo[0].step_s:
            break
        c = todo[0]
        tried.add(core(c))
        began = time.perf_counter()
        try:
            c.compiled = compile_candidate(c, target)
        except InputError as e:  # the plugin is missing: the model's prediction stands
            notes.append(f"  not compiled ({e})")
            break
        except Exception as e:  # noqa: BLE001 - XLA failing on one layout leaves the model's prediction for it
            first = str(e).strip().splitlines()[0][:300]
            notes.append(f"  compiling {_label(c.settings)} failed in XLA ({type(e).__name__}: {first}); its row "
                         "is the model's alone")
            c.compile_error = first
            continue
        last = time.perf_counter() - began
        _learn(ranked, c, result["too_big"])
        if c.fits:
            fitting += 1
        else:
            ranked.remove(c)
            result["too_big"].insert(0, c)
            notes.append(f"  compiled {_label(c.settings)} mb {c.settings['train.micro_batch_size']}: XLA needs "
                         f"{c.memory_gib:.1f} GiB (the model said {c.estimate.memory['total'] / GIB:.1f}): too big")
        rank(ranked)
        _order(ranked, margin)
    return notes + _unsettled(ranked, margin)


def _order(ranked: list[Candidate], margin: float) -> None:
    """Compiled rows first (their numbers are the program's), except behind the uncompiled rows the model predicts
    clearly (by `margin`) faster than the best of them: those are not crowned by a slower compile."""
    best = min((c.step_s for c in ranked if c.compiled), default=None)
    if best is not None:
        ranked.sort(key=lambda c: (c.compiled is not None or c.step_s >= best * (1 - margin), c.compiled is None))


def _unsettled(ranked: list[Candidate], margin: float) -> list[str]:
    """A note where the first rows are the model's alone, predicted clearly faster than every compiled layout:
    the compiles stopped (--compile's count, its budget, or failures) before reaching them."""
    compiled = [i for i, c in enumerate(ranked, 1) if c.compiled]
    if not compiled or compiled[0] == 1:
        return []
    k = compiled[0]
    note = (f"  unsettled: rows 1-{k - 1} are the model's alone, predicted more than {margin:.0%} faster than the "
            f"best compiled layout (row {k}, {ranked[k - 1].step_s:.4g} s); the compiles stopped before them, and a "
            "compile can move them (XLA's memory and exposed communication replace the model's): rerun with a larger "
            "--compile or --compile-budget, or audit row 1 (python -m megajax.audit) before training on it")
    return [textwrap.fill(note, 118, subsequent_indent="  ")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node)):
            check(value >= 1, f"{flag} {value}: the count must be 1 or more (e.g. --gpus 64 --gpus-per-node 8)")
        base, raw, fixed = _base(args)
        hw = hardware(args.target)
        result = search(base, hw, args.gpus, args.gpus_per_node, fixed, margin=args.memory_margin)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ranked = result["ranked"]
    if not ranked:
        smallest = result["too_big"][:1]
        need = f" (the smallest needs {smallest[0].estimate.memory['total'] / GIB:.1f} GiB: " \
               f"{_label(smallest[0].settings)})" if smallest else ""
        print(f"error: no layout of {result['counted']['layouts']} fits {args.gpus} {hw.name}s{need}; add GPUs, "
              "shorten model.seq_length or lower train.global_batch_size", file=sys.stderr)
        return 1
    notes = _compile(result, args.target, args.compile, args.separate, args.compile_budget)
    counted = result["counted"]
    rows = [row(c, i, hw.peak_flops) for i, c in enumerate(ranked, 1)]
    if args.json:
        band = ERROR[args.target]
        for r, c in zip(rows, ranked):
            r["within_error_of_best"] = _within(c, ranked[0], band)
        text = json.dumps({"target": args.target, "hardware": hw.name, "gpus": args.gpus,
                           "gpus_per_node": args.gpus_per_node, "uncertainty": band, "counted": counted,
                           "rows": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.json != "-":
        best = ranked[0]
        print(f"{counted['layouts']} layouts for {args.gpus} {hw.name}s ({args.gpus_per_node} a node): "
              f"{counted['fit']} fit, {counted['too_big']} too big, {counted['invalid']} invalid "
              f"({result['seconds']:.1f} s)")
        odd = _odd_count(args.gpus, args.gpus_per_node)
        if odd:
            print(textwrap.fill(odd, 118))
        print(_table(ranked, hw.peak_flops, args.top, ERROR[args.target]))
        print(textwrap.fill(LEGEND, 118))
        print(textwrap.fill(_uncertainty(ranked, args.target), 118))
        print(f"\nbest: {_label(best.settings)}, micro batch {best.settings['train.micro_batch_size']}, recompute "
              f"{best.settings['model.recompute']}: {best.step_s:.4g} s a step, "
              f"{rows[0]['tflops_per_gpu']:.0f} TFLOP/s a GPU, {best.memory_gib:.1f} GiB"
              + (" (the model's, not compiled)" if args.compile > 0 and not best.compiled else ""))
        print("\n".join(_why(ranked, result["too_big"]) + notes))
        own = own_layout(base, hw, args.gpus, args.gpus_per_node, args.memory_margin)
        own = next((c for c in ranked if own is not None and c.settings == own.settings), own)  # (as the table has it)
        print(_own(own, best, ERROR[args.target]))
    if args.write:
        write_preset(args.write, raw, ranked[0], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
