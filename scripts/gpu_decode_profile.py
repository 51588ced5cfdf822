#!/usr/bin/env python3
"""GPU time of each kernel of one decode step of the packed `generate` example, by Nsight Compute.

Runs ON the GPU machine: writes the random-weight model (scripts/gpu_model_check.py's, the
Llama-3.2-1B shape by default) if missing, runs `generate -n 2` on one random prompt under
`ncu --metrics gpu__time_duration.sum` (clocks left alone), and sums the kernels after the
prefill's greedy argmax (the decode step's) by kernel name: the step's
GPU time without the host. That first decode step runs eagerly, before the capture; --graph
profiles a replayed step instead (`generate -n 4`, `ncu --graph-profiling node`: each kernel of
the graph timed alone, the last replay's kernels summed), with the captured call's attention
split and its combine.

    python3 scripts/gpu_decode_profile.py --bin /tmp/gpu-run-bin/generate [--batch 1] [--prompt 512] [--graph]
        [--kv-cache-dtype fp8]
"""
import argparse
import collections
import csv
import io
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model_check as g  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--bin", required=True)
ap.add_argument("--work", default="/tmp/flash-llama-check")
ap.add_argument("--model", default="llama3.2-1b-shape")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--no-flush", action="store_true",
                help="leave the caches alone between kernels (ncu --cache-control none): closer to a replayed step")
ap.add_argument("--graph", action="store_true",
                help="profile the last replay of the CUDA-graph decode step (each kernel node timed alone)")
ap.add_argument("--kv-cache-dtype", default=None, help="generate's --kv-cache-dtype (e.g. fp8)")
args = ap.parse_args()

cfg = g.MODELS[args.model]
d = os.path.join(args.work, args.model)
if not os.path.exists(os.path.join(d, "model.safetensors")):
    g.write_model(cfg, d, seed=7)
rng = np.random.default_rng(5)
cmd = (["ncu", "--clock-control", "none"] + (["--cache-control", "none"] if args.no_flush else [])
       + (["--graph-profiling", "node"] if args.graph else [])
       + ["--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base",
          args.bin, "--model", d, "-n", "4" if args.graph else "2", "--dtype", "bf16", "--ignore-eos"]
       + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []))
cmd += g.token_id_args(
    [rng.integers(10, cfg["vocab_size"], size=args.prompt).tolist() for _ in range(args.batch)],
    os.path.join(args.work, "profile-prompt"),
)
r = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
lines = r.stdout.splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    print(r.stdout[-3000:], r.stderr[-3000:])
    sys.exit(1)
rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
kernels = [(row["Kernel Name"], float(row["Metric Value"].replace(",", ""))) for row in rows
           if row.get("Metric Name") == "gpu__time_duration.sum"]
scale = 1e-3  # base unit: ns
# Each step ends with its greedy argmax: the decode step is what follows the prefill's. The argmax
# is one kernel (argmax_rows) in older builds, chunks then argmax_finish now: a step ends with the
# last of them.
ends = [i for i, (name, _) in enumerate(kernels) if "argmax_rows" in name or "argmax_finish" in name]
if len(ends) < 2:
    print("no two argmax launches; kernels:", [n.split("(")[0] for n, _ in kernels[-60:]])
    sys.exit(1)
# The last step: the kernels after the second-to-last argmax, through the last.
step = kernels[ends[-2] + 1:ends[-1] + 1]
total = sum(t for _, t in step) * scale
by_name = collections.defaultdict(lambda: [0, 0.0])
for name, t in step:
    short = name.split("(")[0][:70]
    by_name[short][0] += 1
    by_name[short][1] += t * scale
print(f"{'replayed' if args.graph else 'eager'} decode step, batch {args.batch}, prompt {args.prompt}: {len(step)} kernels, {total:.1f} us of GPU time "
      f"({len(kernels)} kernels profiled in all)")
print("| kernel | launches | us | % |")
print("|---|---|---|---|")
for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
    print(f"| {name} | {n} | {t:.1f} | {100 * t / total:.1f} |")
