#!/usr/bin/env bash
# The rows of benchmarks/2026-12-06-compile-only-zero-bubble-weight-loop.md (compile-only H100s;
# pip install -e '.[gpu-audit]'). Run from the repository root.
set -euo pipefail
out=benchmarks/compile-only/2026-12-06-zero-bubble-weight-loop
no_overlap="parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false"
# the Llama 3 70B preset's layout (data 2 x pipeline 4 x tensor 8, 5 chunks a stage of 4 layers, 256 micro batches)
for s in optim optim_grads optim_grads_params; do
  python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 \
    --set $no_overlap parallel.schedule=zero_bubble parallel.data_parallel_sharding_strategy=$s \
    > $out/llama3-70b-zero_bubble-$s.json
done
python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 \
  --set $no_overlap parallel.data_parallel_sharding_strategy=optim_grads > $out/llama3-70b-interleaved-optim_grads.json
# chunks of 1 and 2 layers (8 and 16 layers over 4 stages x 2 chunks, 8 micro batches): the growth per layer
for layers in 8 16; do
  for sched in interleaved zero_bubble; do
    python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 \
      --set $no_overlap model.num_layers=$layers parallel.virtual_stages=2 train.global_batch_size=16 \
      parallel.schedule=$sched parallel.data_parallel_sharding_strategy=optim_grads \
      > $out/llama3-70b-${layers}layers-$sched-optim_grads.json
  done
done
