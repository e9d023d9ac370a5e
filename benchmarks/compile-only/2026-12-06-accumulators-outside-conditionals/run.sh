#!/usr/bin/env bash
# The rows of benchmarks/2026-12-06-compile-only-accumulators-outside-conditionals.md (compile-only H100s;
# pip install -e '.[gpu-audit]'). Run from the repository root of the code to measure: after/ ran the commit that
# adds the report, before/ its parent commits' code at 7d15baf, lax-cond/ the backward's change with two-way
# conditionals as jax.lax.cond (before the zero_bubble W change).
set -euo pipefail
out=benchmarks/compile-only/2026-12-06-accumulators-outside-conditionals/${1:-after}
mkdir -p $out
audit() { name=$1; shift; python -m megajax.audit --target h100 "$@" > $out/$name.json; }
audit llama3.1-405b --config configs/llama3.1-405b.yaml --devices 1024 --set train.steps=1
audit llama3.1-405b-vocab-over-pipeline --config configs/llama3.1-405b.yaml --devices 1024 \
  --set train.steps=1 parallel.vocab_over_pipeline=true
audit llama3-70b --config configs/llama3-70b.yaml --devices 64
no_overlap="parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false"
for s in optim optim_grads optim_grads_params; do
  audit llama3-70b-zero_bubble-$s --config configs/llama3-70b.yaml --devices 64 \
    --set $no_overlap parallel.schedule=zero_bubble parallel.data_parallel_sharding_strategy=$s
done
audit llama3-70b-interleaved-optim_grads --config configs/llama3-70b.yaml --devices 64 \
  --set $no_overlap parallel.data_parallel_sharding_strategy=optim_grads
# what each conditional's form copies, one loop-carried buffer (the report's first table)
JAX_PLATFORMS=cpu python benchmarks/compile-only/2026-12-06-accumulators-outside-conditionals/conditional_copies.py \
  > benchmarks/compile-only/2026-12-06-accumulators-outside-conditionals/conditional_copies.jsonl
