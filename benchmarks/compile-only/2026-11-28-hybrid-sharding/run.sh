#!/usr/bin/env bash
# The rows of benchmarks/2026-11-28-compile-only-hybrid-sharding.md: Llama 3 8B cut to 16 layers on 32 compile-only
# H100s (4 nodes of 8), 4 micro batches of one 8192-token sequence per data rank (16 with tensor 2). Run from the
# repository root; each row takes under a minute on a 2-core CPU.
set -euo pipefail
out=benchmarks/compile-only/2026-11-28-hybrid-sharding
base="train.steps=1 parallel.tp_comm_overlap=false parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false model.num_layers=16"
audit() { python -m megajax.audit --config configs/llama3-8b.yaml --target h100 --devices 32 --set $base "$@"; }
t1="parallel.tensor=1 parallel.sequence_parallel=false parallel.data=32 train.global_batch_size=128"
t2="parallel.tensor=2 parallel.sequence_parallel=true parallel.data=16 train.global_batch_size=64"
zero3="parallel.data_parallel_sharding_strategy=optim_grads_params"
audit $t1 parallel.data_parallel_sharding_strategy=optim > $out/t1-zero1.json
audit $t1 $zero3 > $out/t1-zero3.json
audit $t1 $zero3 parallel.num_distributed_optimizer_instances=4 > $out/t1-zero3-hybrid4.json
audit $t2 $zero3 > $out/t2-zero3.json
audit $t2 $zero3 parallel.num_distributed_optimizer_instances=4 > $out/t2-zero3-hybrid4.json
# ZeRO-1 reduced and gathered under the compute: the instances' all-reduce in the last backward
audit $t1 parallel.data_parallel_sharding_strategy=optim parallel.overlap_grad_reduce=true parallel.overlap_param_gather=true parallel.num_distributed_optimizer_instances=4 > $out/t1-zero1-overlapped-hybrid4.json
audit $t1 parallel.data_parallel_sharding_strategy=optim parallel.overlap_grad_reduce=true parallel.overlap_param_gather=true > $out/t1-zero1-overlapped.json
