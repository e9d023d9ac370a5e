#!/bin/bash
# 200 steps of the tiny preset at hidden 256 in bf16, with and without blockwise FP8 (CPU, emulated FP8)
cd "$(dirname "$0")/../../.."
mkdir -p runs/blockwise-fp8
SETS="model.num_layers=4 model.hidden_size=256 model.num_heads=4 model.seq_length=128 train.global_batch_size=16 train.steps=200 train.log_every=10 train.eval_every=0 optim.warmup_steps=40 model.compute_dtype=bfloat16 checkpoint.every=0"
for run in "bf16:model.fp8=none" "blockwise:model.fp8=e4m3 model.fp8_recipe=blockwise"; do
  name=${run%%:*}; extra=${run#*:}
  /usr/bin/time -f "$name %e s" python -m megajax.train --config configs/tiny.yaml --set $SETS $extra train.output_dir=runs/blockwise-fp8/$name > runs/blockwise-fp8/$name.log 2>&1
done
echo done
