#!/bin/bash
# 200 steps of the tiny MoE preset at hidden 256 in bf16: no FP8, e4m3 with current scaling (each expert's own), and
# blockwise FP8 (CPU, emulated FP8); each run's metrics.jsonl copied here
cd "$(dirname "$0")/../../.."
out=benchmarks/cpu/2026-12-05-blockwise-fp8-experts
mkdir -p runs/blockwise-fp8-experts
SETS="model.hidden_size=256 model.moe_ffn_hidden_size=512 train.steps=200 train.log_every=10 train.eval_every=0 optim.warmup_steps=40 model.compute_dtype=bfloat16 checkpoint.every=0"
for run in "bf16:model.fp8=none" "current:model.fp8=e4m3" "blockwise:model.fp8=e4m3 model.fp8_recipe=blockwise"; do
  name=${run%%:*}; extra=${run#*:}
  rm -rf runs/blockwise-fp8-experts/$name
  /usr/bin/time -f "$name %e s" python -m megajax.train --config configs/tiny-moe.yaml --set $SETS $extra \
    train.output_dir=runs/blockwise-fp8-experts/$name > runs/blockwise-fp8-experts/$name.log 2>&1
  cp runs/blockwise-fp8-experts/$name/metrics.jsonl $out/$name-metrics.jsonl
done
echo done
