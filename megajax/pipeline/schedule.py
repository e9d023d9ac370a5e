"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B (Narayanan et al., SC21).

A schedule is built in plain NumPy, without JAX. Each pipeline rank gets Megatron's order of actions:
  1F1B         p - r - 1 warm-up forwards, then one forward one backward, then the remaining backwards
  interleaved  v model chunks per rank; forward k runs micro batch (k // (p v)) p + k % p on local chunk
               (k // p) % v (backwards the same with the chunk reversed); (p - r - 1) 2 + (v - 1) p
               warm-up forwards (capped at m v); needs m % p == 0
  GPipe        every forward, then every backward
Global chunk c = local chunk * p + rank holds layers [c L / (p v), (c + 1) L / (p v)).

A lock-step simulation turns the orders into a table: at every tick each rank runs its next action if
its inputs have arrived (sent during an earlier tick), else idles. Each tick ends with one send of an
activation to rank r + 1 and one of a gradient to rank r - 1. The simulation also assigns every message a
buffer slot on its receiver (one spare "trash" slot takes the ticks with nothing to keep), so the executor's
writes are unconditional and its buffers have a fixed size.

    python -m megajax.pipeline.schedule --schedule interleaved -p 4 -v 2 -m 8 [--png out.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

IDLE, FWD, BWD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tables are [ticks, p] int32 arrays; -1 where a field does not apply.

    kind        IDLE / FWD / BWD
    chunk       local chunk index (0 .. v-1) of the action
    micro       micro batch of the action
    act_slot    activation-buffer slot the action reads (its input, kept until its backward)
    grad_slot   gradient-buffer slot a backward reads
    recv_act    slot where the activation arriving at the end of the tick is written (trash: no arrival)
    recv_grad   slot where the arriving gradient is written
    """

    name: str
    p: int
    v: int
    m: int
    kind: np.ndarray
    chunk: np.ndarray
    micro: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int  # buffer sizes including the trash slot
    grad_slots: int

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def num_chunks(self) -> int:
        return self.p * self.v

    def global_chunk(self) -> np.ndarray:
        """[ticks, p] global chunk index of each action (-1 when idle)."""
        ranks = np.arange(self.p)[None, :]
        return np.where(self.kind == IDLE, -1, self.chunk * self.p + ranks)

    def bubble_fraction(self) -> float:
        """Idle ticks over busy ticks per rank (every rank has the same count): the paper's bubble
        time / ideal time, (p - 1) / m for 1F1B and (p - 1) / (v m) interleaved."""
        busy = 2 * self.m * self.v
        return (self.ticks - busy) / busy

    def in_flight(self) -> np.ndarray:
        """Peak number of micro batches (per chunk) whose forward ran and backward has not, per rank."""
        peak = np.zeros(self.p, int)
        for r in range(self.p):
            live = 0
            for t in range(self.ticks):
                live += int(self.kind[t, r] == FWD) - int(self.kind[t, r] == BWD)
                peak[r] = max(peak[r], live)
        return peak

    def sends(self) -> dict[str, int]:
        """Messages the schedule needs (activations forward, gradients backward) over all ranks."""
        g = self.global_chunk()
        fwd = int(np.sum((self.kind == FWD) & (g < self.num_chunks - 1)))
        bwd = int(np.sum((self.kind == BWD) & (g > 0)))
        return {"activations": fwd, "gradients": bwd}

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
        warm = min(p - r - 1, m)
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


def build(name: str, p: int, v: int = 1, m: int = 1) -> Schedule:
    """Simulates the rank orders in lock step and assigns buffer slots."""
    _check_layout(name, p, v, m)
    orders = [rank_order(name, p, v, m, r) for r in range(p)]
    chunks = p * v
    done: dict[tuple[int, int, int], int] = {}  # (kind, global chunk, micro) -> tick finished
    arrived_act: dict[tuple[int, int], int] = {}  # (global chunk, micro) -> slot on the chunk's rank
    arrived_grad: dict[tuple[int, int], int] = {}
    act_alloc = [_Slots() for _ in range(p)]
    grad_alloc = [_Slots() for _ in range(p)]
    ptr = [0] * p
    rows = []
    t = 0
    while any(ptr[r] < len(orders[r]) for r in range(p)):
        if t > 4 * (len(orders[0]) + p) * v + 16:
            raise RuntimeError(f"schedule {name} p={p} v={v} m={m} deadlocked")  # never for Megatron's orders
        row = {f: [-1] * p for f in ("kind", "chunk", "micro", "act_slot", "grad_slot", "recv_act", "recv_grad")}
        row["kind"] = [IDLE] * p
        finished = []
        for r in range(p):
            if ptr[r] >= len(orders[r]):
                continue
            kind, c, mb = orders[r][ptr[r]]
            g = c * p + r
            if kind == FWD:
                ready = g == 0 or done.get((FWD, g - 1, mb), t) < t
            else:
                ready = done.get((FWD, g, mb), t) < t and (g == chunks - 1 or done.get((BWD, g + 1, mb), t) < t)
            if not ready:
                continue
            ptr[r] += 1
            row["kind"][r], row["chunk"][r], row["micro"][r] = kind, c, mb
            if g > 0:
                row["act_slot"][r] = arrived_act[(g, mb)]
            if kind == BWD:
                if g > 0:
                    act_alloc[r].give(arrived_act.pop((g, mb)))
                if g < chunks - 1:
                    row["grad_slot"][r] = arrived_grad.pop((g, mb))
                    grad_alloc[r].give(row["grad_slot"][r])
            finished.append((kind, g, mb))
        for kind, g, mb in finished:  # messages sent at the end of the tick
            done[(kind, g, mb)] = t
            if kind == FWD and g < chunks - 1:
                dst = (g + 1) % p
                slot = act_alloc[dst].take()
                arrived_act[(g + 1, mb)] = slot
                row["recv_act"][dst] = slot
            if kind == BWD and g > 0:
                dst = (g - 1) % p
                slot = grad_alloc[dst].take()
                arrived_grad[(g - 1, mb)] = slot
                row["recv_grad"][dst] = slot
        rows.append(row)
        t += 1
    act_slots = max(a.size for a in act_alloc) + 1  # + the trash slot
    grad_slots = max(a.size for a in grad_alloc) + 1
    table = {f: np.array([row[f] for row in rows], np.int32) for f in rows[0]}
    table["recv_act"] = np.where(table["recv_act"] < 0, act_slots - 1, table["recv_act"])
    table["recv_grad"] = np.where(table["recv_grad"] < 0, grad_slots - 1, table["recv_grad"])
    return Schedule(name, p, v, m, act_slots=act_slots, grad_slots=grad_slots, **table)


def timeline(s: Schedule) -> str:
    """One line per rank: forwards as micro batch numbers, backwards in brackets-free letters, '.' idle.
    Chunk 0 forwards print as digits, chunk 1 as letters a.., backwards upper-case (like Figure 4)."""
    def cell(t, r):
        k, c, mb = s.kind[t, r], s.chunk[t, r], s.micro[t, r]
        if k == IDLE:
            return "  ."
        tag = f"{'F' if k == FWD else 'B'}{mb}" + (chr(ord("a") + c) if s.v > 1 else "")
        return f"{tag:>3}" if len(tag) <= 3 else tag

    lines = [f"rank {r}: " + " ".join(cell(t, r) for t in range(s.ticks)) for r in range(s.p)]
    return "\n".join(lines)


def save_png(s: Schedule, path: str) -> None:
    """A Figure-4-like picture: forwards light, backwards dark, one hue per chunk."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install matplotlib (or megajax[plot])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, s.ticks * 0.3), 0.5 * s.p + 1))
    hues = plt.get_cmap("tab10")
    for t in range(s.ticks):
        for r in range(s.p):
            k = s.kind[t, r]
            if k == IDLE:
                continue
            color = hues(int(s.chunk[t, r]) % 10)
            ax.add_patch(plt.Rectangle((t, s.p - 1 - r), 1, 1, color=color, alpha=0.45 if k == FWD else 0.95))
            ax.text(t + 0.5, s.p - 0.5 - r, str(s.micro[t, r]), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, s.ticks)
    ax.set_ylim(0, s.p)
    ax.set_yticks([s.p - 0.5 - r for r in range(s.p)], [f"rank {r}" for r in range(s.p)])
    ax.set_xlabel("tick")
    ax.set_title(f"{s.name} p={s.p} v={s.v} m={s.m}: bubble {s.bubble_fraction():.3f} "
                 f"(formula {(s.p - 1) / (s.v * s.m):.3f})")
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
