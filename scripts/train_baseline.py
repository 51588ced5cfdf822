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

With --data (a directory or file, or "stdlib" for the Rust example's default corpus), the run
trains on the Rust example's data exactly: the same files in the same order, byte tokens with
the end-of-text id between documents, every 20th document held out, and the windows drawn by the
same SplitMix64 sampler from the same seed, so both trainers see the same batches in the same
order. --same-init draws the initial weights as the Rust trainer does (N(0, 0.02), o_proj and
down_proj scaled by 1/sqrt(2 layers), norms 1, in the parameters' sorted-name order, from the
same generator), and --losses-out writes each step's loss (the mean over its micro-batches) as
"step,loss" lines: the reference curve for `train --reference-losses`.

    python3 scripts/train_baseline.py --data stdlib --same-init --warmup-steps 0 --steps 300 \
        --lr-warmup 30 --losses-out pytorch.csv

Data-parallel (PyTorch DDP, one process per GPU, NCCL): launched through torchrun, each step
is the same global batch (--grad-accum micro-batches, a multiple of the GPUs, shared out as the
Rust example's --data-parallel does); tokens/s counts all GPUs, MFU is against all their peaks.

    python3 -m torch.distributed.run --nproc_per_node 4 scripts/train_baseline.py --grad-accum 4
"""

import argparse
import contextlib
import json
import math
import os
import sysconfig
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# crates/model/src/train: the sampler's seed salt, held-out document period, byte vocabulary.
DATA_SEED_SALT = 0x5EED_DA7A
EVAL_EVERY = 20
BYTE_END_OF_TEXT = 256
MASK = (1 << 64) - 1


class SplitMix64:
    """crates/model/src/train/data.rs `Rng`: the same draws from the same state."""

    def __init__(self, state):
        self.state = state & MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next_u64() % n

    def normals(self, n, std):
        """`Rng::normals`: Box-Muller over pairs of draws, vectorised (the i-th draw of a
        SplitMix64 is a function of the state plus i steps)."""
        pairs = (n + 1) // 2
        with np.errstate(over="ignore"):
            steps = np.arange(1, 2 * pairs + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            z = steps + np.uint64(self.state)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        self.state = (self.state + 2 * pairs * 0x9E3779B97F4A7C15) & MASK
        unit = ((z >> np.uint64(11)) + np.uint64(1)).astype(np.float64) / float(1 << 53)
        u1, u2 = unit[0::2], unit[1::2]
        r = np.sqrt(-2.0 * np.log(u1)) * std
        theta = 2.0 * math.pi * u2
        out = np.empty(2 * pairs, dtype=np.float64)
        out[0::2], out[1::2] = r * np.cos(theta), r * np.sin(theta)
        return out[:n].astype(np.float32)


def rust_corpus(path, exts):
    """`Corpus::from_files` over `list_files` with byte tokens: the training token stream."""
    skip = set()
    if path == "stdlib":
        path, skip = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages", "__pycache__"}
    if os.path.isfile(path):
        files = [path]
    else:
        files, dirs = [], [path]
        while dirs:
            d = dirs.pop()
            for e in os.scandir(d):
                if e.is_dir(follow_symlinks=False):
                    if e.name not in skip:
                        dirs.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    ext = os.path.splitext(e.name)[1][1:]
                    if not exts or ext in exts:
                        files.append(e.path)
        # Rust sorts PathBufs component by component.
        files.sort(key=lambda f: f.split(os.sep))
    docs = [d for d in (open(f, "rb").read() for f in files) if d]
    by_document = len(docs) >= EVAL_EVERY
    train = bytearray()
    parts = []
    for i, d in enumerate(docs):
        if by_document and i % EVAL_EVERY == EVAL_EVERY - 1:
            continue
        parts.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64))
        parts.append(np.array([BYTE_END_OF_TEXT], dtype=np.int64))
    train = np.concatenate(parts)
    if not by_document:
        train = train[: len(train) - len(train) // EVAL_EVERY]
    return torch.from_numpy(train)


def learning_rate(step, warmup, total, peak, minimum):
    """crates/model/src/train/optim.rs `learning_rate`: linear warmup, then cosine to `minimum`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))


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
    p.add_argument("--data", help='train on this file or directory ("stdlib": the Rust example\'s default) as the Rust example does')
    p.add_argument("--ext", default="py", help="--data directory: file extensions, comma-separated")
    p.add_argument("--seed", type=int, default=0, help="the Rust trainer's --seed (weights and batches)")
    p.add_argument("--same-init", action="store_true", help="initial weights drawn as the Rust trainer draws them")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--lr-warmup", type=int, default=0, help="warmup steps of the schedule (0: constant --lr)")
    p.add_argument("--losses-out", help='write "step,loss" for every step (warmup steps included) here')
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
    if a.same_init:
        # `Trainer::new`: in the sorted order of the HF names, from Rng(seed).
        rng = SplitMix64(a.seed)
        residual_std = 0.02 / math.sqrt(2 * a.layers)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in sorted(params):
                t = params[name]
                if name.endswith("norm.weight"):
                    values = np.ones(t.numel(), dtype=np.float32)
                elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    values = rng.normals(t.numel(), residual_std)
                else:
                    values = rng.normals(t.numel(), 0.02)
                t.copy_(torch.from_numpy(values).view(t.shape))
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
        lr=a.lr,
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
    corpus = rust_corpus(a.data, [e for e in a.ext.split(",") if e]) if a.data else None
    sampler = SplitMix64(a.seed ^ DATA_SEED_SALT)
    offsets = torch.arange(a.seq_len + 1)
    total_steps = a.warmup_steps + a.steps
    losses = []

    def batch(mine):
        """(inputs, targets), batch x seq_len each: the Rust sampler's next windows (drawn on
        every rank, so that the ranks' samplers stay in step), or random bytes without --data;
        None where the micro-batch is not `mine`."""
        if corpus is None:
            x = torch.randint(0, 256, (a.batch_size, a.seq_len + 1), device=dev) if mine else None
        else:
            starts = torch.tensor([sampler.below(len(corpus) - a.seq_len) for _ in range(a.batch_size)])
            x = corpus[starts[:, None] + offsets].to(dev) if mine else None
        return None if x is None else (x[:, :-1], x[:, 1:])

    def step(number):
        if a.lr_warmup:
            for g in opt.param_groups:
                g["lr"] = learning_rate(number, a.lr_warmup, total_steps, a.lr, a.min_lr)
        step_loss = 0.0
        for micro_batch in range(a.grad_accum):
            # Every rank draws every micro-batch (the Rust sampler's order) and computes its share.
            xy = batch(micro_batch % world == rank)
            if xy is None:
                continue
            x, y = xy
            i = micro_batch // world
            # DDP: gradients are all-reduced in the backward of the last micro-batch only.
            sync = world == 1 or i == local_accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = step_fn(input_ids=x).logits
                # Next-token loss over every position, in f32.
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
                (loss / a.grad_accum).backward()
            if a.losses_out:
                step_loss += loss.item() / a.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.losses_out:
            losses.append((number + 1, step_loss))
        return loss

    for number in range(a.warmup_steps):
        step(number)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for number in range(a.warmup_steps, total_steps):
        loss = step(number)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    tokens = a.steps * a.grad_accum * a.batch_size * a.seq_len
    tps = tokens / secs
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    if a.losses_out:
        with open(a.losses_out, "w") as f:
            f.write("step,loss\n")
            f.writelines(f"{n},{l:.6f}\n" for n, l in losses)
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
