#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/ carried (scripts/gpu-pack.sh --attn
# --fp8): where our fp8 forward and the fp8 anchors (FA3's, cuDNN's) spend a launch, cell by cell.
#
#   bash scripts/gpu-fp8-counts.sh [--power] [--ncu]
#
#   --power  each cell run back to back for 4 s (ours, then each anchor) while nvidia-smi samples
#            the SM clock, the board power and the throttle reasons every 100 ms; prints per cell
#            and implementation the medians of the last 3 s (0x4 in the reasons: the software
#            power cap, where energy per FLOP sets the rate, not cycles alone)
#   --ncu    Nsight Compute on one launch of each (clocks left alone): elapsed cycles, warp
#            instructions, tensor-pipe instructions, local-memory load sectors, DRAM bytes; ours
#            also with V^T written by the pre-pass (BENCH_TUNING=fp8_vt=prepass, the pre-pass's
#            own kernel not counted); then, from the two shortest lengths of each head dim, the
#            period p per 128 keys and each tile's fixed part B (elapsed = tiles per CTA · (B +
#            keys · p); the numbers and what B holds: docs/kernels/forward-fp8.md, session 70)
# Default: both. Env: HDIMS (default 64,128,256), SEQS (default 2048,16384), unmasked only;
# KERNELS (--ncu: default "ours prepass fa3 cudnn").
# Logs and the tables go to $OUT (the device tool brings it back) or /tmp/gpu-fp8-counts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
POWER=0 NCU=0
for a in "$@"; do
    case $a in
    --power) POWER=1 ;;
    --ncu) NCU=1 ;;
    *) echo "usage: $0 [--power] [--ncu]" >&2; exit 2 ;;
    esac
done
((POWER + NCU == 0)) && POWER=1 NCU=1
LOGS=${OUT:-/tmp/gpu-fp8-counts}
mkdir -p "$LOGS"
HDIMS=${HDIMS:-64,128,256}
SEQS=${SEQS:-2048,16384}
BENCH=/tmp/gpu-fp8-counts-bench
xz -dc .device/gpu-bench.xz >"$BENCH" && chmod +x "$BENCH" || exit 2
ls .device/fp8/*.whl >/dev/null 2>&1 || { echo "gpu-fp8-counts: no .device/fp8 wheels (gpu-pack.sh --fp8)" >&2; exit 2; }
SITE=/tmp/gpu-fp8-counts-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .device/fp8/*.whl || exit 2

# ours D S [BENCH_TUNING] [wrapper...] and anchor IMPL D S [wrapper...]: one unmasked cell.
ours() {
    local d=$1 s=$2 tuning=$3
    shift 3
    env BENCH_HDIMS="$d" BENCH_SEQS="$s" BENCH_CAUSAL=0 BENCH_DECODE=0 BENCH_PASSES=fp8 BENCH_TUNING="$tuning" \
        BENCH_TIMING=sustained timeout 150 "$@" "$BENCH"
}
anchor() {
    local impl=$1 d=$2 s=$3
    shift 3
    env IMPLS="$impl" HDIMS="$d" SEQS="$s" CAUSAL=0 PROBE=0 ACCURACY=0 PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 \
        timeout 150 "$@" python3 scripts/fp8_anchors.py
}

if ((POWER)); then
    Q="timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
    nvidia-smi --query-gpu=$Q --format=csv,noheader >/dev/null 2>&1 || Q="timestamp,clocks.sm,power.draw"
    nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
    nvidia-smi --query-gpu=$Q --format=csv,noheader,nounits -lms 100 >"$LOGS/smi.csv" &
    smi=$!
    : >"$LOGS/marks.txt"
    mark() { echo "$1 $(date +'%Y/%m/%d %H:%M:%S.%N')" >>"$LOGS/marks.txt"; }
    for d in ${HDIMS//,/ }; do
        for s in ${SEQS//,/ }; do
            mark "ours $d $s"
            BENCH_SETTLE_MS=4000 ours "$d" "$s" "" 2>&1 | grep -E "TFLOP/s$" | tee -a "$LOGS/power-rates.txt"
            mark "end"
            for impl in fa3_fp8 cudnn_fp8; do
                mark "$impl $d $s"
                SETTLE_MS=4000 TIMING_MODE=sustained anchor "$impl" "$d" "$s" 2>&1 | grep -E "TFLOP/s$" |
                    tee -a "$LOGS/power-rates.txt"
                mark "end"
            done
        done
    done
    kill "$smi"
    python3 - "$LOGS" <<'EOF'
import datetime, statistics, sys
logs = sys.argv[1]
def ts(x): return datetime.datetime.strptime(x.strip()[:26], "%Y/%m/%d %H:%M:%S.%f")
samples = []
for line in open(f"{logs}/smi.csv"):
    f = [x.strip() for x in line.split(",")]
    try: samples.append((ts(f[0]), float(f[1]), float(f[2]), f[3] if len(f) > 3 else "-"))
    except (ValueError, IndexError): pass
marks = [l.split() for l in open(f"{logs}/marks.txt")]
print("\nimplementation, head dim, seqlen | SM MHz median (min-max) | board W median | throttle reasons")
for cur, nxt in zip(marks, marks[1:]):
    if cur[0] == "end" or nxt[0] != "end": continue
    t1 = ts(" ".join(nxt[1:3]))
    w = [x for x in samples if t1 - datetime.timedelta(seconds=3.4) <= x[0] <= t1 - datetime.timedelta(seconds=0.4)]
    if not w: print(" ".join(cur[:3]), "| no samples"); continue
    c = [x[1] for x in w]
    print(f"{cur[0]:9s} {cur[1]:>3s} {cur[2]:>5s} | {statistics.median(c):5.0f} ({min(c):.0f}-{max(c):.0f}) | "
          f"{statistics.median(x[2] for x in w):4.0f} | {statistics.mode(x[3] for x in w)}")
EOF
fi

if ((NCU)); then
    command -v ncu >/dev/null || { echo "gpu-fp8-counts: ncu not found" >&2; exit 2; }
    M=sm__cycles_elapsed.avg,sm__inst_executed.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,dram__bytes_read.sum,dram__bytes_write.sum
    # The 4th launch of the kernel (after the warm-ups); ours: the forward kernel, not the pre-pass.
    one=(ncu --clock-control none --launch-skip 3 --launch-count 1 --metrics "$M" --kernel-name-base demangled)
    for d in ${HDIMS//,/ }; do
        for s in ${SEQS//,/ }; do
            for kernel in ${KERNELS:-ours prepass fa3 cudnn}; do
                case $kernel in
                ours) ours "$d" "$s" "" "${one[@]}" -k regex:flash_fwd_d ;;
                prepass) ours "$d" "$s" fp8_vt=prepass "${one[@]}" -k regex:flash_fwd_d ;;
                fa3) anchor fa3_fp8 "$d" "$s" "${one[@]}" -k regex:FlashAttnFwdSm90 ;;
                cudnn) anchor cudnn_fp8 "$d" "$s" "${one[@]}" -k regex:sdpa ;;
                *) echo "gpu-fp8-counts: unknown kernel $kernel (ours, prepass, fa3, cudnn)" ;;
                esac >"$LOGS/ncu-$kernel-$d-$s.log" 2>&1
            done
            echo "ncu d$d $s done"
        done
    done
    python3 - "$LOGS" <<'EOF'
import collections, glob, math, os, re, sys
logs = sys.argv[1]
cycles = collections.defaultdict(dict)
cols = [("sm__cycles_elapsed.avg", "cycles", 1), ("sm__inst_executed.sum", "warp inst M", 1e6),
        ("sm__inst_executed_pipe_tensor_op_gmma.sum", "gmma inst M", 1e6),
        ("l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum", "local ld sectors M", 1e6),
        ("dram__bytes_read.sum", "DRAM read MB", 1e6), ("dram__bytes_write.sum", "DRAM write MB", 1e6)]
scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
print("\n| kernel, head dim, seqlen | " + " | ".join(c[1] for c in cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for f in sorted(glob.glob(f"{logs}/ncu-*.log")):
    vals = {}
    for line in open(f, errors="replace"):
        m = re.match(r"^\s+([a-z0-9_]+__[a-z0-9_.]+)\s+(\S+)\s+([\d.,]+)\s*$", line)
        if m: vals[m[1]] = float(m[3].replace(",", "")) * scale.get(m[2], 1)
    name = os.path.basename(f)[4:-4]
    if not vals: print(f"| {name} | no launch profiled (log: {f}) |"); continue
    print(f"| {name} | " + " | ".join(f"{vals.get(k, float('nan')) / div:.4g}" for k, _, div in cols) + " |")
    kernel, d, s = name.rsplit("-", 2)
    cycles[(kernel, int(d))][int(s)] = vals.get("sm__cycles_elapsed.avg")

# Per kernel and head dim, from its two shortest lengths: elapsed = k · (B + keys · p), k the tiles
# of the busiest CTA (the grid's tiles over 132 CTAs, rounded up; d64, whose 192-row tiles leave
# a partial one per sequence and go through the atomic counter: the average), tiles of 192 query
# rows at d64 and 128 otherwise (ours and FA3's; cuDNN's taken as 128 too).
print("\n| kernel, head dim | p (cycles per 128 keys) | B (cycles per tile) |\n|---|---|---|")
for (kernel, d), by_len in sorted(cycles.items()):
    lens = sorted(s for s, c in by_len.items() if c)
    if len(lens) < 2: continue
    def per_tile(s):
        rows = 192 if d == 64 else 128
        tiles = math.ceil(s / rows) * (2048 // d) * max(1, 16384 // s)
        return by_len[s] / (tiles / 132 if d == 64 else math.ceil(tiles / 132))
    (s0, s1) = lens[:2]
    p = (per_tile(s1) - per_tile(s0)) / (s1 - s0)
    print(f"| {kernel} d{d} | {p * 128:.0f} | {per_tile(s0) - s0 * p:.0f} |")
EOF
fi
