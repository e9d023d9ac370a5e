#!/usr/bin/env bash
# The compile-only H100 programs of this report, with DeepSeek-V3's blockwise FP8 recipe (run from the repository
# root; $1 names the rows: before, after; PYTHONPATH at a checkout of the other commit gives its rows).
set -euo pipefail
out=benchmarks/compile-only/2026-12-07-fp8-weight-transposes
tag=${1:-after}
mkdir -p $out/$tag
fp8="model.fp8=e4m3 model.fp8_recipe=blockwise"
audit() {  # name, config, devices, extra --set values
  local name=$1 config=$2 devices=$3; shift 3
  python -m megajax.audit --config $config --target h100 --devices $devices --set $fp8 train.steps=1 "$@" \
    --dump-hlo /tmp/fp8t-$tag-$name.hlo > $out/$tag/$name.json
}
# DeepSeek-V3 in DeepSeek's layout (the V3 report's: pipeline 16, experts over 64, no tensor parallelism, ZeRO-1)
audit deepseek-v3-deepseek-layout-2048 configs/deepseek-v3.yaml 2048 parallel.data=128 train.global_batch_size=6144 \
  parallel.expert=64 parallel.pipeline=16 parallel.tensor=1 parallel.expert_tensor=null parallel.sequence_parallel=false \
  parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim \
  parallel.decoder_first_pipeline_num_layers=4 parallel.decoder_last_pipeline_num_layers=1 train.micro_batch_size=1 \
  model.recompute=selective
# the DeepSeek-V3 preset's layout (1024 GPUs, no pipeline) and the Llama 3 8B preset's (8 GPUs)
audit deepseek-v3-preset configs/deepseek-v3.yaml 1024
audit llama3-8b-preset configs/llama3-8b.yaml 8
for f in /tmp/fp8t-$tag-*.hlo; do
  echo "$(basename $f): $(grep -c 'wrapped_transpose[.0-9]* = f32.*fusion(%param' $f) fp32 transposes of a parameter"
done > $out/$tag/transposes.txt
python benchmarks/compile-only/2026-12-06-fp8-delayed-casts/fusion_bytes.py /tmp/fp8t-$tag-*.hlo > $out/$tag/fusion_bytes.txt
