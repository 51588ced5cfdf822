#!/usr/bin/env python3
"""Where a replayed decode step's time goes, kernel by kernel, in place (CUPTI activity records).

Runs ON the GPU machine (scripts/gpu-run.sh --timeline): writes the random-weight model
(scripts/gpu_model_check.py's, the Llama-3.2-1B shape by default) if missing, runs `generate`
(CUDA-graph decode) with a CUPTI activity tracer injected (scripts/kernel_trace.cpp, built by
scripts/build-kernel-trace.sh, loaded through CUDA_INJECTION64_PATH), which records every kernel
node of every replay with its real start and end, and summarises the last --steps steps (a step
= the kernels after one greedy argmax through the next). Unlike scripts/gpu_decode_profile.py
(Nsight Compute, each node run alone), the times here are the nodes as they run inside the
replay: overlapped with their neighbours (programmatic dependent launch) and with the caches as
the step leaves them. (The machine's nsys cannot import its own reports: no QdstrmImporter.)

Per kernel name: launches per step, the mean time from its start to its end ("busy"), and the
mean time it adds to the step ("exposed": from the previous kernel's end, or its own start if
later, to its own end; a node that finishes under its predecessor adds nothing), and the time the
GPU ran nothing before it ("idle before"). Exposed and idle times sum to the step. Copies and
memsets appear as "[memcpy ...]" rows.

    python3 scripts/gpu_decode_timeline.py --bin /tmp/gen [--base-bin /tmp/gb] [--batch 1] [--steps 20]
"""
import argparse
import collections
import csv
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model_check as g  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--bin", required=True)
ap.add_argument("--base-bin", help="another build's generate, summarised the same way after --bin")
ap.add_argument("--work", default="/tmp/flash-llama-check")
ap.add_argument("--model", default="llama3.2-1b-shape")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--new", type=int, default=48)
ap.add_argument("--steps", type=int, default=20, help="the last this many decode steps are summarised")
ap.add_argument("--tracer", default=".device/kt/libkernel_trace.so", help="the injection library")
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="where the step's kernel list (CSV) goes")
args = ap.parse_args()

tracer = os.path.abspath(args.tracer)
if not os.path.exists(tracer):
    sys.exit(f"gpu_decode_timeline: no {tracer} (scripts/build-kernel-trace.sh builds it)")

cfg = g.MODELS[args.model]
d = os.path.join(args.work, args.model)
if not os.path.exists(os.path.join(d, "model.safetensors")):
    g.write_model(cfg, d, seed=7)
rng = np.random.default_rng(5)
prompts = g.token_id_args(
    [rng.integers(10, cfg["vocab_size"], size=args.prompt).tolist() for _ in range(args.batch)],
    os.path.join(args.work, "timeline-prompt"),
)


def trace(binary, tag):
    """[(name, start ns, end ns)] of every kernel the run launched, in start order."""
    path = os.path.join(args.work, f"timeline-{tag}.csv")
    if os.path.exists(path):
        os.remove(path)
    env = dict(os.environ, CUDA_INJECTION64_PATH=tracer, KERNEL_TRACE_OUT=path)
    cmd = [binary, "--model", d, "-n", str(args.new), "--dtype", "bf16", "--ignore-eos", "--warmup"] + prompts
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    if r.returncode != 0 or not os.path.exists(path):
        print(r.stdout[-2000:], r.stderr[-2000:])
        sys.exit(f"gpu_decode_timeline: the traced run failed ({r.returncode})")
    out = []
    with open(path) as f:
        for row in csv.DictReader(f):
            out.append((row["name"][:60], int(row["start_ns"]), int(row["end_ns"])))
    out.sort(key=lambda k: k[1])
    return out


def summarise(kernels, tag):
    # A greedy step ends with its argmax: one kernel (argmax_rows) in older builds, chunks then
    # argmax_finish now.
    ends = [i for i, (name, _, _) in enumerate(kernels) if name.startswith(("argmax_rows", "argmax_finish"))]
    if len(ends) < args.steps + 1:
        sys.exit(f"gpu_decode_timeline: {len(ends)} argmax launches, fewer than --steps + 1")
    busy = collections.defaultdict(float)
    exposed = collections.defaultdict(float)
    idle = collections.defaultdict(float)
    count = collections.defaultdict(int)
    step_ns = []
    first_step = None
    for s in range(len(ends) - args.steps - 1, len(ends) - 1):
        step = kernels[ends[s] + 1:ends[s + 1] + 1]
        if first_step is None:
            first_step = step
        prev_end = kernels[ends[s]][2]
        step_ns.append(step[-1][2] - prev_end)
        for name, t0, t1 in step:
            count[name] += 1
            busy[name] += t1 - t0
            exposed[name] += max(0, t1 - max(t0, prev_end))
            idle[name] += max(0, t0 - prev_end)
            prev_end = max(prev_end, t1)
    n = args.steps
    step_us = np.array(step_ns) / 1e3
    print(f"{tag}: batch {args.batch}, the last {n} replayed steps: step median {np.median(step_us):.1f} us "
          f"(min {step_us.min():.1f}, max {step_us.max():.1f}), {len(first_step)} kernels a step")
    print("| kernel | per step | busy us (sum a step) | exposed us (sum a step) | exposed us each | idle before it (us a step) |")
    print("|---|---|---|---|---|---|")
    for name in sorted(exposed, key=lambda k: -exposed[k]):
        c = count[name] / n
        print(f"| {name} | {c:g} | {busy[name] / n / 1e3:.1f} | {exposed[name] / n / 1e3:.1f} | "
              f"{exposed[name] / count[name] / 1e3:.2f} | {idle[name] / n / 1e3:.1f} |")
    path = os.path.join(args.out, f"timeline-{tag}-step.csv")
    with open(path, "w") as f:
        f.write("kernel,start_us,end_us\n")
        base = first_step[0][1]
        for name, t0, t1 in first_step:
            f.write(f"{name},{(t0 - base) / 1e3:.3f},{(t1 - base) / 1e3:.3f}\n")
    print(f"one step's kernels in place: {path}")


summarise(trace(args.bin, "this"), "this")
if args.base_bin:
    summarise(trace(args.base_bin, "base"), "base")
