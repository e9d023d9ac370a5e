#!/usr/bin/env bash
# The row of benchmarks/2026-11-29-compile-only-deepseek-v3-mtp.md (compile-only H100s, 1024 devices; about 4 minutes
# on a 2-core CPU). Run from the repository root.
set -euo pipefail
out=benchmarks/compile-only/2026-11-29-deepseek-v3-mtp
python -m megajax.audit --config configs/deepseek-v3.yaml --target h100 --devices 1024 > $out/deepseek-v3-preset.json
