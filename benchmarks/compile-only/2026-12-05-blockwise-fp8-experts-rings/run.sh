#!/usr/bin/env bash
# The rows of benchmarks/2026-12-05-compile-only-blockwise-fp8-experts-rings.md: FP8 with current (per-tensor;
# per expert in the experts) or blockwise scaling on compile-only H100s, in configs/tiny-moe.yaml's experts (8
# experts, 2 a token, at hidden 256 in bf16) and in the collective matmuls; each audit's JSON and its HLO's kernel
# calls. Run from the repository root; a row takes about a minute on a 2-core CPU.
set -euo pipefail
out=benchmarks/compile-only/2026-12-05-blockwise-fp8-experts-rings
common="model.fp8=e4m3 model.compute_dtype=bfloat16 model.hidden_size=256 model.moe_ffn_hidden_size=512"
row() {  # name devices sets...
  local name=$1 n=$2; shift 2
  python -m megajax.audit --config configs/tiny-moe.yaml --target h100 --devices "$n" --dump-hlo /tmp/$name.hlo \
    --set $common "$@" > $out/$name.json
  grep 'custom-call(' /tmp/$name.hlo | grep -o 'name = "[a-z0-9_]*"' | sort | uniq -c > $out/$name.kernels.txt
}
for recipe in current blockwise; do
  # dropless, data 4 (2 of them expert ranks) x tensor 2: the expert width split over tensor
  row dropless-d4e2t2-$recipe 8 model.fp8_recipe=$recipe parallel.data=4 parallel.expert=2 parallel.tensor=2 \
    parallel.sequence_parallel=true
  # capacity 1.25, data 8 (2 of them expert ranks)
  row capacity-d8e2-$recipe 8 model.fp8_recipe=$recipe parallel.data=8 parallel.expert=2 model.moe_capacity_factor=1.25
done
# the collective matmuls (parallel.tp_comm_overlap): configs/tiny.yaml at hidden 256 and sequence 256 on data 4 x
# tensor 2 with sequence parallelism, every linear layer in FP8
tiny="model.fp8=e4m3 model.compute_dtype=bfloat16 model.hidden_size=256 model.num_heads=4 model.seq_length=256"
for recipe in current blockwise; do
  python -m megajax.audit --config configs/tiny.yaml --target h100 --devices 8 --dump-hlo /tmp/rings-$recipe.hlo \
    --set $tiny model.fp8_recipe=$recipe parallel.data=4 parallel.tensor=2 parallel.sequence_parallel=true \
    parallel.tp_comm_overlap=true > $out/rings-d4t2-$recipe.json
  grep 'custom-call(' /tmp/rings-$recipe.hlo | grep -o 'name = "[a-z0-9_]*"' | sort | uniq -c > $out/rings-d4t2-$recipe.kernels.txt
done
