// The largest value of a row and its first index, reduced over a block: the greedy choice of
// argmax_rows (fused.cu) and of sample_rows (sampling.cu), one code so that both pick the same
// token (as flash_llama::sampling::argmax on the host: the first index on ties, NaNs never chosen).
#pragma once

#include <stdint.h>

// "Nothing seen yet" (every value was NaN, or the thread had no values).
constexpr uint32_t kNoIndex = 0xffffffffu;

// The better of two candidates (value, index): the larger value, the smaller index on ties.
__device__ __forceinline__ void keep_better(float& v, uint32_t& i, float ov, uint32_t oi) {
    if (oi == kNoIndex) return;
    if (i == kNoIndex || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Each of the block's kThreads threads passes its candidate (best, at), found over its own
// values in ascending index order with a strict `>` (so a later equal value never replaces an
// earlier one); every thread gets the block's back. A thread's indices are not a contiguous
// range (threads stride the row), so ties are broken by index at every level.
template <int kThreads>
__device__ __forceinline__ void block_argmax(float& best, uint32_t& at) {
    static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
    for (int o = 16; o > 0; o >>= 1)
        keep_better(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    __shared__ float warp_best[kThreads / 32];
    __shared__ uint32_t warp_at[kThreads / 32];
    if (threadIdx.x % 32 == 0) {
        warp_best[threadIdx.x / 32] = best;
        warp_at[threadIdx.x / 32] = at;
    }
    __syncthreads();
    best = 0.f;
    at = kNoIndex;
    for (int w = 0; w < kThreads / 32; ++w) keep_better(best, at, warp_best[w], warp_at[w]);
}
