#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/ carried (scripts/gpu-pack.sh):
# Nsight Compute on one forward (or backward) launch per case of the GPU benchmark binary.
#
#   PROFILE_CASES="128:2048:0 64:8192:0" bash scripts/gpu-profile.sh
#   PROFILE_PASS=bwd PROFILE_CASES="128:4096:0" bash scripts/gpu-profile.sh
#
# A case is HEAD_DIM:SEQLEN:CAUSAL on the benchmark's grid (16k tokens, hidden 2048, bf16). For
# each, ncu (--set full, clocks left alone) profiles the 4th launch (after the bench's warm-ups)
# and prints the headline metrics and the SASS instructions with the most stall samples.
# $OUT/profile.tar.xz (or /tmp/gpu-profile/) gets each case's details page and per-instruction CSV.
# Env: PROFILE_PASS (fwd, fp8 (the e4m3 grid) or bwd; default fwd: the backward's main kernel is profiled, not its
# pre/postprocess), PROFILE_SET (default full), PROFILE_TOP (default 30 instructions),
# PROFILE_METRICS (extra comma-separated ncu metrics, printed per case).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
DEV=$PWD/.device
WORK=/tmp/gpu-profile
mkdir -p "$WORK"
BENCH=$WORK/gpu-bench
[[ -x $BENCH ]] || { xz -dc "$DEV/gpu-bench.xz" >"$BENCH" && chmod +x "$BENCH"; } || exit 2
command -v ncu >/dev/null || { echo "gpu-profile: ncu not found" >&2; exit 2; }

PASS=${PROFILE_PASS:-fwd}
case $PASS in
fwd) KERNEL=regex:flash_fwd ;;
bwd) KERNEL=regex:flash_bwd_d ;;
fp8) KERNEL=regex:flash_fwd_d ;;  # the e4m3 grid's forward kernel, not its V transpose pre-pass
*) echo "gpu-profile: PROFILE_PASS is fwd, fp8 or bwd" >&2; exit 2 ;;
esac

# ncu ARGS... on the 4th launch of the case's kernel (after the bench's warm-ups).
profile_case() {
    BENCH_HDIMS=$d BENCH_SEQS=$s BENCH_CAUSAL=$c BENCH_DECODE=0 BENCH_PASSES=$PASS \
        ncu --clock-control none -k $KERNEL --launch-skip 3 --launch-count 1 "$@" "$BENCH"
}

for case in ${PROFILE_CASES:-128:2048:0}; do
    IFS=: read -r d s c <<<"$case"
    name=${PASS}_d${d}_s${s}_c${c}
    echo "===== $name"
    profile_case --set "${PROFILE_SET:-full}" --import-source no -f -o "$WORK/$name" >"$WORK/$name.run.log" 2>&1 ||
        { tail -20 "$WORK/$name.run.log"; continue; }
    ncu -i "$WORK/$name.ncu-rep" --page details --print-units base >"$WORK/$name.details.txt" 2>&1
    ncu -i "$WORK/$name.ncu-rep" --page source --csv --print-source sass >"$WORK/$name.sass.csv" 2>&1
    # The details page indents its metric rows by four spaces.
    grep -E "^ {4}(Duration|Elapsed Cycles|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc Active|No Eligible|Achieved Occupancy|Local Memory|Shared Memory Configuration)" \
        "$WORK/$name.details.txt" | sort -u | head -30
    if [[ -n ${PROFILE_METRICS:-} ]]; then
        profile_case --metrics "$PROFILE_METRICS" 2>&1 | grep -E "^ +[a-z0-9_]+__[a-z0-9_.]+ " ||
            echo "gpu-profile: the metrics run printed no metric"
    fi
    python3 - "$WORK/$name.sass.csv" "${PROFILE_TOP:-30}" <<'EOF'
import csv, sys
path, top = sys.argv[1], int(sys.argv[2])
rows = list(csv.reader(open(path, errors="replace")))
hdr = next((i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r)), None)
if hdr is None:
    print("no per-instruction sampling columns in", path); print("\n".join(",".join(r) for r in rows[:5])); sys.exit()
h = rows[hdr]
src = h.index("Source")
samp = next(i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All"))
addr = h.index("Address") if "Address" in h else None
data = []
for r in rows[hdr + 1:]:
    try:
        data.append((float(r[samp] or 0), r[addr] if addr is not None else "", r[src]))
    except (ValueError, IndexError):
        pass
total = sum(x[0] for x in data) or 1
print(f"top {top} of {len(data)} SASS instructions by stall samples (total {int(total)}):")
for n, a, s in sorted(data, reverse=True)[:top]:
    print(f"{100 * n / total:6.2f}%  {a:>6}  {s[:110]}")
EOF
done
tar -C "$WORK" -cJf "${OUT:-$WORK}/profile.tar.xz" $(cd "$WORK" && ls *.details.txt *.sass.csv 2>/dev/null)
