#!/usr/bin/env bash
# Runs ON the GPU machine: A/B of builds of the benchmark in one call, alternating (each build
# once per round, ROUNDS rounds), then the new build's GPU tests. Between device calls the same
# binary moves by up to 8%, so kernel versions are compared this way only. The builds:
#   base            .device-base/gpu-bench.xz (gpu-pack.sh --baseline REV: another revision), if packed
#   new             .device/gpu-bench.xz (the working tree)
#   NAME            .device-base/gpu-bench-NAME.xz (gpu-pack.sh --variant NAME=FLAGS: the working
#                   tree with extra nvcc flags), each one packed
#
#   here:  scripts/gpu-pack.sh --attn [--baseline REV] [--variant NAME=FLAGS]...
#   run    carry [".device", ".device-base"]  command "bash scripts/gpu-ab.sh"
#
# Env: TUNINGS (below: builds run again with a BENCH_TUNING), PASSES (fwd, fp8, bwd, kvcache, kvcache_fp8, comma-separated; default fwd), SEQS (default 512..8192), HD
# (head dims, default 64,128,256), KV_FP8_D (the kvcache_fp8 pass's head dim: 128, or 64), ROUNDS (default 2), TESTS (a test filter; empty: every test;
# "none": no tests), DEADLINE (seconds for the whole script, default 540: keep it under the device
# call's limit, so that the tables still print), RUN_TIMEOUT (seconds per benchmark run, default
# 240) and TEST_TIMEOUT (the tests, default 360). Each run's whole output goes to $OUT/ab-*.log
# (the device tool brings $OUT back; /tmp/gpu-ab without it), so a run that hangs or fails still
# leaves its log; a run that hits its limit or the deadline is reported as such (the rows it
# printed before count). Prints the failing tests (if any), then per cell every build's best run and
# its ratio to the first build (base if packed, else new); backward cells use the op-alone
# TFLOP/s (FlashAttn::backward); kvcache rows (the decode grid, d128) the µs of the contiguous,
# paged (16 / 64 / 256) and graph-replayed calls.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export BENCH_DECODE=0 BENCH_SEQS=${SEQS:-512,1024,2048,4096,8192} BENCH_HDIMS=${HD:-64,128,256}
export BENCH_PASSES=${PASSES:-fwd}
# The kvcache_fp8 pass's head dim: 128 (heads 32/4) or 64 (the Llama-3.2-1B shape, 32/8); one per
# A/B, since the table below keys its rows by batch and seqlen_k.
export BENCH_KV_FP8_D=${KV_FP8_D:-128}
WORK=/tmp/gpu-ab
rm -rf "$WORK" && mkdir -p "$WORK"
LOGS=${OUT:-$WORK}
mkdir -p "$LOGS"
START=$SECONDS
DEADLINE=${DEADLINE:-540}
# limited NAME LIMIT CMD...: CMD with its output in $LOGS/ab-NAME.log, stopped after LIMIT seconds
# or at the deadline (whichever comes first); returns CMD's status, 124 when stopped.
limited() {
    local name=$1 limit=$2 left rc
    shift 2
    left=$((DEADLINE - (SECONDS - START)))
    : >"$LOGS/ab-$name.log"
    if ((left < 5)); then
        echo "gpu-ab: $name not run (deadline)" >&2
        return 124
    fi
    ((left < limit)) && limit=$left
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/ab-$name.log" 2>&1
    rc=$?
    ((rc == 124 || rc == 137)) && echo "gpu-ab: $name stopped after $limit s (log: $LOGS/ab-$name.log, last line: $(tail -n 1 "$LOGS/ab-$name.log"))" >&2
    ((rc != 0 && rc != 124 && rc != 137)) && echo "gpu-ab: $name failed (rc $rc; log: $LOGS/ab-$name.log): $(grep -m1 -E 'Error|panicked' "$LOGS/ab-$name.log")" >&2
    return $rc
}
BUILDS=()
unpack() { xz -dc "$1" >"$WORK/$2" && chmod +x "$WORK/$2" && BUILDS+=("$2"); }
[[ -f .device-base/gpu-bench.xz ]] && unpack .device-base/gpu-bench.xz base
unpack .device/gpu-bench.xz new || exit 2
for f in .device-base/gpu-bench-*.xz; do
    [[ -f $f ]] || continue
    name=${f#.device-base/gpu-bench-}
    unpack "$f" "${name%.xz}"
done
# TUNINGS="NAME=TUNING;...": each packed build also runs with BENCH_TUNING=TUNING, as build
# "BUILD-NAME" (a kernel the default choice does not take, forced: e.g. prepass=fp8_vt=prepass).
if [[ -n ${TUNINGS:-} ]]; then
    IFS=';' read -ra entries <<<"$TUNINGS"
    packed=("${BUILDS[@]}")
    for e in "${entries[@]}"; do
        [[ $e =~ ^[A-Za-z0-9_-]+=.+$ ]] || { echo "gpu-ab: TUNINGS entry '$e' is not NAME=TUNING" >&2; exit 2; }
        for b in "${packed[@]}"; do
            printf '#!/usr/bin/env bash\nBENCH_TUNING=%q exec %q "$@"\n' "${e#*=}" "$WORK/$b" >"$WORK/$b-${e%%=*}"
            chmod +x "$WORK/$b-${e%%=*}" && BUILDS+=("$b-${e%%=*}")
        done
    done
fi
((${#BUILDS[@]} >= 2)) || { echo "gpu-ab: one build only (pack a --baseline or a --variant, or set TUNINGS)" >&2; exit 2; }
[[ -f .device-base/manifest.txt ]] && cat .device-base/manifest.txt
for r in $(seq "${ROUNDS:-2}"); do
    for b in "${BUILDS[@]}"; do
        limited "$b.$r" "${RUN_TIMEOUT:-240}" "$WORK/$b"
        grep -E "^ours|^\| [0-9]" "$LOGS/ab-$b.$r.log" >"$WORK/$b.$r.txt"
    done
done
if [[ ${TESTS:-} != none ]] && xz -dc .device/gpu-test.xz >"$WORK/test" && chmod +x "$WORK/test"; then
    # shellcheck disable=SC2086 # TESTS is a word list
    limited tests "${TEST_TIMEOUT:-360}" "$WORK/test" --test-threads=1 ${TESTS:-}
    grep -E "^test |test result" "$LOGS/ab-tests.log" | grep -v " ok$"
fi
python3 - "$WORK" "${ROUNDS:-2}" "${BUILDS[@]}" <<'PY'
import collections, os, re, sys
work, rounds, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ref = builds[0]
lines = {b: [l for r in range(1, rounds + 1) for l in open(f"{work}/{b}.{r}.txt")] for b in builds}
cells = collections.defaultdict(lambda: collections.defaultdict(list))
for b in builds:
    for line in lines[b]:
        m = re.search(r"^(\S+)\s+(fwd|bwd) d=\s*(\d+) causal=(\d) s=\s*(\d+)", line)
        tflops = re.findall(r"([\d.]+) TFLOP/s", line)
        if m and tflops:  # the backward's last figure is the op alone
            cells[(m[1], m[2], int(m[3]), int(m[4]), int(m[5]))][b].append(float(tflops[-1]))
if cells:
    print(f"\nTFLOP/s, best of {rounds} runs (ratio to {ref})")
    print("| kernel | pass | head dim | causal | seqlen | " + " | ".join(builds) + " |")
    print("|---|---|---|---|---|" + "---|" * len(builds))
    for key, v in sorted(cells.items()):
        if not all(v[b] for b in builds):
            continue
        best = {b: max(v[b]) for b in builds}
        row = [f"{best[ref]:.0f}"] + [f"{best[b]:.0f} ({best[b] / best[ref]:.3f})" for b in builds[1:]]
        print("| %s | %s | %d | %d | %d | " % key + " | ".join(row) + " |")

def us_table(title, width, key_names, cols):
    """The microsecond rows of one benchmark pass: table rows of `width` cells whose first
    len(key_names) cells are the shape; per shape each build's best of its runs in the columns
    `cols` (name: cell index), with the ratio to the first build."""
    keys = len(key_names)
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for b in builds:
        for line in lines[b]:
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) == width and c[0].isdigit():
                try:
                    rows[tuple(int(x) for x in c[:keys])][b].append([float(c[i]) for i in cols.values()])
                except ValueError:
                    pass
    if not rows:
        return
    print(f"\n{title}, best of {rounds} runs (ratio to {ref}); eager calls but for `graph`")
    print("| " + " | ".join(key_names) + " | build | " + " | ".join(cols) + " |")
    print("|" + "---|" * (keys + 1 + len(cols)))
    for key, v in sorted(rows.items()):
        if not all(v[b] for b in builds):
            continue
        best = {b: [min(x[i] for x in v[b]) for i in range(len(cols))] for b in builds}
        for b in builds:
            vals = " | ".join(f"{best[b][i]:.1f}" + ("" if b == ref else f" ({best[b][i] / best[ref][i]:.2f})") for i in range(len(cols)))
            print("| " + " | ".join(str(k) for k in key) + f" | {b} | {vals} |")


# The kvcache pass's rows (gpu_attention.rs, kvcache_table): batch | seqlen_q | seqlen_k |
# contiguous us | TB/s | % copy | graph us | TB/s | graph, max splits us | then per page size
# (16, 64, 256; labelled so even when BENCH_PAGE_SIZES ran others): us | x contiguous | graph x
# contiguous graph.
us_table("kvcache µs", 18, ["batch", "seqlen_q", "seqlen_k"],
         {"contiguous": 3, "graph": 6, "page 16": 9, "page 64": 12, "page 256": 15})
# The kvcache_fp8 pass's rows (kvcache_fp8_table): batch | seqlen_k | bf16 us | fp8 us | ratio |
# bf16 page 64 us | fp8 page 64 us | ratio | bf16 graph us | fp8 graph us | ratio.
# (The heads of each head dim's shape: gpu_attention.rs, kvcache_fp8_tables, and the runs' logs.)
us_table(f"kvcache_fp8 µs (d{os.environ['BENCH_KV_FP8_D']}, seqlen_q 1)", 11, ["batch", "seqlen_k"],
         {"bf16": 2, "fp8": 3, "bf16 page 64": 5, "fp8 page 64": 6, "bf16 graph": 8, "fp8 graph": 9})
PY
