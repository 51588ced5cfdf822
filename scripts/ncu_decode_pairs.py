"""The decode kernel against the forward kernel per cell, from the output of
`ncu --metrics gpu__time_duration.sum` over the benchmark's kvcache_decode pass with
BENCH_DECODE_ONCE (scripts/gpu-decode-durations.sh).

Each cell prints a `cell ...` line and makes four calls: forward, decode, forward, decode. The
forward call is one or two kernels (the attention and, for split calls that do not merge in a
cluster, the combine), the decode call one, so a decode kernel closes each call's group. The
second (warm) pair of each cell is printed: µs of the forward call, of the decode call, and their
ratio."""
import re
import sys

lines = open(sys.argv[1]).read().splitlines()
cells = [line[5:] for line in lines if line.startswith("cell ")]
durations, name = [], None
for line in lines:
    m = re.match(r"\s*(\S+)\s*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m:
        name = m.group(1)
    m = re.match(r"\s*gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and name:
        unit, value = m.group(1), float(m.group(2).replace(",", ""))
        durations.append((name, value / 1000 if unit == "nsecond" else value))
        name = None
pairs, forward = [], 0.0
for kernel, us in durations:
    if kernel.startswith("kvcache_decode"):
        pairs.append((forward, us))
        forward = 0.0
    else:
        forward += us
if len(pairs) != 2 * len(cells):
    sys.exit(f"ncu_decode_pairs: {len(cells)} cells but {len(pairs)} forward/decode pairs")
print("| cell | forward us | decode us | decode / forward |")
print("|---|---|---|---|")
for i, cell in enumerate(cells):
    f, d = pairs[2 * i + 1]
    print(f"| {cell} | {f:.2f} | {d:.2f} | {d / f:.2f} |")
