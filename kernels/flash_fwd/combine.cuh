// Split-KV combine: merges the per-split partial outputs of a split-KV forward into out and lse.
//
// Split s of a query row wrote its O normalised over its own keys, O_s, and the LSE of those keys,
// lse_s (-inf when it saw none; O_s is then not written and never read). Over all keys:
// lse = log Σ_s exp(lse_s) and O = Σ_s exp(lse_s - lse) · O_s.
//
// `warps_per_row` (W: 1, 2, 4 or 8, chosen by the host from the split count) warps share a row, so
// a block of kCombineWarps warps combines kCombineWarps / W rows. The row's 32·W threads load its
// split LSEs at once and reduce them through shuffles and shared memory; then warp w of the row
// accumulates splits w, w + W, ... (four in flight), each lane its column pairs (d_v <= 256: at
// most 4 pairs; a split's row is one coalesced line), and the row's first warp adds the other
// warps' sums. Decode calls have few rows and many splits (batch 1, 32 heads, 32 splits: 32 rows),
// where a warp walking every split one after the other was bound by the latency of its loads.
#pragma once
#include <cmath>

#include "../primitives/convert.cuh"
#include "../primitives/dependent_launch.cuh"
#include "params.cuh"

namespace fa3 {

constexpr int kCombineWarps = 8;        // 256-thread blocks
constexpr int kCombineMaxSplits = 128;  // MAX_SPLITS in params.rs
constexpr int kCombineInFlight = 4;     // splits a warp reads at once

template <int kDtype> __device__ void combine_splits(const CombineParams& p) {
    // The kernel after the combine may start its blocks as this one drains (programmatic
    // dependent launch: flash-llama's matrix-vector products, which wait for it before they read
    // its output; a no-op for a kernel launched normally).
    let_dependents_start();
    const int per_row = p.warps_per_row;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = warp / per_row;            // the block's row this warp works on
    const int row_warp = warp % per_row;        // which of the row's warps
    const int t = row_warp * 32 + lane;         // the thread's rank among the row's threads
    const int row_threads = 32 * per_row;
    const int64_t rows = (int64_t)p.total_q * p.heads;
    const int64_t row = (int64_t)blockIdx.x * (kCombineWarps / per_row) + slot;
    const bool active = row < rows;
    const int splits = p.num_splits;

    __shared__ float weight[kCombineWarps][kCombineMaxSplits];  // per row slot: exp(lse_s - lse)
    __shared__ float partial[kCombineWarps];                    // per warp: a max, then a sum
    __shared__ float2 sums[kCombineWarps][4][32];               // per warp: its column sums

    // The split LSEs: up to kCombineMaxSplits / 32 per thread with one warp per row.
    constexpr int kLsePerThread = kCombineMaxSplits / 32;
    float lse_s[kLsePerThread];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kLsePerThread; ++i) {
        const int s = t + i * row_threads;
        lse_s[i] = active && s < splits ? p.lse_accum[s * rows + row] : -INFINITY;
        mx = fmaxf(mx, lse_s[i]);
    }
    // Reduces v over the row's warps (op: fmaxf or +), in every thread of the row.
    auto row_reduce = [&](float v, bool is_max) {
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
            const float other = __shfl_xor_sync(0xffffffff, v, o);
            v = is_max ? fmaxf(v, other) : v + other;
        }
        if (lane == 0) partial[warp] = v;
        __syncthreads();
        v = partial[slot * per_row];
        for (int w = 1; w < per_row; ++w) v = is_max ? fmaxf(v, partial[slot * per_row + w]) : v + partial[slot * per_row + w];
        __syncthreads();  // `partial` is reused by the next reduction
        return v;
    };
    mx = row_reduce(mx, true);
    // An attention sink is one more term of the denominator, added once here (the splits leave
    // it out): it weighs the partials down and adds nothing to the output.
    const float sink = active && p.sinks != nullptr ? p.sinks[row % p.heads] : -INFINITY;
    mx = fmaxf(mx, sink);
    float sum = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
        for (int i = 0; i < kLsePerThread; ++i) sum += expf(lse_s[i] - mx);  // exp(-inf) = 0
    }
    sum = row_reduce(sum, false);
    if (sink != -INFINITY) sum += expf(sink - mx);
    // No split saw a key (and no sink): a zero row and LSE -inf, as the unsplit kernel writes.
    const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);
#pragma unroll
    for (int i = 0; i < kLsePerThread; ++i) {
        const int s = t + i * row_threads;
        if (s < splits) weight[slot][s] = mx == -INFINITY ? 0.f : expf(lse_s[i] - lse);
    }
    __syncthreads();

    float2 acc[4] = {};
    if (active && mx != -INFINITY) {
        for (int s0 = row_warp; s0 < splits; s0 += kCombineInFlight * per_row) {
            float w[kCombineInFlight];
            float2 v[kCombineInFlight][4];
#pragma unroll
            for (int u = 0; u < kCombineInFlight; ++u) {
                const int s = s0 + u * per_row;
                w[u] = s < splits ? weight[slot][s] : 0.f;  // the same in every lane of the warp
                const float* src = p.o_accum + (s * rows + row) * p.head_dim_v;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int col = 64 * c + 2 * lane;
                    // A split without keys has weight 0 and an unwritten O: never read.
                    v[u][c] = w[u] != 0.f && col < p.head_dim_v ? *reinterpret_cast<const float2*>(src + col)
                                                                : make_float2(0.f, 0.f);
                }
            }
#pragma unroll
            for (int u = 0; u < kCombineInFlight; ++u) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    acc[c].x = fmaf(w[u], v[u][c].x, acc[c].x);
                    acc[c].y = fmaf(w[u], v[u][c].y, acc[c].y);
                }
            }
        }
    }
    if (per_row > 1) {
#pragma unroll
        for (int c = 0; c < 4; ++c) sums[warp][c][lane] = acc[c];
        __syncthreads();
        if (row_warp == 0) {
            for (int w = 1; w < per_row; ++w) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float2 o = sums[warp + w][c][lane];
                    acc[c].x += o.x;
                    acc[c].y += o.y;
                }
            }
        }
    }
    if (!active || row_warp != 0) return;
    uint16_t* out = reinterpret_cast<uint16_t*>(p.out) + row * p.head_dim_v;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int col = 64 * c + 2 * lane;
        if (col < p.head_dim_v) *reinterpret_cast<uint32_t*>(out + col) = pack16x2<kDtype>(acc[c].x, acc[c].y);
    }
    if (lane == 0) {
        const int64_t token = row / p.heads, head = row % p.heads;
        const int64_t at = p.varlen ? head * p.lse_head_stride + token
                                    : (token / p.seqlen_q) * p.lse_batch_stride + head * p.lse_head_stride +
                                          token % p.seqlen_q;
        p.lse[at] = lse;
    }
}

}  // namespace fa3
