"""Reading compiled HLO text: every collective with its bytes, its device groups and how often it runs.

XLA prints replica groups in several forms, all handled here:
  {{0,1},{2,3}}                         explicit groups
  [2,4]<=[8]  or  [4,2]<=[2,4]T(1,0)    iota: arange(N) reshaped (and transposed), rows are groups
  mesh['axis_0'=2,'axis_1'=4] {'axis_1'}  a mesh of XLA's own factorisation (device ids optional) and the
                                         axes the collective spans
Groups are mapped back to the (data, pipeline, tensor) mesh by device coordinates. Ops inside a while body
run `known_trip_count` times; ops inside a conditional branch run at most once per visit (reported apart), or,
given `branch_runs` (the pipeline executor's: how often each branch of each of its switches runs per visit, found
by the name scope the compiled program keeps in the conditional's op_name), as often as the schedule runs them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "ragged-all-to-all")
RINGS = ("all-reduce", "all-gather", "reduce-scatter")  # run as rings (NCCL's), whose channels share a node's NICs
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "token": 0, "s4": 1, "u4": 1}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass
class Collective:
    kind: str  # one of KINDS
    name: str
    # the full buffer: all-reduce in/out, all-gather output, reduce-scatter input, permute/all-to-all input; a
    # ragged all-to-all: the smaller of its input and output (what moves when each row is sent once, as MoE's
    # exchanges send every routed row: all of the input on the way out, all of the output on the way back)
    bytes: int
    group_size: int
    axes: tuple[str, ...]  # mesh axes the groups span (permute: the axes source and target differ on)
    count: float  # executions per step (while trip counts multiplied in; branches weighted by branch_runs)
    in_conditional: bool  # inside a conditional branch: runs only when that branch is taken
    computation: str
    is_async: bool = False  # a start/done pair the scheduler may place work between
    flops_under: float = 0.0  # GEMM FLOPs scheduled between its start and its done (one execution)
    crosses_nodes: bool = False  # a group spans GPUs of more than one node (the inter-node network)
    scope: str = ""  # the pipeline switch it runs under (pipeline.ticks.scope + "_" + action), if any
    # NICs a crossing group's ring uses: its members on one node (the fewest of any node), each GPU with its own
    # NIC, as NCCL spreads a ring's channels over them; 1 for permutes and all-to-alls (each GPU's own traffic)
    nics: int = 1


def _parse_shape_tree(text: str):
    """'(f32[2,3]{1,0}, (bf16[4]))' -> nested lists of byte sizes."""
    text = text.strip()
    if text.startswith("("):
        return [_parse_shape_tree(p) for p in _split_top(text[1:text.rindex(")")])]
    m = _SHAPE.match(text)
    if not m:
        return 0
    dims = [int(x) for x in m.group(2).split(",") if x]
    return _DTYPE_BYTES.get(m.group(1), 4) * math.prod(dims)


def _total(tree) -> int:
    return sum(_total(t) for t in tree) if isinstance(tree, list) else tree


def _split_top(text: str) -> list[str]:
    depth, parts, cur = 0, [], ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _iota(dims: list[int], perm: list[int] | None, reshape: list[int]) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    return (arr.transpose(perm) if perm else arr).reshape(dims)


def parse_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Device groups of a collective from its attribute text (None: every device in one group)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", attrs)
    if m:
        sizes = [int(s.split("=")[1]) for s in m.group(1).split(",")]
        names = [s.split("=")[0].strip().strip("'") for s in m.group(1).split(",")]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            dm = re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group(2))
            dims = [int(x) for x in dm.group(1).split(",")]
            perm = [int(x) for x in dm.group(2).split(",")] if dm.group(2) else None
            ids = _iota([math.prod(sizes)], perm, dims)
        grid = ids.reshape(sizes)
        over = [names.index(a.strip().strip("'")) for a in m.group(3).split(",") if a.strip()]
        keep = [i for i in range(len(sizes)) if i not in over]
        grid = grid.transpose(keep + over).reshape(-1, math.prod(sizes[i] for i in over) if over else 1)
        return grid.tolist()
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        reshape = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
        return _iota(dims, perm, reshape).reshape(dims[0], -1).tolist()
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", attrs)
    if m:
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
        return groups or None
    return None


def _axes_of_groups(groups, coords: np.ndarray, axis_names) -> tuple[str, ...]:
    if groups is None:
        return tuple(n for i, n in enumerate(axis_names) if coords[:, i].max() > 0)
    varying = {n for g in groups for i, n in enumerate(axis_names) if len(set(coords[g][:, i])) > 1}
    return tuple(n for n in axis_names if n in varying)


def _permute_axes(attrs: str, coords: np.ndarray, axis_names) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=")[1])]
    varying = {n for s, t in pairs for i, n in enumerate(axis_names) if coords[s, i] != coords[t, i]}
    return tuple(n for n in axis_names if n in varying), pairs


def _kind(opcode: str) -> str | None:
    base = opcode[:-6] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _bytes(kind: str, opcode: str, shape_text: str, group_size: int) -> int:
    tree = _parse_shape_tree(shape_text)
    if kind == "ragged-all-to-all":  # (operand, output, 4 offsets and sizes)[, output]: the smaller buffer
        operands = tree[0] if opcode.endswith("-start") else tree
        return min(_total(operands[0]), _total(operands[1])) if isinstance(operands, list) else _total(operands)
    if opcode.endswith("-start") and isinstance(tree, list) and kind != "all-reduce":  # (operands, results[, ...])
        return _total(tree[1] if kind == "all-gather" else tree[0])
    if kind == "reduce-scatter":
        return _total(tree) * group_size
    return _total(tree)


def _callees(opcode: str, rest: str, branch_runs: dict | None = None) -> list[tuple[str, float, str | None]]:
    """The computations one op runs: (name, executions per execution of the op, None, or for a conditional
    branch the pipeline switch's scope ("" when it has none)): a while body times its known trip count, every
    branch of a conditional (as `branch_runs` weights it, else once), what calls, fusions and async starts
    call."""
    if opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest)
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        return [(body.group(1), int(trip.group(1)) if trip else 1, None)] if body else []
    if opcode == "conditional":
        found = re.search(r"branch_computations=\{([^}]*)\}", rest) or re.search(r"(true_computation=.*)", rest)
        branches = re.findall(r"%([\w.\-]+)", found.group(1))
        # a pipeline switch `scope` (or ticks.LAST_RANK's, differentiated too), or its group i run under a two-way
        # conditional named scope + i, true when the group runs (pipeline.executor.backward): a two-way switch whose
        # first branch is the false one (sharding.cond); a predicated conditional (jax.lax.cond): true branch first
        link = re.search(r'op_name="[^"]*/(?:[a-z]+\()*(pipeline_s\d+t\d_[a-z]|pipeline_last)(\d*)\)*/cond"', rest)
        scope = link.group(1) if link else ""
        runs = (branch_runs or {}).get(scope)
        if runs is not None and link.group(2) and len(branches) == 2 and int(link.group(2)) < len(runs):
            taken = runs[int(link.group(2))]
            runs = [taken, 1 - taken] if "true_computation=" in rest else [1 - taken, taken]
        elif runs is None or link.group(2) or len(runs) != len(branches):
            runs = [1] * len(branches)
        return [(b, r, scope) for b, r in zip(branches, runs)]
    if opcode in ("call", "async-start", "fusion"):
        return [(c, 1, None) for c in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)]
    return []


def _walk(hlo_text: str, branch_runs: dict | None = None):
    """(computation -> its ops (name, shape, opcode, rest of line), executions of each computation per step,
    whether each runs inside a conditional branch, the pipeline switch each runs under), from the entry through
    while bodies (times their known trip counts), conditional branches (each counted as if taken, or as
    `branch_runs` says), calls and fusions."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # XLA's /*index=5*/ markers inside tuple shapes
        cm = _COMP.match(line)
        if cm:
            current = cm.group(2)
            comps[current] = []
            if cm.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        om = _OP.match(line)
        if om:
            comps[current].append((om.group(1), om.group(2), om.group(3), om.group(4)))

    # executions of each computation: walk calls from the entry
    multiplicity: dict[str, float] = defaultdict(float)
    conditional: dict[str, bool] = defaultdict(bool)
    scopes: dict[str, str] = {}  # computation -> the innermost pipeline switch it runs under

    def visit(comp: str, mult: float, in_cond: bool, scope: str, depth: int = 0) -> None:
        if depth > 64 or comp not in comps:
            return
        multiplicity[comp] += mult
        conditional[comp] |= in_cond
        if scope:
            scopes[comp] = scope
        for _, _, opcode, rest in comps[comp]:
            for callee, times, branch in _callees(opcode, rest, branch_runs):
                visit(callee, mult * times, in_cond or branch is not None, branch or scope, depth + 1)

    if entry:
        visit(entry, 1, False, "")
    return comps, multiplicity, conditional, scopes


def parse(hlo_text: str, mesh_shape: dict[str, int], devices_per_node: int | None = None,
          branch_runs: dict | None = None) -> list[Collective]:
    """Every collective of a compiled module, with executions per step and what the schedule places under it
    (the module's instruction order is its schedule once XLA has scheduled it: `is_scheduled=true`).
    `devices_per_node`: logical device i sits on node i // devices_per_node (megajax's meshes order devices
    host by host), to mark the collectives whose groups cross nodes."""
    axis_names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in axis_names]
    n = math.prod(sizes)
    coords = np.stack(np.unravel_index(np.arange(n), sizes), axis=1)
    comps, multiplicity, conditional, scopes = _walk(hlo_text, branch_runs)
    under = _scheduled_under(comps)
    per_node = devices_per_node or n
    out = []
    for comp, ops in comps.items():
        if multiplicity.get(comp, 0) == 0:
            continue
        for name, shape_text, opcode, rest in ops:
            kind = _kind(opcode)
            if kind is None:
                continue
            nics = 1
            if kind == "collective-permute":
                axes, pairs = _permute_axes(rest, coords, axis_names)
                crosses = any(a // per_node != b // per_node for a, b in pairs)
                group = 2
            else:
                groups = parse_groups(rest, n)
                group = len(groups[0]) if groups else n
                axes = _axes_of_groups(groups, coords, axis_names)
                every = groups or [range(n)]
                crosses = any(len({i // per_node for i in g}) > 1 for g in every)
                if crosses and kind in RINGS:
                    nics = min(min(Counter(i // per_node for i in g).values()) for g in every)
            is_async, flops = under.get((comp, name), (opcode.endswith("-start"), 0.0))
            out.append(Collective(kind, name, _bytes(kind, opcode, shape_text, group), group, axes,
                                  multiplicity[comp], conditional[comp], comp, is_async, flops, crosses,
                                  scopes.get(comp, ""), nics))
    return out


def _scheduled_under(comps) -> dict[tuple[str, str], tuple[bool, float]]:
    """(computation, collective op) -> (asynchronous, the GEMM FLOPs between its start and its done, loops
    included). `X-start`/`X-done` pairs, and `async-start`/`async-done` wrapping a computation with
    the collective (reported under that collective's name)."""
    flops_of = _inclusive_flops(comps)
    out = {}
    for comp, ops in comps.items():
        for i, (name, _, opcode, rest) in enumerate(ops):
            if opcode.endswith("-start") and _kind(opcode):
                targets = [(comp, name)]
            elif opcode == "async-start":
                callee = re.search(r"calls=%?([\w.\-]+)", rest)
                targets = [(callee.group(1), n) for n, _, op, _ in comps.get(callee.group(1) if callee else "", [])
                           if _kind(op)] if callee else []
            else:
                continue
            done = next((j for j in range(i + 1, len(ops)) if ops[j][2].endswith("-done")
                         and re.match(rf"\s*(?:\S+\s+)?%{re.escape(name)}[,)]", ops[j][3])), None)
            between = ops[i + 1:done] if done is not None else []
            flops = sum(flops_of(comp, op) for op in between)
            for t in targets:
                out[t] = (True, flops)
    return out


_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


def _dims(shape_text: str) -> list[int]:
    m = _SHAPE.search(shape_text)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


def _own_gemm_flops(op, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size of one dot or cuBLAS GEMM custom call (0 for anything else)."""
    _, shape_text, opcode, rest = op
    first = re.match(r"\s*(?:([a-z][a-z0-9]*\[[0-9,]*\])\S*\s+)?%?([\w.\-]+)", rest)
    lhs = _dims(first.group(1) or shapes.get(first.group(2), "")) if first else []
    if opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
    elif opcode == "custom-call" and any(f'custom_call_target="{t}"' in rest for t in _GEMM_CALLS):
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
        shape_text = _SHAPE.search(shape_text).group(0)  # (result, workspace): the result
    else:
        return 0.0
    ks = [int(x.strip('" ')) for x in contracting.group(1).split(",") if x.strip('" ')] if contracting else []
    return 2.0 * math.prod(_dims(shape_text)) * math.prod(lhs[i] for i in ks)


def _is_fp8(op, shapes: dict[str, str]) -> bool:
    """A GEMM with FP8 operands: cuBLASLt's FP8 call, a grouped-GEMM or block-scaled kernel with an FP8 operand, or
    a dot (a Triton GEMM's) whose left operand is FP8."""
    _, _, opcode, rest = op
    if opcode == "custom-call":
        kernel = (_kernel_operand_types(op, 'name = "grouped_matmul')
                  or _kernel_operand_types(op, 'name = "block_fp8_') or [])
        return 'custom_call_target="__cublas$lt$matmul$f8"' in rest or any(t.startswith("f8") for t in kernel)
    first = re.match(r"\s*(?:([a-z][a-z0-9]*\[[0-9,]*\])\S*\s+)?%?([\w.\-]+)", rest)
    lhs = (first.group(1) or shapes.get(first.group(2), "")) if first else ""
    return lhs.startswith("f8")


def gemm_flops(hlo_text: str, branch_runs: dict | None = None) -> dict[str, float]:
    """The matmul FLOPs of one step of a compiled module: 2 x output elements x contracted size over every
    dot (also inside fusions: XLA:GPU's Triton GEMMs), cuBLAS GEMM custom call and grouped-GEMM kernel (MoE),
    times the executions of its computation. `in_conditional`: the part inside conditional branches, counted as
    if every branch ran (an upper bound: the pipeline's ticks run one branch each) unless `branch_runs` (the
    pipeline executor's) says how often each runs. `fp8`: the FLOPs of GEMMs with FP8 operands; `gemms` and
    `fp8_gemms`: the GEMM sites in the program (a GEMM inside a loop body counts once)."""
    comps, multiplicity, conditional, _ = _walk(hlo_text, branch_runs)
    total = in_cond = fp8 = 0.0
    sites = fp8_sites = 0
    for comp, ops in comps.items():
        mult = multiplicity.get(comp, 0)
        if not mult:
            continue
        shapes = {name: shape_text for name, shape_text, _, _ in ops}
        for op in ops:
            own = _own_gemm_flops(op, shapes) + _kernel_gemm_flops(op)
            if not own:
                continue
            flops = own * mult
            total += flops
            in_cond += flops if conditional[comp] else 0.0
            sites += 1
            if _is_fp8(op, shapes):
                fp8 += flops
                fp8_sites += 1
    return {"total": total, "in_conditional": in_cond, "fp8": fp8, "gemms": sites, "fp8_gemms": fp8_sites}


def _kernels(hlo_text: str, branch_runs: dict | None = None):
    """(computations, [(the pipeline switch, "" if none; an op outside fusions; its executions a step)])."""
    comps, multiplicity, _, scopes = _walk(hlo_text, branch_runs)
    fused = {c for ops in comps.values() for _, _, opcode, rest in ops if opcode == "fusion"
             for c in re.findall(r"calls=%?([\w.\-]+)", rest)}
    return comps, [(scopes.get(comp, ""), op, multiplicity[comp]) for comp, ops in comps.items()
                   if multiplicity.get(comp) and comp not in fused for op in ops]


def copies(hlo_text: str, branch_runs: dict | None = None) -> list[tuple[str, str, float]]:
    """XLA's copies outside fusions in a compiled module: (the pipeline switch they run under, "" if none; shape;
    executions a step as `gemm_flops` counts them). XLA copies a buffer it cannot update in place (a loop's carry
    through a conditional, a layout change): on a GPU, 2 x its bytes of HBM traffic."""
    return [(scope, shape, n) for scope, (_, shape, op, _), n in _kernels(hlo_text, branch_runs)[1] if op == "copy"]


def fp8_casts(hlo_text: str) -> list[tuple[bool, float]]:
    """The fusions that write FP8 arrays (the matmuls' operands cast): (whether the fusion also reduces, as a cast
    that computes its operand's amax in the same pass does; executions a step)."""
    comps, ops = _kernels(hlo_text)
    return [(any(o[2] == "reduce" for c in re.findall(r"calls=%?([\w.\-]+)", rest) for o in comps.get(c, ())), runs)
            for _, (_, shape, op, rest), runs in ops if op == "fusion" and "f8e" in re.sub(r"\{[^}]*\}", "", shape)]


def copied_bytes(hlo_text: str, branch_runs: dict | None = None) -> dict[str, float]:
    """The bytes `copies` write in one step, and the largest one copy writes."""
    sizes = [(_total(_parse_shape_tree(shape)), runs) for _, shape, runs in copies(hlo_text, branch_runs)]
    return {"per_step": sum(size * runs for size, runs in sizes), "largest": max((s for s, _ in sizes), default=0)}


def _kernel_operand_types(op, name: str) -> list[str] | None:
    """The operand types (`f8e4m3fn[4352,128]`) of a Pallas (Triton custom call) kernel whose name contains `name`,
    else None."""
    _, _, opcode, rest = op
    triton = 'custom_call_target="__gpu$xla.gpu.triton"' in rest
    if opcode != "custom-call" or not triton or name not in rest:
        return None
    start = rest.find("operand_layout_constraints={")
    listed = rest[start:rest.find("}}", start)] if start >= 0 else ""  # shapes with their {layouts}, then "}"
    return re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\]", listed)


def _kernel_operands(op, name: str) -> list[tuple[int, ...]] | None:
    """The operand dims of a Pallas (Triton custom call) kernel whose name contains `name`, else None."""
    types = _kernel_operand_types(op, name)
    return None if types is None else [_dims(t) for t in types]


def _grouped_gemm_flops(op) -> float:
    """The FLOPs of one grouped-GEMM kernel (megajax.kernels.grouped_matmul), 2 x padded rows x k x n from its
    row operands: x [rows, k] and w [e, k, n] (forward and input gradient), x [rows, k] and dy [rows, n] (weight
    gradient). The rows include each group's padding to a whole tile."""
    dims = _kernel_operands(op, 'name = "grouped_matmul')
    if not dims or len(dims) < 3:
        return 0.0
    if 'name = "grouped_matmul_weight_grad"' in op[3]:
        (rows, k), (_, n) = dims[-2], dims[-1]
    else:
        (rows, k), n = dims[-2], dims[-1][-1]
    return 2.0 * rows * k * n


def _block_fp8_flops(op) -> float:
    """The FLOPs of one block-scaled FP8 kernel (megajax.kernels.block_fp8), 2 x m x k x n from its operands
    a [m, k], its scales, b [k, n] (or [n, k]) and its scales [k / group, n] (rows and columns padded to tiles)."""
    dims = _kernel_operands(op, 'name = "block_fp8_matmul')
    if not dims or len(dims) != 4:
        return 0.0
    (m, k), n = dims[0], dims[3][-1]
    return 2.0 * m * k * n


def _kernel_gemm_flops(op) -> float:
    """The FLOPs of one of megajax's GEMM kernels (grouped, block-scaled, block-scaled grouped); 0 for anything else."""
    return _grouped_gemm_flops(op) + _block_fp8_flops(op) + _block_fp8_grouped_flops(op)


def _block_fp8_grouped_flops(op) -> float:
    """The FLOPs of one block-scaled FP8 grouped kernel (megajax.kernels.block_fp8's grouped_matmul and
    grouped_weight_matmul), 2 x padded rows x k x n: a [.., rows, k] and b [.., e, k, n] (forward, input gradient),
    a [.., rows, k] and b [.., rows, n] (weight gradient), each after its table(s) and beside its scales; a leading
    dim (blocks of experts) multiplies."""
    dims = _kernel_operands(op, 'name = "block_fp8_grouped')
    if not dims or len(dims) < 5:
        return 0.0
    a, b = (dims[2], dims[4]) if 'name = "block_fp8_grouped_weight' in op[3] else (dims[1], dims[3])
    return 2.0 * math.prod(a) * b[-1]


def _own_kernel_flops(op) -> float:
    """Matmul FLOPs of a flash-attention kernel (q [b,s,h,d], k [b,t,g,d], v [b,t,g,d_v]; causal not halved): 2bsht
    x (d + d_v) forward, 2d + d_v dq, 2(d + d_v) dk/dv (both recompute p); else a GEMM kernel's, or 0."""
    dims = _kernel_operands(op, "flash_attention")
    if not dims or len(dims) < 3 or any(len(x) != 4 for x in dims[:3]):
        return _kernel_gemm_flops(op)
    d, dv, name = dims[0][3], dims[2][3], op[3]
    width = 2 * (d + dv) if "flash_attention_dkv" in name else 2 * d + dv if "flash_attention_dq" in name else d + dv
    return 2.0 * math.prod(dims[0][:3]) * dims[1][1] * width


def _inclusive_flops(comps):
    """flops(computation, op): the GEMM FLOPs one execution of `op` runs, with what it calls (fusions, calls,
    while bodies times their trip counts; a conditional: its largest branch), the flash-attention kernels'
    estimated (`_own_kernel_flops`) included: what a collective can hide under."""
    shapes = {c: {name: shape_text for name, shape_text, _, _ in ops} for c, ops in comps.items()}
    memo: dict[str, float] = {}

    def of_comp(c: str) -> float:
        if c not in memo:
            memo[c] = 0.0  # guards a cycle
            memo[c] = sum(of_op(c, op) for op in comps.get(c, []))
        return memo[c]

    def of_op(c: str, op) -> float:
        callees = _callees(op[2], op[3])
        inner = [of_comp(callee) * times for callee, times, _ in callees]
        own = _own_gemm_flops(op, shapes[c]) + _own_kernel_flops(op)
        if any(branch for _, _, branch in callees):  # one branch runs: the largest
            return own + max(inner, default=0.0)
        return own + sum(inner)

    return of_op


def custom_calls(hlo_text: str) -> dict[str, float]:
    """Executions per step of each custom call target (a cuDNN attention, a Triton kernel), counted through while
    loops' trip counts and calls like the collectives."""
    comps, multiplicity, _, _ = _walk(hlo_text)
    runs: dict[str, float] = defaultdict(float)
    for comp, ops in comps.items():
        for _, _, opcode, rest in ops:
            target = re.search(r'custom_call_target="([^"]+)"', rest) if opcode == "custom-call" else None
            if target:
                runs[target.group(1)] += multiplicity.get(comp, 0)
    return dict(runs)


def wire_bytes(c: Collective) -> float:
    """Bytes each device sends for one execution with ring algorithms (Megatron's accounting)."""
    g = c.group_size
    if c.kind == "all-reduce":
        return 2 * (g - 1) / g * c.bytes
    if c.kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (g - 1) / g * c.bytes
    return float(c.bytes)


def group_key(c: Collective) -> str:
    """The report's row of a collective: its kind and the mesh axes it spans."""
    return f"{c.kind} over {'+'.join(c.axes) or 'none'}"


def summarize(collectives: list[Collective]) -> dict:
    """By kind and mesh axes: executions per step, bytes per step, ring wire bytes per step."""
    table: dict[str, dict] = {}
    for c in collectives:
        key = group_key(c)
        row = table.setdefault(key, {"kind": c.kind, "axes": list(c.axes), "ops": 0, "count": 0, "bytes": 0,
                                     "wire_bytes": 0.0, "in_conditional": 0})
        row["ops"] += 1
        row["count"] += c.count
        row["bytes"] += c.bytes * c.count
        row["wire_bytes"] += wire_bytes(c) * c.count
        row["in_conditional"] += c.count if c.in_conditional else 0
    return dict(sorted(table.items()))


def link_seconds(c: Collective, nvlink_bytes_s: float, network_bytes_s: float) -> float:
    """One execution's time on the wire: ring wire bytes over the link its groups use: NVLink inside a node;
    once a group crosses nodes, the network at its `nics` NICs, at most NVLink."""
    return wire_bytes(c) / (min(nvlink_bytes_s, c.nics * network_bytes_s) if c.crosses_nodes else nvlink_bytes_s)


def overlap(collectives: list[Collective], peak_flops: float, nvlink_bytes_s: float,
            network_bytes_s: float) -> dict:
    """By kind and mesh axes: bytes per step, the fraction of them with GEMMs scheduled between start and done
    (`overlapped_fraction`), and an estimate of the time per step on the wire and of the part of it left
    exposed: each execution hides at most the GEMM time under it (its FLOPs at peak). An estimate, optimistic
    where two collectives share the GEMMs under them, pessimistic where non-GEMM work hides some."""
    table: dict[str, dict] = {}
    for c in collectives:
        key = group_key(c)
        row = table.setdefault(key, {"bytes": 0, "overlapped_bytes": 0, "crosses_nodes": False, "nics": c.nics,
                                     "comm_s": 0.0, "exposed_s": 0.0})
        wire = link_seconds(c, nvlink_bytes_s, network_bytes_s)
        row["bytes"] += c.bytes * c.count
        row["overlapped_bytes"] += c.bytes * c.count if c.is_async and c.flops_under > 0 else 0
        row["crosses_nodes"] |= c.crosses_nodes
        row["nics"] = min(row["nics"], c.nics)
        row["comm_s"] += wire * c.count
        row["exposed_s"] += max(0.0, wire - (c.flops_under / peak_flops if c.is_async else 0.0)) * c.count
    for row in table.values():
        row["overlapped_fraction"] = row["overlapped_bytes"] / row["bytes"] if row["bytes"] else 1.0
    return dict(sorted(table.items()))


_NESTING = ("while", "conditional", "call", "async-start")  # ops that run computations of their own


def unordered_collectives(hlo_text: str) -> list[tuple[str, str, str]]:
    """(computation, op, next op) wherever a compiled CPU program lets a device wait in two collectives at once:
    an op that runs a computation holding a collective (a conditional, a loop, a call), and the next op in its
    computation's schedule that holds or is one, which does not read what the first wrote.

    XLA's CPU runtime starts a computation's collectives in schedule order but waits for an op's completion only
    where a later op reads a buffer it writes; a conditional counts as started before the collectives inside it
    run, so the next collective can start beside them (a collective op alone runs to its end before the next
    one starts). The CPU client has threads for one waiting collective per device, so two at once can starve
    each other and hang the step (`megajax.parallel.sharding.CollectiveOrder`)."""
    comps, *_ = _walk(hlo_text)
    holds: dict[str, bool] = {}

    def holds_collective(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False  # (a recursive call guard; HLO has no recursion)
            holds[comp] = any(_kind(op) or (op in _NESTING and any(holds_collective(c) for c, _, _ in
                                                                     _callees(op, rest)))
                              for _, _, op, rest in comps.get(comp, ()))
        return holds[comp]

    out = []
    for comp, ops in comps.items():
        names = {name for name, *_ in ops}
        # operands only: control predecessors order XLA's schedule, not the CPU runtime
        reads = {name: set(re.findall(r"%([\w.\-]+)", re.sub(r"control-predecessors=\{[^}]*\}", "", rest))) & names
                 for name, _, _, rest in ops}

        def reads_from(later: str, earlier: str) -> bool:
            seen, stack = set(), [later]
            while stack:
                x = stack.pop()
                if x == earlier:
                    return True
                if x not in seen:
                    seen.add(x)
                    stack.extend(reads[x])
            return False

        marked = [(name, op in _NESTING) for name, _, op, rest in ops
                  if _kind(op) or (op in _NESTING and any(holds_collective(c) for c, _, _ in _callees(op, rest)))]
        out += [(comp, a, b) for (a, nested), (b, _) in zip(marked, marked[1:])
                if nested and not reads_from(b, a)]
    return out
