#!/usr/bin/env bash
# One prepared run for an H100/H200-class GPU (about 10 minutes; ROWS=8,9 runs only those), with full-size
# architectures and random weights (bench/fullsize.py: SDXL's 2.6B UNet, FLUX.1's 11.9B
# transformer), bf16, no download:
#   1. direct batch-size scaling: bursts of 1, 2, 4, 8, 16 at 512x512 and 1024x1024;
#   2. server vs direct in a continuous closed loop at concurrency 8 and 16 (512x512);
#   3. memory (issue 25): peak GPU memory and images/s at 1024x1024 for no offload, model,
#      group and sequential offload, and float8 weights (layerwise casting; torchao int8 and
#      float8 weight-only too where torchao is installed), SDXL and FLUX
#      (bench/fullsize_memory.py; each scheme in a process of its own).
#   4. the profile run at start (issue 25 item 5): for SDXL and FLUX at 1024x1024 with
#      --max-num-seqs 16, the step group and decode budgets it fits within 0.9 of the GPU's
#      memory, and the peaks it read (bench/profile_check.py; fails unless "measured").
#   5. compiled denoisers and attention kernels (issue 27 items 1-2): for SDXL and FLUX,
#      --compile off against blocks in step mode under a closed loop of 8 at 1024x1024 and
#      768x768 (bench/compile_load.sh: start-up and warm-up time, img/s, recompiles from
#      /metrics), and FLUX with --attention-backend native, cudnn and (where installed)
#      flash / sage, bursts of 8 at 1024x1024 (a backend the GPU cannot run stops its
#      server at start: that row then fails with the reason in its log).
#   6. cache acceleration per request (issue 27 item 3): FLUX at 1024x1024, 28 steps, step
#      mode, a closed loop of 8: --cache none against first-block at two thresholds and
#      TaylorSeer at two intervals (img/s and blocks skipped per request from /metrics). Random weights: what a threshold skips here
#      says nothing of quality (the trained shapes-dit model judges that, on CPU); this row
#      measures what the per-row skip bookkeeping costs and saves at full size.
#   7. one request across two GPUs (issue 43; only where nvidia-smi lists two or more): FLUX at
#      1024x1024, 28 steps, one GPU against --sequence-parallel 2 (Ulysses, and ring with
#      cudnn attention), --cfg-parallel 2 with true CFG, and --data-parallel-size 2, bursts of
#      1 (latency of one request) and 8 (throughput).
#   8. the front end with few-step models (issue 46): FLUX at 1024x1024, 4 steps, a lone
#      client (server ÷ direct) and a closed loop of 16 through one API process against two
#      and four in front of the one engine; and the fixed-time front end (bench/front_end.py:
#      HTTP, encoding and transfer alone, 1024x1024 PNG and JPEG) with 1, 2 and 4 API
#      processes on this host's cores, where a second API process has cores to take.
#   9. mixed sizes in one step (issue 42): FLUX, 4 steps, 512x512, 768x768 and 1024x1024
#      drawn per request, closed loop of 8 and Poisson arrivals: packed (the default)
#      against the padded grid (--mix-sizes pad), --mix-sizes off and --batching request,
#      native attention (sdpa once per size packed; the grid's key mask padded), and one size
#      of about the mixed requests' mean tokens (800x800: the ceiling); then packed and
#      per-size again with --attention-backend cudnn (the padded grid mixes on native only).
# Servers started by 1-2 profile too (--profile-run auto): their logs say if it lowered
# --max-num-seqs. Not yet: a Qwen-Image- or Wan-14B-size transformer (bench/fullsize.py has
# neither).
# Prints the tables; results.json and plots go to $OUT (default bench-results/gpu).
# The tests never need it. Usage: bench/gpu_check.sh [extra diffbatch bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
STEPS=${STEPS:-4}
COMMON=(--device cuda --dtype bfloat16 --threads 4 --steps "$STEPS" --rounds 1 --warmup 2)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Which numbered rows of the header to run (a comma list; default all): a lent machine's
# command runs at most 10 minutes.
want() { [[ ",${ROWS:-all}," == *",all,"* || ",${ROWS:-}," == *",$1,"* ]]; }

if want 1 || want 2; then
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
fi

if want 3; then
    schemes=none,layerwise,model,group,sequential
    if python -c "import torchao" 2>/dev/null; then schemes="$schemes,int8,float8"; fi
    mkdir -p "$OUT"
    for model in random-sdxl random-flux; do
        echo "== ${model#random-} 1024x1024: memory and speed per offload and weight scheme"
        # Exits non-zero when any scheme fails (pipefail carries it through tee).
        python -m bench.fullsize_memory --device cuda --model "$model" --size 1024 --requests 2 \
            --threads 4 --schemes "$schemes" | tee "$OUT/$model-memory.txt"
    done
fi

if want 4; then
    for family in SDXL Flux; do
        echo "== ${family} 1024x1024: the profile run at start (--max-num-seqs 16)"
        python -m bench.profile_check "random-${family,,}" --device cuda --dtype bfloat16 \
            --pipeline-class "bench.fullsize:Random$family" --max-num-seqs 16 --default-size 1024x1024 \
            --gpu-memory-utilization 0.9 | tee "$OUT/random-${family,,}-profile.txt"
    done
fi

if want 5; then
    for family in SDXL Flux; do
        echo "== ${family} 1024x1024 and 768x768: --compile off vs blocks (warm-up, img/s, recompiles)"
        MODEL="random-${family,,}" DEVICE=cuda SIZES=1024x1024,768x768 STEPS="$STEPS" THREADS=4 \
            WORKLOAD=closed:8 OUT="$OUT/compile-${family,,}" \
            bench/compile_load.sh --pipeline-class "bench.fullsize:Random$family" --dtype bfloat16 \
            --max-num-seqs 8
    done

    backends=(--contender native="--attention-backend native" --contender cudnn="--attention-backend cudnn")
    for package in flash_attn:flash sageattention:sage; do
        if python -c "import ${package%%:*}" 2>/dev/null; then
            backends+=(--contender "${package##*:}=--attention-backend ${package##*:}")
        fi
    done
    echo "== Flux 1024x1024: attention backends"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --size 1024x1024 --requests 8 --contenders '' "${backends[@]}" --workload burst:8 \
        --out "$OUT/random-flux-attention" "$@"
fi

if want 6; then
    echo "== Flux 1024x1024, 28 steps: --cache none vs first-block vs taylorseer (step mode, closed loop of 8)"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --steps 28 --size 1024x1024 --requests 16 --max-num-seqs 8 --server-args "--max-num-seqs 8" \
        --contenders '' --contender none="--cache none" \
        --contender fbc05="--cache first-block --cache-threshold 0.05" \
        --contender fbc12="--cache first-block --cache-threshold 0.12" \
        --contender ts2="--cache taylorseer --cache-interval 2 --cache-warmup 3" \
        --contender ts4="--cache taylorseer --cache-interval 4 --cache-warmup 3" \
        --workload closed:8 --out "$OUT/random-flux-cache" "$@"
fi

if want 7; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    if [ "${gpus:-0}" -ge 2 ]; then
        echo "== Flux 1024x1024, 28 steps: one request on two GPUs (sequence, CFG, data parallel) vs one"
        diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
            --steps 28 --size 1024x1024 --requests 8 --max-num-seqs 8 --contenders '' \
            --contender one="--max-num-seqs 8" \
            --contender ulysses2="--sequence-parallel 2" \
            --contender ring2="--sequence-parallel 2 --sp-mode ring --attention-backend cudnn" \
            --contender dp2="--data-parallel-size 2" \
            --workload burst:1,8 --out "$OUT/random-flux-lanes" "$@"
        echo "== Flux 1024x1024, 28 steps, true CFG: --cfg-parallel 2 (and x --sequence-parallel 2 on 4 GPUs)"
        cfg="--default-true-cfg-scale 4"
        lanes=(--contender one="--max-num-seqs 8 $cfg" --contender cfg2="--cfg-parallel 2 $cfg")
        if [ "$gpus" -ge 4 ]; then
            lanes+=(--contender cfg2-ulysses2="--cfg-parallel 2 --sequence-parallel 2 $cfg")
        fi
        diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
            --steps 28 --size 1024x1024 --requests 8 --max-num-seqs 8 --contenders '' "${lanes[@]}" \
            --negative blurry --workload burst:1,8 --out "$OUT/random-flux-cfg-lanes" "$@"
    else
        echo "== skipped: one request across devices needs two GPUs (nvidia-smi lists ${gpus:-0})"
    fi
fi

if want 8; then
    echo "== Flux 1024x1024, 4 steps: a lone client and a closed loop of 16, 1, 2 and 4 API processes"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --steps 4 --size 1024x1024 --requests 32 --max-num-seqs 16 --contenders direct \
        --contender api1="--max-num-seqs 16 --api-server-count 1" \
        --contender api2="--max-num-seqs 16 --api-server-count 2" \
        --contender api4="--max-num-seqs 16 --api-server-count 4" \
        --workload lone --workload closed:16 --out "$OUT/random-flux-front" "$@"
    echo "== the fixed-time front end (no model): 1, 2 and 4 API processes on $(nproc) cores"
    python -m bench.front_end --sizes 1024 --formats png,jpeg --rounds 2 --requests 64 \
        --variant "api1=--api-server-count 1" --variant "api2=--api-server-count 2" \
        --variant "api4=--api-server-count 4" | tee "$OUT/front-end.txt"
fi

if want 9; then
    echo "== Flux, 4 steps: mixed sizes (512, 768, 1024) packed vs padded vs per-size groups vs request mode"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --steps 4 --size 512x512,768x768,1024x1024 --requests 24 --max-num-seqs 8 --contenders server \
        --server-args "--max-num-seqs 8" --contender padded="--max-num-seqs 8 --mix-sizes pad" \
        --contender per-size="--max-num-seqs 8 --mix-sizes off" \
        --contender request="--max-num-seqs 8 --batching request" \
        --workload closed:8 --workload poisson:80% --out "$OUT/random-flux-mixed" "$@"
    echo "== Flux, 4 steps: mixed sizes packed vs per-size groups, cudnn attention"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --steps 4 --size 512x512,768x768,1024x1024 --requests 24 --max-num-seqs 8 --contenders server \
        --server-args "--max-num-seqs 8 --attention-backend cudnn" \
        --contender per-size="--max-num-seqs 8 --attention-backend cudnn --mix-sizes off" \
        --workload closed:8 --out "$OUT/random-flux-mixed-flash" "$@"
    echo "== Flux, 4 steps: one size of about the mixed tokens per request (the ceiling)"
    diffbatch bench --model random-flux --pipeline-class bench.fullsize:RandomFlux "${COMMON[@]}" \
        --steps 4 --size 800x800 --requests 24 --max-num-seqs 8 --contenders server \
        --server-args "--max-num-seqs 8" --workload closed:8 --out "$OUT/random-flux-single" "$@"
fi
