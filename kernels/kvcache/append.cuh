// The rules of flash_attn_with_kvcache's append (crates/flash-attn/src/kvcache.rs), shared by the
// append kernel (append.cu) and the decode kernel's fused append (decode.cu), so that a cache
// holds the same bits whichever kernel wrote it, and the CPU path's.
#pragma once
#include <cstdint>

namespace fa3 {

// Error bits of the caller's status word, mirrored by flash_attn3::kvcache::STATUS_*.
enum KvCacheError : uint32_t {
    kKeysPastCache = 1,     // cache_seqlens[b] + seqlen_new keys do not fit the cache
    kPagePastPool = 2,      // a page the sequence uses is past the page pool
    kBatchIdxPastCache = 4, // cache_batch_idx[b] is past the cache's rows
    kPastRotary = 8,        // a position past the rotary tables (left unturned)
};

// The rotary embedding's turn of the pair (x0, x1) by the angle whose cos and sin are c and s:
// the host's arithmetic (kvcache.rs, RotaryTables::apply), f32 with each product rounded (no FMA
// contraction): (x0·c − x1·s, x0·s + x1·c).
__device__ __forceinline__ float2 turn_pair(float x0, float x1, float c, float s) {
    return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// The two elements of a row that pair r of `half` turned pairs covers: (r, r + half), or (2r,
// 2r + 1) if interleaved. Pairs r >= half cover the unturned rest, two elements each from 2 · half.
__device__ __forceinline__ int2 turn_pair_elements(int r, int half, bool interleaved) {
    if (r >= half || interleaved) return make_int2(2 * r, 2 * r + 1);
    return make_int2(r, r + half);
}

}  // namespace fa3
