#!/usr/bin/env python3
"""The fp8 KV cache of flash-llama on the GPU machine: decode speed and perplexity against the
model-dtype (bf16) cache, in one call. Runs ON the GPU machine with the `generate` example built
with `--features cuda` (scripts/gpu-pack.sh packs it as .device/generate.xz):

    python3 scripts/gpu_fp8_cache.py --bin /tmp/generate [--contexts 8192,32768] [--batches 1,8]
        [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf]

Speed: for each model shape (SmolLM2-135M's and Llama-3.2-1B's configs, random bf16 weights
written by scripts/gpu_model_check.py's write_model), each context and batch, a prompt of
(context - new tokens) random ids per sequence, then `generate --ignore-eos --warmup -n NEW` with
`--kv-cache-dtype model` and `fp8`; the decode tokens/s of both and their ratio, and the K/V bytes
a decode step reads at the end of the run (bf16: 2 bytes per element, fp8: 1).
Perplexity (with --gguf, a real model): `generate --perplexity examples/assets/perplexity.txt`
with both caches. A summary table prints last.
"""
import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_model_check import MODELS, token_id_args, write_model  # noqa: E402

GEN = re.compile(
    r"prompt: (\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\); generation: (\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\)"
)
PPL = re.compile(r"perplexity ([\d.]+) \(mean NLL ([\d.]+) nats\) over (\d+) predicted tokens")


def log(*a):
    print(*a, flush=True)


def run(cmd, timeout):
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return r, time.time() - t


def decode_speed(args, model_dir, prompts, kv):
    cmd = [args.bin, "--model", model_dir, "-n", str(args.new_tokens), "--dtype", "bf16", "--ignore-eos", "--warmup"]
    cmd += ["--kv-cache-dtype", kv]
    # Through files: 32k-token prompts overflow a command line.
    os.makedirs(args.work, exist_ok=True)
    cmd += token_id_args(prompts, os.path.join(args.work, "prompt"))
    r, secs = run(cmd, args.timeout)
    m = GEN.search(r.stderr)
    if not m:
        raise RuntimeError(f"no timing line in:\n{r.stderr[-2000:]}")
    return float(m.group(3)), float(m.group(6)), secs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", default="/tmp/fp8-cache-check")
    ap.add_argument("--models", default="llama3.2-1b-shape")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gguf", default=None, help="a real model for the perplexity (skipped if absent)")
    ap.add_argument("--text", default="examples/assets/perplexity.txt")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no new case starts")
    args = ap.parse_args()
    start = time.time()
    summary = []

    if args.gguf and os.path.exists(args.gguf):
        for kv in ["model", "fp8"]:
            r, secs = run([args.bin, "--model", args.gguf, "--dtype", "bf16", "--perplexity", args.text, "--kv-cache-dtype", kv], args.timeout)
            m = PPL.search(r.stdout)
            log(f"perplexity {os.path.basename(args.gguf)} bf16 model, {kv} cache: {r.stdout.strip()} ({secs:.1f}s)")
            summary.append(f"perplexity  {os.path.basename(args.gguf)}  bf16 model  cache {kv:5}  {m.group(1) if m else '?'}")
    elif args.gguf:
        log(f"perplexity skipped: {args.gguf} is absent")

    rng = np.random.default_rng(7)
    for name in args.models.split(","):
        cfg = MODELS[name]
        model_dir = os.path.join(args.work, name)
        if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
            write_model(cfg, model_dir, seed=11)
        hk, d, layers = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_hidden_layers"]
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                if time.time() - start > args.deadline:
                    log(f"deadline: {name} context {context} batch {batch} not run")
                    summary.append(f"{name:18} ctx {context:6} batch {batch:3}  not run (deadline)")
                    continue
                plen = context - args.new_tokens
                prompts = rng.integers(10, cfg["vocab_size"], size=(batch, plen)).tolist()
                res = {}
                for kv in ["model", "fp8"]:
                    try:
                        res[kv] = decode_speed(args, model_dir, prompts, kv)
                        log(f"{name} ctx {context} batch {batch} cache {kv}: prefill {res[kv][0]:.0f} tok/s, decode {res[kv][1]:.1f} tok/s ({res[kv][2]:.0f}s)")
                    except Exception as e:  # noqa: BLE001
                        log(f"{name} ctx {context} batch {batch} cache {kv}: FAILED {e}")
                if len(res) == 2:
                    kv_bytes = batch * context * layers * 2 * hk * d  # elements of k and v at the last step
                    ratio = res["fp8"][1] / res["model"][1]
                    summary.append(
                        f"{name:18} ctx {context:6} batch {batch:3}  decode tok/s bf16 {res['model'][1]:8.1f}  fp8 {res['fp8'][1]:8.1f}  fp8/bf16 {ratio:5.2f}  KV read/step bf16 {2 * kv_bytes / 2**20:7.0f} MiB fp8 {kv_bytes / 2**20:7.0f} MiB"
                    )
                else:
                    summary.append(f"{name:18} ctx {context:6} batch {batch:3}  FAILED")
    log("\n===== fp8 KV cache summary")
    for line in summary:
        log(line)


if __name__ == "__main__":
    main()
