"""The executor's tick tables: a schedule (schedule.py) as the rows the executor's scan reads, NumPy only.

Per tick and rank, each action (F forward, R recompute, B backward, W zero_bubble's weight gradients, X an idle
tick's data-parallel reduction, G an idle tick's all-gather of weights from their optimizer shards) gets a kind:
where its chunk sits in the model (it picks the branch of the action's switch) or, for X and G, how many layers
it reduces or gathers. Ticks are grouped into segments (filling, steady, cool-down), each run by one scan whose
switches hold only the kinds it runs; segments after the filling go in tick pairs (the staggered lock step). The
audit reads the same plan to weigh the compiled program's branches (`branch_runs`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from megajax.config.model import ModelConfig
from megajax.parallel.pipeline import schedule as schedule_lib
from megajax.parallel.step_plan import StepPlan

# what an action does depends on where its chunk sits in the model: 0 none, 1 first, 2 middle, 3 last chunk;
# 4: a forward of the last chunk that keeps its residuals for the backward of the next tick (both the forward's kind
# and the recompute's, whose switch runs it: executor._tick)
NONE, FIRST, MID, LAST, LAST_KEEP = range(5)
# added to a backward's kind: the chunk's last backward on its rank, which reduces the chunk's gradients over the
# data ranks layer by layer (parallel.overlap_grad_reduce, on a rank with no idle tick after its last backward)
FINAL = 8
# added to a forward's kind: the chunk's first forward on its rank, which all-gathers the chunk's weights from their
# optimizer shards layer by layer (parallel.overlap_param_gather, on a rank with no idle tick before its first forward)
GATHER = 16
# the table columns a tick reads (the schedule's f_keep becomes the LAST_KEEP kind); x_first, g_first: the first of
# the layers (counted over the rank's chunks, chunk-major) an idle tick reduces (parallel.overlap_grad_reduce) or
# gathers (parallel.overlap_param_gather)
FIELDS = ("f_chunk", "f_micro", "f_slot", "f_grad_slot", "r_chunk", "r_micro", "r_slot", "b_chunk", "b_micro",
          "b_grad_slot", "w_chunk", "w_micro", "recv_act", "recv_grad", "x_first", "g_first")
# x: the data-parallel reduction of x_kind layers from x_first, in an idle tick after the rank's last backward;
# g: the all-gather of g_kind layers from g_first, in an idle tick before the rank's first forward
ACTIONS = ("f", "r", "b", "w", "x", "g")


def _position(global_chunk: np.ndarray, chunks: int) -> np.ndarray:
    out = np.full(global_chunk.shape, NONE, np.int32)
    out[global_chunk == 0] = FIRST
    out[(global_chunk > 0) & (global_chunk < chunks - 1)] = MID
    out[global_chunk == chunks - 1] = LAST
    return out


@dataclasses.dataclass(frozen=True)
class Segment:
    """Ticks [start, stop) run by one scan. roles: the staggered lock step (ticks go in pairs, even then odd
    from `start`'s parity); else every rank may run a forward and only activations move. f, r, b, w, x: the
    action kinds present (NONE always)."""

    start: int
    stop: int
    roles: bool
    parity: int  # of the segment's first tick in the schedule (the table here is padded)
    f: tuple[int, ...]
    r: tuple[int, ...]
    b: tuple[int, ...]
    w: tuple[int, ...]
    x: tuple[int, ...] = (NONE,)  # (the layer counts of the x action's reductions)
    g: tuple[int, ...] = (NONE,)  # (the layer counts of the g action's gathers)


def _busy(s) -> np.ndarray:
    """[ticks, p]: the ticks a rank computes something."""
    return (s.f_chunk >= 0) | (s.r_chunk >= 0) | (s.b_chunk >= 0) | (s.w_chunk >= 0)


def _runs(pool: list[int], n: int, shape, cap: int | None = None, late: bool = True):
    """n layers in near-equal runs over the ticks of `pool` (its first n ticks, or with `late` false its last
    n): (first layer, layer count) per tick of one rank. `cap`: the most layers a tick takes; the rest go to the
    spill tick, the pool's last (`late`: the schedule's end, where nothing waits for them) or first (its start)."""
    first, count = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
    used = pool[:n] if late else pool[-n:]
    sizes = np.diff(np.linspace(0, n, len(used) + 1).round().astype(int))
    if cap is not None and sizes.max() > cap:
        spill = pool[-1] if late else pool[0]
        if spill not in used:
            used, sizes = (used + [spill], np.append(sizes, 0)) if late else ([spill] + used, np.insert(sizes, 0, 0))
        sizes = np.minimum(sizes, cap)
        at = used.index(spill)
        sizes[at] = 0
        sizes[at] = n - sizes.sum()
    first[used], count[used] = np.cumsum(sizes) - sizes, sizes
    return first, count


def _reductions(s, lc: int, cap: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where parallel.overlap_grad_reduce reduces each rank's gradients (lc layers a chunk): (FINAL marks [ticks,
    p]: the chunk's last backward reduces it; x_first, x_kind [ticks, p]: an idle tick reduces x_kind layers from
    x_first). A rank with idle ticks after its last backward (the cool-down's waiting) reduces there, its v x lc
    layers split into near-equal runs, one per idle tick, so that each run overlaps the ticks the other ranks are
    still computing, at most `cap` layers a tick (the rest in its last idle tick, the schedule's last); a rank with
    none (rank 0: its last backward ends the schedule) reduces in its last backwards, under their compute."""
    busy = _busy(s)
    final = np.zeros(busy.shape, bool)
    x_first, x_kind = np.full(busy.shape, -1, np.int32), np.zeros(busy.shape, np.int32)
    for r in range(s.p):
        last = np.flatnonzero(s.b_chunk[:, r] >= 0)[-1]
        pool = [t for t in range(last + 1, s.ticks) if not busy[t, r]]
        if not pool:
            for c in range(s.v):
                final[np.flatnonzero(s.b_chunk[:, r] == c)[-1], r] = True
            continue
        x_first[:, r], x_kind[:, r] = _runs(pool, s.v * lc, s.ticks, cap)
    return final, x_first, x_kind


def _gathers(s, lc: int, cap: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where parallel.overlap_param_gather all-gathers each rank's weights from their optimizer shards, the
    mirror of `_reductions`: (GATHER marks [ticks, p]: the chunk's first forward gathers it; g_first, g_kind
    [ticks, p]). A rank with idle ticks before its first forward (the warm-up's waiting: rank r has r in 1F1B)
    gathers there, in near-equal runs, under the forwards the ranks before it compute, at most `cap` layers a tick
    (the rest in its first tick, the schedule's first); a rank with none (rank 0) gathers in each chunk's first
    forward, each layer's gather issued under the forward of the layer before."""
    busy = _busy(s)
    first_fwd = np.zeros(busy.shape, bool)
    g_first, g_kind = np.full(busy.shape, -1, np.int32), np.zeros(busy.shape, np.int32)
    for r in range(s.p):
        start = np.flatnonzero(s.f_chunk[:, r] >= 0)[0]
        pool = [t for t in range(start) if not busy[t, r]]
        if not pool:
            for c in range(s.v):
                first_fwd[np.flatnonzero(s.f_chunk[:, r] == c)[0], r] = True
            continue
        g_first[:, r], g_kind[:, r] = _runs(pool, s.v * lc, s.ticks, cap, late=False)
    return first_fwd, g_first, g_kind


@functools.lru_cache(maxsize=64)
def plan(name: str, p: int, v: int, m: int, reduce_layers: int = 0, gather_layers: int = 0,
         caps: tuple[int | None, int | None] = (None, None), reduce_every: bool = False):
    """(the schedule, its table padded to whole tick pairs per segment, its forward / recompute / backward
    kinds per (tick, rank), the segments). reduce_layers: the layers a chunk (parallel.overlap_grad_reduce on):
    where each rank reduces its gradients (`_reductions`): FINAL backwards, the x action's idle ticks.
    gather_layers: the same for parallel.overlap_param_gather (`_gathers`): GATHER forwards, the g action's.
    caps: the most layers an idle tick reduces and gathers (`tick_caps`). reduce_every (ZeRO-2: StepPlan.shard_grads):
    every backward reduces its chunk's gradients (FINAL), and no idle tick does."""
    s = schedule_lib.build(name, p, v, m)
    chunks = p * v
    nothing = (np.zeros(s.b_chunk.shape, bool), np.full(s.b_chunk.shape, -1, np.int32),
               np.zeros(s.b_chunk.shape, np.int32))
    final, x_first, x_kind = _reductions(s, reduce_layers, caps[0]) if reduce_layers else nothing
    if reduce_every:
        final, x_first, x_kind = s.b_chunk >= 0, nothing[1], nothing[2]
    first_fwd, g_first, g_kind = _gathers(s, gather_layers, caps[1]) if gather_layers else nothing
    tables = {**{k: getattr(s, k) for k in FIELDS if k not in ("x_first", "g_first")}, "x_first": x_first,
              "g_first": g_first}
    fg, rg, bg = s.global_chunk(s.f_chunk), s.global_chunk(s.r_chunk), s.global_chunk(s.b_chunk)
    wg = s.global_chunk(s.w_chunk)
    free = s.free_ticks
    fsend_any = np.any((fg >= 0) & (fg < chunks - 1), axis=1)
    last_fwd = int(s.ticks - np.argmax(fsend_any[::-1])) if fsend_any.any() else free
    steady_end = max(free, last_fwd)
    steady_end += (steady_end - free) % 2  # whole tick pairs, so that no idle tick splits an R from its B
    bounds = sorted({0, free, min(steady_end, s.ticks), s.ticks})
    idle = {k: (np.full(p, s.act_slots - 1 if k in schedule_lib.ACT_SLOT_FIELDS else
                        s.grad_slots - 1 if k in schedule_lib.GRAD_SLOT_FIELDS else
                        -1, np.int32)) for k in FIELDS}
    rows = {k: [] for k in FIELDS}
    kinds = {key: [] for key in ACTIONS}
    segments = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        roles = start >= free
        n = stop - start
        pad = n % 2 if roles else 0  # tick pairs: an idle tick completes an odd segment
        seg_start = len(rows["f_chunk"])
        for k in FIELDS:
            rows[k] += list(tables[k][start:stop]) + [idle[k]] * pad
        keep = (fg[start:stop] == chunks - 1) & (s.f_keep[start:stop] > 0)
        assert not (keep & (rg[start:stop] >= 0)).any(), "a tick keeps the last chunk's residuals or recomputes"
        for key, g in (("f", fg), ("r", rg), ("b", bg), ("w", wg)):
            kind = _position(g[start:stop], chunks)
            if key in ("r", "w"):  # a recompute or a weight gradient is the same for every chunk position
                kind = np.where(kind == NONE, NONE, MID)
            if key in ("f", "r"):  # the recompute's switch runs the forward that keeps its residuals
                kind = np.where(keep, LAST_KEEP, kind)
            if key == "f":
                kind = np.where(first_fwd[start:stop], kind | GATHER, kind)
            if key == "b":
                kind = np.where(final[start:stop], kind | FINAL, kind)
            kinds[key] += list(kind) + [np.zeros(p, np.int32)] * pad
        kinds["x"] += list(x_kind[start:stop]) + [np.zeros(p, np.int32)] * pad
        kinds["g"] += list(g_kind[start:stop]) + [np.zeros(p, np.int32)] * pad
        present = {key: tuple(sorted(set(np.ravel(kinds[key][seg_start:]).tolist()) | {NONE})) for key in kinds}
        segments.append(Segment(seg_start, seg_start + n + pad, roles, start % 2, present["f"], present["r"],
                                present["b"], present["w"], present["x"], present["g"]))
    table = {k: np.array(rows[k], np.int32) for k in FIELDS}
    return s, table, {k: np.array(val, np.int32) for k, val in kinds.items()}, tuple(segments)


LAST_RANK = "pipeline_last"  # the name scope of a conditional the last pipeline rank alone takes (vocab.Ranks.owned)


def scope(segment: int, tick: int) -> str:
    """The name scope of a tick's switches (`tick`: its place in the scan body, 0 or 1 for a pair of ticks): the
    compiled program keeps it in each conditional's op_name, where the audit finds it (`branch_runs`)."""
    return f"pipeline_s{segment}t{tick}"


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def tick_caps(step_plan: StepPlan, model: ModelConfig) -> tuple[int | None, int | None]:
    """The most layers an idle tick reduces and gathers, from parallel.overlap_comm_ratio (one layer's reduce-scatter
    of its gradient over its forward of one micro batch): a cool-down tick holds the others' recompute and backward
    of a chunk (3 forwards of its layers; an all-reduce moves twice a reduce-scatter's bytes), a warm-up tick their
    forward (the matmul weights are gathered in the compute dtype: half the bytes in bf16). (None, None): no cap
    (ratio 0)."""
    ratio = step_plan.overlap_comm_ratio
    if not ratio:
        return None, None
    reduce_bytes = 1 if step_plan.shard_optimizer else 2
    gather_bytes = _ITEMSIZE[model.compute_dtype] / _ITEMSIZE[model.param_dtype]
    layers = chunk_layers(step_plan)
    return int(3 * layers / (ratio * reduce_bytes)), int(layers / (ratio * gather_bytes))


def plan_of(step_plan: StepPlan, model: ModelConfig):
    """`plan` for a step's plan (its overlapped reductions and gathers as the StepPlan says)."""
    return plan(step_plan.schedule, step_plan.pipeline, step_plan.virtual_stages, step_plan.micro_batches,
                reduce_layers(step_plan), gather_layers(step_plan), tick_caps(step_plan, model))


def reduce_layers(step_plan: StepPlan) -> int:
    """`plan`'s reduce_layers for a step: the layers (scanned units) of a chunk when the step reduces the
    gradients inside the schedule (StepPlan.reduce_in_backward), else 0."""
    return chunk_layers(step_plan) if step_plan.reduce_in_backward else 0


def chunk_layers(step_plan: StepPlan) -> int:
    """The slots for layers (scanned units) of a pipeline chunk: its units, the most of any chunk with uneven stages
    (layout.py)."""
    return step_plan.stage_split.slots


def gather_layers(step_plan: StepPlan) -> int:
    """`plan`'s gather_layers for a step: the layers of a chunk when the step gathers the weights from their
    optimizer shards inside the schedule (StepPlan.gather_in_forward), else 0."""
    return chunk_layers(step_plan) if step_plan.gather_in_forward else 0


def in_backward_group(kinds, final: bool):
    """Whether backward kinds (an int, a NumPy or a JAX array) are in the group that adds to the accumulators
    (`final` False) or in the FINAL one that reduces (True): what `executor.backward` runs under one conditional."""
    return (kinds != NONE) & (((kinds & FINAL) > 0) == final)


def first_backward(kinds):
    """Whether backward kinds (an int, a NumPy or a JAX array) run the first chunk, whose input gradient goes into
    the embedding's backward."""
    return (kinds & ~FINAL) == FIRST


def embeds(kinds):
    """Whether forward kinds (an int, a NumPy or a JAX array) run the first chunk, whose input is the embedding."""
    return (kinds & ~GATHER) == FIRST


def runs_head(kinds):
    """Whether forward kinds (an int, a NumPy or a JAX array) run the last chunk, whose output goes into the head
    (under `executor._tick`'s conditional scope_h1)."""
    position = kinds & ~GATHER
    return (position == LAST) | (position == LAST_KEEP)


def backward_groups(kinds: tuple[int, ...]) -> tuple[bool, ...]:
    """The groups of a segment's backward kinds (`in_backward_group`) that `executor.backward` runs under one
    conditional each: the backwards that add to the accumulators (False) and the FINAL ones that reduce (True),
    those present."""
    return tuple(final for final in (False, True) if in_backward_group(np.asarray(kinds), final).any())


def branch_runs(step_plan: StepPlan, model: ModelConfig) -> dict[str, list[float]]:
    """For the audit: per switch of the executor ('<scope>_<action>'), how often each branch runs per visit
    of the switch, averaged over the pipeline ranks (the compiled program counts every branch of a conditional
    as taken; the schedule's table says which is). The backward's: how often it runs none, then each of its
    groups (`backward_groups`), group i under its own conditional named '<scope>_b<i>'; '<scope>_e': how often
    it does not and does run the first chunk, whose embedding backward runs under '<scope>_e1'; '<scope>_h': how
    often the forward does not and does run the last chunk, whose head runs under '<scope>_h1'; '<scope>_g': how
    often the gather runs none and each of its layer counts, count i under '<scope>_g<i>'; '<scope>_w': how often
    zero_bubble's W does not and does run, each of its layers under '<scope>_w1'. With the vocabulary
    over the pipeline (executor.py) every rank runs the embedding's lookup ('<scope>_l1'), its backward's
    ('<scope>_k1', '<scope>_t1') and the head where the first (last) rank's column says: those weigh by that
    column alone, and a conditional under LAST_RANK (the multi-token prediction modules' blocks) by the one rank
    of p that takes it."""
    if step_plan.pipeline == 1 or step_plan.schedule == "gpipe":
        return {}
    _, _, kinds, segments = plan_of(step_plan, model)
    vocab = step_plan.vocab_over_pipeline
    out = {LAST_RANK: [1 - 1 / step_plan.pipeline, 1 / step_plan.pipeline]} if vocab else {}
    for i, seg in enumerate(segments):
        step = 2 if seg.roles else 1
        for t in range(step):
            for key in ACTIONS:
                rows = kinds[key][seg.start + t:seg.stop:step]
                if key == "b":  # (the backward's conditionals: none, then each group's, executor.backward)
                    out[f"{scope(i, t)}_b"] = [float(np.mean(rows == NONE))] + [
                        float(np.mean(in_backward_group(rows, final))) for final in backward_groups(seg.b)]
                    first = float(np.mean(first_backward(rows)))  # (the embedding's backward)
                    out[f"{scope(i, t)}_e"] = [1 - first, first]
                    if vocab:  # (every rank's share of it, in rank 0's ticks)
                        first = float(np.mean(first_backward(rows[:, 0])))
                        out[f"{scope(i, t)}_k"] = out[f"{scope(i, t)}_t"] = [1 - first, first]
                    continue
                if key == "f" and any(runs_head(k) for k in seg.f):  # (the head, under '<scope>_h1')
                    head = float(np.mean(runs_head(rows[:, -1] if vocab else rows)))
                    out[f"{scope(i, t)}_h"] = [1 - head, head]
                if key == "f" and vocab and any(embeds(k) for k in seg.f):  # (the lookup, under '<scope>_l1')
                    look = float(np.mean(embeds(rows[:, 0])))
                    out[f"{scope(i, t)}_l"] = [1 - look, look]
                if key == "w":  # (W's layers each under a two-way conditional, '<scope>_w1': zero_bubble.py)
                    out[f"{scope(i, t)}_w"] = [float(np.mean(rows == NONE)), float(np.mean(rows != NONE))]
                    continue
                out[f"{scope(i, t)}_{key}"] = [float(np.mean(rows == k)) for k in getattr(seg, key)]
    return out
