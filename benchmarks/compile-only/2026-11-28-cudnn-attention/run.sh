#!/usr/bin/env bash
# The rows of benchmarks/2026-11-28-compile-only-cudnn-attention.md: Llama 3.2 1B (the preset) on 8 compile-only
# H100s at data 4 x tensor 2 with sequence parallelism, Pallas against cuDNN attention. Run from the repository
# root with the gpu-audit extra (it brings cuDNN); each row takes about a minute on a 2-core CPU.
set -euo pipefail
out=benchmarks/compile-only/2026-11-28-cudnn-attention
for impl in pallas cudnn; do
  python -m megajax.audit --config configs/llama3.2-1b.yaml --target h100 --devices 8 --dump-hlo /tmp/llama3.2-1b-$impl.hlo \
    --set train.steps=1 parallel.data=4 model.attention_impl=$impl > $out/llama3.2-1b-d4t2-$impl.json
  python -c "import json, sys; from megajax import hlo; print(json.dumps({k: v for k, v in hlo.custom_calls(open(sys.argv[1]).read()).items() if 'cudnn' in k or 'triton' in k}))" /tmp/llama3.2-1b-$impl.hlo > $out/llama3.2-1b-d4t2-$impl-kernel-calls.json
done
