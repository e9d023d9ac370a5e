#!/bin/bash
# compile-only H100: the tiny preset at hidden 256 on data 4 x tensor 2 with sequence parallelism, bf16, FP8 e4m3
# with current scaling against blockwise scaling
cd "$(dirname "$0")/../../.."
for recipe in current blockwise; do
  python -m megajax.audit --config configs/tiny.yaml --target h100 --devices 8 --set model.fp8=e4m3 \
    model.fp8_recipe=$recipe model.compute_dtype=bfloat16 parallel.data=4 parallel.tensor=2 \
    parallel.sequence_parallel=true model.hidden_size=256 model.num_heads=4 model.seq_length=128 \
    > benchmarks/compile-only/2026-12-05-blockwise-fp8/$recipe.json
done
