"""`megajax schedule` (`python -m megajax schedule`): print, check or draw a pipeline schedule (schedule.py), with the
work per rank and the bubble at given costs, or at a config's uneven stages and head (--config). NumPy alone, and
matplotlib for --png."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megajax.parallel.pipeline.schedule import SCHEDULES, Costs, Schedule, build, formula


def timeline(s: Schedule) -> str:
    """One line per rank, one cell per tick: 'F3' forward of micro batch 3, 'R1' recompute for the backward
    of micro batch 1, 'B1' that backward (zero_bubble: its input gradient), 'W1' its weight gradient, 'F3R1'
    a forward and a recompute; with v > 1 a chunk letter follows each micro batch (a, b, ...); '.' is idle."""
    def part(kind, chunk, micro):
        return "" if chunk < 0 else f"{kind}{micro}" + (chr(ord("a") + chunk) if s.v > 1 else "")

    cells = [[part("W", s.w_chunk[t, r], s.w_micro[t, r]) + part("F", s.f_chunk[t, r], s.f_micro[t, r])
              + part("R", s.r_chunk[t, r], s.r_micro[t, r]) + part("B", s.b_chunk[t, r], s.b_micro[t, r]) or "."
              for t in range(s.ticks)] for r in range(s.p)]
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"rank {r}: " + " ".join(c.rjust(width) for c in cells[r]) for r in range(s.p))


def _action_cost(s: Schedule, c: Costs, label: str, g: int) -> float:
    """The time of one action ('F', 'R', 'B' or 'W') on global chunk g, as `Schedule.work` counts it."""
    kind = {"F": "f", "R": "r", "W": "w", "B": "b_input" if s.split_backward else "b"}[label]
    if c.layers is None:
        return getattr(c, kind) / s.v
    return float(c.per_chunk(s.p)[kind][g])


def save_png(s: Schedule, path: str, costs: Costs | None = None) -> None:
    """A Figure-4-like picture in time units (one forward of a whole stage = 1), each rank's ticks where
    `Schedule.clock` starts them (pairwise waits): forwards light, recomputes hatched, backwards dark (zero_bubble:
    the input gradient), weight gradients cross-hatched, one hue per chunk; gaps are the bubble."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install matplotlib (or megajax[plot])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = costs or Costs()
    starts = s.clock(c)
    fig, ax = plt.subplots(figsize=(max(6, starts[-1].max() * 0.35), 0.5 * s.p + 1.2))
    hues = plt.get_cmap("tab10")
    for t in range(s.ticks):
        for r in range(s.p):
            x, y = starts[t, r], s.p - 1 - r
            for label, chunk, micro, alpha, hatch in (  # in the executor's order
                    ("W", s.w_chunk[t, r], s.w_micro[t, r], 0.7, "xx"),
                    ("B", s.b_chunk[t, r], s.b_micro[t, r], 0.95, None),
                    ("R", s.r_chunk[t, r], s.r_micro[t, r], 0.25, "//"),
                    ("F", s.f_chunk[t, r], s.f_micro[t, r], 0.45, None)):
                if chunk < 0:
                    continue
                width = _action_cost(s, c, label, int(chunk) * s.p + r)
                ax.add_patch(plt.Rectangle((x, y), width, 1, facecolor=hues(int(chunk) % 10),
                                           edgecolor="white", alpha=alpha, hatch=hatch))
                ax.text(x + width / 2, y + 0.5, f"{label}{micro}", ha="center", va="center", fontsize=6)
                x += width
    ax.set_xlim(0, starts[-1].max())
    ax.set_ylim(0, s.p)
    ax.set_yticks([s.p - 0.5 - r for r in range(s.p)], [f"rank {r}" for r in range(s.p)])
    ax.set_xlabel("time (one forward of a whole stage = 1)")
    ax.set_title(f"{s.name} p={s.p} v={s.v} m={s.m}: bubble {s.bubble_fraction(c):.3f} "
                 f"(formula {formula(s.name, s.p, s.v, s.m):.3f}); F forward, R recompute, B backward"
                 + (" (input), W weight gradient" if s.split_backward else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --model: (layers, hidden, ffn, vocab, seq) of known models, for per-chunk costs
MODELS = {"llama3.1-405b": {"layers": 126, "hidden": 16384, "ffn": 53248, "vocab": 128256, "seq": 8192}}


def head_cost(hidden: int, ffn: int, vocab: int, seq: int) -> float:
    """The output layer's forward FLOPs over one transformer layer's, for `Costs.head`: 2 s h V over
    2 s (4 h^2 + 3 h F) (the attention projections as if K and V were as wide as Q: grouped-query attention's
    narrower ones are left out, as are the norms) + 2 s^2 h (the causal half of attention's scores and values).
    The loss's softmax (a few s V) is below 1 / h of the output layer and left out; so is the embedding (a
    gather, no matmul)."""
    layer = 2 * seq * (4 * hidden**2 + 3 * hidden * ffn) + 2 * seq**2 * hidden
    return 2 * seq * hidden * vocab / layer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megajax schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a megajax config (configs/*.yaml): its schedule, p, v, micro batches, "
                        "split and head cost (`config_costs`); flags given beside it win")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for --config")
    parser.add_argument("--schedule", choices=SCHEDULES)
    parser.add_argument("-p", type=int, help="pipeline ranks")
    parser.add_argument("-v", type=int, help="virtual stages (model chunks) per rank")
    parser.add_argument("-m", type=int, help="micro batches")
    parser.add_argument("--costs", metavar="F,R,B,W,BI",
                        help="action costs for the bubble: forward, recompute, fused backward, weight gradient, "
                             "and (optional) the split backward's input gradient, e.g. 1,1,2.6,0.94,1.86 "
                             "(scripts/bench_split_backward.py measures them); the summary adds at_costs")
    stages = parser.add_argument_group(
        "uneven stages", "per-chunk costs (per layer with --costs) from config.pipeline_split's layers per chunk; "
        "the summary is then at these costs, with the work per rank")
    stages.add_argument("--layers", type=int, help="transformer layers (model.num_layers)")
    stages.add_argument("--first-stage-layers", type=int, help="parallel.decoder_first_pipeline_num_layers")
    stages.add_argument("--last-stage-layers", type=int, help="parallel.decoder_last_pipeline_num_layers")
    stages.add_argument("--account-for-embedding", action="store_true",
                        help="parallel.account_for_embedding_in_pipeline_split")
    stages.add_argument("--account-for-loss", action="store_true", help="parallel.account_for_loss_in_pipeline_split")
    stages.add_argument("--embed-cost", type=float, default=0.0, help="the embedding's forward, in layers' forwards")
    stages.add_argument("--head-cost", type=float,
                        help="the output layer's and loss's forward, in layers' forwards (default: estimated from "
                             "--vocab --hidden --ffn --seq when given, else 0)")
    for name in ("vocab", "hidden", "ffn", "seq"):
        stages.add_argument(f"--{name}", type=int, help="model shape for the head's cost (`head_cost`)")
    stages.add_argument("--model", choices=sorted(MODELS), help="the shape flags of a known model (flags win)")
    parser.add_argument("--png", help="also draw the timeline into this PNG file")
    return parser


def config_costs(cfg) -> dict:
    """A megajax config's schedule as this CLI's flags: schedule, p, v, m, the layers and split keys, and the head's
    cost in layers' forwards (its logits' FLOPs over the mean layer's, matmuls as metrics counts them and attention's
    scores and values causal, halved). parallel.data must be set (it decides m)."""
    from megajax.config import ConfigError
    from megajax.config.model import layer_forward_flops_per_token

    par, model = cfg.parallel, cfg.model
    if par.data is None:
        raise ConfigError("the schedule needs the micro batches a pipeline runs: set parallel.data (--set "
                          "parallel.data=N) for the GPUs you plan")
    dense, core = layer_forward_flops_per_token(model)
    return {"schedule": par.schedule, "p": par.pipeline, "v": par.virtual_stages, "m": cfg.num_micro_batches,
            "layers": model.num_layers, "first_stage_layers": par.decoder_first_pipeline_num_layers,
            "last_stage_layers": par.decoder_last_pipeline_num_layers,
            "account_for_embedding": par.account_for_embedding_in_pipeline_split,
            "account_for_loss": par.account_for_loss_in_pipeline_split,
            "head_cost": 2 * model.hidden_size * model.padded_vocab_size / (dense + core / 2),
            "first_dense": model.first_dense_layers, "period": model.layer_period}


def _from_config(args) -> None:
    """Fills the flags left unset from --config (`config_costs`); without it, the defaults."""
    given = {}
    if args.config:
        from megajax.config import io as config_io  # (no JAX: the config and its YAML are plain Python)

        given = config_costs(config_io.load(args.config, args.set))
    defaults = {"schedule": "1f1b", "v": 1, "first_dense": 0, "period": 1}
    for key in ("schedule", "p", "v", "m", "layers", "first_stage_layers", "last_stage_layers", "head_cost",
                "first_dense", "period"):
        if getattr(args, key, None) is None:
            setattr(args, key, given.get(key, defaults.get(key)))
    for key in ("account_for_embedding", "account_for_loss"):
        setattr(args, key, getattr(args, key) or given.get(key, False))
    if args.p is None or args.m is None:
        raise ValueError("give -p and -m (pipeline ranks and micro batches), or --config")


def _costs(args) -> Costs | None:
    """The costs the flags ask for: --costs, and per-chunk ones with --layers (or --model, or --config)."""
    for key, val in MODELS.get(args.model, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    costs = None
    if args.costs:
        values = [float(x) for x in args.costs.split(",")]
        if len(values) not in (4, 5):
            raise ValueError(f"--costs takes 4 or 5 numbers F,R,B,W[,BI], got {args.costs!r}")
        costs = Costs(*values[:4], b_input=values[4] if len(values) == 5 else None)
    if args.layers is None:
        return costs
    from megajax.config import pipeline_split  # (no JAX: the config is plain Python)

    split = pipeline_split(args.layers, args.p, args.v, args.first_stage_layers, args.last_stage_layers,
                           args.account_for_embedding, args.account_for_loss, args.first_dense, args.period)
    shape = (args.hidden, args.ffn, args.vocab, args.seq)
    head = args.head_cost if args.head_cost is not None else head_cost(*shape) if None not in shape else 0.0
    return dataclasses.replace(costs or Costs(), layers=split.layers, embed=args.embed_cost, head=head)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _from_config(args)
        s = build(args.schedule, args.p, args.v, args.m)
        costs = _costs(args)
    except ValueError as e:  # (config.ConfigError is one)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(timeline(s))
    if costs is not None and costs.layers is not None:
        summary = s.summary(costs)
        print("work per rank: " + " ".join(f"{w:.3f}" for w in summary["work_per_rank"])
              + f"; busiest {summary['ideal']:.3f}, step {summary['step_time']:.3f}, bubble "
              f"{summary['bubble_fraction']:.4f} (of the step {summary['idle_share_of_step']:.4f})")
    else:
        summary = s.summary()
        if costs:
            summary["at_costs"] = {"bubble_fraction": s.bubble_fraction(costs),
                                   "bubble_lock_step": s.bubble_fraction(costs, "ticks")}
    print(json.dumps(summary, indent=2))
    if args.png:
        save_png(s, args.png, costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
