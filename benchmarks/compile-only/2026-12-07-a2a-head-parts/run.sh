#!/usr/bin/env bash
# The rows of benchmarks/2026-12-07-compile-only-a2a-head-parts.md: Llama 3.2 1B (configs/llama3.2-1b-long.yaml:
# 32 heads, 8 key-value heads of 64, or 32 with model.num_kv_heads=32; full recomputation, Pallas attention) with
# the all-to-all exchange on compile-only H100s (pip install -e '.[gpu-audit]'). Run from the repository root at
# the report's commit for the rows in this folder (bash run.sh), at git ee36b31 for before/ (bash run.sh before).
set -euo pipefail
out=benchmarks/compile-only/2026-12-07-a2a-head-parts/${1:-}
audit() { python -m megajax.audit --config configs/llama3.2-1b-long.yaml --target h100 "$@"; }
comm=a2a
# 32k tokens, 8 GPUs: data 2 x context 4 (the preset's layout), 8 and 32 key-value heads
audit --devices 8 --set train.steps=1 parallel.context_comm=$comm > $out/32k-d2c4-$comm.json
audit --devices 8 --set train.steps=1 parallel.context_comm=$comm model.num_kv_heads=32 > $out/32k-d2c4-$comm-mha.json
# 128k tokens, 8 GPUs: context 8
audit --devices 8 --set train.steps=1 parallel.context_comm=$comm parallel.context=8 parallel.data=1 \
  model.seq_length=131072 train.global_batch_size=8 > $out/128k-c8-$comm.json
# 128k tokens, 64 GPUs: data 4 x context 16 (every context group spans two nodes)
audit --devices 64 --set train.steps=1 parallel.context_comm=$comm parallel.context=16 parallel.data=4 \
  model.seq_length=131072 train.global_batch_size=32 > $out/128k-d4c16-$comm.json
