"""rows.json from run.sh's output: each row's peak, exposed communication, stack copy kernels and audit time."""
import json
import os
import re
OUT = os.environ.get("OUT", "/tmp/unroll")  # run.sh's output folder; writes rows.json there
DT = {'bf16': 2, 'f32': 4, 's32': 4, 'f8e4m3fn': 1, 'f8e5m2': 1, 'pred': 1, 'u32': 4}
times = {}
for l in open(os.path.join(OUT, 'times.txt')):
    p = l.split()
    if len(p) == 3: times[(p[0], p[1])] = float(p[2])
def copies(path):
    n = b = 0
    for l in open(path):
        if '"name":"dynamic_slice_fusion"' in l:
            n += 1
            m = re.search(r'= (\w+)\[([\d,]*)\]', l)
            if m and 'dynamic_update_slice' not in l:
                k = 1
                for d in m.group(2).split(','): k *= int(d) if d else 1
                b += k * DT.get(m.group(1), 4)
    return n, b
rows = []
for (name, scan), t in times.items():
    j = os.path.join(OUT, f'{name}-{scan}.json')
    if not os.path.exists(j) or os.path.getsize(j) == 0: continue
    r = json.load(open(j))
    n, b = copies(os.path.join(OUT, f'{name}-{scan}.hlo'))
    rows.append({"row": name, "scan_layers": scan == "true", "peak_gib": round(r["memory_per_device"]["peak_estimate_gib"], 2),
                 "exposed_comm_s": round(r["communication"]["exposed_comm_s"], 3), "stack_copy_kernels": n,
                 "sliced_out_gib": round(b / 2**30, 2), "audit_wall_s": round(t, 1)})
for r in rows: print(r)
json.dump(rows, open(os.path.join(OUT, 'rows.json'), 'w'), indent=1)
