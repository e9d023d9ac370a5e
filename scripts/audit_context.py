"""Context parallelism on compile-only H100s (no GPU needed): the audit of configs/llama3.2-1b-long.yaml at context
1, 4 and 8 on 8 GPUs (memory per GPU, the exchange's bytes in the compiled program against the analytic volume,
the share of them with GEMMs scheduled underneath), the ring against the all_gather exchange, and the longest
sequence that fits with and without context parallelism.

    python scripts/audit_context.py --out benchmarks/h100/context.json   # about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONFIG = "configs/llama3.2-1b-long.yaml"


def audit(*sets: str) -> dict:
    cmd = [sys.executable, "-m", "megajax.audit", "--config", CONFIG, "--target", "h100", "--devices", "8",
           "--set", *sets]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    r = json.loads(out.stdout)
    context = {k: {"bytes": v["bytes"], "count": v["count"]} for k, v in r["collectives"].items()
               if "context" in v["axes"] and v["kind"] in ("collective-permute", "all-gather", "reduce-scatter")
               and "data" not in v["axes"]}
    groups = (r["communication"] or {}).get("groups", {})
    return {"sets": list(sets), "peak_gib": round(r["memory_per_device"]["peak_estimate_gib"], 2),
            "fits": r["memory_per_device"]["fits"], "context_collectives": context,
            "expected": r["expected_context_exchange"],
            "overlapped_fraction": {k: round(g["overlapped_fraction"], 3) for k, g in groups.items()
                                    if "context" in k and "data" not in k}}


def layout(c: int, seq: int, comm: str = "auto") -> list[str]:
    # 8 GPUs: data x context; 8 sequences per step; micro batch 1
    return [f"parallel.context={c}", f"parallel.data={8 // c}", f"model.seq_length={seq}",
            f"parallel.context_comm={comm}", "model.rope_original_max_positions=8192"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/h100/context.json")
    args = parser.parse_args()
    report: dict = {"config": CONFIG, "by_context_at_32k": {}, "exchange_at_32k_c4": {}, "longest": {}}
    for c in (1, 4, 8):
        report["by_context_at_32k"][c] = audit(*layout(c, 32768))
        print(c, report["by_context_at_32k"][c], flush=True)
    for comm in ("ring", "all_gather"):
        report["exchange_at_32k_c4"][comm] = audit(*layout(4, 32768, comm))
        print(comm, report["exchange_at_32k_c4"][comm], flush=True)
    for c in (1, 8):
        rows = report["longest"][c] = {}
        for seq in (65536, 131072, 262144, 524288, 1048576):
            rows[seq] = audit(*layout(c, seq))
            print(c, seq, rows[seq], flush=True)
            if not rows[seq].get("fits"):
                break
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
