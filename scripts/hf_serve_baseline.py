#!/usr/bin/env python3
"""HF transformers' own batch throughput on the serving load test's requests, for comparison
with `serve` (scripts/gpu-serve-load.sh runs both in one device call).

The same 200 chat prompts as scripts/serve-load.py (its PROMPTS, each wrapped in the model's chat
template by transformers' tokenizer), max_new_tokens 16, greedy, in static batches of --batch
(left-padded, `model.generate`, SDPA attention, bf16 on the GPU), the default GGUF dequantised by
transformers (needs the `gguf` package). One warm-up batch first. Prints requests/s and generated
tokens/s (tokens up to and including each answer's first EOS).

    python3 scripts/hf_serve_baseline.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --batch 32
    python3 scripts/hf_serve_baseline.py --model-dir /tmp/serve-1b --batch 32   # an HF directory
"""
import argparse
import importlib.util
import os
import time

import torch


def prompts_of_load_test():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve-load.py")
    spec = importlib.util.spec_from_file_location("serve_load", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PROMPTS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a GGUF file, dequantised by transformers")
    source.add_argument("--model-dir", help="an HF model directory (scripts/serve_model_1b.py's)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.gguf:
        d, kw = os.path.dirname(os.path.abspath(args.gguf)), {"gguf_file": os.path.basename(args.gguf)}
    else:
        d, kw = args.model_dir, {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa", **kw)
    model = model.to("cuda").eval()
    base = prompts_of_load_test()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": base[i % len(base)]}], tokenize=False, add_generation_prompt=True)
        for i in range(args.requests)
    ]
    eos = tok.eos_token_id

    def run(batch_texts):
        enc = tok(batch_texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        count = 0
        for row in new:
            n = len(row)
            if eos in row:
                n = row.index(eos) + 1
            count += n
        return count

    run(texts[: args.batch])  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), args.batch):
        tokens += run(texts[i : i + args.batch])
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    print(f"HF transformers static batches of {args.batch}: {args.requests} requests in {secs:.2f} s")
    print("| requests/s | generated tokens/s | mean generated tokens |")
    print("|---|---|---|")
    print(f"| {args.requests / secs:.2f} | {tokens / secs:.1f} | {tokens / args.requests:.1f} |")


if __name__ == "__main__":
    main()
