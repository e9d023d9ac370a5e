"""rows.json from run.sh's two outputs ($OUT/before, $OUT/after): each preset's peak, the Pallas kernels in its
program (attention forward launches counted apart), its loops, the layer-stack copy kernels and the audit's time."""
import json
import os
import re

OUT = os.environ.get("OUT", "/tmp/fast-defaults")
HERE = os.path.dirname(os.path.abspath(__file__))


def program(hlo: str) -> dict:
    text = open(hlo).read()
    names = re.findall(r'name = \\?"([a-z_]+)', text)
    kernels = sorted({n for n in names if n.startswith(("flash_attention", "layer_norm", "rms_norm", "grouped"))})
    return {"kernels": kernels, "flash_attention_fwd_calls": names.count("flash_attention_fwd"),
            "while_loops": text.count(" while("), "stack_copy_kernels": text.count('"name":"dynamic_slice_fusion"')}


rows = []
for label in ("before", "after"):
    times = dict(line.split() for line in open(os.path.join(OUT, label, "times.txt")))
    for name, t in times.items():
        path = os.path.join(OUT, label, f"{name}.json")
        if not os.path.getsize(path):
            rows.append({"row": name, "code": label, "error": open(path[:-5] + ".err").read()[-300:]})
            continue
        r = json.load(open(path))
        rows.append({"row": name, "code": label, "peak_gib": round(r["memory_per_device"]["peak_estimate_gib"], 2),
                     "exposed_comm_s": round(r["communication"]["exposed_comm_s"], 3),
                     "gemm_tflop_per_device": round(r["program_gemm_flops_per_device"]["total"] / 1e12, 2),
                     **program(os.path.join(OUT, label, f"{name}.hlo")), "audit_wall_s": round(float(t), 1)})
for r in rows:
    print(r)
json.dump(rows, open(os.path.join(HERE, "rows.json"), "w"), indent=1)
