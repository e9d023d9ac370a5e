"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B (Narayanan et al., SC21).

A schedule is built in plain NumPy, without JAX. Each pipeline rank gets Megatron's order of actions:
  1F1B         2 (p - r - 1) warm-up forwards, then one forward one backward, then the remaining backwards
  interleaved  v model chunks per rank; forward k runs micro batch (k // (p v)) p + k % p on local chunk
               (k // p) % v (backwards the same with the chunk reversed); (p - r - 1) 2 + (v - 1) p
               warm-up forwards (capped at m v); needs m % p == 0
  GPipe        every forward, then every backward
Global chunk c = local chunk * p + rank holds layers [c L / (p v), (c + 1) L / (p v)).

The executor runs in lock step: every tick ends with one send of activations to rank r + 1 and one of
gradients to rank r - 1, so a tick lasts as long as its slowest rank. A tick therefore holds up to one
forward AND one backward per rank, taken in the rank's order (1F1B's steady state is exactly one of each),
and every rank's tick costs about the same: with a backward twice a forward, that gives the paper's bubble
(p - 1) / (v m), which ticks of one action each (costing a forward on some ranks, a backward on others)
would not. One consequence: an activation needs a tick per hop, so the gradient of a micro batch comes
back to rank r 2 (p - r - 1) ticks after its forward, and 1F1B warms up with 2 (p - r - 1) forwards (as
Megatron's interleaved schedule does) instead of p - r - 1, or its steady state would idle every other
tick. In-flight micro batches stay bounded by the pipeline depth (2 p - 1 at most), never by m.
A lock-step simulation turns the orders into the table: an action runs when its inputs arrived
in an earlier tick (the last chunk's backward may follow its own forward in the same tick). It also gives
every message a buffer slot on its receiver (a spare "trash" slot takes ticks with nothing to keep), so the
executor's writes are unconditional and its buffers have a fixed size.

    python -m megajax.pipeline.schedule --schedule interleaved -p 4 -v 2 -m 8 [--png out.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

FWD, BWD = 1, 2
BWD_COST = 2.0  # a backward costs twice a forward (the paper's assumption, for bubble accounting)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tables are [ticks, p] int32 arrays, -1 where nothing runs (or no slot applies).

    f_chunk, f_micro   the forward of the tick: local chunk and micro batch
    f_slot             activation slot of the forward: its input arrived there (chunk > 0), and the forward
                       stashes there what its backward needs (the first chunk takes a fresh slot)
    b_chunk, b_micro   the backward of the tick (after the forward in the same tick)
    b_act_slot         activation slot of the backward's stash; freed by it
    b_grad_slot        gradient slot the backward reads (not the last chunk); freed by it
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
    b_chunk: np.ndarray
    b_micro: np.ndarray
    b_act_slot: np.ndarray
    b_grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int  # buffer sizes, including the trash slot
    grad_slots: int

    @property
    def ticks(self) -> int:
        return self.f_chunk.shape[0]

    @property
    def num_chunks(self) -> int:
        return self.p * self.v

    def global_chunk(self, local: np.ndarray) -> np.ndarray:
        """Global chunk index of a [ticks, p] table of local chunks (-1 stays -1)."""
        return np.where(local < 0, -1, local * self.p + np.arange(self.p)[None, :])

    def tick_costs(self, bwd_cost: float = BWD_COST) -> np.ndarray:
        """[ticks] duration of each tick in forward-chunk units: its slowest rank's work."""
        work = (self.f_chunk >= 0) * 1.0 + (self.b_chunk >= 0) * bwd_cost
        return work.max(axis=1) / self.v

    def bubble_fraction(self, bwd_cost: float = BWD_COST) -> float:
        """Step time over the ideal (every rank busy), minus one: the paper's bubble time / ideal time,
        (p - 1) / m for 1F1B and (p - 1) / (v m) interleaved."""
        ideal = self.m * (1.0 + bwd_cost)
        return float(self.tick_costs(bwd_cost).sum() / ideal - 1.0)

    def in_flight(self) -> np.ndarray:
        """Peak number of (chunk, micro batch) pairs whose forward ran and backward has not, per rank."""
        before = np.cumsum((self.f_chunk >= 0).astype(int) - (self.b_chunk >= 0).astype(int), axis=0)
        after_forward = before + (self.b_chunk >= 0)  # a tick's forward runs before its backward
        return after_forward.max(axis=0)

    def sends(self) -> dict[str, int]:
        """Messages the schedule needs (activations forward, gradients backward) over all ranks."""
        last = self.num_chunks - 1
        fg, bg = self.global_chunk(self.f_chunk), self.global_chunk(self.b_chunk)
        return {"activations": int(np.sum((fg >= 0) & (fg < last))), "gradients": int(np.sum(bg > 0))}

    def summary(self) -> dict:
        return {
            "schedule": self.name, "p": self.p, "v": self.v, "m": self.m, "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction(), "formula": (self.p - 1) / (self.v * self.m),
            "peak_in_flight_per_rank": self.in_flight().tolist(), "sends": self.sends(),
            "act_slots": self.act_slots, "grad_slots": self.grad_slots,
        }


def rank_order(name: str, p: int, v: int, m: int, r: int) -> list[tuple[int, int, int]]:
    """Megatron's action order for rank r: [(FWD|BWD, local chunk, micro batch), ...]."""
    if name == "gpipe":
        return [(FWD, 0, i) for i in range(m)] + [(BWD, 0, i) for i in range(m)]
    if name == "1f1b":
        warm = min(2 * (p - r - 1), m)  # lock-step ticks: see the module docstring
        fwd = [(FWD, 0, i) for i in range(m)]
        bwd = [(BWD, 0, i) for i in range(m)]
        steady = [a for i in range(m - warm) for a in (fwd[warm + i], bwd[i])]
        return fwd[:warm] + steady + bwd[m - warm:]
    if name == "interleaved":
        total = m * v

        def micro(k):
            return (k // (p * v)) * p + k % p

        fwd = [(FWD, (k // p) % v, micro(k)) for k in range(total)]
        bwd = [(BWD, v - 1 - (k // p) % v, micro(k)) for k in range(total)]
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        steady = [a for i in range(total - warm) for a in (fwd[warm + i], bwd[i])]
        return fwd[:warm] + steady + bwd[total - warm:]
    raise ValueError(f"unknown schedule {name!r}: use gpipe, 1f1b or interleaved")


def _check_layout(name: str, p: int, v: int, m: int) -> None:
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"pipeline sizes must be positive, got p={p} v={v} m={m}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"v={v} virtual stages need the interleaved schedule, not {name}")
    if name == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro batches m={m} to be a multiple of p={p}")


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
    """Lock-step execution of the rank orders: which actions run in which tick, and buffer slots."""

    FIELDS = ("f_chunk", "f_micro", "f_slot", "b_chunk", "b_micro", "b_act_slot", "b_grad_slot",
              "recv_act", "recv_grad")

    def __init__(self, name: str, p: int, v: int, m: int):
        self.p, self.chunks = p, p * v
        self.orders = [rank_order(name, p, v, m, r) for r in range(p)]
        self.ptr = [0] * p
        self.done: dict[tuple[int, int, int], int] = {}  # (kind, global chunk, micro) -> tick
        self.act_at: dict[tuple[int, int], int] = {}  # (global chunk, micro) -> slot on its rank
        self.grad_at: dict[tuple[int, int], int] = {}
        self.act_alloc = [_Slots() for _ in range(p)]
        self.grad_alloc = [_Slots() for _ in range(p)]

    def ready(self, kind: int, g: int, mb: int, t: int) -> bool:
        if kind == FWD:
            return g == 0 or self.done.get((FWD, g - 1, mb), t) < t
        own_forward = (FWD, g, mb) in self.done  # may be this very tick, on this rank
        return own_forward and (g == self.chunks - 1 or self.done.get((BWD, g + 1, mb), t) < t)

    def tick(self, t: int) -> dict[str, list[int]]:
        row = {f: [-1] * self.p for f in self.FIELDS}
        finished = []
        for r in range(self.p):
            actions = []
            while self.ptr[r] < len(self.orders[r]):
                kind, c, mb = self.orders[r][self.ptr[r]]
                g = c * self.p + r
                if kind in {a[0] for a in actions} or not self.ready(kind, g, mb, t):
                    break
                self.ptr[r] += 1
                self.done[(kind, g, mb)] = t
                actions.append((kind, c, g, mb))
            # The executor runs a tick's forward before its backward, whatever their order in the rank's
            # list (no dependency is broken by that): slots are taken and freed in that order too.
            for kind, c, g, mb in sorted(actions):
                finished.append((kind, g, mb))
                self._record(row, r, kind, c, g, mb)
        for kind, g, mb in finished:  # sends at the end of the tick
            if kind == FWD and g < self.chunks - 1:
                dst = (g + 1) % self.p
                self.act_at[(g + 1, mb)] = row["recv_act"][dst] = self.act_alloc[dst].take()
            if kind == BWD and g > 0:
                dst = (g - 1) % self.p
                self.grad_at[(g - 1, mb)] = row["recv_grad"][dst] = self.grad_alloc[dst].take()
        return row

    def _record(self, row, r, kind, c, g, mb) -> None:
        if kind == FWD:
            row["f_chunk"][r], row["f_micro"][r] = c, mb
            if g == 0:  # the first chunk's input is computed here (the embedding): stash it in a fresh slot
                self.act_at[(0, mb)] = self.act_alloc[r].take()
            row["f_slot"][r] = self.act_at[(g, mb)]
            return
        row["b_chunk"][r], row["b_micro"][r] = c, mb
        row["b_act_slot"][r] = self.act_at.pop((g, mb))
        self.act_alloc[r].give(row["b_act_slot"][r])
        if g < self.chunks - 1:
            row["b_grad_slot"][r] = self.grad_at.pop((g, mb))
            self.grad_alloc[r].give(row["b_grad_slot"][r])

    def finished(self) -> bool:
        return all(self.ptr[r] >= len(self.orders[r]) for r in range(self.p))


def build(name: str, p: int, v: int = 1, m: int = 1) -> Schedule:
    """Simulates the rank orders in lock step and assigns buffer slots."""
    _check_layout(name, p, v, m)
    sim = _Simulator(name, p, v, m)
    rows = []
    while not sim.finished():
        if len(rows) > 4 * (m * v + p) + 16:
            raise RuntimeError(f"schedule {name} p={p} v={v} m={m} deadlocked")  # never for Megatron's orders
        rows.append(sim.tick(len(rows)))
    act_slots = max(a.size for a in sim.act_alloc) + 1  # + the trash slot
    grad_slots = max(a.size for a in sim.grad_alloc) + 1
    table = {f: np.array([row[f] for row in rows], np.int32) for f in _Simulator.FIELDS}
    for field in ("recv_act", "f_slot", "b_act_slot"):  # nothing to read or keep: the trash slot
        table[field] = np.where(table[field] < 0, act_slots - 1, table[field])
    table["recv_grad"] = np.where(table["recv_grad"] < 0, grad_slots - 1, table["recv_grad"])
    return Schedule(name, p, v, m, act_slots=act_slots, grad_slots=grad_slots, **table)


def timeline(s: Schedule) -> str:
    """One line per rank, one cell per tick: 'F3' forward of micro batch 3, 'B1' backward, 'F3B1' both;
    with v > 1 a chunk letter follows each micro batch (a, b, ...); '.' is idle."""
    def part(kind, chunk, micro):
        return "" if chunk < 0 else f"{kind}{micro}" + (chr(ord("a") + chunk) if s.v > 1 else "")

    cells = [[part("F", s.f_chunk[t, r], s.f_micro[t, r]) + part("B", s.b_chunk[t, r], s.b_micro[t, r]) or "."
              for t in range(s.ticks)] for r in range(s.p)]
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"rank {r}: " + " ".join(c.rjust(width) for c in cells[r]) for r in range(s.p))


def save_png(s: Schedule, path: str) -> None:
    """A Figure-4-like picture in time units (a forward 1 / v, a backward 2 / v): forwards light,
    backwards dark, one hue per chunk; gaps are the bubble."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install matplotlib (or megajax[plot])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = s.tick_costs()
    starts = np.concatenate([[0.0], np.cumsum(costs)])
    fig, ax = plt.subplots(figsize=(max(6, starts[-1] * 0.35), 0.5 * s.p + 1.2))
    hues = plt.get_cmap("tab10")
    for t in range(s.ticks):
        for r in range(s.p):
            x, y = starts[t], s.p - 1 - r
            for kind, chunk, micro, width in ((FWD, s.f_chunk[t, r], s.f_micro[t, r], 1 / s.v),
                                              (BWD, s.b_chunk[t, r], s.b_micro[t, r], BWD_COST / s.v)):
                if chunk < 0:
                    continue
                ax.add_patch(plt.Rectangle((x, y), width, 1, facecolor=hues(int(chunk) % 10), edgecolor="white",
                                           alpha=0.45 if kind == FWD else 0.95))
                ax.text(x + width / 2, y + 0.5, str(micro), ha="center", va="center", fontsize=7)
                x += width
    ax.set_xlim(0, starts[-1])
    ax.set_ylim(0, s.p)
    ax.set_yticks([s.p - 0.5 - r for r in range(s.p)], [f"rank {r}" for r in range(s.p)])
    ax.set_xlabel("time (one forward of a whole stage = 1)")
    ax.set_title(f"{s.name} p={s.p} v={s.v} m={s.m}: bubble {s.bubble_fraction():.3f} "
                 f"(formula {(s.p - 1) / (s.v * s.m):.3f}); light = forward, dark = backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.pipeline.schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    parser.add_argument("-p", type=int, required=True, help="pipeline ranks")
    parser.add_argument("-v", type=int, default=1, help="virtual stages (model chunks) per rank")
    parser.add_argument("-m", type=int, required=True, help="micro batches")
    parser.add_argument("--png", help="also draw the timeline into this PNG file")
    args = parser.parse_args(argv)
    try:
        s = build(args.schedule, args.p, args.v, args.m)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(timeline(s))
    print(json.dumps(s.summary(), indent=2))
    if args.png:
        save_png(s, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
