#!/usr/bin/env python3
"""Tensor-parallel generation on a machine with several GPUs: `generate --tp N` against `--tp 1`.

Runs ON the GPU machine, with the generate example built with `--features nccl`
(scripts/gpu-pack.sh --multi packs it; scripts/gpu-multi.sh runs this script):

    python3 scripts/gpu_tp.py --bin /tmp/generate --work /tmp/tp --tp 1,2,4 [--shapes 1b,8b]

For each shape it writes a random-weight bf16 HF directory (gpu_model_check.write_model: the
Llama-3.2-1B shape, and a Llama-3.1-8B shape: hidden 4096, 32 layers, 32 heads / 8 kv heads,
MLP 14336, untied head), then for each tensor-parallel size:

  * logits: 8 greedy steps after a 64-token prompt (--dump-logits), max |tp N - tp 1| over
    max |tp 1| at each step while both runs have taken the same greedy tokens (bf16 compute: the
    sums differ in order, so noise of about 1e-2, not 0; random weights give near-flat logits, so
    a near-tie can send the greedy paths apart, after which the logits are not comparable), and
    how many of the 8 greedy tokens agree; for the 1B shape also the prefill logits' error of
    each tp size against the f32 forward on the CPU (the truth), to show that splitting adds no
    error beyond bf16's own;
  * speed: batch 1, 128-token prompt, 128 new tokens greedy (--warmup --ignore-eos), decode
    tokens/s as generate prints it, with eager steps (--no-cuda-graphs) and with the step
    captured into a CUDA graph (the default; NCCL's all-reduces are captured too).

Prints one JSON line per (shape, tp) and a table last.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_model_check import LLAMA32_1B, write_model  # noqa: E402

LLAMA31_8B = dict(
    LLAMA32_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
    rope_scaling=dict(LLAMA32_1B["rope_scaling"], factor=8.0),
)
SHAPES = {"1b": LLAMA32_1B, "8b": LLAMA31_8B}


def log(*a):
    print(*a, flush=True)


def generate(args, model_dir, tp, prompt, n, extra, timeout=300):
    cmd = [args.bin, "--model", model_dir, "--tp", str(tp), "-n", str(n), "--token-ids", ",".join(map(str, prompt))]
    r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"generate --tp {tp} failed (rc {r.returncode}):\n{r.stderr[-2000:]}")
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True)
    p.add_argument("--work", default="/tmp/tp")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--shapes", default="1b,8b")
    a = p.parse_args()
    sizes = [int(x) for x in a.tp.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for shape in a.shapes.split(","):
        cfg = SHAPES[shape]
        model_dir = os.path.join(a.work, shape)
        t = time.time()
        n_params = write_model(cfg, model_dir, seed=1)
        log(f"{shape}: {n_params / 1e9:.2f}B random parameters written in {time.time() - t:.0f}s")
        check_prompt = rng.integers(10, cfg["vocab_size"], size=64).tolist()
        speed_prompt = rng.integers(10, cfg["vocab_size"], size=128).tolist()
        base_logits = None
        base_speed = None
        truth = None
        if shape == "1b":
            npy = os.path.join(a.work, f"{shape}-f32.npy")
            generate(a, model_dir, 1, check_prompt, 1, ["--temperature", "0", "--cpu", "--dtype", "f32", "--dump-logits", npy])
            truth = np.load(npy)[0, 0, :]
        for tp in sizes:
            row = {"shape": shape, "tp": tp}
            try:
                npy = os.path.join(a.work, f"{shape}-tp{tp}.npy")
                generate(a, model_dir, tp, check_prompt, 8, ["--temperature", "0", "--dump-logits", npy])
                logits = np.load(npy)[:, 0, :]  # (steps, vocab)
                if base_logits is None:
                    base_logits = logits
                same = 0  # steps whose inputs agree: the prompt, then every step after equal tokens
                while same < len(logits) and (same == 0 or logits[same - 1].argmax() == base_logits[same - 1].argmax()):
                    same += 1
                row["logit_rel_diff"] = float(
                    np.abs(logits[:same] - base_logits[:same]).max() / np.abs(base_logits[:same]).max()
                )
                row["prefill_rel_diff"] = float(np.abs(logits[0] - base_logits[0]).max() / np.abs(base_logits[0]).max())
                if truth is not None:
                    row["prefill_error_vs_f32"] = float(np.abs(logits[0] - truth).max() / np.abs(truth).max())
                row["greedy_tokens_equal"] = int(sum(logits[i].argmax() == base_logits[i].argmax() for i in range(len(logits))))
                r = generate(a, model_dir, tp, speed_prompt, 128,
                             ["--temperature", "0", "--warmup", "--ignore-eos", "--no-cuda-graphs"])
                m = re.search(r"generation: \d+ tokens in [\d.]+s \(([\d.]+) tokens/s\)", r.stderr)
                row["decode_tokens_per_s"] = float(m.group(1)) if m else None
                # The same with the step captured into a CUDA graph (NCCL calls included). Its
                # greedy tokens are not compared with the eager run's: the graph's attention
                # runs another kernel path, and random weights' near-flat logits turn rounding
                # differences into other tokens (tp 1 too).
                try:
                    g = generate(a, model_dir, tp, speed_prompt, 128, ["--temperature", "0", "--warmup", "--ignore-eos"])
                    m = re.search(r"generation: \d+ tokens in [\d.]+s \(([\d.]+) tokens/s\)", g.stderr)
                    row["graph_tokens_per_s"] = float(m.group(1)) if m else None
                except Exception as e:
                    row["graph_error"] = str(e)[-300:]
                if base_speed is None:
                    base_speed = row["decode_tokens_per_s"]
                if row["decode_tokens_per_s"] and base_speed:
                    row["speedup"] = round(row["decode_tokens_per_s"] / base_speed, 3)
            except Exception as e:  # keep the other cells
                row["error"] = str(e)[-500:]
            log(json.dumps(row))
            rows.append(row)
    log("\n== tensor-parallel decode, batch 1, 128-token prompt, 128 new tokens, bf16 (tokens/s: eager steps)")
    log(f"{'shape':6} {'tp':>3} {'tokens/s':>10} {'vs tp 1':>8} {'logits vs tp 1':>15} {'greedy =':>9} {'prefill vs f32':>15} {'graph tok/s':>12}")
    for r in rows:
        tps = r.get("decode_tokens_per_s")
        diff = ('%.1e' % r['logit_rel_diff']) if 'logit_rel_diff' in r else r.get('error', '-')[:40]
        log(f"{r['shape']:6} {r['tp']:>3} {tps if tps else '-':>10} {r.get('speedup', '-'):>8} {diff:>15} "
            f"{str(r.get('greedy_tokens_equal', '-')) + '/8':>9} "
            f"{('%.1e' % r['prefill_error_vs_f32']) if 'prefill_error_vs_f32' in r else '-':>15} "
            f"{r.get('graph_tokens_per_s') or ('error' if 'graph_error' in r else '-'):>12}")


if __name__ == "__main__":
    main()
