"""FA3 (the fa3-fwd wheel of ../shared/anchors) on the decode-like shapes of
crates/flash-attn/benches/gpu_attention.rs (both read crates/flash-attn/benches/decode_shapes.txt): d128, bf16,
split-KV chosen by FA3's own heuristic (num_splits=0). Runs on the GPU machine with the anchors'
wheels installed (scripts/gpu-run.sh --anchors does that and runs this after anchors_bench.py).
Prints one table row per shape: median time per call over CUDA events, and K+V bytes read per
second."""
import os

import torch

SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "flash-attn", "benches",
                           "decode_shapes.txt")
# (batch, seqlen_q, q heads, kv heads, seqlen_k), the same file the Rust benchmark reads
SHAPES = [tuple(int(x) for x in line.split()) for line in open(SHAPES_FILE) if line.strip() and not line.startswith("#")]


def median_seconds(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2] / 1e3


def main():
    from fa3_fwd_interface import flash_attn_func

    d = 128
    print("FA3 (fa3-fwd, num_splits=0: its own split heuristic), decode-like, d128, bf16")
    print("| batch | seqlen_q | heads q/kv | seqlen_k | causal | us | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for b, sq, h, hk, sk in SHAPES:
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        for causal in [False] if sq == 1 else [False, True]:
            try:
                sec = median_seconds(lambda: flash_attn_func(q, k, v, causal=causal, num_splits=0))
            except Exception as ex:  # report, keep going
                print(f"| {b} | {sq} | {h}/{hk} | {sk} | {int(causal)} | FAILED {type(ex).__name__}: {str(ex)[:120]} | |")
                continue
            tbs = 2 * b * sk * hk * d * 2 / sec / 1e12
            print(f"| {b} | {sq} | {h}/{hk} | {sk} | {int(causal)} | {sec * 1e6:.1f} | {tbs:.2f} |", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
