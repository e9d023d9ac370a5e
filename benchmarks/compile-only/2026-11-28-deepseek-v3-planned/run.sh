#!/usr/bin/env bash
# The rows of benchmarks/2026-11-28-compile-only-deepseek-v3-planned.md (compile-only H100s, 1024 devices; a few
# minutes each on a 2-core CPU). Run from the repository root.
set -euo pipefail
out=benchmarks/compile-only/2026-11-28-deepseek-v3-planned
# the planner, refined by compiling its best candidates
python -m megajax.plan --config configs/deepseek-v3.yaml --target h100 --gpus 1024 --compile 4 > $out/plan-compile-4.txt
# its first choice before the compiles, and its first choice after them
python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 --set train.steps=1 \
  parallel.data=1024 parallel.pipeline=1 parallel.tensor=1 parallel.expert=8 parallel.sequence_parallel=false \
  parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim_grads_params train.micro_batch_size=3 \
  model.recompute=full parallel.decoder_first_pipeline_num_layers=null parallel.decoder_last_pipeline_num_layers=null \
  > $out/d1024-e8-fsdp.json
python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 --set train.steps=1 \
  parallel.data=512 parallel.pipeline=1 parallel.tensor=2 parallel.expert=128 parallel.sequence_parallel=true \
  parallel.tp_comm_overlap=true parallel.data_parallel_sharding_strategy=optim_grads_params train.micro_batch_size=2 \
  model.recompute=full parallel.decoder_first_pipeline_num_layers=null parallel.decoder_last_pipeline_num_layers=null \
  > $out/d512-t2-e128-fsdp.json
# the preset after it moved to that layout (the same program)
python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 > $out/deepseek-v3-preset.json
