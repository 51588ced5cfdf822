#!/usr/bin/env python3
"""Decode/prefill tokens/s of two `generate` builds, alternating, median of --reps runs each.

Runs ON the GPU machine next to scripts/gpu_model_check.py (whose random-weight model
directories it writes into --work when they are missing); same prompts and flags as its speed
rows (512-token random prompts, 128 new tokens, --warmup --ignore-eos, bf16):

    python3 scripts/gpu_model_reps.py --before /tmp/dec/before --after /tmp/dec/after --work /tmp/w

A single generation of 127 decode steps takes about half a second at batch 1 and moves by
±15% from run to run; alternating the builds and taking medians keeps that noise out of the
before/after ratio.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model_check as g  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--before", required=True)
ap.add_argument("--after", required=True)
ap.add_argument("--work", default="/tmp/flash-llama-check")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--batches", default="1,16")
args = ap.parse_args()
bins = {"before": args.before, "after": args.after}
for name, cfg in g.MODELS.items():
    d = os.path.join(args.work, name)
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        g.write_model(cfg, d, seed=7)
    rng = np.random.default_rng(99)
    for batch in map(int, args.batches.split(",")):
        prompts = rng.integers(10, cfg["vocab_size"], size=(batch, 512)).tolist()
        res = {k: [] for k in bins}
        for _ in range(args.reps):
            for k, b in bins.items():
                cmd = [b, "--model", d, "-n", "128", "--dtype", "bf16", "--ignore-eos", "--warmup"]
                for p in prompts:
                    cmd += ["--token-ids", ",".join(map(str, p))]
                err = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stderr
                m = re.search(r"\(([\d.]+) tokens/s\); generation: \d+ tokens in [\d.]+s \(([\d.]+) tokens/s\)", err)
                # Builds from 2026-11-22 on also print how much of the decode time was spent
                # waiting for the device.
                w = re.search(r"(\d+)% of the time waiting", err)
                res[k].append((float(m.group(1)), float(m.group(2)), int(w.group(1)) if w else None))
        for k, v in res.items():
            dec, pre = [x[1] for x in v], [x[0] for x in v]
            waits = [x[2] for x in v if x[2] is not None]
            wait = f"; waiting for the device {', '.join(f'{x}%' for x in waits)}" if waits else ""
            print(
                f"{name} batch {batch} {k}: decode median {statistics.median(dec):.1f} "
                f"(runs {', '.join(f'{x:.1f}' for x in dec)}); prefill median {statistics.median(pre):.0f} "
                f"(runs {', '.join(f'{x:.0f}' for x in pre)}){wait}",
                flush=True,
            )
