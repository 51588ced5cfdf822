#!/usr/bin/env python3
"""Writes the model of the GPU serving load test's 1B run (scripts/gpu-serve-load.sh, MODEL_SHAPE=1b), on
the GPU machine: random bf16 weights in the Llama-3.2-1B shape (16 layers, hidden 2048, 32 query
and 8 KV heads of 64, MLP 8192, tied embeddings, llama3 RoPE) with SmolLM2-135M-Instruct's
tokenizer and chat template, which transformers reads out of the default GGUF. The vocabulary is
that tokenizer's 49,152 ids (Llama 3.2's has 128,256), so that every id the random weights pick
decodes to text in both engines: 1.0 B parameters. `serve` and transformers read the same
directory (config.json, model.safetensors, tokenizer files, generation_config.json).

    python3 scripts/serve_model_1b.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/serve-1b
"""
import argparse
import importlib.util
import json
import os


def gpu_model_check():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_model_check.py")
    spec = importlib.util.spec_from_file_location("gpu_model_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the default model's GGUF (its tokenizer is used)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    check = gpu_model_check()
    d, f = os.path.dirname(os.path.abspath(args.gguf)), os.path.basename(args.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    cfg = dict(
        check.LLAMA32_1B,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    params = check.write_model(cfg, args.out, args.seed)
    tok.save_pretrained(args.out)
    with open(os.path.join(args.out, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, fh)
    print(f"wrote {args.out}: {params / 1e9:.2f} B parameters, vocabulary {len(tok)}, eos {tok.eos_token!r}")


if __name__ == "__main__":
    main()
