"""Where a run's wall time went: the goodput ledger, and `python -m megajax.goodput RUN_DIR`.

Every process of a run keeps a ledger of its wall time by kind, from the moment the process started, in
contiguous segments (each moment is in exactly one kind):
  startup     the process's start to the step's compile, less the restore: imports, jax.distributed, the mesh,
              the data indices, the initial weights
  restore     reading the checkpoint the run resumes from
  compile     compiling the train step
  data        waiting for the next batch
  step        training steps (their dispatch and the waits on the device between them)
  recomputed  steps trained again after a restart: an earlier attempt had trained them, after its last checkpoint
  eval        evaluation on the validation split
  checkpoint  the blocking part of checkpoint saves
  other       the rest: log lines, the last checkpoint's background write, shutdown
Useful training is `step`; goodput is its share of the wall time.

Each process writes its ledger to <output_dir>/goodput/attempt-<A>-process-<i>.json (replaced atomically) at every
log step, checkpoint and at the end, so a process killed with kill -9 loses at most the time since its last write.
A is the start time of the attempt's process 0 (in ms), the same on every process of the attempt. The command reads
every attempt of the run, counts the time between one attempt's last write and the next one's start as `down`
(a killed attempt's unwritten tail, the wait for the restart), and prints the table over all of them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

KINDS = ("startup", "restore", "compile", "data", "step", "recomputed", "eval", "checkpoint", "other")
DOWN = "down"  # between attempts (the command's, never a process's)
FILE = "attempt-{attempt}-process-{process}.json"


def process_start_time() -> float:
    """When this process started (Unix seconds): its age from Linux's /proc (to 10 ms), else now."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started / ticks)
    except (OSError, ValueError, IndexError):
        return time.time()


class Ledger:
    """One process's wall time by kind (KINDS), in contiguous segments from `start`; `switch` ends the open segment
    and opens one of another kind. Thread-safe: the watchdog reads the open segment from another thread."""

    def __init__(self, start: float | None = None, clock=time.time):
        self.clock = clock
        self.start = process_start_time() if start is None else start
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.kind, self.since = "startup", self.start
        self.step = 0  # the last step completed (dispatched and its predecessor finished)
        self.first_step = None  # the step this attempt started from
        self.redo_until = 0  # steps up to this one were trained by an earlier attempt, after its last checkpoint
        self._recent = collections.deque(maxlen=50)  # seconds of the last training steps
        self.path: Path | None = None
        self.identity: dict = {}
        self._lock = threading.Lock()

    def switch(self, kind: str) -> str:
        """Ends the open segment (counted to its kind) and opens one of `kind`; returns the kind it ended."""
        assert kind in KINDS, kind
        with self._lock:
            now = self.clock()
            before = self.kind
            self.seconds[before] += now - self.since
            if before in ("step", "recomputed"):
                self._recent.append(now - self.since)
            self.kind, self.since = kind, now
            return before

    def training(self, step: int) -> str:
        """Opens the segment of training step `step` (1-based): `recomputed` when an earlier attempt trained it."""
        return self.switch("recomputed" if step <= self.redo_until else "step")

    def completed(self, step: int) -> None:
        with self._lock:
            self.step = step

    def recent_steps(self) -> list[float]:
        with self._lock:
            return list(self._recent)

    def open_segment(self) -> tuple[str, float, int]:
        """(kind, seconds it has been open, last step completed): what the watchdog reads."""
        with self._lock:
            return self.kind, self.clock() - self.since, self.step

    def totals(self, now: float | None = None) -> dict:
        """Seconds by kind with the open segment counted up to `now` (this clock's time; None: the time now)."""
        with self._lock:
            out = dict(self.seconds)
            out[self.kind] += (self.clock() if now is None else now) - self.since
            return out

    def metrics(self) -> dict:
        """The attempt's ledger as metrics: its goodput and the seconds by kind so far (TensorBoard, W&B)."""
        totals = self.totals()
        return {"goodput": totals["step"] / max(sum(totals.values()), 1e-9),
                **{f"time_{kind}_s": totals[kind] for kind in KINDS}}

    def attach(self, directory: str | os.PathLike, attempt: int, process: int, **identity) -> None:
        """Writes to <directory>/goodput/ from now on, as attempt `attempt` (ms), process `process`; reads the
        earlier attempts there to know which steps this one trains again (`redo_until`)."""
        folder = Path(directory) / "goodput"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / FILE.format(attempt=attempt, process=process)
        self.identity = {"attempt": attempt, "process": process, "pid": os.getpid(), **identity}
        earlier = [r for r in read_ledgers(directory) if r["attempt"] != attempt]
        self.redo_until = max((r["step"] for r in earlier), default=0)

    def resumed_at(self, step: int) -> None:
        """The attempt starts training after step `step` (0: from scratch)."""
        with self._lock:
            self.first_step = self.step = step

    def write(self) -> None:
        """Replaces this process's ledger file (atomically) with the totals up to now."""
        if self.path is None:
            return
        now = self.clock()  # one reading: the record's seconds add up to written - start exactly
        record = {**self.identity, "start": self.start, "written": now, "seconds": self.totals(now),
                  "first_step": self.first_step, "step": self.step, "redo_until": self.redo_until}
        replace_json(self.path, record)


def replace_json(path: Path, record: dict) -> None:
    """Writes `record` to `path` through a temporary file renamed over it, so a reader never sees half of it (the
    ledgers here, the watchdog's heartbeats)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json_files(directory: str | os.PathLike, pattern: str) -> list[dict]:
    """The JSON files in `directory` matching `pattern`, in name order; unreadable ones (being replaced, cut short)
    skipped."""
    out = []
    for path in sorted(Path(directory).glob(pattern)):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def read_ledgers(directory: str | os.PathLike) -> list[dict]:
    """Every ledger file of the run in `directory` (a run's output_dir), unreadable ones skipped."""
    return read_json_files(Path(directory) / "goodput", "attempt-*-process-*.json")


def account(directory: str | os.PathLike, process: int = 0) -> dict:
    """The run's time over all its attempts, from process `process`'s ledgers (or, for an attempt where that process
    left none, its lowest process's): {"attempts": [row...], "total": {kind: s, "down": s}, "wall_s", "goodput"}."""
    by_attempt: dict[int, dict] = {}
    for r in read_ledgers(directory):
        have = by_attempt.get(r["attempt"])
        if have is None or (have["process"] != process and (r["process"] == process or r["process"] < have["process"])):
            by_attempt[r["attempt"]] = r
    rows, total, end = [], dict.fromkeys((*KINDS, DOWN), 0.0), None
    for r in sorted(by_attempt.values(), key=lambda r: r["start"]):
        down = 0.0 if end is None else max(r["start"] - end, 0.0)
        total[DOWN] += down
        for kind in KINDS:
            total[kind] += r["seconds"].get(kind, 0.0)
        rows.append({**r, "down_before_s": down, "wall_s": r["written"] - r["start"]})
        end = r["written"]
    wall = (rows[-1]["written"] - rows[0]["start"]) if rows else 0.0
    return {"attempts": rows, "total": total, "wall_s": wall, "accounted_s": sum(total.values()),
            "goodput": total["step"] / wall if wall > 0 else 0.0}


def table(acct: dict) -> str:
    """The account as text: one row per attempt, the totals, the share of each kind and the goodput."""
    kinds = (DOWN, *KINDS)
    head = f"{'attempt':<26}{'procs':>6}{'steps':>12}" + "".join(f"{k:>11}" for k in kinds)
    lines = [head]
    for i, r in enumerate(acct["attempts"], 1):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["start"]))
        first = r.get("first_step") or 0
        steps = f"{first}->{r['step']}"
        seconds = {**r["seconds"], DOWN: r["down_before_s"]}
        lines.append(f"{f'{i} {when}':<26}{r.get('processes', 1):>6}{steps:>12}"
                     + "".join(f"{seconds.get(k, 0.0):>10.1f}s" for k in kinds))
    total, wall = acct["total"], max(acct["wall_s"], 1e-9)
    lines.append(f"{'total':<26}{'':>6}{'':>12}" + "".join(f"{total[k]:>10.1f}s" for k in kinds))
    lines.append(f"{'share':<26}{'':>6}{'':>12}" + "".join(f"{total[k] / wall:>11.1%}" for k in kinds))
    lines.append(f"wall time {acct['wall_s']:.1f} s over {len(acct['attempts'])} attempt(s), "
                 f"{acct['accounted_s']:.1f} s accounted; goodput (training steps / wall time) {acct['goodput']:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.goodput",
                                     description="Where a run's wall time went, over all its restarts.")
    parser.add_argument("run_dir", help="the run's train.output_dir")
    parser.add_argument("--process", type=int, default=0, help="whose ledgers to read (default 0)")
    parser.add_argument("--json", action="store_true", help="print the account as JSON")
    args = parser.parse_args(argv)
    acct = account(args.run_dir, args.process)
    if not acct["attempts"]:
        print(f"error: no goodput ledger in {args.run_dir}/goodput (is it a run's train.output_dir?)", file=sys.stderr)
        return 2
    print(json.dumps(acct, indent=1) if args.json else table(acct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
