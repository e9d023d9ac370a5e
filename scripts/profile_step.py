"""Where one train step's device time goes: the step traced with jax.profiler and its GPU kernels summed by kind.

    python scripts/profile_step.py --config configs/llama-1b.yaml --set train.global_batch_size=8 \
        --label llama-1b --json out.json

The step is scripts/bench_train.py's (random tokens, compiled once, warmed up); `--steps` of them are traced.
Each kernel on the device's timeline is put in one kind by its name (GEMM, attention, the rest of XLA's fusions,
copies), and the rows give each kind's milliseconds per step, kernel count and share; `idle` is the step's span
minus the union of its kernels (launch gaps and host waits). Beside them: the longest kernels by total time. This
is what the planner's time model (megajax/plan/cost.py) is checked against term by term; on CPU the trace has no
device plane and the script says so.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from bench_train import append_row, step_parser, warmed_step  # noqa: E402 - the step benchmark's step and CLI
from megajax import distributed, step as step_lib  # noqa: E402
from megajax.config import io as config_io

# kernel name -> kind, first match wins (cuBLAS / cuBLASLt / CUTLASS / Triton GEMMs, then fused attention)
KINDS = [("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|wgmma|triton_dot|_dot_", re.I)),
         ("attention", re.compile(r"flash|attention|attn|cudnn|fmha|sdpa|mha", re.I)),
         ("norm kernel", re.compile(r"rms_norm|layer_norm", re.I)),
         ("copy", re.compile(r"memcpy|memset|copy", re.I))]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other fusion")


def device_events(xspace: bytes) -> tuple[list[tuple[str, int, int]], list[str]]:
    """(kernel name, start ns, duration ns) of every event on the first GPU's stream lines (all its lines where
    none is named a stream), and the names of the lines read."""
    from jax.profiler import ProfileData

    data = ProfileData.from_serialized_xspace(xspace)
    plane = next((p for p in data.planes if p.name.startswith("/device:GPU:0")), None)
    if plane is None:
        return [], []
    lines = [line for line in plane.lines if line.name.lower().startswith("stream")] or list(plane.lines)
    events = [(e.name, int(e.start_ns), int(e.duration_ns)) for line in lines for e in line.events]
    return events, [line.name for line in lines]


def summarize(events: list[tuple[str, int, int]], steps: int) -> dict:
    if not events:
        return {"error": "no GPU device plane in the trace (this runs on a GPU)"}
    by_kind = collections.defaultdict(lambda: [0, 0])
    by_name = collections.defaultdict(lambda: [0, 0])
    for name, _, dur in events:
        k = by_kind[kind_of(name)]
        k[0] += dur
        k[1] += 1
        n = by_name[name]
        n[0] += dur
        n[1] += 1
    spans = sorted((s, s + d) for _, s, d in events)
    busy, end = 0, None
    for s, e in spans:  # the union of the kernels' intervals (streams may overlap)
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = spans[-1][1] - spans[0][0]
    ms = 1e-6 / steps
    kinds = {k: {"ms": v[0] * ms, "kernels": v[1] / steps, "share": v[0] / max(span, 1)}
             for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])}
    top = [{"name": n[:120], "kind": kind_of(n), "ms": v[0] * ms, "calls": v[1] / steps}
           for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]]
    return {"span_ms": span * ms, "busy_ms": busy * ms, "idle_ms": (span - busy) * ms, "kinds": kinds, "top": top}


def profile(cfg, steps: int, warmup: int) -> dict:
    setup = step_lib.setup_for(cfg)
    with jax.set_mesh(setup.mesh):
        step_fn, state, batch, _ = warmed_step(setup, warmup)
        with tempfile.TemporaryDirectory() as where:
            with jax.profiler.trace(where):
                for _ in range(steps):
                    state, stats = step_fn(state, batch)
                jax.block_until_ready(stats)
            paths = [os.path.join(d, f) for d, _, fs in os.walk(where) for f in fs if f.endswith(".xplane.pb")]
            xspace = open(paths[0], "rb").read() if paths else b""
    events, lines = device_events(xspace) if xspace else ([], [])
    return {"lines": lines, **summarize(events, steps)}


def main(argv: list[str] | None = None) -> int:
    parser = step_parser(__doc__, 2, "traced steps")
    parser.add_argument("--json", help="append the row (one JSON line) to this file")
    args = parser.parse_args(argv)
    distributed.prefer_cpu_without_gpu()
    cfg = config_io.load(args.config, args.set)
    row = {"label": args.label, "config": args.config, "set": args.set, "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, **profile(cfg, args.steps, args.warmup)}
    if "kinds" in row:
        print(f"{args.label}: span {row['span_ms']:.1f} ms/step, kernels busy {row['busy_ms']:.1f}, "
              f"idle {row['idle_ms']:.1f}")
        for kind, v in row["kinds"].items():
            print(f"  {kind:13s} {v['ms']:8.2f} ms  {v['kernels']:7.0f} kernels  {100 * v['share']:5.1f}%")
        for t in row["top"][:12]:
            print(f"    {t['ms']:7.2f} ms  x{t['calls']:<5.0f} {t['kind']:12s} {t['name'][:80]}")
    else:
        print(row["error"])
    append_row(args.json, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
