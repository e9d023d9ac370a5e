"""Loss curves of several runs side by side, from their metrics.jsonl (needs matplotlib: the plot extra).

    python scripts/plot_losses.py --out loss.png bf16=runs/a fp8=runs/b [--title TEXT]

Each LABEL=DIR reads DIR/metrics.jsonl (a resumed run's later lines replace earlier ones). Prints each run's
last logged loss and the relative difference of every run's last loss from the first run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_losses(out_dir: str | Path) -> dict[int, float]:
    losses = {}
    with open(Path(out_dir) / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                losses[int(rec["step"])] = float(rec["loss"])
    return dict(sorted(losses.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=DIR", help="a run's label and its train.output_dir")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default="training loss", help="the plot's title")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: write LABEL=DIR")
        curves[label] = read_losses(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(list(losses), list(losses.values()), label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    first = next(iter(curves.values()))
    base_step, base = next(reversed(first.items()))
    for label, losses in curves.items():
        step, last = next(reversed(losses.items()))
        print(f"{label}: loss {last:.4f} at step {step} ({(last - base) / base:+.2%} against the first run's "
              f"{base:.4f} at step {base_step})")


if __name__ == "__main__":
    main()
