"""Bytes per [s, s] score element that each fusion of the unfused attention moves, per loop body of a compiled
program (python -m megajax.audit ... --dump-hlo FILE): python benchmarks/planner/2026-11-27-scores.py FILE.
Used for cost.SCORES_BYTES_* on gpt2-124m (micro batch 8, 12 heads, sequence 1024), selective and no recomputation:
  python -m megajax.audit --config configs/gpt2-124m.yaml --set train.global_batch_size=32 model.attention_impl=xla \
      [model.recompute=none] --target h100 --devices 1 --dump-hlo FILE"""
import re, sys
text = open(sys.argv[1]).read()
S = 8 * 12 * 1024 * 1024
DT = {'bf16': 2, 'f32': 4, 's32': 4, 'pred': 1, 'u32': 4, 'u8': 1, 's8': 1, 'f16': 2}
shapes = {}
for l in text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\(', l)
    if m: shapes[m.group(1)] = m.group(2)
def score_bytes(s):
    b = 0
    for t, d in re.findall(r'(bf16|f32|s32|pred|u32|u8|s8|f16)\[([\d,]*)\]', s):
        n = 1
        for x in d.split(','):
            if x: n *= int(x)
        if n == S or n == S * 16: b += DT[t] * (S if n == S else S)  # a per-layer slice of a stack counts once
    return b
for c in re.split(r'\n(?=\S)', text):
    head = c.split('\n', 1)[0]
    tot = {'gemm': 0, 'other': 0}; rows = []
    for l in c.split('\n')[1:]:
        m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (.+?) (fusion|custom-call|copy)\((.*?)\)(,|$)', l)
        if not m: continue
        name, shp, op, operands = m.group(1), m.group(2), m.group(3), m.group(4)
        ob = score_bytes(shp)
        ib = sum(score_bytes(shapes.get(o, '')) for o in re.findall(r'%([\w.\-]+)', operands))
        if ob + ib == 0: continue
        kind = 'gemm' if 'gemm' in name or op == 'custom-call' else 'other'
        tot[kind] += ob + ib; rows.append((name, round(ob / S, 1), round(ib / S, 1)))
    if rows:
        print(head[:50], {k: round(v / S, 1) for k, v in tot.items()}, 'B per score element')
        for r in rows: print('    ', r)
