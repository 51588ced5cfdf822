"""FA3's flash_attn_with_kvcache (the fa3-fwd wheel, scripts/get-fp8-wheels.sh) on the decode grid of
the benchmark's kvcache pass (crates/flash-attn/benches/gpu_attention.rs, kvcache_shapes): 32 q heads
on 4 kv heads, d128, bf16, every sequence at seqlen_k cached keys, no append, causal for seqlen_q > 1,
split-KV by FA3's own heuristic (num_splits=0). The fa3-fwd wheel is built with paged KV off
(FLASHATTENTION_DISABLE_PAGEDKV in fa3_fwd_config.py), so only the contiguous cache runs; the script
says so if a paged call fails. Prints one table row per shape: time per call (back-to-back eager calls,
and CUDA-graph replay) and K+V bytes read per second."""
import torch


def shapes():
    out = []
    for b in [1, 8, 32, 128]:
        for sq in [1, 4]:
            for sk in [1024, 8192, 32768, 131072]:
                if b * sk <= 1 << 20:
                    out.append((b, sq, sk))
    return out


def mean_seconds(fn, iters=100, warmup=5):
    """Mean time per call of back-to-back calls (as the Rust benchmark times ours): the GPU time
    where the host keeps ahead of the GPU, the host's time per call where it does not."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / iters


def graph_seconds(fn, iters=50):
    """GPU time per call: fn captured once in a CUDA graph, replayed back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return mean_seconds(g.replay, iters=iters)


def main():
    from fa3_fwd_interface import flash_attn_with_kvcache

    h, hk, d = 32, 4, 128
    print("FA3 flash_attn_with_kvcache (fa3-fwd 0.0.3), d128, bf16, heads 32/4, no append")
    print("eager: mean of back-to-back calls (host included, as ours is timed); graph: one call captured")
    print("in a CUDA graph and replayed (GPU time)")
    print("| batch | seqlen_q | seqlen_k | eager us | TB/s | graph us | TB/s | page 64 |")
    print("|---|---|---|---|---|---|---|---|")
    for b, sq, sk in shapes():
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        causal = sq > 1
        call = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=causal, num_splits=0)
        eager = mean_seconds(call)
        graph = graph_seconds(call)
        nbytes = 2 * b * sk * hk * d * 2
        try:
            page = 64
            kp = k.reshape(b * sk // page, page, hk, d)
            vp = v.reshape(b * sk // page, page, hk, d)
            table = torch.arange(b * sk // page, device="cuda", dtype=torch.int32).reshape(b, sk // page)
            paged = f"{mean_seconds(lambda: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, causal=causal, num_splits=0)) * 1e6:.1f}"
        except Exception as ex:  # the wheel has paged KV compiled out
            paged = f"unsupported ({type(ex).__name__})"
        print(f"| {b} | {sq} | {sk} | {eager * 1e6:.1f} | {nbytes / eager / 1e12:.2f} | {graph * 1e6:.1f} | "
              f"{nbytes / graph / 1e12:.2f} | {paged} |", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
