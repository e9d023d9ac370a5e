"""The bytes the fusions around a compiled step's GEMMs read and write, and its FP8 casts.

python fusion_bytes.py PROGRAM.hlo ... : per program, each kind of kernel outside fusions (a GEMM fusion, a
reduction, a cast to FP8, another fusion, a custom call) with its launches a step and the bytes of its operands
and results, summed; then the total of all but the GEMMs (the Pallas attention kernels, custom calls, count) and megajax.hlo.fp8_casts' counts. Executions a step are
megajax.hlo's (while bodies times their trip counts)."""

import math
import re
import sys
from collections import defaultdict

from megajax import hlo

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def nbytes(text: str) -> int:
    return sum(BYTES.get(t, 4) * math.prod(int(x) for x in d.split(",") if x) for t, d in SHAPE.findall(text))


def kind(comps, shape: str, opcode: str, rest: str) -> str:
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        return "custom-call " + (target.group(1) if target else "?")
    body = [op for c in re.findall(r"calls=%?([\w.\-]+)", rest) for op in comps.get(c, ())]
    ops = {op[2] for op in body}
    casts = "f8e" in re.sub(r"\{[^}]*\}", "", shape)
    if "dot" in ops:
        return "gemm fusion"
    if "reduce" in ops:
        return "reduction, casting to fp8" if casts else "reduction"
    return "cast to fp8" if casts else "other fusion"


def main(paths):
    for path in paths:
        text = open(path).read()
        comps, kernels = hlo._kernels(text)
        launches, moved = defaultdict(float), defaultdict(float)
        shapes = {n: s for ops in comps.values() for n, s, _, _ in ops}
        for _, (name, shape, opcode, rest), runs in kernels:
            if opcode not in ("fusion", "custom-call", "copy"):
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
            size = nbytes(re.sub(r"\{[^}]*\}", "", shape)) + sum(nbytes(shapes.get(o, "")) for o in operands)
            k = "copy" if opcode == "copy" else kind(comps, shape, opcode, rest)
            launches[k] += runs
            moved[k] += size * runs
        print(path)
        for k in sorted(moved, key=lambda k: -moved[k]):
            print(f"  {k:40s} {launches[k]:6.0f} launches {moved[k] / 1e9:8.3f} GB")
        other = sum(v for k, v in moved.items() if k != "gemm fusion" and "cublas" not in k)
        casts = hlo.fp8_casts(text)
        print(f"  non-GEMM bytes {other / 1e9:.3f} GB; casts to fp8 {sum(n for _, n in casts):.0f}, "
              f"with their amax {sum(n for a, n in casts if a):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
