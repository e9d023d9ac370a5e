"""Hangs that name their rank: a watchdog thread in every process, and `python -m megajax.watchdog DIR`.

Every second the watchdog of each process writes a heartbeat, <progress dir>/process-<i>.json: the time, and where
its ledger (megajax.goodput) stands: the open segment's kind (data, step, eval, checkpoint...), how long it has been
open and the last step completed. A segment of the step loop open longer than train.hang_report_s (default: 10x the
median of the recent steps, at least 120 s; an evaluation 10x that median per eval batch, a checkpoint's blocking
part at least 600 s) is a stall: the watchdog writes to the process's log (stderr) what it is
in, for how long, every thread's Python stack, and which process the heartbeats say is behind; once a stall, again
only after progress. Past train.hang_exit_s it ends the process with HANG_EXIT, so the launcher (scripts/
launch_local.sh, scripts/slurm.sbatch) can end or restart the job; the launchers print the same report of which
process is behind from the heartbeats before they do.

Which process is behind: one whose heartbeat stopped while the others' went on (stopped with SIGSTOP, its host or
driver hung outside Python: its watchdog thread cannot write); else the lowest position in the step loop (last
step completed, then data < step < eval < checkpoint). A hang inside one collective that every process entered is
localized no further than that: they all show the same position.

The progress dir is $MEGAJAX_PROGRESS_DIR where a launcher sets it, else <train.output_dir>/progress.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from megajax.goodput import Ledger, read_json_files, replace_json

HANG_EXIT = 86  # the exit status of a process the watchdog ended (the launchers restart on it)
BEAT_S = 1.0
STALE_S = 10.0  # a heartbeat this much older than the newest one: its process has stopped answering
WATCHED = {"data": 0, "step": 1, "recomputed": 1, "eval": 2, "checkpoint": 3}  # the step loop's order in a step
ORDER = {**WATCHED, "startup": -1, "restore": -1, "compile": -1, "other": 4}
MIN_REPORT_S = 120.0
MIN_CHECKPOINT_S = 600.0  # a first save, or a big state on a slow filesystem, may block this long
FACTOR = 10.0


def progress_dir(output_dir: str) -> Path:
    return Path(os.environ.get("MEGAJAX_PROGRESS_DIR") or Path(output_dir) / "progress")


def read_heartbeats(directory: str | os.PathLike) -> list[dict]:
    return sorted(read_json_files(directory, "process-*.json"), key=lambda b: b["process"])


def _position(beat: dict) -> tuple[int, int]:
    return beat["step"], ORDER.get(beat["kind"], 4)


def _where(beat: dict) -> str:
    kind, step = beat["kind"], beat["step"]
    if kind in ("data", "step", "recomputed"):
        at = f"{'the batch of ' if kind == 'data' else ''}step {step + 1}"
    else:
        at = f"{kind} after step {step}"
    return f"{at} for {beat['open_s']:.0f} s (pid {beat['pid']} on {beat['host']})"


def behind(beats: list[dict]) -> str:
    """One line: which process the heartbeats say is behind the others, and where each stands."""
    if beats:  # the newest attempt's (a restart on fewer processes leaves the others' files)
        attempt = max(b.get("attempt", 0) for b in beats)
        beats = [b for b in beats if b.get("attempt", 0) == attempt]
    if not beats:
        return "no heartbeats: the processes did not reach their step loop"
    newest = max(b["time"] for b in beats)
    stale = [b for b in beats if newest - b["time"] > STALE_S]
    if stale and len(stale) < len(beats):
        names = ", ".join(f"process {b['process']} (last heard {newest - b['time']:.0f} s before the others, in "
                          f"{_where(b)})" for b in stale)
        return (f"behind: {names}: its watchdog stopped writing, so the process is stopped or hung outside Python "
                "(SIGSTOP, a lost host, a stuck driver); the others wait for it")
    low = min(_position(b) for b in beats)
    late = [b for b in beats if _position(b) == low]
    if len(late) == len(beats):
        return (f"no process is behind the others: all {len(beats)} are in {_where(beats[0])}: a collective, the "
                "file system or a device that every process waits on")
    ahead = next(b for b in beats if _position(b) != low)
    names = ", ".join(f"process {b['process']} in {_where(b)}" for b in late)
    return f"behind: {names}; the others have gone further (process {ahead['process']}: {_where(ahead)})"


class Watchdog:
    """The heartbeat and stall detector of one process (a daemon thread); `stop()` ends it."""

    def __init__(self, ledger: Ledger, directory: str | os.PathLike, process: int, report_s: float | None = None,
                 exit_s: float | None = None, log=None, eval_batches: int = 1):
        self.ledger, self.process, self.eval_batches = ledger, process, eval_batches
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"process-{process}.json"
        self.report_s, self.exit_s = report_s, exit_s
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.reported = None  # (kind, step) of the stall last reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megajax-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def threshold(self, kind: str = "step") -> float:
        """Seconds a watched segment of `kind` may stay open before it is reported."""
        if self.report_s is not None:
            return self.report_s
        recent = self.ledger.recent_steps()
        step = FACTOR * statistics.median(recent) if recent else 0.0
        if kind == "eval":
            return max(step * self.eval_batches, MIN_REPORT_S)
        return max(step, MIN_CHECKPOINT_S if kind == "checkpoint" else MIN_REPORT_S)

    def beat(self) -> dict:
        kind, open_s, step = self.ledger.open_segment()
        record = {"process": self.process, "attempt": self.ledger.identity.get("attempt", 0), "pid": os.getpid(),
                  "host": socket.gethostname(), "time": time.time(), "kind": kind, "open_s": open_s, "step": step,
                  "first_step": self.ledger.first_step}
        replace_json(self.path, record)
        return record

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                record = self.beat()
            except OSError:
                continue
            self.check(record)

    def check(self, record: dict) -> None:
        kind, open_s, step = record["kind"], record["open_s"], record["step"]
        if kind not in WATCHED:
            return
        if open_s > self.threshold(kind) and self.reported != (kind, step):
            self.reported = (kind, step)
            self.report(record)
        if self.exit_s is not None and open_s > self.exit_s:
            self.log(f"watchdog: process {self.process}: {_where(record)}, past train.hang_exit_s={self.exit_s:g}: "
                     f"ending the process (exit {HANG_EXIT}) so the launcher can restart the job")
            try:
                self.ledger.write()
            finally:
                os._exit(HANG_EXIT)

    def report(self, record: dict) -> None:
        self.log(f"watchdog: process {self.process} has been in {_where(record)}, over "
                 f"{self.threshold(record['kind']):.0f} s (train.hang_report_s); last step completed {record['step']}. "
                 "Its Python stacks:")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.log(f"watchdog: {behind(read_heartbeats(self.dir))}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megajax.watchdog",
                                     description="Which process of a job is behind, from its heartbeats.")
    parser.add_argument("progress_dir", help="$MEGAJAX_PROGRESS_DIR, or a run's <train.output_dir>/progress")
    args = parser.parse_args(argv)
    if not Path(args.progress_dir).is_dir():
        print(f"error: {args.progress_dir} is not a directory: give $MEGAJAX_PROGRESS_DIR, or a run's "
              "<train.output_dir>/progress", file=sys.stderr)
        return 2
    print(behind(read_heartbeats(args.progress_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
