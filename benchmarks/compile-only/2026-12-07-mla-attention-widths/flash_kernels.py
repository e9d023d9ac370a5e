"""The flash-attention kernel calls of a compiled program (`python -m megajax.audit ... --dump-hlo FILE`): each
kernel's name and operand types, how many calls the program text holds, and their matmul FLOPs per call (not halved
for causal masking: 2 b s h t (d + d_v) forward, (2 d + d_v) dq, 2 (d + d_v) dk/dv). Self-contained, so that it reads
any version's program alike.

    python flash_kernels.py PROGRAM.hlo
"""

import collections
import math
import re
import sys

WIDTH = {"flash_attention_fwd": lambda d, dv: d + dv, "flash_attention_dq": lambda d, dv: 2 * d + dv,
         "flash_attention_dkv": lambda d, dv: 2 * (d + dv)}

calls = collections.Counter()
for line in open(sys.argv[1]):
    if 'custom_call_target="__gpu$xla.gpu.triton"' not in line:
        continue
    name = re.search(r'name = \\?"(flash_attention_[a-z]+)', line)
    if not name:
        continue
    start = line.find("operand_layout_constraints={")
    types = re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\]", line[start:line.find("}}", start)])
    calls[(name.group(1), tuple(types[:4]))] += 1
for (name, types), n in sorted(calls.items()):
    dims = [tuple(int(x) for x in t[t.index("[") + 1:-1].split(",")) for t in types]
    flops = 2.0 * math.prod(dims[0][:3]) * dims[1][1] * WIDTH[name](dims[0][3], dims[2][3])
    print(f"{name:20s} {n:3d} calls  {' '.join(types)}  {flops / 1e12:.3f} TFLOP a call")
