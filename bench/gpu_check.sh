#!/usr/bin/env bash
# One prepared run for an H100/H200-class GPU (under 8 minutes), with full-size
# architectures and random weights (bench/fullsize.py: SDXL's 2.6B UNet, FLUX.1's 11.9B
# transformer), bf16, no download:
#   1. direct batch-size scaling: bursts of 1, 2, 4, 8, 16 at 512x512 and 1024x1024;
#   2. server vs direct in a continuous closed loop at concurrency 8 and 16 (512x512).
# Prints the tables; results.json and plots go to $OUT (default bench-results/gpu).
# The tests never need it. Usage: bench/gpu_check.sh [extra diffbatch bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
STEPS=${STEPS:-4}
COMMON=(--device cuda --dtype bfloat16 --threads 4 --steps "$STEPS" --rounds 1 --warmup 2)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

for family in SDXL Flux; do
    model="random-${family,,}"
    for size in 512x512 1024x1024; do
        echo "== $family $size: direct batch-size scaling"
        diffbatch bench --model "$model" --pipeline-class "bench.fullsize:Random$family" \
            "${COMMON[@]}" --size "$size" --requests 16 --max-num-seqs 16 \
            --contenders direct --workload burst:1,2,4,8,16 --out "$OUT/$model-$size-scaling" "$@"
    done
    echo "== $family 512x512: server vs direct, closed loop"
    diffbatch bench --model "$model" --pipeline-class "bench.fullsize:Random$family" \
        "${COMMON[@]}" --size 512x512 --requests 48 --max-num-seqs 16 \
        --server-args "--max-num-seqs 16" --contenders direct,server \
        --workload closed:8,16 --out "$OUT/$model-512-served" "$@"
done
