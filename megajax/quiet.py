"""No CUDA-driver noise on a machine without an NVIDIA GPU.

With the CUDA plugin installed (the `gpu-audit` extra, for compile-only GPU programs), importing jax and starting
its backends probe for a CUDA driver from C++, and each probe prints two lines to stderr ("All log messages before
absl::InitializeLog() ...", "cudart_stub.cc ... Could not find cuda drivers on your machine") that no environment
variable silences. Where there is no NVIDIA driver those lines say nothing, so the two steps that print them run
with the process's stderr caught, and every other line is written back as it came.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile

NOISE = (b"absl::InitializeLog()", b"cudart_stub.cc")


def _no_driver() -> bool:
    return not os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("jax_plugins") is not None


@contextlib.contextmanager
def _filtered_stderr():
    """File descriptor 2 into a temporary file, whose lines but the CUDA probes' go back to stderr after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught if not any(n in line for n in NOISE)]
            if kept:
                sys.stderr.buffer.write(b"".join(kept))
                sys.stderr.flush()


def import_jax() -> None:
    """Imports jax, without the CUDA probes' lines where there is no NVIDIA driver."""
    if "jax" in sys.modules or not _no_driver():
        return
    with _filtered_stderr():
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
        with _filtered_stderr():
            discover()
