#!/usr/bin/env bash
# The four programs of benchmarks/2026-12-07-compile-only-gradient-accumulation-in-the-backward.md.
#   bash run.sh before   # in a checkout of the commit that adds the report
#   bash run.sh after    # the same checkout with accumulate-in-the-layers-backward.patch applied (git apply)
# then: python ../2026-12-06-fp8-delayed-casts/fusion_bytes.py /tmp/gaf/{before,after}-{unrolled,looped}.hlo
set -euo pipefail
which=${1:?before or after}
mkdir -p /tmp/gaf
SETS="parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard
      model.num_layers=2 train.global_batch_size=16"
for loop in unrolled looped; do
    extra=""
    [ "$loop" = looped ] && extra="model.scan_layers=true"
    # shellcheck disable=SC2086
    python -m megajax.audit --config configs/llama-1b.yaml --target h100 --devices 1 --set $SETS $extra \
        --dump-hlo "/tmp/gaf/$which-$loop.hlo" > "$which-$loop.json"
done
