#!/usr/bin/env bash
# Runs on the GPU machine (one GPU): the train example's 125m preset next to the other trainers,
# in one call, and the loss curves of ours and PyTorch's on the same data in one PNG.
#
#   scripts/gpu-pack.sh --multi     # here: .device/train-nccl.xz (the train example)
#   # llm.c (optional): .device-exp/llmc/train_gpt2cu.xz, built as scripts/llmc_baseline.sh says
#   run  carry [".device", ".device-exp"]  command "bash scripts/gpu-train-compare.sh"
#
# 1. Throughput (tokens/s and MFU of the 125m preset's shape, 8 x 2048 tokens x 4 per step):
#    ours; HF transformers' LlamaForCausalLM eager and under torch.compile
#    (scripts/train_baseline.py); llm.c's hand-written CUDA GPT-2 124M trainer
#    (scripts/llmc_baseline.sh, 16 x 1024 tokens x 4 per step, its own MFU count), plain and with
#    its GELU fused into the matmul (-ge 2).
# 2. The same data, the same initial weights: PyTorch (train_baseline.py --data stdlib
#    --same-init: the Rust trainer's corpus, batch sampler and weight draws) for CURVE_STEPS
#    steps with the preset's schedule (warmup CURVE_WARMUP), its per-step losses written out; then
#    ours for the same steps with --reference-losses, which draws both into loss.png and prints
#    the mean difference.
# Env: STEPS (timed steps, default 20), CURVE_STEPS (default 300), CURVE_WARMUP (default 30),
# SKIP=ours,eager,compile,llmc,curves. Results (the PNG, both curves' losses, the table, the
# baselines' JSON lines) go to $OUT (the device tool's folder, which brings back only a few
# files) or /tmp/gpu-train-compare; logs and runs to $LOGS (default: a new temporary folder).
# A short table last.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu-train-compare}
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$OUT" "$LOGS"
STEPS=${STEPS:-20}
CURVE_STEPS=${CURVE_STEPS:-300}
CURVE_WARMUP=${CURVE_WARMUP:-30}
SKIP=${SKIP:-}
log() { printf '[train-compare %s] %s\n' "$(date +%T)" "$*" | tee -a "$LOGS/progress.txt" >&2; }
skipped() { [[ ,$SKIP, == *,$1,* ]]; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
log "GPU: $GPU; logs in $LOGS"

# The train example links libnccl.so.2 (built with --features nccl): PyTorch's wheel has it.
source scripts/nccl-lib.sh || log "no libnccl.so.2 in python3's site-packages"
BIN=$(mktemp -d)
[[ -f .device/train-nccl.xz ]] || { log "no .device/train-nccl.xz: run scripts/gpu-pack.sh --multi"; exit 1; }
xz -d -c .device/train-nccl.xz >"$BIN/train" && chmod +x "$BIN/train"

declare -A TPS MFU NOTE
json_field() { python3 -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); v=d.get(sys.argv[2]); print("" if v is None else v)' "$1" "$2" 2>/dev/null; }

if ! skipped ours; then
    log "ours: 125m, $STEPS steps"
    timeout 300 "$BIN/train" --preset 125m --steps "$STEPS" --eval-every "$STEPS" --sample 0 \
        --out "$LOGS/ours" >"$LOGS/ours.log" 2>&1
    line=$(grep -E '^done:' "$LOGS/ours.log" | tail -n1)
    TPS[ours]=$(sed -E 's/.*: ([0-9]+) tokens\/s.*/\1/' <<<"$line")
    MFU[ours]=$(sed -E 's/.*MFU ([0-9.]+)%.*/\1/' <<<"$line")
    NOTE[ours]="flash-llama train, explicit backward, bf16 + f32 masters"
    log "ours: ${TPS[ours]} tokens/s, MFU ${MFU[ours]}%"
fi

for mode in eager compile; do
    skipped "$mode" && continue
    extra=()
    [[ $mode == compile ]] && extra=(--compile)
    log "PyTorch $mode: $STEPS steps"
    timeout 400 python3 scripts/train_baseline.py --steps "$STEPS" "${extra[@]}" >"$OUT/$mode.json" 2>"$LOGS/$mode.log"
    TPS[$mode]=$(json_field "$OUT/$mode.json" tokens_per_s)
    MFU[$mode]=$(json_field "$OUT/$mode.json" mfu_percent)
    NOTE[$mode]=$(json_field "$OUT/$mode.json" impl)
    log "PyTorch $mode: ${TPS[$mode]} tokens/s, MFU ${MFU[$mode]}%"
done

if ! skipped llmc; then
    if [[ -f .device-exp/llmc/train_gpt2cu.xz ]]; then
        for variant in plain ge2; do
            args=()
            [[ $variant == ge2 ]] && args=(-ge 2)
            log "llm.c ($variant)"
            OUT="$LOGS/llmc-$variant" LLMC_ARGS="${args[*]}" bash scripts/llmc_baseline.sh >"$OUT/llmc-$variant.json" 2>"$LOGS/llmc-$variant.log"
            TPS[llmc-$variant]=$(json_field "$OUT/llmc-$variant.json" tokens_per_s)
            MFU[llmc-$variant]=$(json_field "$OUT/llmc-$variant.json" mfu_percent_llmc)
            NOTE[llmc-$variant]="llm.c train_gpt2cu GPT-2 124M, no cuDNN${args[*]:+, ${args[*]}} (its own MFU count)"
            log "llm.c ($variant): ${TPS[llmc-$variant]} tokens/s, MFU ${MFU[llmc-$variant]}%"
            [[ -n ${TPS[llmc-$variant]} ]] || tail -n 5 "$LOGS/llmc-$variant.log" >&2
        done
    else
        log "no .device-exp/llmc/train_gpt2cu.xz: llm.c skipped"
    fi
fi

CURVE=""
if ! skipped curves; then
    log "PyTorch on the Rust trainer's data and initial weights: $CURVE_STEPS steps"
    timeout 500 python3 scripts/train_baseline.py --data stdlib --same-init --warmup-steps 0 \
        --steps "$CURVE_STEPS" --lr-warmup "$CURVE_WARMUP" --losses-out "$OUT/pytorch.csv" \
        >"$LOGS/curve-pytorch.json" 2>"$LOGS/curve-pytorch.log" || tail -n 5 "$LOGS/curve-pytorch.log" >&2
    log "ours on the same data: $CURVE_STEPS steps"
    timeout 300 "$BIN/train" --preset 125m --steps "$CURVE_STEPS" --warmup "$CURVE_WARMUP" \
        --eval-every "$CURVE_STEPS" --sample 0 --out "$LOGS/curve" --reference-losses "$OUT/pytorch.csv" \
        >"$LOGS/curve-ours.log" 2>&1 || tail -n 5 "$LOGS/curve-ours.log" >&2
    CURVE=$(grep -E '^reference ' "$LOGS/curve-ours.log" | tail -n1)
    # Both curves every 25 steps, for the notes (ours from the checkpoint's history).
    python3 - "$OUT/pytorch.csv" "$LOGS/curve/checkpoint.safetensors" <<'PY' | tee "$OUT/curves.txt"
import json, struct, sys
ref = {int(s): float(l) for s, l in (x.split(",") for x in open(sys.argv[1]).read().split()[1:])}
with open(sys.argv[2], "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
ours = dict(json.loads(header["__metadata__"]["history"])["train"])
print("step  ours    pytorch")
for s in sorted(ours):
    if s in ref and (s % 25 == 0 or s == 1):
        print(f"{s:4d}  {ours[s]:.4f}  {ref[s]:.4f}")
PY
    cp "$LOGS/curve/loss.png" "$OUT/loss-ours-vs-pytorch.png" 2>/dev/null
fi

{
echo
echo "== training throughput, one GPU ($GPU): 125m preset's shape, $STEPS timed steps"
printf '%-14s %12s %7s %10s  %s\n' trainer tokens/s MFU% ours/it what
for k in ours eager compile llmc-plain llmc-ge2; do
    [[ -n ${TPS[$k]:-} ]] || continue
    r=$(python3 -c "import sys; print(f'{float(sys.argv[1])/float(sys.argv[2]):.2f}')" "${TPS[ours]:-0}" "${TPS[$k]}" 2>/dev/null)
    printf '%-14s %12.0f %7s %10s  %s\n' "$k" "${TPS[$k]}" "${MFU[$k]}" "${r:--}" "${NOTE[$k]}"
done
[[ -n $CURVE ]] && { echo; echo "== loss curves, same data and initial weights ($CURVE_STEPS steps): $CURVE"; }
} | tee "$OUT/table.txt"
exit 0
