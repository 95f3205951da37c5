#!/usr/bin/env bash
# --compile off against --compile blocks (issue 27 item 1) under a mixed-size, mixed-steps
# Poisson load, step-level batching: both servers are started here (their start-up time,
# the compile warm-up's graphs and seconds read from the log), driven side by side by
# `diffbatch bench --url` (rounds interleaved), and their recompiles read from /metrics.
#   bench/compile_load.sh                       # shapes-dit, 64x64 and 48x48, CPU
#   MODEL=tiny-flux DEVICE=cuda bench/compile_load.sh --dtype bfloat16
# Extra arguments go to both servers. Results under $OUT (default bench-results/compile).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/compile}
MODEL=${MODEL:-shapes-dit}
DEVICE=${DEVICE:-cpu}
SIZES=${SIZES:-64x64,48x48}
STEPS=${STEPS:-4,8}
THREADS=${THREADS:-2}
WORKLOAD=${WORKLOAD:-poisson:1}
mkdir -p "$OUT"
port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

declare -A URL PID
for mode in off blocks; do
    p=$(port)
    URL[$mode]="http://127.0.0.1:$p"
    # --compile-sizes: the sizes other than the default the load sends (64x64 is shapes-dit's).
    diffbatch serve "$MODEL" --port "$p" --device "$DEVICE" --num-threads "$THREADS" \
        --compile "$mode" --compile-sizes "${SIZES#*,}" --log-level info \
        --output-dir "$OUT/outputs-$mode" "$@" >"$OUT/server-$mode.log" 2>&1 &
    PID[$mode]=$!
done
trap 'kill "${PID[off]}" "${PID[blocks]}" 2>/dev/null || true' EXIT

start=$(date +%s)
for mode in off blocks; do
    until curl -sf "${URL[$mode]}/health" >/dev/null; do
        kill -0 "${PID[$mode]}" || { cat "$OUT/server-$mode.log"; exit 1; }
        sleep 1
    done
    echo "$mode: ready $(($(date +%s) - start)) s after launch (both servers loading at once)"
done
grep -h "compile warm-up" "$OUT/server-blocks.log" | sed 's/^/blocks: /'

diffbatch bench --url off="${URL[off]}" --url blocks="${URL[blocks]}" --model "$MODEL" \
    --size "$SIZES" --steps "$STEPS" --n 1,2 --workload "$WORKLOAD" --requests 16 --rounds 2 \
    --warmup 4 --threads "$THREADS" --out "$OUT"

for mode in off blocks; do
    echo "$mode: $(curl -s "${URL[$mode]}/metrics" | grep '^diffbatch_denoiser_recompiles_total')"
done
