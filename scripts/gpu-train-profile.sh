#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/train-nccl.xz carried
# (scripts/gpu-pack.sh --multi): where one training step of the train example's 125m preset
# spends its GPU time. Nsight Compute times every kernel of a window of launches
# (gpu__time_duration, clocks left alone, one pass each); the kernels between two launches of
# the AdamW kernel are one whole step (with --grad-accum 1: one micro-batch and the update),
# summed by kind, largest first.
#
#   bash scripts/gpu-train-profile.sh                     # the explicit backward
#   TRAIN_ARGS=--autograd bash scripts/gpu-train-profile.sh
#
# Env: TRAIN_ARGS (extra train flags), SKIP_LAUNCHES (default 1500: past the first steps),
# LAUNCHES (default 2500: the window, which must hold two AdamW launches). $OUT/train-profile.csv
# (or /tmp/gpu-train-profile/) keeps the raw per-kernel times.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
WORK=${OUT:-/tmp/gpu-train-profile}
mkdir -p "$WORK"
command -v ncu >/dev/null || { echo "gpu-train-profile: ncu not found" >&2; exit 2; }
BIN=$(mktemp -d)
xz -dc .device/train-nccl.xz >"$BIN/train" && chmod +x "$BIN/train" || exit 2
# The real libnccl.so.2 (the build linked a stub), from PyTorch's wheel.
source scripts/nccl-lib.sh

read -r -a extra <<<"${TRAIN_ARGS:-}"
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-skip "${SKIP_LAUNCHES:-1500}" --launch-count "${LAUNCHES:-2500}" \
    "$BIN/train" --preset 125m --grad-accum 1 --steps 12 --eval-every 1000 --sample 0 --out "$BIN/out" "${extra[@]}" \
    >"$WORK/train-profile.csv" 2>"$WORK/train-profile.log"
echo "ncu exit $?"

python3 - "$WORK/train-profile.csv" <<'EOF'
import csv, re, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace"))]
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]
ki, vi, ii = h.index("Kernel Name"), h.index("Metric Value"), h.index("ID")
kernels = []
for r in rows[hdr + 1:]:
    if len(r) == len(h):
        kernels.append((int(r[ii]), r[ki], float(r[vi].replace(",", ""))))
kernels.sort()
adam = [n for n, (_, name, _) in enumerate(kernels) if "optim_adamw" in name]
if len(adam) < 2:
    sys.exit(f"fewer than two AdamW launches in the window ({len(adam)}): raise LAUNCHES")
step = kernels[adam[0] + 1: adam[1] + 1]
def kind(name):
    rules = [
        (r"nvjet|gemm|cutlass|sm90_xmma|splitKreduce|Kernel2", "matmuls (cuBLAS)"),
        (r"flash_bwd|bwd_pre|bwd_post|convert_dq|dq_", "attention backward"),
        (r"flash_fwd", "attention forward"),
        (r"swiglu", "SiLU x up"),
        (r"rms_norm", "RMSNorm"),
        (r"rope", "RoPE"),
        (r"embedding", "embedding"),
        (r"optim_", "optimizer"),
        (r"badd|bsub|bmul|bdiv|affine", "candle binary/affine"),
        (r"cast", "candle casts"),
        (r"copy|ucopy", "candle copies"),
        (r"fill|zero", "fills"),
        (r"reduce|sum|max|fast_", "candle reductions"),
        (r"uexp|ulog|gather|eq|where", "candle loss ops"),
    ]
    for pat, k in rules:
        if re.search(pat, name):
            return k
    return "other: " + name[:60]
total = sum(t for _, _, t in step)
by = defaultdict(lambda: [0.0, 0])
names = defaultdict(lambda: [0.0, 0])
for _, name, t in step:
    by[kind(name)][0] += t; by[kind(name)][1] += 1
    short = re.sub(r"\(.*", "", name)[:70]
    names[short][0] += t; names[short][1] += 1
print(f"one step (grad-accum 1): {len(step)} kernels, {total / 1e6:.2f} ms of GPU time")
print(f"{'kind':<28} {'ms':>8} {'share':>6} {'launches':>8}")
for k, (t, n) in sorted(by.items(), key=lambda x: -x[1][0]):
    print(f"{k:<28} {t / 1e6:8.2f} {100 * t / total:5.1f}% {n:8d}")
print("\ntop kernels:")
for k, (t, n) in sorted(names.items(), key=lambda x: -x[1][0])[:25]:
    print(f"{t / 1e6:8.2f} ms {n:5d}  {k}")
EOF
