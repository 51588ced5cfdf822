#!/usr/bin/env python3
"""Decode tokens/s and inter-token latency of the packed `generate` example with the decode step
replayed from a CUDA graph (the default) and with eager launches (--no-cuda-graphs), alternating
in one call, medians of --reps runs each.

Runs ON the GPU machine (scripts/gpu-run.sh --graphs): random-weight models written by
scripts/gpu_model_check.py (the Llama-3.2-1B shape by default), bf16, greedy, random prompts of
--prompt tokens, --new new tokens, --warmup --ignore-eos:

    python3 scripts/gpu_decode_graphs.py --bin /tmp/gpu-run-bin/generate --batches 1,32,128

Prints one line per (model, batch, mode) and a markdown table last, with the batch-1 decode
against the weight-bandwidth bound (every bf16 weight read once per step at the measured device
copy bandwidth).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_model_check as g  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--bin", required=True)
ap.add_argument("--base-bin", help="another build's generate, for mode `base` (its graph decode), alternating with this build's")
ap.add_argument("--work", default="/tmp/flash-llama-check")
ap.add_argument("--models", default="llama3.2-1b-shape")
ap.add_argument("--batches", default="1,32,128")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--prompt", type=int, default=512)
ap.add_argument("--new", type=int, default=128)
ap.add_argument("--modes", default="graph,eager", help="graph (the default decode), base (the same with --base-bin), eager (--no-cuda-graphs), sampled (temperature 0.8, top-p 0.95: tokens drawn on the device after each graph replay), sampled-eager (the same with --no-cuda-graphs), sampled-host (the same drawn on the host)")
ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which no run starts")
args = ap.parse_args()
start = time.time()

PAT = re.compile(r"generation: (\d+) tokens in [\d.]+s \(([\d.]+) tokens/s\)")
ITL = re.compile(r"inter-token latency: p50 ([\d.]+) ms, p99 ([\d.]+) ms")
PRE = re.compile(r"prompt: (\d+) tokens in [\d.]+s \(([\d.]+) tokens/s\)")


def weight_bytes(cfg):
    """bf16 bytes a batch-1 step reads: every layer's weights, the final norm and the output head
    (the embedding matrix itself when tied); the embedding lookup's one row is left out."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 2 * (n * per_layer + h + v * h)


bw = g.copy_bandwidth()
print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
rows = []
for name in args.models.split(","):
    cfg = g.MODELS[name]
    d = os.path.join(args.work, name)
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        g.write_model(cfg, d, seed=7)
    bound = bw / weight_bytes(cfg)
    rng = np.random.default_rng(99)
    for batch in map(int, args.batches.split(",")):
        prompts = rng.integers(10, cfg["vocab_size"], size=(batch, args.prompt)).tolist()
        ids_file = os.path.join(args.work, f"prompts-{batch}.txt")
        res = {m: [] for m in args.modes.split(",")}
        for _ in range(args.reps):
            for mode in res:
                if time.time() - start > args.deadline:
                    break
                binary = args.base_bin if mode == "base" else args.bin
                if binary is None:
                    sys.exit("mode base needs --base-bin")
                cmd = [binary, "--model", d, "-n", str(args.new), "--dtype", "bf16", "--ignore-eos", "--warmup"]
                cmd += g.token_id_args(prompts, ids_file)
                if mode == "eager":
                    cmd.append("--no-cuda-graphs")
                elif mode == "sampled":
                    # Temperature / top-p sampling, drawn on the device after each graph replay.
                    cmd += ["--temperature", "0.8", "--top-p", "0.95"]
                elif mode == "sampled-eager":
                    # The same with eager steps.
                    cmd += ["--temperature", "0.8", "--top-p", "0.95", "--no-cuda-graphs"]
                elif mode == "sampled-host":
                    # The same with a (negligible) repeat penalty, which keeps the draw on the host.
                    cmd += ["--temperature", "0.8", "--top-p", "0.95", "--repeat-penalty", "1.0001"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                m, itl = PAT.search(r.stderr), ITL.search(r.stderr)
                if r.returncode != 0 or not m:
                    print(f"{name} batch {batch} {mode}: FAILED (rc {r.returncode})\n{r.stderr[-2000:]}", flush=True)
                    continue
                pre = PRE.search(r.stderr)
                # The prefill's time (time to the first token), and the prefill and decode's together.
                pre_ms = 1e3 * int(pre.group(1)) / float(pre.group(2)) if pre else float("nan")
                total_ms = pre_ms + 1e3 * int(m.group(1)) / float(m.group(2))
                res[mode].append((float(m.group(2)), float(itl.group(1)), float(itl.group(2)), pre_ms, total_ms))
        for mode, v in res.items():
            if not v:
                rows.append((name, batch, mode, None, None, None, "", bound))
                continue
            tok = statistics.median(x[0] for x in v)
            p50 = statistics.median(x[1] for x in v)
            p99 = statistics.median(x[2] for x in v)
            pre = statistics.median(x[3] for x in v)
            total = statistics.median(x[4] for x in v)
            runs = ", ".join(f"{x[0]:.1f}" for x in v)
            print(f"{name} batch {batch} {mode}: decode median {tok:.1f} tokens/s (runs {runs}); ITL p50 {p50:.2f} ms, p99 {p99:.2f} ms; prefill {pre:.2f} ms, prefill + decode {total:.2f} ms", flush=True)
            rows.append((name, batch, mode, tok, p50, p99, runs, bound))

print(f"\n| model | batch | mode | decode tokens/s (median) | runs | ITL p50 ms | ITL p99 ms | batch 1: % of the weight-bandwidth bound |")
print("|---|---|---|---|---|---|---|---|")
for name, batch, mode, tok, p50, p99, runs, bound in rows:
    if tok is None:
        print(f"| {name} | {batch} | {mode} | failed | | | | |")
        continue
    pct = f"{100 * tok / bound:.0f}% of {bound:.0f}" if batch == 1 else ""
    print(f"| {name} | {batch} | {mode} | {tok:.1f} | {runs} | {p50:.2f} | {p99:.2f} | {pct} |")
