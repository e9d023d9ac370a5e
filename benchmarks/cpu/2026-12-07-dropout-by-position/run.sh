#!/usr/bin/env bash
# The residual dropout's cost under context parallelism 8 on 8 CPU devices: the tiny preset at 2048 tokens, dropout
# 0.1 (and without dropout), 12 steps each, the two checkouts alternating twice.
# BEFORE and AFTER name checkouts of 3f7c2ab (the whole sequence's mask drawn on every rank) and of the code that
# hashes each token's position; OUT the folder the metrics go to.
set -euo pipefail
: "${BEFORE:?}" "${AFTER:?}" "${OUT:?}"
export XLA_FLAGS=--xla_force_host_platform_device_count=8
run() {  # checkout, name, dropout
  rm -rf "/tmp/run-$2"
  (cd "$1" && python -m megajax.train --config configs/tiny.yaml --set parallel.context=8 model.seq_length=2048 \
    model.dropout="$3" train.global_batch_size=8 train.steps=12 train.log_every=1 train.eval_every=0 \
    checkpoint.every=0 train.output_dir="/tmp/run-$2" > /dev/null 2>&1)
  cp "/tmp/run-$2/metrics.jsonl" "$OUT/$2.jsonl"
}
mkdir -p "$OUT"
for i in 1 2; do
  run "$BEFORE" "before-dropout-$i" 0.1
  run "$AFTER" "after-dropout-$i" 0.1
  run "$AFTER" "after-none-$i" 0.0
done
