#!/usr/bin/env bash
# The rows of benchmarks/2026-12-07-compile-only-context-all-gather-by-head-parts.md: Llama 3.2 1B
# (configs/llama3.2-1b-long.yaml: 32 heads, 8 key-value heads, full recomputation, Pallas attention) with context
# parallelism by the all-gather exchange, which gathers the keys and values head part by head part under the
# previous part's attention, on compile-only H100s, without and with a 1F1B pipeline of 2 stages. Run from the
# repository root (the "before" rows: the same commands at the commit the report names); a row takes one to a
# few minutes on a 2-core CPU.
set -euo pipefail
out=${OUT:-benchmarks/compile-only/2026-12-07-context-all-gather-by-head-parts}
audit() { python -m megajax.audit --config configs/llama3.2-1b-long.yaml --target h100 --set train.steps=1 \
  parallel.context_comm=all_gather "$@"; }
# no pipeline: 32k tokens, data 2 x context 4 (the preset); 128k, context 8; 128k, data 4 x context 16 (2 nodes)
audit --devices 8 > $out/32k-d2c4.json
audit --devices 8 --set parallel.context=8 parallel.data=1 model.seq_length=131072 train.global_batch_size=8 \
  > $out/128k-c8.json
audit --devices 64 --set parallel.context=16 parallel.data=4 model.seq_length=131072 train.global_batch_size=32 \
  > $out/128k-d4c16.json
# a 1F1B pipeline of 2: 32k, pipeline 2 x context 4; 128k, data 2 x pipeline 2 x context 16
audit --devices 8 --set parallel.pipeline=2 parallel.data=1 train.global_batch_size=4 > $out/32k-p2c4.json
audit --devices 64 --set parallel.context=16 parallel.pipeline=2 parallel.data=2 model.seq_length=131072 \
  train.global_batch_size=8 > $out/128k-d2p2c16.json
