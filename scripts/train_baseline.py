#!/usr/bin/env python3
"""PyTorch baseline for the train example's 125m preset: training tokens/s on one GPU.

The same model as `cargo run --release --features cuda --example train -- --preset 125m`
(Llama, 12 layers, hidden 768, 12 heads of 64, SwiGLU 3456, byte vocabulary of 264, untied
head, RMSNorm eps 1e-5, RoPE theta 10000), as HF transformers' LlamaForCausalLM with SDPA
attention, f32 master weights under bf16 autocast, AdamW (betas 0.9/0.95, weight decay 0.1),
global-norm clipping at 1.0, micro-batches of 8 x 2048 tokens, 4 accumulated per step.

Tokens are uniform random bytes: throughput does not depend on the text. Prints one JSON line
with tokens/s and MFU (the same FLOP count as the Rust example: 6 per matmul parameter per
token plus causal attention, over --peak-tflops).

    pip install torch transformers
    python3 scripts/train_baseline.py                 # 5 warmup + 20 timed steps
    python3 scripts/train_baseline.py --compile       # also with torch.compile

Data-parallel (PyTorch DDP, one process per GPU, NCCL): launched through torchrun, each step
is the same global batch (--grad-accum micro-batches, a multiple of the GPUs, shared out as the
Rust example's --data-parallel does); tokens/s counts all GPUs, MFU is against all their peaks.

    python3 -m torch.distributed.run --nproc_per_node 4 scripts/train_baseline.py --grad-accum 4
"""

import argparse
import contextlib
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (allocator, autotuning)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=3456)
    p.add_argument("--vocab", type=int, default=264)
    p.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa, eager, flash_attention_2")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM / H200: 989)")
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        if a.grad_accum % world:
            p.error(f"--grad-accum {a.grad_accum} is not a multiple of the {world} GPUs")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        max_position_embeddings=a.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation=a.attn,
    )
    model = LlamaForCausalLM(cfg).to(dev)  # f32 master weights
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    # Matmul parameters: every weight matrix except the input embedding (a lookup).
    n_matmul = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name
    )
    head_dim = a.hidden // a.heads
    flops_per_token = 6 * n_matmul + 6 * a.layers * a.heads * head_dim * a.seq_len

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    if world > 1:
        # Default buckets (25 MB), all-reduce overlapped with the backward of the last micro-batch.
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index or torch.cuda.current_device()])
    step_fn = torch.compile(model) if a.compile else model
    torch.manual_seed(1 + rank)  # each rank's own batches
    local_accum = a.grad_accum // world

    def step():
        for i in range(local_accum):
            x = torch.randint(0, 256, (a.batch_size, a.seq_len), device=dev)
            # DDP: gradients are all-reduced in the backward of the last micro-batch only.
            sync = world == 1 or i == local_accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = step_fn(input_ids=x).logits
                # Next-token loss over seq_len - 1 positions, in f32.
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].float().reshape(-1, a.vocab), x[:, 1:].reshape(-1)
                )
                (loss / a.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup_steps):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    tokens = a.steps * a.grad_accum * a.batch_size * a.seq_len
    tps = tokens / secs
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    print(
        json.dumps(
            {
                "impl": f"pytorch {torch.__version__} transformers LlamaForCausalLM attn={a.attn}"
                + (" compiled" if a.compile else "")
                + (f" DDP x{world}" if world > 1 else ""),
                "gpu": torch.cuda.get_device_name(),
                "gpus": world,
                "params": n_params,
                "batch": a.batch_size,
                "seq_len": a.seq_len,
                "grad_accum": a.grad_accum,
                "steps_timed": a.steps,
                "tokens_per_s": round(tps, 1),
                "mfu_percent": round(100 * tps * flops_per_token / (world * a.peak_tflops * 1e12), 2),
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "last_loss": round(loss.item(), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
