#!/bin/bash
# Each row compiled for compile-only H100s with model.scan_layers true and false: audit JSON, HLO and wall time
# into $OUT (default /tmp/unroll). Usage: bash run.sh l1b l1b8 g13 g124 l8 l70 l70f
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/unroll}; mkdir -p $OUT
S1="train.global_batch_size=8 train.micro_batch_size=4 model.attention_impl=pallas model.norm_impl=pallas parallel.tensor=1 parallel.sequence_parallel=false parallel.distributed_optimizer=false"
row() { name=$1; cfg=$2; n=$3; shift 3
  for scan in true false; do
    s=$(date +%s.%N)
    timeout 1800 python -m megajax.audit --config $cfg --target h100 --devices $n --dump-hlo $OUT/$name-$scan.hlo --set "$@" model.scan_layers=$scan > $OUT/$name-$scan.json 2>$OUT/$name-$scan.err
    e=$(date +%s.%N); echo "$name $scan $(echo "$e - $s" | bc)" >> $OUT/times.txt
  done; }
for r in "$@"; do case $r in
 l1b) row l1b configs/llama-1b.yaml 1 $S1;;
 l1b8) row l1b8 configs/llama-1b.yaml 1 $S1 model.fp8=hybrid;;
 g13) row g13 configs/gpt2-1.3b.yaml 1 train.global_batch_size=8 model.attention_impl=pallas model.norm_impl=pallas parallel.tensor=1 parallel.sequence_parallel=false parallel.distributed_optimizer=false;;
 g124) row g124 configs/gpt2-124m.yaml 1 train.global_batch_size=32 model.attention_impl=pallas model.norm_impl=pallas;;
 l8) row l8 configs/llama3-8b.yaml 8 train.steps=1;;
 l70) row l70 configs/llama3-70b.yaml 64 train.steps=1;;
 l70f) row l70f configs/llama3-70b.yaml 64 parallel.data=64 parallel.pipeline=1 parallel.tensor=1 parallel.virtual_stages=1 parallel.schedule=1f1b parallel.sequence_parallel=false parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim_grads_params model.recompute=full parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false train.micro_batch_size=1;;
esac; done
echo ALLDONE >> $OUT/times.txt
