#!/bin/bash
# Each preset compiled for compile-only H100s as a user runs it (no kernel or loop keys), in the checkout at $SRC:
# audit JSON, HLO and wall time into $OUT/<label>/. Usage: SRC=/path/to/checkout LABEL=after bash run.sh g124 l1b ...
HERE=$(cd "$(dirname "$0")" && pwd)
cd "${SRC:-$HERE/../../..}"
OUT=${OUT:-/tmp/fast-defaults}/${LABEL:-after}; mkdir -p $OUT
ONE="parallel.tensor=1 parallel.sequence_parallel=false parallel.distributed_optimizer=false"
row() { name=$1; cfg=$2; n=$3; shift 3
  s=$(date +%s.%N)
  timeout 1800 python -m megajax.audit --config $cfg --target h100 --devices $n --dump-hlo $OUT/$name.hlo \
    --set train.steps=1 "$@" > $OUT/$name.json 2>$OUT/$name.err
  e=$(date +%s.%N); echo "$name $(echo "$e - $s" | bc)" >> $OUT/times.txt; }
for r in "$@"; do case $r in
 tiny) row tiny configs/tiny.yaml 1;;
 tinymoe) row tinymoe configs/tiny-moe.yaml 1;;
 g124) row g124 configs/gpt2-124m.yaml 1;;
 g124x8) row g124x8 configs/gpt2-124m.yaml 8;;
 l1b) row l1b configs/llama-1b.yaml 1 $ONE;;
 l1bx8) row l1bx8 configs/llama-1b.yaml 8;;
 l321bx8) row l321bx8 configs/llama3.2-1b.yaml 8;;
 g13) row g13 configs/gpt2-1.3b.yaml 1 $ONE;;
 g13x8) row g13x8 configs/gpt2-1.3b.yaml 8;;
 l8) row l8 configs/llama3-8b.yaml 8;;
 p17) row p17 configs/paper/gpt-1.7b.yaml 32;;
 mixtral) row mixtral configs/mixtral-8x7b.yaml 512;;
esac; done
