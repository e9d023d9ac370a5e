"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B (Narayanan et al., SC21), zero bubble (Qi et
al., ICLR 2024).

A schedule is built in plain NumPy, without JAX. Each pipeline rank gets Megatron's order of actions:
  1F1B         p - r - 1 warm-up forwards, then one forward one backward, then the remaining backwards
  interleaved  v model chunks per rank, micro batches in groups of p (the last group takes the rest, so
               any m >= p works): forwards run group by group, each chunk in turn over the group's micro
               batches (backwards the same with the chunk order reversed); (p - r - 1) 2 + (v - 1) p
               warm-up forwards (capped at m v)
  GPipe        every forward, then every backward
  zero_bubble  1F1B's order (interleaved's with v > 1) with the backward split into B (the input
               gradient, sent at once) and W (the weight gradients), W run in the rank's next tick
Global chunk c = local chunk * p + rank holds layers [c L / (p v), (c + 1) L / (p v)).

The executor runs in lock step. 1F1B (and zero_bubble with v = 1) stagger roles by rank: on ticks where t + r
is even rank r may run a forward (F) and the recompute (R) of the backward it runs next, on odd ticks that
backward (B, input and weight gradients from R's residuals). F + R and B each cost about two forwards, so every
tick costs the same on every rank, and a message needs one tick per hop in either direction: the forward's
activation goes to rank r + 1 while rank r + 1, in its backward tick, sends a gradient to rank r (one ppermute
of swaps). So a micro batch's gradient is back at rank r 2 (p - r - 1) + 1 ticks after its forward, during
which the rank ran p - r - 1 more forwards: Megatron's p - r in flight. The last chunk's forward keeps its own
residuals (no separate recompute) and runs the head's forward and backward once; a chunk's stash is its input
alone, freed by its recompute.
With v > 1 (interleaved, and zero_bubble's interleaved orders) every tick ends with messages both ways over the
ring (two ppermutes: activations to r + 1, gradients to r - 1), so a rank may run any action in any tick; an
interleaved tick is Megatron's step: B, then the recompute of the rank's next backward (replacing the residuals
B read), then F. Roles would not do here: Megatron's (v - 1) p + 2 (p - r - 1) warm-up forwards outnumber the
ticks before the first gradient comes back, and with roles the rest would run every other tick only, as would
every cool-down backward. The rank holds Megatron's warm-up + 1 in flight.
Bubble (F 1, R 1, B 2 units): 1F1B below (p - 1) / m (the last stage skips the recompute); interleaved below the
paper's (p - 1) / (v m) for every p, v and m a multiple of p (the recompute runs while the gradient it waits
for is on its way, where the paper counts it on the critical path; tests/test_schedule.py checks p 2-8, v 2-4,
m p-4p); with a short last group of micro batches (m not a multiple of p, which Megatron rejects) above it,
never above 1F1B's.
zero_bubble (after Qi et al.) keeps this table and splits each backward: B computes the input gradient
(and the small parameters' gradients) and sends it, W computes the weight gradients at the start of the
rank's next tick, before that tick's recompute replaces the residuals it reads. The gradient that goes back
waits only for B, so in the cool-down the gradients reach the first stage sooner, and each W fills time in
which the rank waited for a message (bubble (p - 1) / (2 m) or less with unit costs, v = 1). Memory: 1F1B's,
plus each weight matmul's output gradient of one chunk between B and W. With v > 1, W between a backward and
the next recompute leaves a rank one backward every other tick, where interleaved runs one every tick: in this
accounting interleaved zero_bubble loses to interleaved, at unit costs and at the H100's.
A lock-step simulation turns the orders into the table: an action runs in a tick it may run in (its role, or
any with v > 1) when its inputs arrived in an earlier tick; R runs in the tick before its B (with v > 1 after
the rank's B of that tick, zero_bubble's not in a tick with a B), once the gradient B needs is there or on its
way. It also gives every message a buffer slot on its receiver (a spare "trash" slot takes ticks with nothing
to keep), so the executor's writes are unconditional and its buffers have a fixed size.

Time (`Schedule.step_time`): the executor's ticks end with ppermutes between pairs of ranks, and a send /
receive waits only for its two ranks (NCCL's point-to-point), so a rank's tick ends when it and the ranks it
exchanges with in that tick are done ("pairs", the accounting used for the bubble). "ticks" is the bound of a
global lock step, every tick as long as its slowest rank.
Uneven stages (config.pipeline_split: Megatron's decoder_first / last_pipeline_num_layers, or its accounting of
the embedding and the loss as layers): `Costs` with the layers of each chunk, and the embedding's and head's
costs in layers, charges each action its chunk's layers. The bubble is then measured against the critical path,
the busiest rank's work (`Schedule.ideal`): what the schedule adds to the shortest step the split allows.

    megajax schedule --schedule interleaved -p 4 -v 2 -m 8 [--png out.png]
    megajax schedule -p 16 -m 64 --model llama3.1-405b --account-for-embedding --account-for-loss
"""

from __future__ import annotations

import dataclasses

import numpy as np

FWD, BWD = 1, 2
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
SYNCS = ("pairs", "ticks")  # the time accountings of `Schedule.step_time`
# the table columns that name a slot of the activation or the gradient buffer (the trash slot when idle)
ACT_SLOT_FIELDS = ("recv_act", "f_slot", "r_slot")
GRAD_SLOT_FIELDS = ("recv_grad", "f_grad_slot", "b_grad_slot")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Action costs for the time accounting. The defaults are the papers': a recompute is a forward, the whole
    backward two, split into an input and a weight gradient of one each. `scripts/bench_split_backward.py`
    measures them (H100, Llama 4096 wide, cuDNN attention: b 2.61, b_input 1.86, w 0.94).
    Without `layers` they are per chunk, every chunk alike. With `layers` (the transformer layers of each global
    chunk, `config.pipeline_split(...).layers`) they are per layer and an action on chunk c costs layers[c] of
    them, plus `embed` and `head` (the embedding, and the output layer with the loss, in layers' forwards) on the
    first and the last chunk: the embedding's forward in chunk 0's F and its backward in chunk 0's B, the head's
    forward and backward in the last chunk's F (where the executor runs both); their backwards cost b / f times
    their forwards, as a layer's."""

    f: float = 1.0
    r: float = 1.0
    b: float = 2.0  # the fused backward (input and weight gradients)
    w: float = 1.0
    b_input: float | None = None  # the split backward's input gradient: b - w unless given
    layers: tuple[float, ...] | None = None  # per global chunk c = local chunk * p + rank
    embed: float = 0.0
    head: float = 0.0

    def __post_init__(self):
        if self.b_input is None:
            object.__setattr__(self, "b_input", self.b - self.w)
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.layers is None and (self.embed or self.head):
            raise ValueError("embedding and head costs are in layers' forwards: give the layers per chunk too")

    def per_chunk(self, p: int) -> dict[str, np.ndarray]:
        """Per global chunk, in units of one forward of an average stage (sum(layers) / p layers): each action's
        cost, "b" the fused backward, "b_input" the split one's input gradient (`layers` required)."""
        n = np.asarray(self.layers, float)
        unit = n.sum() / p
        first, last = np.arange(n.size) == 0, np.arange(n.size) == n.size - 1
        out = {"f": n * self.f + first * self.embed * self.f + last * self.head * (self.f + self.b), "r": n * self.r,
               "b": n * self.b + first * self.embed * self.b, "b_input": n * self.b_input + first * self.embed * self.b,
               "w": n * self.w}
        return {k: val / unit for k, val in out.items()}


def free_sends(name: str, v: int) -> bool:
    """Whether the schedule's ticks send activations forward and gradients backward on every rank (two
    ppermutes a tick), so that any rank may run a forward or a backward in any tick: the schedules with a
    ring of chunks (v > 1). Else the staggered roles, one direction per rank and tick."""
    return v > 1 and name in ("interleaved", "zero_bubble")


def perm_pairs(p: int, v: int, roles: bool, parity: int) -> list[list[tuple[int, int]]]:
    """The ppermutes that end a tick: a list of (source, destination) pair lists. Without roles, activations
    go to r + 1. With roles and v > 1 (`free_sends`), every rank sends both ways, activations over the ring to
    r + 1, then gradients to r - 1. With roles and v = 1, ranks with (parity + r) even send activations
    forward, the others gradients back; one ppermute when that is a permutation, else one per direction. The
    wrap-around pair only when v > 1."""
    ring = v > 1
    if not roles:
        return [[(r, (r + 1) % p) for r in range(p) if ring or r + 1 < p]]
    if ring:
        return [[(r, (r + 1) % p) for r in range(p)], [(r, (r - 1) % p) for r in range(p)]]
    fwd = [(r, (r + 1) % p) for r in range(p) if (parity + r) % 2 == 0 and (ring or r + 1 < p)]
    bwd = [(r, (r - 1) % p) for r in range(p) if (parity + r) % 2 == 1 and (ring or r > 0)]
    if len({d for _, d in fwd + bwd}) == len(fwd + bwd):
        return [fwd + bwd] if fwd + bwd else []
    return [fwd, bwd]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tables are [ticks, p] int32 arrays, -1 where nothing runs (or no slot applies).

    f_chunk, f_micro   the forward of the tick: local chunk and micro batch
    f_slot             activation slot of the forward's input (the first chunk writes its embedding into a
                       free slot); the input stays there as the stash until the recompute reads it
    f_keep             1: the forward keeps its residuals for the backward of the next tick (the last chunk,
                       when its backward comes next), instead of a separate recompute
    f_grad_slot        last chunk: the gradient slot the head's backward writes the output gradient to
    r_chunk, r_micro   the recompute of the tick: the backward of the next tick, recomputed from its stash
    r_slot             activation slot of that stash; freed by the recompute
    b_chunk, b_micro   the backward of the tick, from the residuals the previous tick made (zero_bubble: the
                       input gradient only)
    b_grad_slot        gradient slot the backward reads; freed by it
    w_chunk, w_micro   zero_bubble: the weight gradient of the rank's backward of the previous tick, run first
                       in the tick (-1 everywhere for the others)
    recv_act           slot the activation arriving at the end of the tick is written to
    recv_grad          slot for the arriving gradient
    Slot fields with nothing to read or keep point at the trash slot (the last one).
    """

    name: str
    p: int
    v: int
    m: int
    f_chunk: np.ndarray
    f_micro: np.ndarray
    f_slot: np.ndarray
    f_keep: np.ndarray
    f_grad_slot: np.ndarray
    r_chunk: np.ndarray
    r_micro: np.ndarray
    r_slot: np.ndarray
    b_chunk: np.ndarray
    b_micro: np.ndarray
    b_grad_slot: np.ndarray
    w_chunk: np.ndarray
    w_micro: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int  # buffer sizes, including the trash slot
    grad_slots: int
    free_ticks: int = 0  # the first ticks, before any backward: roles not yet kept, only activations move

    @property
    def ticks(self) -> int:
        return self.f_chunk.shape[0]

    @property
    def num_chunks(self) -> int:
        return self.p * self.v

    def global_chunk(self, local: np.ndarray) -> np.ndarray:
        """Global chunk index of a [ticks, p] table of local chunks (-1 stays -1)."""
        return np.where(local < 0, -1, local * self.p + np.arange(self.p)[None, :])

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into the input gradient (B) and the weight gradient (W)."""
        return self.name == "zero_bubble"

    def work(self, costs: Costs | None = None) -> np.ndarray:
        """[ticks, p] what each rank computes in each tick, in units of one forward of a whole stage (with
        per-chunk costs an average stage: `Costs.per_chunk`)."""
        c = costs or Costs()
        b = c.b_input if self.split_backward else c.b
        if c.layers is None:
            return ((self.f_chunk >= 0) * c.f + (self.r_chunk >= 0) * c.r + (self.b_chunk >= 0) * b
                    + (self.w_chunk >= 0) * c.w) / self.v
        per = self._per_chunk(c)
        return (self._charge(self.f_chunk, per["f"]) + self._charge(self.r_chunk, per["r"])
                + self._charge(self.b_chunk, per["b_input" if self.split_backward else "b"])
                + self._charge(self.w_chunk, per["w"]))

    def _per_chunk(self, c: Costs) -> dict[str, np.ndarray]:
        if len(c.layers) != self.num_chunks:
            raise ValueError(f"costs for {len(c.layers)} chunks, but p={self.p} x v={self.v} = {self.num_chunks}")
        return c.per_chunk(self.p)

    def _charge(self, local: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """[ticks, p]: cost[global chunk] where a [ticks, p] table of local chunks runs one, else 0."""
        g = self.global_chunk(local)
        return np.where(g >= 0, cost[np.maximum(g, 0)], 0.0)

    def ideal(self, costs: Costs | None = None) -> float:
        """The step with no bubble, m (f + r + b) with every chunk alike: a recompute and a fused backward for
        every micro batch (full recomputation, as the executor runs). With per-chunk costs, the busiest rank's
        work as the table runs it (forwards, recomputes, backwards counted fused: zero_bubble's split costs
        show as bubble), which no schedule can beat: the critical path, as Megatron's uneven splits are
        judged. Both agree for equal chunks and p > 1 (the busiest rank never holds the last chunk, the one
        whose recompute the table skips)."""
        c = costs or Costs()
        if c.layers is None:
            return self.m * (c.f + c.r + c.b)
        per = self._per_chunk(c)
        busy = self._charge(self.f_chunk, per["f"]) + self._charge(self.r_chunk, per["r"]) + self._charge(
            self.b_chunk, per["b"])
        return float(busy.sum(axis=0).max())

    def exchanges(self, t: int) -> list[tuple[int, int]]:
        """The (source, destination) pairs of the ppermutes that end tick t."""
        roles = t >= self.free_ticks and self.name != "gpipe"
        return [pair for pairs in perm_pairs(self.p, self.v, roles, t % 2) for pair in pairs]

    def clock(self, costs: Costs | None = None, sync: str = "pairs") -> np.ndarray:
        """[ticks + 1, p] when each rank starts each tick (the last row: when it is done), in units of one
        forward of a whole stage. sync "pairs": a rank's tick ends when it and the ranks it sends to or
        receives from in that tick are done (a send / receive pair waits for its two ranks only, as NCCL's
        point-to-point does); "ticks": a global lock step, every tick as long as its slowest rank (an upper
        bound)."""
        work = self.work(costs)
        if sync not in SYNCS:
            raise ValueError(f"unknown sync {sync!r}: use {' or '.join(SYNCS)}")
        out = np.zeros((self.ticks + 1, self.p))
        for t in range(self.ticks):
            done = out[t] + work[t]
            out[t + 1] = done
            if sync == "ticks":
                out[t + 1] = done.max()
            for src, dst in self.exchanges(t) if sync == "pairs" else ():  # (a pair waits for its two ranks)
                out[t + 1, src] = max(out[t + 1, src], done[dst])
                out[t + 1, dst] = max(out[t + 1, dst], done[src])
        return out

    def step_time(self, costs: Costs | None = None, sync: str = "pairs") -> float:
        """The step's time in units of one forward of a whole stage (see `clock`)."""
        return float(self.clock(costs, sync)[-1].max())

    def bubble_fraction(self, costs: Costs | None = None, sync: str = "pairs") -> float:
        """Step time over the ideal (`ideal`: the busiest rank's work), minus one: the paper's bubble time /
        ideal time, (p - 1) / m for 1F1B, (p - 1) / (v m) interleaved. With uneven stages the ideal is the
        critical path's: a step can be no shorter than the busiest rank's work, so the bubble is what the
        schedule adds to that, not the lighter ranks' idle time."""
        c = costs or Costs()
        return self.step_time(c, sync) / self.ideal(c) - 1.0

    def in_flight(self) -> np.ndarray:
        """Peak number of (chunk, micro batch) pairs whose forward ran and backward has not, per rank."""
        return np.cumsum((self.f_chunk >= 0).astype(int) - (self.b_chunk >= 0).astype(int), axis=0).max(axis=0)

    def sends(self) -> dict[str, int]:
        """Messages the schedule needs (activations forward, gradients backward) over all ranks."""
        last = self.num_chunks - 1
        fg, bg = self.global_chunk(self.f_chunk), self.global_chunk(self.b_chunk)
        return {"activations": int(np.sum((fg >= 0) & (fg < last))), "gradients": int(np.sum(bg > 0))}

    def summary(self, costs: Costs | None = None) -> dict:
        out = {
            "schedule": self.name, "p": self.p, "v": self.v, "m": self.m, "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction(costs), "bubble_lock_step": self.bubble_fraction(costs, "ticks"),
            "formula": formula(self.name, self.p, self.v, self.m),
            "peak_in_flight_per_rank": self.in_flight().tolist(), "sends": self.sends(),
            "act_slots": self.act_slots, "grad_slots": self.grad_slots,
        }
        if costs is not None and costs.layers is not None:  # uneven stages: the time per rank
            step = self.step_time(costs)
            out.update({"layers_per_chunk": list(costs.layers), "embed_cost": costs.embed, "head_cost": costs.head,
                        "work_per_rank": self.work(costs).sum(axis=0).round(4).tolist(), "ideal": self.ideal(costs),
                        "step_time": step, "idle_share_of_step": 1.0 - self.ideal(costs) / step})
        return out


def formula(name: str, p: int, v: int, m: int) -> float:
    """The bubble fraction the papers give: (p - 1) / (v m) (Narayanan et al.; GPipe and 1F1B with v = 1),
    (p - 1) / (2 v m) for zero_bubble (Qi et al.'s ZB-H1 with unit costs)."""
    return (p - 1) / (2 * v * m) if name == "zero_bubble" else (p - 1) / (v * m)


def interleaved_table(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """Megatron's interleaved order of (micro batch, local chunk) for the forwards: micro batches in groups
    of p (the last one takes what is left), within a group every chunk in turn over its micro batches."""
    return [(mb, c) for lo in range(0, m, p) for c in range(v) for mb in range(lo, min(lo + p, m))]


def rank_queues(name: str, p: int, v: int, m: int, r: int) -> tuple[list, list, int]:
    """Megatron's orders for rank r: (forwards [(local chunk, micro batch)], backwards [...], the most
    micro batches the rank may hold in flight). GPipe holds all m and starts no backward before its last
    forward. zero_bubble: 1F1B's orders, interleaved's with v > 1."""
    if name == "zero_bubble":
        name = "interleaved" if v > 1 else "1f1b"
    if name == "gpipe":
        return [(0, i) for i in range(m)], [(0, i) for i in range(m)], m
    if name == "1f1b":
        return [(0, i) for i in range(m)], [(0, i) for i in range(m)], min(p - r, m)
    if name == "interleaved":
        table = interleaved_table(p, v, m)
        return [(c, mb) for mb, c in table], [(v - 1 - c, mb) for mb, c in table], interleaved_depth(p, v, m, r)
    raise ValueError(f"unknown schedule {name!r}: use {', '.join(SCHEDULES)}")


def interleaved_depth(p: int, v: int, m: int, r: int) -> int:
    """In-flight bound of the interleaved schedule on rank r: Megatron's (p - r - 1) 2 + (v - 1) p warm-up
    forwards plus the steady state's forward before its backward, at most m v."""
    return max(1, min((p - r - 1) * 2 + (v - 1) * p + 1, m * v))


def _check_layout(name: str, p: int, v: int, m: int) -> None:
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline sizes must be positive, got p={p} v={v} m={m}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use {', '.join(SCHEDULES)}")
    if name not in ("interleaved", "zero_bubble") and v != 1:
        raise ValueError(f"v={v} virtual stages need the interleaved or zero_bubble schedule, not {name}")
    if v > 1 and p > 1 and m < p:
        raise ValueError(f"{name} with v={v} chunks per rank needs at least p={p} micro batches, got m={m}")


class _Slots:
    """Free-list slot allocator for one buffer on one rank."""

    def __init__(self):
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


class _Simulator:
    """Lock-step execution of the rank orders: which actions run in which tick, and buffer slots. `free`: messages
    move both ways in every tick, so a rank may run a forward or a backward in any tick (interleaved and v > 1);
    else in the staggered roles (module docstring). `fused`: a backward and the next backward's recompute may share
    a tick (not zero_bubble, whose weight gradient reads the backward's residuals in the next tick)."""

    FIELDS = ("f_chunk", "f_micro", "f_slot", "f_keep", "f_grad_slot", "r_chunk", "r_micro", "r_slot",
              "b_chunk", "b_micro", "b_grad_slot", "w_chunk", "w_micro", "recv_act", "recv_grad")

    def __init__(self, name: str, p: int, v: int, m: int):
        self.p, self.chunks, self.gpipe = p, p * v, name == "gpipe"
        self.free = free_sends(name, v)
        self.fused = self.free and name != "zero_bubble"
        queues = [rank_queues(name, p, v, m, r) for r in range(p)]
        self.fwd = [q[0] for q in queues]
        self.bwd = [q[1] for q in queues]
        self.depth = [q[2] for q in queues]
        self.fptr, self.bptr = [0] * p, [0] * p
        self.done: dict[tuple[int, int, int], int] = {}  # (kind, global chunk, micro) -> tick
        self.prepared = [None] * p  # per rank: the (global chunk, micro) whose residuals the last tick made
        self.roles = False  # whether ranks keep to their tick roles yet (see tick)
        self.free_ticks = 0
        self.act_at: dict[tuple[int, int], int] = {}  # (global chunk, micro) -> slot on its rank
        self.grad_at: dict[tuple[int, int], int] = {}
        self.act_alloc = [_Slots() for _ in range(p)]
        self.grad_alloc = [_Slots() for _ in range(p)]

    def _head(self, queue, ptr, r):
        if ptr[r] >= len(queue[r]):
            return None
        c, mb = queue[r][ptr[r]]
        return c, c * self.p + r, mb

    def tick(self, t: int) -> dict[str, list[int]]:
        row = {f: [-1] * self.p for f in self.FIELDS}
        sends = []
        prepared = [None] * self.p
        forward_role = [(t + r) % 2 == 0 for r in range(self.p)]
        # backwards first: their gradient sends decide which recomputes may run
        for r in range(self.p):
            if self.free or not forward_role[r]:
                self._backward(r, t, row, sends)
        # Until the first recompute, nothing goes backwards: every rank may run a forward in every tick
        # (the pipeline fills at one hop per tick); from then on with roles only in ticks of its forward role.
        for r in range(self.p):
            if self.free or forward_role[r] or not self.roles:
                self._forward(r, t, row, sends)
            if (self.fused or row["b_chunk"][r] < 0) if self.free else forward_role[r]:
                prepared[r] = self._recompute(r, row, sends)
        self.free_ticks += not self.roles
        self.roles = self.roles or any(x is not None for x in prepared)
        for kind, g, mb in sends:  # at the end of the tick
            dst = g % self.p
            if kind == FWD:
                self.act_at[(g, mb)] = row["recv_act"][dst] = self.act_alloc[dst].take()
            else:
                self.grad_at[(g, mb)] = row["recv_grad"][dst] = self.grad_alloc[dst].take()
        self.prepared = prepared
        return row

    def _backward(self, r, t, row, sends) -> None:
        """Rank r's next backward, if the last tick made its residuals."""
        nxt = self._head(self.bwd, self.bptr, r)
        if not nxt or self.prepared[r] != nxt[1:]:
            return
        c, g, mb = nxt
        self.bptr[r] += 1
        self.done[(BWD, g, mb)] = t
        row["b_chunk"][r], row["b_micro"][r] = c, mb
        row["b_grad_slot"][r] = self.grad_at.pop((g, mb))
        self.grad_alloc[r].give(row["b_grad_slot"][r])
        if g > 0:
            sends.append((BWD, g - 1, mb))

    def _forward(self, r, t, row, sends) -> None:
        """Rank r's next forward, if its input arrived and the rank holds fewer than its depth in flight."""
        nxt = self._head(self.fwd, self.fptr, r)
        in_flight = self.fptr[r] - self.bptr[r]
        if not nxt or in_flight >= self.depth[r] or (nxt[1] > 0 and self.done.get((FWD, nxt[1] - 1, nxt[2]), t) >= t):
            return
        c, g, mb = nxt
        self.fptr[r] += 1
        self.done[(FWD, g, mb)] = t
        row["f_chunk"][r], row["f_micro"][r] = c, mb
        if g == 0:  # the first chunk's input is computed here (the embedding): a fresh slot
            self.act_at[(0, mb)] = self.act_alloc[r].take()
        row["f_slot"][r] = self.act_at[(g, mb)]
        if g < self.chunks - 1:
            sends.append((FWD, g + 1, mb))
        else:  # the head's backward starts the gradient here
            self.grad_at[(g, mb)] = row["f_grad_slot"][r] = self.grad_alloc[r].take()

    def _recompute(self, r, row, sends) -> tuple[int, int] | None:
        """The recompute of rank r's next backward (its residuals for the next tick), once its forward ran and
        the gradient it needs is there or on its way: (global chunk, micro), or None."""
        nxt = self._head(self.bwd, self.bptr, r)
        if not nxt or (self.gpipe and self.fptr[r] < len(self.fwd[r])):
            return None
        c, g, mb = nxt
        if (FWD, g, mb) not in self.done or not ((g, mb) in self.grad_at or (BWD, g, mb) in sends):
            return None
        slot = self.act_at.pop((g, mb))
        if row["f_chunk"][r] == c and row["f_micro"][r] == mb:  # its own forward keeps the residuals
            row["f_keep"][r] = 1
        else:
            row["r_chunk"][r], row["r_micro"][r], row["r_slot"][r] = c, mb, slot
        self.act_alloc[r].give(slot)
        return g, mb

    def finished(self) -> bool:
        return all(self.bptr[r] >= len(self.bwd[r]) for r in range(self.p))


def build(name: str, p: int, v: int = 1, m: int = 1) -> Schedule:
    """Simulates the rank orders in lock step and assigns buffer slots; zero_bubble then runs each
    backward's weight gradient in the rank's next tick (one more tick after the last backward)."""
    _check_layout(name, p, v, m)
    sim = _Simulator(name, p, v, m)
    rows = []
    while not sim.finished():
        if len(rows) > 8 * (m * v + p) + 16:
            raise RuntimeError(f"schedule {name} p={p} v={v} m={m} deadlocked")  # never for Megatron's orders
        rows.append(sim.tick(len(rows)))
    if name == "zero_bubble":
        rows.append({f: [-1] * p for f in _Simulator.FIELDS})
        for before, row in zip(rows[:-1], rows[1:]):
            row["w_chunk"], row["w_micro"] = list(before["b_chunk"]), list(before["b_micro"])
        if all(c < 0 for c in rows[-1]["w_chunk"]):
            rows.pop()
    act_slots = max(a.size for a in sim.act_alloc) + 1  # + the trash slot
    grad_slots = max(a.size for a in sim.grad_alloc) + 1
    table = {f: np.array([row[f] for row in rows], np.int32) for f in _Simulator.FIELDS}
    for field in ACT_SLOT_FIELDS:  # nothing to read or keep: the trash slot
        table[field] = np.where(table[field] < 0, act_slots - 1, table[field])
    for field in GRAD_SLOT_FIELDS:
        table[field] = np.where(table[field] < 0, grad_slots - 1, table[field])
    table["f_keep"] = np.maximum(table["f_keep"], 0)
    return Schedule(name, p, v, m, act_slots=act_slots, grad_slots=grad_slots, free_ticks=sim.free_ticks, **table)
