#!/usr/bin/env bash
# The compile-only H100 programs of this report (run from the root of a checkout of the code measured; $1 names the
# rows: before, after; $2 the folder to write them under, by default this one). Each audit's JSON, and its compiled
# program's flash-attention kernel calls (operand shapes) from --dump-hlo.
set -euo pipefail
out=${2:-benchmarks/compile-only/2026-12-07-mla-attention-widths}
tag=${1:-after}
hlo=${HLO_DIR:-/tmp/mla-attention-widths-hlo}
mkdir -p $out/$tag $hlo/$tag
audit() {  # name, devices, extra --set values (ONLY="name ...": those alone)
  local name=$1 devices=$2; shift 2
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices $devices --set train.steps=1 "$@" \
    --dump-hlo $hlo/$tag/$name.hlo > $out/$tag/$name.json
  python "$(dirname "$0")/flash_kernels.py" $hlo/$tag/$name.hlo > $out/$tag/$name.flash-kernels.txt
}
fp8="model.fp8=e4m3 model.fp8_recipe=blockwise"
ds="parallel.expert=64 parallel.pipeline=16 parallel.tensor=1 parallel.expert_tensor=null
  parallel.sequence_parallel=false parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim
  parallel.decoder_first_pipeline_num_layers=4 parallel.decoder_last_pipeline_num_layers=1 train.micro_batch_size=1
  model.recompute=selective parallel.data=128 train.global_batch_size=6144"
audit deepseek-v3-preset 1024 train.micro_batch_size=2  # (the preset's micro batch before this report)
audit deepseek-v3-preset-fp8 1024 train.micro_batch_size=2 $fp8
audit deepseek-v3-preset-mb3 1024 train.micro_batch_size=3
audit deepseek-v3-preset-mb3-fp8 1024 train.micro_batch_size=3 $fp8
audit deepseek-v3-deepseek-layout-2048 2048 $ds
audit deepseek-v3-deepseek-layout-2048-fp8 2048 $ds $fp8
audit deepseek-v3-deepseek-layout-1024 1024 ${ds/parallel.data=128 train.global_batch_size=6144/parallel.data=64 train.global_batch_size=3072}
audit deepseek-v3-deepseek-layout-2048-tables-whole 2048 $ds parallel.vocab_over_pipeline=false
