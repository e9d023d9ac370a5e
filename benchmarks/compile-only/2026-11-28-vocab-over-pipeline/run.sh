#!/usr/bin/env bash
# The rows of benchmarks/2026-11-28-compile-only-vocab-over-pipeline.md (compile-only H100s; each about 3-8 minutes on
# a 2-core CPU). Run from the repository root.
set -euo pipefail
out=benchmarks/compile-only/2026-11-28-vocab-over-pipeline
ds_layout="parallel.data=64 parallel.expert=64 parallel.tensor=1 parallel.expert_tensor=null parallel.sequence_parallel=false parallel.expert_all_to_all=ragged parallel.expert_buffer_factor=2.0"
audit() { python -m megajax.audit --target h100 "$@"; }
audit --config configs/deepseek-v3.yaml --devices 1024 --set train.steps=1 $ds_layout parallel.vocab_over_pipeline=true > $out/deepseek-v3-deepseek-layout-1024.json
audit --config configs/deepseek-v3.yaml --devices 1024 --set train.steps=1 $ds_layout parallel.vocab_over_pipeline=false > $out/deepseek-v3-deepseek-layout-1024-whole.json
audit --config configs/deepseek-v3.yaml --devices 2048 --set train.steps=1 ${ds_layout/parallel.data=64/parallel.data=128} train.global_batch_size=6144 > $out/deepseek-v3-deepseek-layout-2048.json
audit --config configs/deepseek-v3.yaml --devices 1024 --set train.steps=1 > $out/deepseek-v3-preset.json
audit --config configs/llama3.1-405b.yaml --devices 1024 --set train.steps=1 parallel.vocab_over_pipeline=false > $out/llama3.1-405b.json
audit --config configs/llama3.1-405b.yaml --devices 1024 --set train.steps=1 parallel.vocab_over_pipeline=true > $out/llama3.1-405b-vocab-over-pipeline.json
audit --config configs/llama3.1-405b.yaml --devices 1024 --set train.steps=1 parallel.vocab_over_pipeline=true parallel.data_parallel_sharding_strategy=optim_grads_params > $out/llama3.1-405b-zero3-vocab-over-pipeline.json
# the pipeline bubbles (NumPy)
python -m megajax.parallel.pipeline.schedule_cli --config configs/deepseek-v3.yaml
python -m megajax.parallel.pipeline.schedule_cli --config configs/deepseek-v3.yaml --set $ds_layout
