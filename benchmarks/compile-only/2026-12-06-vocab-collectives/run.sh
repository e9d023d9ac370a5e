#!/usr/bin/env bash
# The rows of benchmarks/2026-12-06-compile-only-vocab-collectives.md (compile-only H100s;
# pip install -e '.[gpu-audit]'), from the repository root at the report's commit. The Llama 3.1 405B preset's rows
# with and without parallel.vocab_over_pipeline are benchmarks/compile-only/2026-12-06-accumulators-outside-
# conditionals/after/ (the same executor). The lookup-outside-conditionals row runs with
# lookup-outside-conditionals.patch applied (git apply), the other rows without it.
set -euo pipefail
out=benchmarks/compile-only/2026-12-06-vocab-collectives
small="parallel.data=1 parallel.pipeline=4 parallel.tensor=2 parallel.schedule=interleaved parallel.virtual_stages=2
  parallel.vocab_over_pipeline=true train.global_batch_size=16 train.micro_batch_size=1 model.num_layers=16
  parallel.overlap_grad_reduce=false parallel.overlap_param_gather=false parallel.data_parallel_sharding_strategy=no_shard"
python -m megajax.audit --config configs/llama3-8b.yaml --target h100 --devices 8 --set $small \
  > $out/${1:-lookup-in-conditional}.json
if [ -z "${1:-}" ]; then
  overlap="parallel.overlap_grad_reduce=true parallel.overlap_param_gather=true"
  python -m megajax.audit --config configs/llama3.1-405b.yaml --target h100 --devices 1024 \
    --set train.steps=1 $overlap > $out/llama3.1-405b-overlap.json
  python -m megajax.audit --config configs/llama3.1-405b.yaml --target h100 --devices 1024 \
    --set train.steps=1 $overlap parallel.vocab_over_pipeline=true > $out/llama3.1-405b-overlap-vocab-over-pipeline.json
  # DeepSeek-V3 in DeepSeek's layout with its multi-token prediction module (the preset's, on)
  ds="parallel.expert=64 parallel.pipeline=16 parallel.tensor=1 parallel.expert_tensor=null parallel.sequence_parallel=false
    parallel.tp_comm_overlap=false parallel.data_parallel_sharding_strategy=optim parallel.decoder_first_pipeline_num_layers=4
    parallel.decoder_last_pipeline_num_layers=1 train.micro_batch_size=1 model.recompute=selective train.steps=1"
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 2048 \
    --set $ds parallel.data=128 train.global_batch_size=6144 > $out/deepseek-v3-deepseek-layout-2048.json
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 2048 \
    --set $ds parallel.data=128 train.global_batch_size=6144 parallel.vocab_over_pipeline=false \
    > $out/deepseek-v3-deepseek-layout-2048-whole.json
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 \
    --set $ds parallel.data=64 > $out/deepseek-v3-deepseek-layout-1024.json
  python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 2048 \
    --set $ds parallel.data=128 train.global_batch_size=6144 model.fp8=e4m3 model.fp8_recipe=blockwise \
    > $out/deepseek-v3-deepseek-layout-2048-blockwise-fp8.json
fi
# with the patch: git apply $out/lookup-outside-conditionals.patch && bash $out/run.sh lookup-outside-conditionals
