#!/usr/bin/env bash
# What to run first on a GPU machine: the kernels' errors and speed, the tiny preset trained on the GPU, and
# the train step's MFU on one GPU. Results go to $OUT (default gpu_out/): *.log, kernels.json, train.jsonl.
#   bash scripts/gpu_check.sh kernels   # scripts/bench_kernels.py, tiny preset with xla and pallas kernels
#   bash scripts/gpu_check.sh small     # step timings: gpt2-124m and llama-1b (bf16, one GPU)
#   bash scripts/gpu_check.sh large     # step timings: gpt2-1.3b on one GPU
#   bash scripts/gpu_check.sh fp8       # step timings: llama-1b and gpt2-1.3b, bf16 against FP8 (hybrid)
#   bash scripts/gpu_check.sh moe       # one MoE layer: Pallas grouped GEMM against ragged_dot (errors, speed),
#                                       # FP8, capacity buffers; Mixtral's and DeepSeek-V2-Lite's expert shapes
#   bash scripts/gpu_check.sh gemm      # scripts/bench_matmul.py: the bf16 and FP8 GEMM rates the planner's H100
#                                       # constants come from, each beside the planner's model of it
#   bash scripts/gpu_check.sh profile   # scripts/profile_step.py: where a step's time goes (GEMM, attention, fusions,
#                                       # copies), llama-1b bf16 and FP8 with the layers looped and unrolled
#                                       # (model.scan_layers), and gpt2-124m: the planner's terms checked
#   bash scripts/gpu_check.sh peers     # scripts/bench_peers.py: gpt2-124m and llama-1b as the presets are (the
#                                       # kernels and layer loop auto) beside torch.compile peers of the same shape
#   bash scripts/gpu_check.sh plan      # the planner's predicted step beside each step in $OUT/train.jsonl
#                                       # (run after small, large or fp8; needs no GPU itself)
# Each part fits in ten minutes on one H100 (compilation included).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

bench() {  # label, timeout in seconds, then bench_train.py arguments
    local label=$1 limit=$2
    shift 2
    echo "== $label"
    timeout "$limit" $PY scripts/bench_train.py --label "$label" --jsonl "$OUT/train.jsonl" "$@" 2>&1 \
        | grep -v -E '^(WARNING|I0000|W0000)' | tail -n 3
}

case "${1:-kernels}" in
kernels)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.log"
    $PY -c 'import jax, flax, optax, orbax.checkpoint as o; print("jax", jax.__version__, "flax", flax.__version__,
"optax", optax.__version__, "devices", jax.devices())' 2>&1 | tail -n 1 | tee -a "$OUT/env.log"
    timeout 300 $PY scripts/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -E '^(op|device)'
    for impl in xla pallas; do
        echo "== tiny preset, $impl kernels, 200 steps"
        rm -rf "/tmp/megajax-gpu-tiny-$impl"
        timeout 150 $PY -m megajax.train --config configs/tiny.yaml --set train.steps=200 train.log_every=50 \
            model.attention_impl=$impl model.norm_impl=$impl train.output_dir=/tmp/megajax-gpu-tiny-$impl \
            2>&1 | tee "$OUT/tiny-$impl.log" | grep -E 'step|eval|compiled|error'
    done
    ;;
small)
    for impl in xla pallas cudnn; do
        norm=$([ $impl = cudnn ] && echo xla || echo $impl)
        bench "gpt2-124m mb8 $impl" 150 --config configs/gpt2-124m.yaml --steps 10 --set train.global_batch_size=32 \
            model.attention_impl=$impl model.norm_impl=$norm
    done
    bench "gpt2-124m mb8 xla recompute=none" 150 --config configs/gpt2-124m.yaml --steps 10 \
        --set train.global_batch_size=32 model.recompute=none
    for impl in cudnn pallas; do
        norm=$([ $impl = cudnn ] && echo xla || echo $impl)
        bench "llama-1b mb4 $impl" 200 --config configs/llama-1b.yaml --steps 5 --set train.global_batch_size=8 \
            train.micro_batch_size=4 model.attention_impl=$impl model.norm_impl=$norm parallel.tensor=1 \
            parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard
    done
    ;;
large)
    for impl in cudnn pallas xla; do
        norm=$([ $impl = cudnn ] && echo xla || echo $impl)
        bench "gpt2-1.3b mb4 $impl" 200 --config configs/gpt2-1.3b.yaml --steps 5 --set train.global_batch_size=8 \
            parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard \
            model.attention_impl=$impl model.norm_impl=$norm
    done
    ;;
fp8)
    base="parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard"
    for fp8 in none hybrid; do
        bench "llama-1b mb4 pallas fp8=$fp8" 120 --config configs/llama-1b.yaml --steps 5 \
            --set train.global_batch_size=8 train.micro_batch_size=4 model.attention_impl=pallas \
            model.norm_impl=pallas model.fp8=$fp8 $base
    done
    # (delayed scaling compiles two programs: the first step's and the later steps', which the timed steps run)
    bench "llama-1b mb4 pallas fp8=hybrid delayed" 200 --config configs/llama-1b.yaml --steps 5 \
        --set train.global_batch_size=8 train.micro_batch_size=4 model.attention_impl=pallas model.norm_impl=pallas \
        model.fp8=hybrid model.fp8_recipe=delayed $base
    for fp8 in none hybrid; do
        bench "gpt2-1.3b mb4 pallas fp8=$fp8" 120 --config configs/gpt2-1.3b.yaml --steps 5 \
            --set train.global_batch_size=8 model.attention_impl=pallas model.norm_impl=pallas model.fp8=$fp8 $base
    done
    ;;
moe)
    echo "== MoE layer, Mixtral 8x7B experts (8 of 4096 x 14336, top 2)"
    timeout 200 $PY scripts/bench_moe.py --fp8 --json "$OUT/moe_mixtral.json" 2>&1 | grep -E '^mode'
    echo "== MoE layer, DeepSeek-V2-Lite experts (64 of 2048 x 1408, top 6)"
    timeout 120 $PY scripts/bench_moe.py --tokens 8192 --hidden 2048 --ffn 1408 --experts 64 --k 6 --factors 1.25 \
        --fp8 --json "$OUT/moe_deepseek.json" 2>&1 | grep -E '^mode'
    ;;
gemm)
    timeout 300 $PY scripts/bench_matmul.py --json "$OUT/matmul.json" 2>&1 | tee "$OUT/matmul.log" | grep -E '^(op|device)'
    ;;
profile)
    base="parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard"
    prof() {
        timeout 100 $PY scripts/profile_step.py --json "$OUT/profile.jsonl" "$@" 2>&1 \
            | grep -v -E '^(WARNING|I0000|W0000)' | tee -a "$OUT/profile.log"
    }
    for fp8 in none hybrid; do
        for scan in true false; do  # false: the layers unrolled, no copies into and out of the layer stacks
            prof --label "llama-1b mb4 pallas fp8=$fp8 scan_layers=$scan" --config configs/llama-1b.yaml \
                --set train.global_batch_size=8 train.micro_batch_size=4 model.attention_impl=pallas \
                model.norm_impl=pallas model.fp8=$fp8 model.scan_layers=$scan $base
        done
    done
    prof --label "gpt2-124m mb8 pallas" --config configs/gpt2-124m.yaml --set train.global_batch_size=32 \
        model.attention_impl=pallas model.norm_impl=pallas
    ;;
peers)
    one="parallel.tensor=1 parallel.sequence_parallel=false parallel.data_parallel_sharding_strategy=no_shard"
    peer() {  # label, timeout in seconds, then bench_peers.py arguments
        local label=$1 limit=$2
        shift 2
        echo "== $label"
        timeout "$limit" $PY scripts/bench_peers.py --label "$label" --jsonl "$OUT/peers.jsonl" "$@" 2>&1 \
            | grep -E '"summary"|failed|Error' | tail -n 3
    }
    peer "gpt2-124m mb8 (preset) vs nanoGPT" 280 --config configs/gpt2-124m.yaml --set train.global_batch_size=32
    peer "llama-1b mb4 (preset, one GPU) vs HF Llama" 280 --config configs/llama-1b.yaml \
        --set train.global_batch_size=8 train.micro_batch_size=4 $one
    ;;
plan)
    JAX_PLATFORMS=cpu $PY -m megajax.plan.checks --steps "$OUT/train.jsonl" 2>&1 | grep -E '^\|' | tee "$OUT/plan.log"
    ;;
*)
    echo "usage: $0 kernels|small|large|fp8|moe|gemm|profile|peers|plan" >&2
    exit 2
    ;;
esac
