#!/usr/bin/env bash
# Run at the root of a checkout of the code measured (before: 3f7c2ab, after: c64426f), OUT naming its folder.
set -euo pipefail
OUT=${OUT:?set OUT to before/ or after/}
mkdir -p "$OUT"
for row in "gpt-1.7b a100 32" "gpt-18b a100 256" "gpt-1.7b h100 32" "gpt-1.7b a100 32 parallel.overlap_grad_reduce=true"; do
  set -- $row
  name="$1-$2-$3${4:+-overlap}"
  python -m megajax.audit --config "configs/paper/$1.yaml" --target "$2" --devices "$3" ${4:+--set "$4"} \
    --dump-hlo "/tmp/$name.hlo" > "$OUT/$name.json" 2> "$OUT/$name.log"
  # the attention kernels the compiled program calls, and its cuBLAS GEMMs' count
  { grep -o 'name = "flash_attention_[a-z]*"' "/tmp/$name.hlo" | sort | uniq -c || true
    echo "cublas gemm calls: $(grep -c 'custom_call_target="__cublas' "/tmp/$name.hlo" || true)"; } > "$OUT/$name.kernels.txt"
  rm -f "/tmp/$name.hlo"
done
