// Split-KV combine: merges the per-split partial outputs of a split-KV forward into out and lse.
//
// Split s of a query row wrote its O normalised over its own keys, O_s, and the LSE of those keys,
// lse_s (-inf when it saw none). Over all keys: lse = log Σ_s exp(lse_s) and
// O = Σ_s exp(lse_s - lse) · O_s. One warp per (token, head) row: the lanes reduce the split LSEs
// with shuffles, then each lane accumulates its column pairs (d_v <= 256: at most 4 pairs), reading
// every split's row as one coalesced 1 KB line.
#pragma once
#include <cmath>

#include "../primitives/convert.cuh"
#include "params.cuh"

namespace fa3 {

constexpr int kCombineWarps = 8;  // rows per 256-thread block

template <int kDtype> __device__ void combine_splits(const CombineParams& p) {
    const int lane = threadIdx.x % 32;
    const int64_t rows = (int64_t)p.total_q * p.heads;
    const int64_t row = (int64_t)blockIdx.x * kCombineWarps + threadIdx.x / 32;
    if (row >= rows) return;

    float mx = -INFINITY;
    for (int s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, p.lse_accum[s * rows + row]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    // An attention sink is one more term of the denominator, added once here (the splits leave
    // it out): it weighs the partials down and adds nothing to the output.
    const float sink = p.sinks != nullptr ? p.sinks[row % p.heads] : -INFINITY;
    mx = fmaxf(mx, sink);
    float sum = 0.f;
    if (mx != -INFINITY) {
        for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lse_accum[s * rows + row] - mx);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (sink != -INFINITY) sum += expf(sink - mx);
    // No split saw a key (and no sink): a zero row and LSE -inf, as the unsplit kernel writes.
    const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);

    float2 acc[4] = {};
    if (mx != -INFINITY) {
        for (int s = 0; s < p.num_splits; ++s) {
            const float w = expf(p.lse_accum[s * rows + row] - lse);  // the same in every lane
            if (w == 0.f) continue;
            const float* src = p.o_accum + (s * rows + row) * p.head_dim_v;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int col = 64 * c + 2 * lane;
                if (col < p.head_dim_v) {
                    const float2 v = *reinterpret_cast<const float2*>(src + col);
                    acc[c].x = fmaf(w, v.x, acc[c].x);
                    acc[c].y = fmaf(w, v.y, acc[c].y);
                }
            }
        }
    }
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
