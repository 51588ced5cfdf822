#!/usr/bin/env python3
"""flash-llama against HF transformers on the GPU machine: logits, greedy tokens and speed.

Runs ON the GPU machine (PyTorch + transformers there, no network), with the `generate` example
built with `--features cuda` (see docs/model.md, "On the GPU"):

    python3 scripts/gpu_model_check.py --bin /tmp/generate --work /tmp/models --out $OUT \
        [--variants=--reference-attention --variants=--composed]

scripts/gpu-pack.sh packs that binary into .device/generate.xz, and `scripts/gpu-run.sh --model`
(one device call with carry [".device"]) runs this script with it.

For each model shape (SmolLM2-135M's config, a Llama-3.2-1B-shaped config) it writes a
random-weight HF directory (config.json in the Hub's format + model.safetensors, bf16 weights,
tied embeddings), then

  * f32: our logits (CPU, `--cpu --dtype f32`) vs transformers f32 on the GPU (TF32 off), for two
    prompts of different lengths in one batch (varlen prefill), 16 greedy steps through the KV
    cache; pass when max |ours - hf| / max |hf| < 1e-3.
  * bf16 on the GPU: our greedy continuation vs transformers' own bf16 greedy continuation, and
    our logits vs transformers' (bf16, and f32 as the truth) on our tokens: top-5 ids and values.
  * speed, bf16, batch 1 and 16, 512-token prompts, 128 new tokens greedy: ours (`generate
    --warmup --ignore-eos`) vs transformers (SDPA, a greedy loop over its KV cache, one host
    sync per step like `model.generate`), plus the weight-bandwidth bound of decode at batch 1.

With --gguf FILE it checks a real model instead (the default SmolLM2-135M-Instruct Q4_1 GGUF):
the same f32 and bf16 comparisons on transformers' own dequantisation of the file (it needs the
`gguf` Python package: `pip download gguf --no-deps` here, install it there with --no-index).

Random weights: linear layers N(0, 0.02), RMSNorm scales 1 + N(0, 0.1), the (tied) embedding
N(0, 2.4 / sqrt(hidden)) so that the logits spread over a few units (clear greedy choices).
Results: a summary printed last and results.json in --out.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M config.json
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}

LLAMA32_1B = {  # meta-llama/Llama-3.2-1B config.json
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# A Llama-architecture model of Qwen2.5-0.5B's shape (Qwen/Qwen2.5-0.5B config.json, without its
# q/k/v biases): 14 q heads on 2 kv heads, GQA groups of 7 rows, head dim 64. For timing only.
QWEN25_05B_SHAPE = {
    **LLAMA32_1B,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "vocab_size": 151936,
}

MODELS = {"smollm2-135m": SMOLLM2_135M, "llama3.2-1b-shape": LLAMA32_1B, "qwen2.5-0.5b-shape": QWEN25_05B_SHAPE}


def log(*a):
    print(*a, flush=True)


def write_model(cfg, path, seed):
    """Random bf16 weights under HF names, written with the Hub-format config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**cfg))
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, p in skeleton.state_dict().items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g, device="cuda")
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(p.shape, generator=g, device="cuda") * (2.4 / math.sqrt(cfg["hidden_size"]))
        else:
            t = torch.randn(p.shape, generator=g, device="cuda") * 0.02
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return sum(t.numel() for t in tensors.values())


def load_hf(path, dtype):
    """transformers' model from an HF directory, or from a .gguf file (dequantised by transformers
    through the `gguf` package)."""
    from transformers import LlamaForCausalLM

    kw = {"attn_implementation": "sdpa"}
    if path.endswith(".gguf"):
        path, kw["gguf_file"] = os.path.dirname(path), os.path.basename(path)
    try:
        m = LlamaForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except TypeError:
        m = LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype, **kw)
    return m.to("cuda").eval()


def expected_inv_freq(cfg):
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.get("rope_scaling")
    if rs:
        factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        inv = np.array(out)
    return inv


def check_rope(model, cfg):
    try:
        got = model.model.rotary_emb.inv_freq.float().cpu().numpy()
        want = expected_inv_freq(cfg)
        err = float(np.max(np.abs(got - want) / want))
        log(f"  HF inv_freq vs the llama3 rule: max rel diff {err:.2e}, attention_scaling {getattr(model.model.rotary_emb, 'attention_scaling', '?')}")
        return err
    except Exception as e:  # diagnostics only
        log(f"  (could not read HF inv_freq: {e})")
        return None


@torch.inference_mode()
def hf_greedy(model, prompt, n):
    """transformers' greedy loop over its KV cache: tokens and per-step f32 logits."""
    ids = torch.tensor([prompt], device="cuda")
    out = model(input_ids=ids, use_cache=True)
    tokens, logits = [], []
    for i in range(n):
        row = out.logits[0, -1].float()
        logits.append(row.cpu().numpy())
        t = int(row.argmax())
        tokens.append(t)
        if i + 1 < n:
            out = model(input_ids=torch.tensor([[t]], device="cuda"), past_key_values=out.past_key_values, use_cache=True)
    return tokens, np.stack(logits)


@torch.inference_mode()
def hf_teacher_forced(model, prompt, cont):
    """Logits after the prompt and after each of cont[:-1], one forward without cache."""
    ids = torch.tensor([prompt + cont[:-1]], device="cuda")
    out = model(input_ids=ids).logits[0].float()
    return out[len(prompt) - 1 :].cpu().numpy()


def token_id_args(prompts, stem):
    """`generate` arguments for `prompts` (lists of token ids): each written to `{stem}.{i}` and
    passed as `--token-ids @file` (a long prompt on the command line can pass ARG_MAX)."""
    out = []
    for i, p in enumerate(prompts):
        path = f"{stem}.{i}"
        with open(path, "w") as f:
            f.write(",".join(map(str, p)))
        out += ["--token-ids", "@" + path]
    return out


def ours(args, model_dir, prompts, n, extra, timeout=900, bin=None):
    cmd = [bin or args.bin, "--model", model_dir, "-n", str(n)] + extra
    for p in prompts:
        cmd += ["--token-ids", ",".join(map(str, p))]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"generate failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    log(f"  ours {' '.join(extra)}: {time.time() - t:.1f}s; {r.stderr.strip().splitlines()[0]}")
    tokens = [list(map(int, line.split(","))) for line in r.stdout.strip().splitlines()]
    return tokens, r.stderr


def load_npy(path):
    return np.load(path)


def correctness(args, name, cfg, model_dir, res):
    rng = np.random.default_rng(1234)
    vocab = cfg["vocab_size"]
    prompts = [rng.integers(10, vocab, size=n).tolist() for n in args.check_lens]
    n = args.steps

    # f32: ours on the CPU, transformers on the GPU without TF32.
    f32_npy = os.path.join(args.work, f"{name}-f32.npy")
    tok32, _ = ours(args, model_dir, prompts, n, ["--cpu", "--dtype", "f32", "--dump-logits", f32_npy])
    our32 = load_npy(f32_npy)  # (steps, batch, vocab)
    hf32 = load_hf(model_dir, torch.float32)
    if "rope_theta" in cfg:
        check_rope(hf32, cfg)
    r32 = []
    for b, p in enumerate(prompts):
        ref = hf_teacher_forced(hf32, p, tok32[b])
        hf_tok, _ = hf_greedy(hf32, p, n)
        rel = float(np.max(np.abs(our32[:, b] - ref)) / np.max(np.abs(ref)))
        same = hf_tok == tok32[b]
        log(f"  f32 prompt {b} ({len(p)} tokens): max|ours-hf|/max|hf| = {rel:.2e}, greedy {n} tokens equal: {same}")
        r32.append({"prompt_len": len(p), "rel_err": rel, "greedy_equal": same, "max_abs_logit": float(np.max(np.abs(ref)))})
    res["f32"] = r32

    # bf16 on the GPU (and the --variants, e.g. "--composed" or "--cpu", for diagnosis).
    hfbf = load_hf(model_dir, torch.bfloat16)
    res["bf16"] = compare_bf16(args, name, model_dir, prompts, hfbf, hf32, [])
    for v in args.variants:
        log(f"  variant {v}:")
        try:
            res[f"bf16 {v}"] = compare_bf16(args, name, model_dir, prompts, hfbf, hf32, v.split())
        except Exception:
            traceback.print_exc()
    del hf32
    torch.cuda.empty_cache()
    return hfbf


def compare_bf16(args, name, model_dir, prompts, hfbf, hf32, extra):
    n = args.steps
    bf_npy = os.path.join(args.work, f"{name}-bf16.npy")
    tokbf, _ = ours(args, model_dir, prompts, n, ["--dtype", "bf16", "--dump-logits", bf_npy] + extra)
    ourbf = load_npy(bf_npy)
    rbf = []
    for b, p in enumerate(prompts):
        hf_tok, hf_logits = hf_greedy(hfbf, p, n)
        first_diff = next((i for i, (x, y) in enumerate(zip(hf_tok, tokbf[b])) if x != y), None)
        ref_bf = hf_teacher_forced(hfbf, p, tokbf[b])
        ref_32 = hf_teacher_forced(hf32, p, tokbf[b])
        top5_same, rel_bf, rel_hfbf_vs_32, rel_ours_vs_32 = 0, 0.0, 0.0, 0.0
        for s in range(n):
            top = np.argsort(-ref_32[s])[:5]
            top5_same += int(set(np.argsort(-ourbf[s, b])[:5]) == set(np.argsort(-ref_bf[s])[:5]))
            rel_bf = max(rel_bf, float(np.max(np.abs(ourbf[s, b, top] - ref_bf[s, top]) / np.abs(ref_bf[s, top]))))
            rel_ours_vs_32 = max(rel_ours_vs_32, float(np.max(np.abs(ourbf[s, b, top] - ref_32[s, top]) / np.abs(ref_32[s, top]))))
            rel_hfbf_vs_32 = max(rel_hfbf_vs_32, float(np.max(np.abs(ref_bf[s, top] - ref_32[s, top]) / np.abs(ref_32[s, top]))))
        margin = None
        if first_diff is not None:
            row = np.sort(hf_logits[first_diff])[::-1]
            margin = float(row[0] - row[1])
        log(
            f"  bf16 prompt {b}: greedy equal {hf_tok == tokbf[b]} (first difference at {first_diff}, HF top-2 margin there {margin});"
            f" top-5 sets equal in {top5_same}/{n} steps; top-5 (of HF f32) rel diff: ours vs HF bf16 {rel_bf:.3f},"
            f" ours vs HF f32 {rel_ours_vs_32:.3f}, HF bf16 vs HF f32 {rel_hfbf_vs_32:.3f}"
        )
        log(f"    ours {tokbf[b]}\n    HF   {hf_tok}")
        rbf.append(
            {
                "prompt_len": len(p),
                "greedy_equal": hf_tok == tokbf[b],
                "first_difference": first_diff,
                "hf_margin_there": margin,
                "top5_sets_equal": top5_same,
                "steps": n,
                "top5_rel_ours_vs_hf_bf16": rel_bf,
                "top5_rel_ours_vs_hf_f32": rel_ours_vs_32,
                "top5_rel_hf_bf16_vs_hf_f32": rel_hfbf_vs_32,
            }
        )
    return rbf


@torch.inference_mode()
def hf_speed(model, ids, n):
    """Prefill (one forward, last-position logits only) and n - 1 decode steps, tokens/s."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    nxt.cpu()
    t1 = time.perf_counter()
    pkv = out.past_key_values
    for _ in range(n - 1):
        out = model(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)
        pkv = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        nxt.cpu()  # a host sync per step, as model.generate's stopping check
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    b, s = ids.shape
    return b * s / (t1 - t0), b * (n - 1) / (t2 - t1)


def speed(args, name, cfg, model_dir, hfbf, res):
    rng = np.random.default_rng(99)
    rows = []
    for batch in args.batches:
        prompts = rng.integers(10, cfg["vocab_size"], size=(batch, args.prompt_len)).tolist()
        def timed(bin=None):
            _, err = ours(args, model_dir, prompts, args.new_tokens, ["--dtype", "bf16", "--ignore-eos", "--warmup"], bin=bin)
            m = re.search(r"prompt: (\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\); generation: (\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\)", err)
            return float(m.group(3)), float(m.group(6))

        our_pre, our_dec = timed()
        ids = torch.tensor(prompts, device="cuda")
        hf_speed(hfbf, ids[:, :64], 4)  # warm-up
        hf_pre, hf_dec = hf_speed(hfbf, ids, args.new_tokens)
        row = {"batch": batch, "ours_prefill": our_pre, "ours_decode": our_dec, "hf_prefill": hf_pre, "hf_decode": hf_dec}
        log(f"  batch {batch}: prefill ours {our_pre:.0f} vs HF {hf_pre:.0f} tok/s; decode ours {our_dec:.1f} vs HF {hf_dec:.1f} tok/s")
        for cmp_bin in args.compare_bin:
            # Other builds of `generate` (e.g. the commit before a change), same prompts, same call.
            cmp_pre, cmp_dec = timed(cmp_bin)
            row.setdefault("compare", []).append({"bin": cmp_bin, "prefill": cmp_pre, "decode": cmp_dec})
            log(f"  batch {batch}: {cmp_bin}: prefill {cmp_pre:.0f} tok/s, decode {cmp_dec:.1f} tok/s")
        rows.append(row)
    res["speed"] = rows


def copy_bandwidth():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="the generate example built with --features cuda")
    ap.add_argument("--work", default="/tmp/flash-llama-check", help="where the model directories go")
    ap.add_argument("--out", default=None, help="where results.json goes")
    ap.add_argument("--models", default="smollm2-135m,llama3.2-1b-shape", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--steps", type=int, default=16, help="greedy steps compared")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-lens", default="40,23", help="prompt lengths of the correctness checks (one batch)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument(
        "--gguf",
        default=None,
        help="check this real .gguf model (e.g. the default SmolLM2-135M-Instruct Q4_1) instead of the random-weight"
        " models: ours and transformers (which needs the `gguf` package) both dequantise its weights; no speed",
    )
    ap.add_argument("--compare-bin", action="append", default=[], help="another generate binary timed on the same prompts (before/after; repeatable)")
    ap.add_argument("--variants", action="append", default=[], help="extra flags of ours for another bf16 comparison (repeatable)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.check_lens = [int(n) for n in args.check_lens.split(",")]
    os.makedirs(args.work, exist_ok=True)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    except Exception:
        pass
    import transformers

    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__}
    bw = copy_bandwidth()
    results["copy_bandwidth"] = bw
    log(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    if args.gguf:
        from transformers import AutoConfig

        path = os.path.abspath(args.gguf)
        hf_cfg = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        name = os.path.basename(path)
        res = results.setdefault(name, {})
        log(f"\n=== {name} (real weights; vocab {hf_cfg.vocab_size}, {hf_cfg.num_hidden_layers} layers)")
        try:
            correctness(args, name, {"vocab_size": hf_cfg.vocab_size}, path, res)
        except Exception:
            traceback.print_exc()
            res["correctness_error"] = traceback.format_exc()[-2000:]
        if args.out:
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
        log("\n=== summary")
        log(json.dumps(results, indent=1))
        return
    for name in args.models.split(","):
        cfg = MODELS[name]
        res = results.setdefault(name, {})
        log(f"\n=== {name}")
        d = os.path.join(args.work, name)
        t = time.time()
        params = write_model(cfg, d, seed=7)
        weight_bytes = 2 * params  # bf16; the tied embedding is read once, as the output head
        res["params"] = params
        res["decode_bound_batch1"] = bw / weight_bytes
        log(f"  wrote {d}: {params / 1e6:.1f}M parameters in {time.time() - t:.1f}s; batch-1 decode bound {bw / weight_bytes:.0f} tok/s")
        hfbf = None
        try:
            hfbf = correctness(args, name, cfg, d, res)
        except Exception:
            traceback.print_exc()
            res["correctness_error"] = traceback.format_exc()[-2000:]
        if not args.skip_speed:
            try:
                if hfbf is None:
                    hfbf = load_hf(d, torch.bfloat16)
                speed(args, name, cfg, d, hfbf, res)
            except Exception:
                traceback.print_exc()
                res["speed_error"] = traceback.format_exc()[-2000:]
        del hfbf
        torch.cuda.empty_cache()
        if args.out:
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)

    log("\n=== summary")
    log(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
