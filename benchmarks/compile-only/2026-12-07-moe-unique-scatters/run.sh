#!/usr/bin/env bash
# The compile-only H100 programs of this report (run from the repository root): Mixtral 8x7B's layers at 2 of them
# on one GPU (one micro batch of 4096 tokens, selective recomputation, the H100 defaults), capacity 1.25 (the
# preset's), dropless with the Pallas grouped GEMM, and dropless with jax.lax.ragged_dot. $1 names the rows (before,
# after); the HLO goes to /tmp for fusion_bytes.py.
set -euo pipefail
out=benchmarks/compile-only/2026-12-07-moe-unique-scatters
tag=${1:-after}
mkdir -p $out/$tag
sets="parallel.pipeline=1 parallel.expert=1 parallel.data=1 parallel.tensor=1 parallel.sequence_parallel=false
      parallel.data_parallel_sharding_strategy=no_shard model.num_layers=2 train.global_batch_size=1"
audit() {  # name, extra --set values
  local name=$1; shift
  python -m megajax.audit --config configs/mixtral-8x7b.yaml --target h100 --devices 1 --set $sets "$@" \
    --dump-hlo /tmp/moe-$tag-$name.hlo > $out/$tag/$name.json
}
audit capacity
audit dropless-grouped model.moe_capacity_factor=null model.moe_grouped_gemm=true
audit dropless-ragged-dot model.moe_capacity_factor=null model.moe_grouped_gemm=false
python benchmarks/compile-only/2026-12-06-fp8-delayed-casts/fusion_bytes.py /tmp/moe-$tag-*.hlo > $out/$tag/fusion_bytes.txt
# DeepSeek-V3 in DeepSeek's layout with its multi-token prediction module (the preset's, on), and the preset itself
ds="parallel.expert=64 parallel.pipeline=16 parallel.tensor=1 parallel.expert_tensor=null parallel.sequence_parallel=false
  parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim parallel.decoder_first_pipeline_num_layers=4
  parallel.decoder_last_pipeline_num_layers=1 train.micro_batch_size=1 model.recompute=selective train.steps=1"
deepseek() {  # name, devices, extra --set values
  local name=$1 devices=$2; shift 2
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices $devices --set "$@" \
    > $out/$tag/$name.json
}
deepseek deepseek-v3-deepseek-layout-2048 2048 $ds parallel.data=128 train.global_batch_size=6144
deepseek deepseek-v3-deepseek-layout-2048-whole 2048 $ds parallel.data=128 train.global_batch_size=6144 \
  parallel.vocab_over_pipeline=false
deepseek deepseek-v3-deepseek-layout-1024 1024 $ds parallel.data=64
deepseek deepseek-v3-deepseek-layout-2048-blockwise-fp8 2048 $ds parallel.data=128 train.global_batch_size=6144 \
  model.fp8=e4m3 model.fp8_recipe=blockwise
deepseek deepseek-v3-preset 1024 train.steps=1
# the planner's uncompiled first choice for the preset's model on 1024 GPUs
deepseek deepseek-v3-d1024-e8-zero3 1024 parallel.data=1024 parallel.expert=8 parallel.pipeline=1 parallel.tensor=1 \
  parallel.expert_tensor=null parallel.sequence_parallel=false parallel.tp_comm_overlap=false \
  parallel.data_parallel_sharding_strategy=optim_grads_params train.micro_batch_size=3 model.recompute=full train.steps=1
