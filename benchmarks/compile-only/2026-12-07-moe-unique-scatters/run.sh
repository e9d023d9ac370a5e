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
