#!/usr/bin/env bash
# Runs ON the GPU machine: A/B of two builds of the benchmark in one call, interleaved (base, new,
# base, new), then the new build's GPU tests. Between device calls the same binary moves by up to
# 8%, so kernel versions are compared this way only.
#
#   here:  scripts/gpu-pack.sh --attn --baseline REV   (REV's benchmark into .device-base/)
#   run    carry [".device", ".device-base"]  command "bash scripts/gpu-ab.sh"
#
# Env: PASSES (fwd, bwd, kvcache, comma-separated; default fwd), SEQS (default 512..8192), HD
# (head dims, default 64,128,256), TESTS (a test filter; empty: every test). Prints the failing
# tests (if any), then per cell both runs of each build and new / base (mean of the two runs);
# backward cells use the op-alone TFLOP/s (FlashAttn::backward); kvcache rows (the decode grid,
# d128) give µs of the contiguous, paged (16 / 64 / 256) and graph-replayed calls per build and
# their new / base ratios.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export BENCH_DECODE=0 BENCH_SEQS=${SEQS:-512,1024,2048,4096,8192} BENCH_HDIMS=${HD:-64,128,256}
export BENCH_PASSES=${PASSES:-fwd}
xz -dc .device-base/gpu-bench.xz >/tmp/base && xz -dc .device/gpu-bench.xz >/tmp/new || exit 2
chmod +x /tmp/base /tmp/new
for r in 1 2; do
    for b in base new; do /tmp/$b | grep -E "^ours|^\| [0-9]" >/tmp/$b$r.txt; done
done
if xz -dc .device/gpu-test.xz >/tmp/test && chmod +x /tmp/test; then
    # shellcheck disable=SC2086 # TESTS is a word list
    /tmp/test --test-threads=1 ${TESTS:-} 2>&1 | grep -E "^test |test result" | grep -v " ok$"
fi
python3 - <<'PY'
import collections, re
cells = collections.defaultdict(lambda: collections.defaultdict(list))
for build in ("base", "new"):
    for r in (1, 2):
        for line in open(f"/tmp/{build}{r}.txt"):
            m = re.search(r"(fwd|bwd) d=\s*(\d+) causal=(\d) s=\s*(\d+)", line)
            tflops = re.findall(r"([\d.]+) TFLOP/s", line)
            if m and tflops:  # the backward's last figure is the op alone
                cells[(m[1], int(m[2]), int(m[3]), int(m[4]))][build].append(float(tflops[-1]))
print("| pass | head dim | causal | seqlen | base TFLOP/s | new TFLOP/s | new / base |")
print("|---|---|---|---|---|---|---|")
for (p, d, c, s), v in sorted(cells.items()):
    b, n = v["base"], v["new"]
    if b and n:
        print(f"| {p} | {d} | {c} | {s} | {' '.join(f'{x:.0f}' for x in b)} | {' '.join(f'{x:.0f}' for x in n)} | {sum(n) / sum(b):.3f} |")
# The kvcache pass's rows: batch | seqlen_q | seqlen_k | contiguous us | TB/s | % copy | page 16 us
# | x | page 64 us | x | page 256 us | x | graph us | TB/s | graph, max splits us.
kv = collections.defaultdict(lambda: collections.defaultdict(list))
for build in ("base", "new"):
    for r in (1, 2):
        for line in open(f"/tmp/{build}{r}.txt"):
            c = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(c) == 15 and c[0].isdigit():
                kv[tuple(int(x) for x in c[:3])][build].append([float(c[i]) for i in (3, 6, 8, 10, 12)])
if kv:
    cols = ("contiguous", "page 16", "page 64", "page 256", "graph")
    print("\nkvcache µs, mean of two runs: base / new (new / base)")
    print("| batch | seqlen_q | seqlen_k | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for key, v in sorted(kv.items()):
        if not (v["base"] and v["new"]):
            continue
        b = [sum(x[i] for x in v["base"]) / len(v["base"]) for i in range(len(cols))]
        n = [sum(x[i] for x in v["new"]) / len(v["new"]) for i in range(len(cols))]
        print("| %d | %d | %d | " % key + " | ".join(f"{b[i]:.1f} / {n[i]:.1f} ({n[i] / b[i]:.2f})" for i in range(len(cols))) + " |")
PY
