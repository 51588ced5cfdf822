#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/train-nccl.xz carried
# (scripts/gpu-pack.sh --multi): long-context training of the train example's 125m preset on one
# GPU, with and without activation checkpointing (--checkpoint-activations).
#   1. tokens/s at 2k, 8k and 32k tokens per sequence (16k tokens per micro-batch where it
#      divides, 4 micro-batches a step);
#   2. the longest sequence that trains (batch 1, one micro-batch a step): doubling from 32k
#      until a run fails (out of memory), each way.
# A short table last. Env: LONG_STEPS (default 4), LONG_MAX (default 262144: the longest length
# tried), OUT (default /tmp/gpu-train-long).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-/tmp/gpu-train-long}
mkdir -p "$OUT"
STEPS=${LONG_STEPS:-4}
BIN=$(mktemp -d)
xz -dc .device/train-nccl.xz >"$BIN/train" && chmod +x "$BIN/train" || exit 2
# The real libnccl.so.2 (the build linked a stub), from PyTorch's wheel.
source scripts/nccl-lib.sh
log() { printf '[gpu-train-long %s] %s\n' "$(date +%T)" "$*" | tee -a "$OUT/progress.txt" >&2; }

# run NAME SEQ BATCH ACCUM [flags]: prints tokens/s, or "failed: REASON".
run() {
    local name=$1 seq=$2 batch=$3 accum=$4
    shift 4
    timeout 300 "$BIN/train" --preset 125m --seq-len "$seq" --batch-size "$batch" --grad-accum "$accum" \
        --steps "$STEPS" --eval-every 100000 --eval-batches 1 --sample 0 --out "$BIN/$name" "$@" \
        >"$OUT/$name.log" 2>&1
    local rc=$? done_line
    done_line=$(grep '^done:' "$OUT/$name.log" | tail -n1)
    rm -rf "${BIN:?}/$name"
    if ((rc == 0)) && [[ -n $done_line ]]; then
        sed -E 's/.*: ([0-9]+) tokens\/s.*/\1/' <<<"$done_line"
    elif grep -qi "out of memory" "$OUT/$name.log"; then
        echo "failed: out of memory"
    else
        echo "failed: exit $rc, $(grep -v '^\s*$' "$OUT/$name.log" | tail -n1 | cut -c1-80)"
    fi
}

declare -A SPEED LONGEST
for mode in plain ckpt; do
    flags=()
    [[ $mode == ckpt ]] && flags=(--checkpoint-activations)
    for seq in 2048 8192 32768; do
        batch=$((16384 / seq))
        ((batch < 1)) && batch=1
        SPEED[$mode,$seq]=$(run "speed-$mode-$seq" "$seq" "$batch" 4 "${flags[@]}")
        log "$mode, seq $seq, batch $batch: ${SPEED[$mode,$seq]} tokens/s"
    done
    seq=32768
    while ((seq <= ${LONG_MAX:-262144})); do
        result=$(run "long-$mode-$seq" "$seq" 1 1 "${flags[@]}")
        log "$mode, seq $seq, batch 1: $result"
        [[ $result == failed* ]] && { LONGEST[$mode,fail]="$seq ($result)"; break; }
        LONGEST[$mode]=$seq
        LONGEST[$mode,speed]=$result
        seq=$((seq * 2))
    done
done

{
    echo
    echo "== 125m preset, one GPU: tokens/s (4 micro-batches of 16k tokens; 32k: batch 1)"
    printf '%-24s %12s %12s %12s\n' "" 2k 8k 32k
    for mode in plain ckpt; do
        printf '%-24s %12s %12s %12s\n' "$mode" "${SPEED[$mode,2048]}" "${SPEED[$mode,8192]}" "${SPEED[$mode,32768]}"
    done
    echo "== longest sequence that trains (batch 1, doubling from 32k up to ${LONG_MAX:-262144})"
    for mode in plain ckpt; do
        echo "$mode: ${LONGEST[$mode]:-none} (${LONGEST[$mode,speed]:--} tokens/s); first failure: ${LONGEST[$mode,fail]:-none tried}"
    done
} | tee "$OUT/table.txt"
