#!/usr/bin/env bash
# The rows of benchmarks/2026-11-29-compile-only-fsdp-embedding.md: Llama 3 8B on 8 compile-only H100s, pure data
# parallelism. Run from the repository root at each of the two commits (the "-before" files at the parent); each row
# takes under half a minute on a 2-core CPU.
set -euo pipefail
out=benchmarks/compile-only/2026-11-29-fsdp-embedding
audit() { python -m megajax.audit --config configs/llama3-8b.yaml --target h100 --devices 8 --set parallel.data=8 \
  parallel.tensor=1 parallel.sequence_parallel=false parallel.tp_comm_overlap=false parallel.overlap_grad_reduce=false \
  parallel.overlap_param_gather=false "$@"; }
cut="model.num_layers=16 train.global_batch_size=64"  # 8 micro batches of one 8192-token sequence a GPU
audit $cut parallel.data_parallel_sharding_strategy=optim_grads_params > $out/llama3-8b-16layers-zero3.json
audit $cut parallel.data_parallel_sharding_strategy=optim_grads parallel.overlap_param_gather=true \
  > $out/llama3-8b-16layers-zero2.json
# all 32 layers, the preset's 128 sequences (16 micro batches a GPU), selective (the preset's) and full recomputation
audit parallel.data_parallel_sharding_strategy=optim_grads_params > $out/llama3-8b-32layers-zero3.json
audit parallel.data_parallel_sharding_strategy=optim_grads_params model.recompute=full \
  > $out/llama3-8b-32layers-zero3-full.json
# Llama 3 70B on 64 GPUs, data 8 x tensor 8, ZeRO-3, micro batches of 1 and 2
for mb in 1 2; do
  python -m megajax.audit --config configs/llama3-70b.yaml --target h100 --devices 64 --set parallel.data=8 \
    parallel.pipeline=1 parallel.tensor=8 parallel.context=1 parallel.expert=1 train.micro_batch_size=$mb \
    model.recompute=none parallel.sequence_parallel=true parallel.tp_comm_overlap=true \
    parallel.data_parallel_sharding_strategy=optim_grads_params parallel.schedule=1f1b parallel.virtual_stages=1 \
    > $out/llama3-70b-64gpus-d8t8-fsdp-mb$mb.json
done
# the DeepSeek-V3 preset as it is, 1024 GPUs (about 2 minutes)
python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 > $out/deepseek-v3-preset.json
