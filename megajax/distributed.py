"""Process start-up: the platform choice and (with many hosts) jax.distributed.

Only entry points (`python -m megajax.*`) call these; importing megajax changes nothing.
"""

from __future__ import annotations

import os


def prefer_cpu_without_gpu() -> None:
    """On a machine with no NVIDIA driver, pick the CPU backend before JAX starts, so an installed CUDA
    plugin (for `megajax.audit --target`) does not print a failed GPU initialisation on every run."""
    if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["JAX_PLATFORMS"] = "cpu"
