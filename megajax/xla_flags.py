"""The XLA flags megajax runs GPU programs with, in one place; the user's own XLA_FLAGS win.

XLA reads XLA_FLAGS once, when the first backend starts, so `install()` runs in the entry points
(`python -m megajax.train`, `python -m megajax.audit`) before anything touches a device. A flag the user sets
in XLA_FLAGS (to any value) is left as the user set it; `MEGAJAX_XLA_FLAGS=0` installs none of these.

Each flag, and what the compiled GPU program shows for it (`python -m megajax.audit --target h100`: the
`communication` report; gpt2-1.3b cut to 8 layers, data 4 x tensor 2, sequence parallel, 4 micro batches):
  xla_gpu_enable_latency_hiding_scheduler  schedule async collectives under independent compute
                                           (XLA's default; set so that it stays on)
  xla_gpu_enable_pipelined_all_reduce      move each layer's gradient all-reduce (megajax/overlap.py) out of
                                           its own loop iteration into the next one, under the backward of
                                           the layer before it: 53% -> 72% of the data-parallel bytes under
                                           GEMMs (91% of the layers' bytes; the rest is the embedding's)
The flags are GPU compiler options: the CPU backend ignores them.
"""

from __future__ import annotations

import os

GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
}


def merged(user: str) -> str:
    """`user` (an XLA_FLAGS value) with each of GPU_FLAGS it does not set appended."""
    named = {part.lstrip("-").split("=")[0] for part in user.split()}
    extra = [f"--{k}={v}" for k, v in GPU_FLAGS.items() if k not in named]
    return " ".join([user.strip(), *extra]).strip()


def install(environ=os.environ) -> None:
    """Sets XLA_FLAGS for this process (call before jax starts a backend)."""
    if environ.get("MEGAJAX_XLA_FLAGS", "1") == "0":
        return
    environ["XLA_FLAGS"] = merged(environ.get("XLA_FLAGS", ""))
