"""What XLA's C++ side prints to stderr, made readable: no CUDA-driver noise on a machine without an NVIDIA GPU,
and the warnings of a GPU compile explained.

With the CUDA plugin installed (the `gpu-audit` extra, for compile-only GPU programs), importing jax and starting
its backends probe for a CUDA driver from C++, and each probe prints two lines to stderr ("All log messages before
absl::InitializeLog() ...", "cudart_stub.cc ... Could not find cuda drivers on your machine") that no environment
variable silences. Where there is no NVIDIA driver those lines say nothing, so the two steps that print them run
with the process's stderr through `rewritten_stderr`, which drops those lines and passes every other as it comes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import threading

NOISE = (b"absl::InitializeLog()", b"cudart_stub.cc")


def _no_driver() -> bool:
    return not os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("jax_plugins") is not None


def drop_noise(line: bytes) -> bytes:
    """A line of stderr, or nothing for the CUDA probes' (`rewritten_stderr`'s rewrite)."""
    return b"" if any(n in line for n in NOISE) else line


_REMAT = re.compile(rb"Can't reduce memory use below ([0-9.]+)GiB.*only reduced to ([0-9.]+)GiB")
_SORT = b"Missing deviceless CUB scratch size data for sort"
_SORT_ADVICE = b"To avoid this, compile with a GPU present, or add the deviceless CUB data"


def explain_xla(line: bytes) -> bytes:
    """A line XLA's GPU compiler writes, made readable. Its rematerialization warning gets a note on what its
    numbers are: the first is XLA's scheduling limit (0.95 x (80% of the device less the program's inputs and
    outputs), those added back), not the device; above it XLA schedules the program for memory rather than for
    overlap. Its sort warning (compiled without a GPU, it cannot size CUB's sort) and the advice after it, on XLA's
    source tree, become one line on what that means for the audit. Every other line passes as it came."""
    if _SORT_ADVICE in line:
        return b""
    if _SORT in line:
        return (b"note: compiled without a GPU, XLA sorts (the router's token sort of a mixture of experts) with its "
                b"own sort kernel rather than CUB's, which it uses on a GPU: the audit's program differs from a GPU's "
                b"there, and the bytes it counts for the sort are the fallback's\n")
    m = _REMAT.search(line)
    if not m:
        return line
    return line + (f"note: XLA's {m.group(1).decode()} GiB above is its scheduling limit (0.95 x (80% of the device "
                   f"less the step's inputs and outputs), those added back), not the device's memory: this program "
                   f"needs about {m.group(2).decode()} GiB by XLA's count, so XLA schedules it for memory rather than "
                   "to hide communication; the audit's peak is the compiled program's\n").encode()


@contextlib.contextmanager
def rewritten_stderr(rewrite):
    """File descriptor 2 through `rewrite` (a line of bytes -> the bytes to write), line by line as it comes (a
    thread forwards them, so a crash loses at most an unfinished line): for C++ output Python does not see."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                os.write(saved, rewrite(line))

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # (closes the pipe's last writer: the thread reads to its end)
        thread.join()
        os.close(saved)


def without_probes():
    """A context in which the CUDA probes' lines are dropped where there is no NVIDIA driver (elsewhere: nothing)."""
    return rewritten_stderr(drop_noise) if _no_driver() else contextlib.nullcontext()


def import_jax() -> None:
    """Imports jax, without the CUDA probes' lines where there is no NVIDIA driver."""
    if "jax" in sys.modules or not _no_driver():
        return
    with rewritten_stderr(drop_noise):
        import jax

        del jax


def discover_plugins() -> None:
    """Registers jax's plugins (the CUDA one: compile-only GPU targets) now, without the CUDA probes' lines where
    there is no NVIDIA driver; call it once the platform is chosen (it decides whether the plugin checks for CUDA)."""
    if not _no_driver():
        return
    from jax._src import xla_bridge

    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)  # (jax 0.10-0.11)
    if discover is not None:
        with rewritten_stderr(drop_noise):
            discover()
