#!/usr/bin/env bash
# The rows of benchmarks/2026-12-07-compile-only-context-a2a-all-gather-pipeline.md: Llama 3.2 1B
# (configs/llama3.2-1b-long.yaml: 32 heads, 8 key-value heads, full recomputation, Pallas attention) with context
# parallelism under a 1F1B pipeline of 2 stages, by the all-gather, the all-to-all and the hierarchical
# a2a+all_gather (its group size by default: the largest that stays inside a node and splits the heads), on
# compile-only H100s. Run from the repository root; a row takes one to a few minutes on a 2-core CPU.
set -euo pipefail
out=benchmarks/compile-only/2026-12-07-context-a2a-all-gather-pipeline
audit() { python -m megajax.audit --config configs/llama3.2-1b-long.yaml --target h100 "$@"; }
for comm in all_gather a2a a2a+all_gather; do
  # 32k tokens, 8 GPUs: pipeline 2 x context 4
  audit --devices 8 --set train.steps=1 parallel.context_comm=$comm parallel.pipeline=2 parallel.data=1 \
    train.global_batch_size=4 > $out/32k-p2c4-$comm.json
  # 128k tokens, 64 GPUs: data 2 x pipeline 2 x context 16 (every context group spans two nodes)
  audit --devices 64 --set train.steps=1 parallel.context_comm=$comm parallel.context=16 parallel.pipeline=2 \
    parallel.data=2 model.seq_length=131072 train.global_batch_size=8 > $out/128k-d2p2c16-$comm.json
done
