"""Process start-up: the platform choice and, with several processes, jax.distributed.

Only entry points (`python -m megajax.*`) call these; importing megajax changes nothing.

Several processes are started either by SLURM (srun: one task per GPU or per node; JAX reads SLURM's
environment) or explicitly, as scripts/launch_local.sh does, with
    MEGAJAX_COORDINATOR=host:port  MEGAJAX_NUM_PROCESSES=N  MEGAJAX_PROCESS_ID=i
    MEGAJAX_CPU_DEVICES=K   (optional: K CPU devices per process, for development on one machine)
"""

from __future__ import annotations

import glob
import os
import re

from megajax import quiet
from megajax.config import ConfigError

# A process whose peer died is told so by the coordination service after this many seconds, and exits
# with an error instead of hanging in a collective (MEGAJAX_HEARTBEAT_TIMEOUT_S overrides it).
HEARTBEAT_TIMEOUT_S = 30


def _heartbeat_timeout() -> int:
    return int(os.environ.get("MEGAJAX_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S))


def prefer_cpu_without_gpu() -> None:
    """On a machine with no NVIDIA driver, pick the CPU backend before JAX starts, so an installed CUDA
    plugin (for `megajax.audit --target`) does not print a failed GPU initialisation on every run."""
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms and not os.path.exists("/dev/nvidiactl"):
        jax.config.update("jax_platforms", "cpu")
    quiet.discover_plugins()


def check_backend() -> None:
    """Stops a run that would train on the CPU by accident: an NVIDIA GPU is visible but JAX's backend is the
    CPU (a CPU-only jaxlib: `pip install -e .` without the gpu extra). JAX_PLATFORMS=cpu, or MEGAJAX_ALLOW_CPU=1,
    trains on the CPU on purpose."""
    import jax

    if (os.path.exists("/dev/nvidiactl") and jax.default_backend() == "cpu"
            and os.environ.get("JAX_PLATFORMS", "") != "cpu" and os.environ.get("MEGAJAX_ALLOW_CPU") != "1"):
        raise ConfigError("an NVIDIA GPU is present but JAX runs on the CPU (no CUDA jaxlib): install the GPU build "
                          "with pip install -e '.[gpu]', or set MEGAJAX_ALLOW_CPU=1 (or JAX_PLATFORMS=cpu) to train "
                          "on the CPU on purpose")


def initialize() -> None:
    """Joins the other processes of the job, if there are any (a no-op for a single process)."""
    import jax

    env = os.environ
    if "MEGAJAX_CPU_DEVICES" in env:
        jax.config.update("jax_num_cpu_devices", int(env["MEGAJAX_CPU_DEVICES"]))
    if "MEGAJAX_COORDINATOR" in env:
        missing = [k for k in ("MEGAJAX_NUM_PROCESSES", "MEGAJAX_PROCESS_ID") if k not in env]
        if missing:
            raise ConfigError(f"MEGAJAX_COORDINATOR is set but {', '.join(missing)} is not: set all three "
                             "(scripts/launch_local.sh does)")
        jax.distributed.initialize(env["MEGAJAX_COORDINATOR"], int(env["MEGAJAX_NUM_PROCESSES"]),
                                   int(env["MEGAJAX_PROCESS_ID"]), heartbeat_timeout_seconds=_heartbeat_timeout(),
                                   initialization_timeout=120)
    elif int(env.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize(local_device_ids=slurm_local_device_ids(env),
                                   heartbeat_timeout_seconds=_heartbeat_timeout())


def _tasks_on_this_node(env) -> int | None:
    """This node's task count from SLURM's compressed list ("2(x3),1": 2 tasks on each of 3 nodes, then 1)."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec or "SLURM_NODEID" not in env:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env["SLURM_NODEID"])
    return counts[node] if node < len(counts) else None


def slurm_local_device_ids(env) -> list[int] | None:
    """The GPUs a SLURM task uses. One task per GPU: None, JAX's own choice (the GPU of SLURM_LOCALID). One task per
    node: every GPU the node gives the task, which JAX would otherwise also reduce to the GPU of SLURM_LOCALID (0)."""
    if _tasks_on_this_node(env) != 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return list(range(len(visible.split(","))))
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return list(range(int(env["SLURM_GPUS_ON_NODE"])))
    gpus = glob.glob("/dev/nvidia[0-9]*")
    return list(range(len(gpus))) if gpus else None
