#!/usr/bin/env bash
# The compile-only H100 programs of this report (run from the repository root). llama-1b's layers at 2 of them, one
# GPU, one micro batch of 4 x 2048, bf16 compute, Pallas attention and norms (the H100 defaults).
set -euo pipefail
out=benchmarks/compile-only/2026-12-06-fp8-delayed-casts
sets="parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard
      model.num_layers=2 train.global_batch_size=4"
audit() {  # name, extra --set values
  local name=$1; shift
  python -m megajax.audit --config configs/llama-1b.yaml --target h100 --devices 1 --set $sets "$@" \
    --dump-hlo /tmp/$name.hlo > $out/$name.json
}
audit bf16
audit current model.fp8=hybrid model.fp8_recipe=current
audit delayed-later model.fp8=hybrid model.fp8_recipe=delayed  # the audit compiles every step's program but the first
# the first step's program of a delayed run (operands without a history take their own scale): as the audit, outside
# fp8.histories_only
JAX_PLATFORMS=cpu python - <<'PY'
from megajax import audit, step
from megajax.config import io
import jax
sets = """parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard
          model.num_layers=2 train.global_batch_size=4 model.fp8=hybrid model.fp8_recipe=delayed""".split()
cfg, mesh, setup, state, batch = audit.abstract_step(io.load("configs/llama-1b.yaml", sets),
                                                     audit._gpu_devices("h100", 1))
with jax.set_mesh(mesh):
    open("/tmp/delayed-first.hlo", "w").write(step.jit_train_step(setup).lower(state, batch).compile().as_text())
PY
python $out/fusion_bytes.py /tmp/bf16.hlo /tmp/current.hlo /tmp/delayed-first.hlo /tmp/delayed-later.hlo \
  > $out/fusion_bytes.txt
