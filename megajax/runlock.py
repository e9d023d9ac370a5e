"""A run owns its output directory: an exclusive lock, taken when the run starts and held until it ends.

Two runs writing one directory would interleave their metrics and overwrite each other's checkpoints without a
word (a second launch by mistake, a requeued SLURM job overlapping its predecessor, a sweep's typo). The lock is an
OS file lock (`flock`) on `<dir>/.megajax.lock`: the kernel drops it when its process ends, however it ends, so
a crashed run never leaves it behind, and on a shared filesystem (NFS, Lustre mounted with flock) it holds across
hosts as checkpoints do. The file also records the holder (host, pid, start time) for the error a second run
prints. With several processes, process 0 takes it for the job and tells the others whether it could.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from megajax.config import InputError

LOCK_FILE = ".megajax.lock"


class RunLockedError(InputError):
    """The directory belongs to another run that is still going."""


def _holder(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[:200] or "a run that has not written its name yet"
    except OSError:
        return "another run"


def _take(directory: Path) -> int:
    """Opens and flocks `directory/.megajax.lock` (exclusive, non-blocking); returns the open descriptor."""
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise InputError(f"{directory}: the run cannot write there ({e.strerror}): choose a writable "
                         "train.output_dir (and checkpoint.dir)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunLockedError(f"{directory} is in use by another run ({_holder(path)}): wait for it to end or stop "
                             "it, or give this run another train.output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    return fd


def _agree(ok: bool) -> bool:
    """Process 0's outcome, on every process."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(ok, np.int32)))


@contextlib.contextmanager
def hold(*directories: str | os.PathLike) -> Iterator[None]:
    """Holds the lock of every directory (the output and, if elsewhere, the checkpoints) for the with-block;
    RunLockedError naming the holder when another run has one."""
    import jax

    fds, error = [], None
    if jax.process_index() == 0:
        try:
            held: list[Path] = []
            for d in (Path(d).absolute() for d in directories):
                if not any(d == h or h in d.parents for h in held):  # a directory inside one held already
                    fds.append(_take(d))
                    held.append(d)
        except RunLockedError as e:
            error = e
            for fd in fds:
                os.close(fd)
            fds = []
    if not _agree(error is None):
        raise error or RunLockedError(f"{', '.join(map(str, directories))} is in use by another run (process 0 "
                                      "could not lock it): wait for it to end, or choose another train.output_dir")
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing the descriptor releases the flock
