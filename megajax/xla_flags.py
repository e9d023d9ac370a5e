"""The XLA flags megajax runs GPU programs with, in one place; the user's own XLA_FLAGS win.

XLA reads XLA_FLAGS once, when the first backend starts, so `install()` runs in the entry points
(`python -m megajax.train`, `python -m megajax.audit`) before anything touches a device. A flag the user sets
in XLA_FLAGS (to any value) is left as the user set it; `MEGAJAX_XLA_FLAGS=0` installs none of these.

Each flag, and what the compiled GPU program shows for it (`python -m megajax.audit --target h100`: the
`communication` report; gpt2-1.3b cut to 8 layers, data 4 x tensor 2, sequence parallel, 4 micro batches):
  xla_gpu_enable_latency_hiding_scheduler  schedule async collectives under independent compute
                                           (XLA's default; set so that it stays on)
  xla_gpu_enable_pipelined_all_reduce      move each layer's gradient all-reduce (megajax/parallel/overlap.py) out of
                                           its own loop iteration into the next one, under the backward of
                                           the layer before it: 53% -> 72% of the data-parallel bytes under
                                           GEMMs (91% of the layers' bytes; the rest is the embedding's)
  xla_gpu_experimental_parallel_collective_overlap_limit=2
                                           let a data-parallel collective stay in flight while a layer's
                                           tensor-parallel ones run (the default, 1, allows one at a time)
  xla_gpu_all_gather_combine_threshold_bytes=256 MiB
                                           one all-gather per layer for the weights gathered one layer ahead
                                           (parallel.overlap_param_gather) instead of one per weight
  Measured together on gpt2-1.3b (24 layers, as above, distributed optimizer, overlap_grad_reduce and
  overlap_param_gather): data-parallel all-gather bytes under GEMMs 37% -> 88%, estimated exposed
  communication 10.7 -> 7.0 ms a step; without the distributed optimizer (overlap_grad_reduce) 10.4 -> 8.2 ms;
  reduced once after the backward, no change.
The flags are GPU compiler options: the CPU backend ignores them.
"""

from __future__ import annotations

import os

GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
    "xla_gpu_all_gather_combine_threshold_bytes": str(256 * 2**20),
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
