#!/usr/bin/env python3
"""Ours against the best anchor, per cell, from one scripts/gpu-run.sh --anchors call.

    python3 scripts/anchor_table.py BENCH_LOG ANCHORS_JSON [fwd|bwd]

BENCH_LOG: the call's bench.log (the gpu_attention benchmark; for the backward, the op-alone
figure); ANCHORS_JSON: anchors_bench.py's anchors.json. Prints the markdown table of
docs/benchmarks.md ("ours / best (which) = ratio") and, last, how many cells at seqlen >= 2k reach
0.9 of the best anchor.
"""
import json
import re
import sys
from collections import defaultdict

bench, anchors = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "fwd"

ours = {}
for line in open(bench):
    m = re.match(r"ours\s+(fwd|bwd) d=\s*(\d+) causal=(\d) s=\s*(\d+)", line)
    tflops = re.findall(r"([\d.]+) TFLOP/s", line)
    if m and tflops and m[1] == mode:
        ours[(int(m[2]), int(m[3]), int(m[4]))] = float(tflops[-1])  # bwd: the op alone

best = defaultdict(lambda: (0.0, "-"))
for r in json.load(open(anchors)):
    if r["mode"] == mode and r.get("tflops"):
        key = (r["d"], int(r["causal"]), r["s"])
        if r["tflops"] > best[key][0]:
            best[key] = (r["tflops"], r["impl"])

seqs = sorted({s for _, _, s in ours})
label = lambda s: f"{s // 1024}k" if s >= 1024 else str(s)
print("| head dim | mask | " + " | ".join(label(s) for s in seqs) + " |")
print("|---|---|" + "---|" * len(seqs))
passing = total = 0
for d in sorted({d for d, _, _ in ours}):
    for c in (0, 1):
        cells = []
        for s in seqs:
            o, (b, impl) = ours.get((d, c, s)), best[(d, c, s)]
            if o is None or b == 0:
                cells.append("-")
                continue
            cells.append(f"{o:.0f} / {b:.0f} ({impl}) = {o / b:.2f}")
            if s >= 2048:
                total += 1
                passing += o / b >= 0.9
        print(f"| {d} | {'causal' if c else 'full'} | " + " | ".join(cells) + " |")
print(f"\n{passing} of {total} cells at seqlen >= 2k reach 0.9 of the best anchor")
