#!/usr/bin/env bash
# The rows of benchmarks/2026-11-29-compile-only-zero-bubble-fsdp.md (compile-only H100s; pip install -e '.[gpu-audit]').
set -euo pipefail
out=benchmarks/compile-only/2026-11-29-zero-bubble-fsdp
zb="parallel.schedule=zero_bubble parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false"
for s in optim optim_grads optim_grads_params; do
  python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 \
    --set $zb parallel.data_parallel_sharding_strategy=$s > $out/llama3-70b-zero_bubble-$s.json
done
python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 --set parallel.overlap_grad_reduce=false \
  parallel.overlap_param_gather=false parallel.data_parallel_sharding_strategy=optim_grads \
  > $out/llama3-70b-interleaved-optim_grads.json
