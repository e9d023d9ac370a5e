#!/usr/bin/env bash
# The compile-only H100 programs of this report (run from the root of a checkout of the code measured; $1 names the
# rows: before, after; $2 the folder to write them under, by default this one).
set -euo pipefail
out=${2:-benchmarks/compile-only/2026-12-07-exchange-buffers}
tag=${1:-after}
mkdir -p $out/$tag
audit() {  # name, devices, extra --set values
  local name=$1 devices=$2; shift 2
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices $devices --set train.steps=1 "$@" \
    > $out/$tag/$name.json
}
fp8="model.fp8=e4m3 model.fp8_recipe=blockwise"
ds="parallel.expert=64 parallel.pipeline=16 parallel.tensor=1 parallel.expert_tensor=null
  parallel.sequence_parallel=false parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim
  parallel.decoder_first_pipeline_num_layers=4 parallel.decoder_last_pipeline_num_layers=1 train.micro_batch_size=1
  model.recompute=selective parallel.data=128 train.global_batch_size=6144"
audit deepseek-v3-preset 1024
audit deepseek-v3-preset-fp8 1024 $fp8
audit deepseek-v3-deepseek-layout-2048 2048 $ds
audit deepseek-v3-deepseek-layout-2048-fp8 2048 $ds $fp8
