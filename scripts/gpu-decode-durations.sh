#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/ carried (scripts/gpu-pack.sh --attn):
# Nsight Compute's kernel durations for the benchmark's kvcache_decode pass, the single-query
# decode kernel (kernels/kvcache/decode.cu) against the forward kernel (its split-KV combine
# added) on the same calls, one line per cell. Each kernel is timed alone with the caches flushed
# (ncu's default), so the numbers are the kernels' own time without the launch cost that a single
# call's graph replay measures (docs/kernels/kvcache.md, session 39).
#
#   DECODE_KEYS=640,2048 DECODE_BATCHES=1,4,8 bash scripts/gpu-decode-durations.sh [BENCH_BINARY]
#
# The bench runs each cell's calls twice (BENCH_DECODE_ONCE); the second, warm pair is printed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
command -v ncu >/dev/null || { echo "gpu-decode-durations: ncu not found" >&2; exit 2; }
BENCH=${1:-}
if [[ -z $BENCH ]]; then
    BENCH=/tmp/gpu-decode-durations-bench
    xz -dc .device/gpu-bench.xz >"$BENCH" && chmod +x "$BENCH" || exit 2
fi
LOG=${OUT:-/tmp}/decode-durations.ncu.txt
BENCH_PASSES=kvcache_decode BENCH_DECODE_ONCE=1 BENCH_DECODE_KEYS=${DECODE_KEYS:-640,2048} \
    BENCH_DECODE_BATCHES=${DECODE_BATCHES:-1,4,8} \
    ncu --metrics gpu__time_duration.sum -k regex:"kvcache_decode|flash_fwd" "$BENCH" >"$LOG" 2>&1 ||
    { tail -20 "$LOG"; exit 1; }
python3 scripts/ncu_decode_pairs.py "$LOG"
