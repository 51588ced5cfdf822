"""A paged decode anchor that installs on the GPU machine: PyTorch's FlexAttention (compiled with
torch.compile, its decoding kernel for short queries) reading K/V from a page pool through a block
mask whose KV blocks are the pages, the way torch.nn.attention.experimental._paged_attention maps a
page table (each sequence's logical blocks -> physical pages). FA3's wheel has paged KV compiled
out (scripts/kvcache_anchor.py), and FlashInfer does not fit a device call (docs/kernels/kvcache.md).

Shapes: the one-query cells of the benchmark's kvcache pass (crates/flash-attn/benches/
gpu_attention.rs): 32 q heads on 4 kv heads, d128, bf16, every sequence at seqlen_k cached keys,
pages of 16, 64 and 256 in shuffled order, and the contiguous cache (flex_attention without a block
mask, which ran up to 44x slower than its paged calls at batch 1 on an H200).
Each (shape, page size) compiles once (Triton, a few seconds). Each call's output is compared with
PyTorch's SDPA on the contiguous keys (the max error column). Prints one row per shape: µs per call, eager
(back-to-back) and CUDA-graph-replayed, and K+V bytes read per second.

Env: SHAPES ("b:sk,b:sk,..."), PAGES ("16,64,256").
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

# The same timing as FA3's anchor (this directory is on sys.path when the script runs).
from kvcache_anchor import graph_seconds, mean_seconds

H, HK, D = 32, 4, 128


def main():
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    torch._dynamo.config.cache_size_limit = 256
    # Static shapes: each (shape, page size) compiles its own kernels (a few seconds each). With
    # dynamic=None the second shape compiled a dynamic-size kernel that ran 2-4x slower and
    # refused pages of 16 at batch 8.
    flex = torch.compile(flex_attention, dynamic=False)
    shapes = [tuple(int(x) for x in s.split(":")) for s in os.environ.get(
        "SHAPES", ",".join(f"{b}:{sk}" for b in [1, 8, 32, 128] for sk in [1024, 8192, 32768, 131072]
                           if b * sk <= 1 << 20)).split(",")]
    pages = [int(p) for p in os.environ.get("PAGES", "16,64,256").split(",")]
    print(f"FlexAttention paged decode (torch {torch.__version__}), d128, bf16, heads {H}/{HK}, one query, "
          f"pages shuffled; {torch.cuda.get_device_name()}")
    print("| batch | seqlen_k | page | eager us | graph us | TB/s (graph) | max err vs SDPA | first call s |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for page in [0] + pages:  # 0: the contiguous cache, no block mask
        for b, sk in shapes:
            q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(b, HK, sk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(b, HK, sk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            rep = lambda x: x.repeat_interleave(H // HK, 1)
            want = F.scaled_dot_product_attention(q, rep(k), rep(v))
            nbytes = 2 * b * sk * HK * D * 2
            label = str(page) if page else "contiguous"
            try:
                if page:
                    call = paged_call(flex, BlockMask, q, k, v, page, gen)
                else:
                    call = lambda: flex(q, k, v, enable_gqa=True)
                t0 = time.time()
                out = call()
                torch.cuda.synchronize()
                first_s = time.time() - t0
                err = (out.float() - want.float()).abs().max().item()
                eager = mean_seconds(call, iters=50, warmup=3)
                try:
                    graph = graph_seconds(call)
                    graph_cell = f"{graph * 1e6:.1f} | {nbytes / graph / 1e12:.2f}"
                except Exception as ex:  # noqa: BLE001
                    graph_cell = f"no graph ({type(ex).__name__}) | {nbytes / eager / 1e12:.2f} (eager)"
                print(f"| {b} | {sk} | {label} | {eager * 1e6:.1f} | {graph_cell} | {err:.3g} | {first_s:.0f} |",
                      flush=True)
            except Exception as ex:  # noqa: BLE001
                msg = str(ex).splitlines()[0][:160] if str(ex) else ""
                print(f"| {b} | {sk} | {label} | failed: {type(ex).__name__} {msg} | | | | |", flush=True)
            del q, k, v


def paged_call(flex, BlockMask, q, k, v, page, gen):
    """The call over a shuffled page pool holding k and v: (1, kv heads, pages * page, d), the
    block mask's KV blocks the pages (every one full, so no mask_mod is evaluated)."""
    b, _, sk, _ = k.shape
    per_seq = sk // page
    n_pages = b * per_seq
    table = torch.randperm(n_pages, device="cuda", generator=gen).view(b, per_seq).to(torch.int32)
    pool = []
    for x in (k, v):
        p = torch.empty(1, HK, n_pages * page, D, device="cuda", dtype=x.dtype)
        p.view(HK, n_pages, page, D)[:, table.flatten().long()] = (
            x.view(b, HK, per_seq, page, D).permute(1, 0, 2, 3, 4).reshape(HK, n_pages, page, D))
        pool.append(p)
    full = torch.zeros(b, 1, 1, n_pages, device="cuda", dtype=torch.int32)
    full[:, 0, 0, :per_seq] = table
    args = (torch.zeros(b, 1, 1, device="cuda", dtype=torch.int32), torch.zeros_like(full),
            torch.full((b, 1, 1), per_seq, device="cuda", dtype=torch.int32), full)
    try:
        mask = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=(128, page), seq_lengths=(1, n_pages * page))
    except TypeError:  # older torch: no seq_lengths
        mask = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=(128, page))
    kp, vp = pool
    return lambda: flex(q, kp, vp, block_mask=mask, enable_gqa=True)


if __name__ == "__main__":
    sys.exit(main())
