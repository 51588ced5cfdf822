// One (row, column pair) item of a split-KV merge across a thread-block cluster, the forward
// kernel's cluster merge (cluster_combine.cuh): every share's LSE and O pair read through distributed
// shared memory, then lse = log Σ_s exp(lse_s) (an attention sink once more in the sum, never in O) and
// O = Σ_s exp(lse_s − lse) · O_s. A share without keys holds LSE -inf (any O) and weighs nothing.
#pragma once
#include <cmath>

#include "../primitives/cluster.cuh"

namespace fa3 {

// (Also the single-query decode kernel's bound on its shares, kernels/kvcache/decode.cu.)
constexpr int kClusterMaxShares = 8;  // a portable cluster size; MAX_CLUSTER_SHARES in forward.rs

// Every share's LSE and O pair at once (one DSMEM round trip): `lse_addr` and `o_addr` are the
// shared::cta addresses of this item's values, the same in each of the cluster's `shares` CTAs.
__device__ __forceinline__ void gather_shares(uint32_t lse_addr, uint32_t o_addr, int shares,
                                              float (&lse_s)[kClusterMaxShares], float2 (&o_s)[kClusterMaxShares]) {
#pragma unroll
    for (int c = 0; c < kClusterMaxShares; ++c) {
        if (c < shares) {
            lse_s[c] = ld_cluster_f32(cluster_map(lse_addr, c));
            o_s[c] = ld_cluster_f32x2(cluster_map(o_addr, c));
        } else {
            lse_s[c] = -INFINITY;
            o_s[c] = make_float2(0.f, 0.f);
        }
    }
}

// The merged O pair and LSE of the gathered shares, with `sink` (-inf: none); no share with keys
// and no sink: O 0 and LSE -inf.
__device__ __forceinline__ float2 merge_shares(const float (&lse_s)[kClusterMaxShares],
                                               const float2 (&o_s)[kClusterMaxShares], float sink,
                                               float& merged_lse) {
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kClusterMaxShares; ++c) mx = fmaxf(mx, lse_s[c]);
    mx = fmaxf(mx, sink);
    merged_lse = -INFINITY;
    float2 acc = make_float2(0.f, 0.f);
    if (mx != -INFINITY) {
        float sum = sink != -INFINITY ? expf(sink - mx) : 0.f;
#pragma unroll
        for (int c = 0; c < kClusterMaxShares; ++c) sum += expf(lse_s[c] - mx);  // exp(-inf) = 0
        merged_lse = mx + logf(sum);
#pragma unroll
        for (int c = 0; c < kClusterMaxShares; ++c) {
            const float w = expf(lse_s[c] - merged_lse);
            if (w != 0.f) {
                acc.x = fmaf(w, o_s[c].x, acc.x);
                acc.y = fmaf(w, o_s[c].y, acc.y);
            }
        }
    }
    return acc;
}

}  // namespace fa3
