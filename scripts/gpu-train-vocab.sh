#!/usr/bin/env bash
# Runs on the GPU machine (one GPU): the 125m preset with a large vocabulary, where the LM head and
# the loss weigh most. A byte-level BPE tokenizer of VOCAB ids (default 32768) is trained on the
# Python standard library with the `tokenizers` package that transformers brings (a few seconds),
# then `train --tokenizer` runs with it: this build (.device/train-nccl.xz) and, when packed, a
# baseline build (.device/train-nccl-base.xz) alternating, ROUNDS rounds (default 2), STEPS steps
# each (default 10), and the same with the byte vocabulary. Prints tokens/s, MFU and the peak
# memory the driver reports, short table last.
#
#   run  carry [".device"]  command "bash scripts/gpu-train-vocab.sh"
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu-train-vocab}
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$OUT" "$LOGS"
VOCAB=${VOCAB:-32768}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-10}
log() { printf '[train-vocab %s] %s\n' "$(date +%T)" "$*" >&2; }

source scripts/nccl-lib.sh || log "no libnccl.so.2 in python3's site-packages"
builds=(ours)
xz -d -c .device/train-nccl.xz >"$LOGS/train-ours" && chmod +x "$LOGS/train-ours"
if [[ -f .device/train-nccl-base.xz ]]; then
    xz -d -c .device/train-nccl-base.xz >"$LOGS/train-base" && chmod +x "$LOGS/train-base"
    builds+=(base)
fi

log "training a byte-level BPE tokenizer of $VOCAB ids"
python3 - "$LOGS/tok" "$VOCAB" <<'PY' >&2
import glob, os, sys, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out, vocab = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
os.makedirs(out, exist_ok=True)
tok.save(os.path.join(out, "tokenizer.json"))
print(f"tokenizer: {tok.get_vocab_size()} ids from {len(files)} files", file=sys.stderr)
PY

declare -A TPS MEM
run() { # run BUILD LABEL ARGS...
    local build=$1 label=$2; shift 2
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$LOGS/mem-$build-$label" &
    local smi=$!
    timeout 300 "$LOGS/train-$build" --preset 125m --steps "$STEPS" --eval-every 1000 --sample 0 \
        --max-bytes 20000000 --out "$LOGS/run-$build-$label" "$@" >"$LOGS/$build-$label.log" 2>&1
    local rc=$?
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    local tps mem
    tps=$(grep -E '^done:' "$LOGS/$build-$label.log" | sed -E 's/.*: ([0-9]+) tokens\/s.*/\1/')
    mem=$(sort -n "$LOGS/mem-$build-$label" | tail -n1)
    log "$build $label (exit $rc): ${tps:-?} tokens/s, peak ${mem:-?} MiB"
    ((rc == 0)) || tail -n 3 "$LOGS/$build-$label.log" >&2
    # The best round.
    if [[ -n $tps && ${tps} -gt ${TPS[$build-$label]:-0} ]]; then TPS[$build-$label]=$tps; fi
    if [[ -n $mem && ${mem} -gt ${MEM[$build-$label]:-0} ]]; then MEM[$build-$label]=$mem; fi
}
for round in $(seq "$ROUNDS"); do
    for b in "${builds[@]}"; do run "$b" "bpe$VOCAB" --tokenizer "$LOGS/tok"; done
    for b in "${builds[@]}"; do run "$b" bytes; done
done
{
echo
echo "== 125m preset, 8 x 2048 tokens x 4 per step, $STEPS steps, best of $ROUNDS ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1))"
printf '%-12s %-6s %10s %14s\n' vocabulary build tokens/s "peak MiB"
for label in "bpe$VOCAB" bytes; do
    for b in "${builds[@]}"; do
        printf '%-12s %-6s %10s %14s\n' "$label" "$b" "${TPS[$b-$label]:--}" "${MEM[$b-$label]:--}"
    done
done
} | tee "$OUT/table.txt"
