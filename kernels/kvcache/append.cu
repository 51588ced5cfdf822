// The KV cache's append (flash_attn_with_kvcache, crates/flash-attn/src/kvcache.rs): before the
// attention reads the cache, this kernel writes each sequence's new keys and values at positions
// cache_seqlens[b].., turns the new keys (and a copy of q) by the rotary embedding on the way, and
// checks every cache row and page the attention will read.
//
// Grid (1 + seqlen_new + (q turned ? seqlen_q : 0), batch), kAppendThreads (256) threads; the
// attention kernel after it is launched to overlap it (let_dependents_start). For sequence b:
//  - block 0 checks the sequence: its keys fit the cache (and the rotary tables), its cache row or
//    pages exist. It writes the key count the attention sees, 0 for a sequence with an error (it
//    reads as empty: output 0, LSE -inf), and ORs the error bits into *status;
//  - block 1 + i writes new token i (skipped where its slot does not exist);
//  - block 1 + seqlen_new + i writes q's token i, turned, into q_rot.
// The rotation is the host's arithmetic (kvcache.rs, RotaryTables::apply): f32, x0·cos − x1·sin
// and x0·sin + x1·cos with each product rounded (no FMA contraction), one rounding to the element
// type, so a cache holds the same bits whichever device wrote it. FP8 (e4m3) caches are copied as
// bytes: the host refuses rotary for them (turn k before quantizing it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../primitives/dependent_launch.cuh"
#include "append.cuh"

namespace fa3 {

// Mirrored field for field by `AppendParams` in crates/flash-attn/src/cuda/kvcache.rs.
struct KvAppendParams {
    const void* k_new;          // (batch, seqlen_new, kv_heads, head_dim): token (b, i) at b · k_new_strides[0]
    const void* v_new;          // + i · k_new_strides[1], its heads contiguous; v likewise
    void* k_cache;              // (slots, rows, kv_heads, head_dim) at the element strides below
    void* v_cache;              // (slots, rows, kv_heads, head_dim_v)
    const void* q;              // (batch, seqlen_q, heads, head_dim), contiguous
    void* q_rot;                // q turned, same layout; null: q is not turned
    const float* cos;           // (positions, rotary_half); null: no rotary
    const float* sin;
    const uint32_t* cache_seqlens;  // (batch)
    const uint32_t* kv_batch_idx;   // (batch) or null: sequence b uses cache row b
    const uint32_t* page_table;     // (batch, max_pages) or null: a contiguous cache
    uint32_t* seqused;          // (batch), written: the keys the attention sees
    uint32_t* status;           // error bits, ORed in
    int64_t k_slot_stride, k_row_stride, k_head_stride;  // elements; a row's values contiguous
    int64_t v_slot_stride, v_row_stride, v_head_stride;
    int64_t k_new_strides[2], v_new_strides[2];  // elements: batch, token
    int batch, seqlen_new, seqlen_q, heads, kv_heads, head_dim, head_dim_v;
    int slots;                  // the caches' first dim: rows of a contiguous cache, or pages
    int rows;                   // the caches' second dim: keys per cache row, or per page
    int max_pages;              // the page table's columns (paged)
    int rotary_half, interleaved, positions;
    int q_per_token;            // 1: q token i turns to position cache_seqlens[b] + i, 0: all
                                // to cache_seqlens[b] (FA3's rule for calls without a mask)
};

// 256 threads: a d128 token of 32 q heads (2,048 pairs) is one batch of kPairsInFlight pairs a thread.
constexpr int kAppendThreads = 256;

template <int kBf16> __device__ __forceinline__ float to_f32(uint16_t x) {
    if constexpr (kBf16) {
        return __bfloat162float(__ushort_as_bfloat16(x));
    } else {
        return __half2float(__ushort_as_half(x));
    }
}

template <int kBf16> __device__ __forceinline__ uint16_t from_f32(float x) {
    if constexpr (kBf16) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    } else {
        return __half_as_ushort(__float2half_rn(x));
    }
}

// The element types: bf16 and f16 as their bits, e4m3 as a byte (copied, never turned).
enum AppendDtype { kAppendBf16, kAppendF16, kAppendE4m3 };
template <int kDtype> using AppendElem = typename std::conditional<kDtype == kAppendE4m3, uint8_t, uint16_t>::type;

// Pairs of elements each thread reads before it writes any (copy_rows_turned): a batch's loads are
// all in flight at once, so a row set costs ceil(pairs / (kAppendThreads · kPairsInFlight)) round
// trips to memory. (One element at a time, each iteration's loads waited for the previous
// iteration's store, which might have aliased them: q's 32 heads of d128 on 128 threads took 32
// dependent round trips, ~10 µs of a decode call; docs/kernels/kvcache.md, session 47.)
constexpr int kPairsInFlight = 8;

// Copies `heads` rows of `d` values from element src_off of src (rows contiguous) to element dst_off
// of dst (rows `dst_head_stride` elements apart), turning the first 2 · rotary_half dims of each by
// the angle whose cos / sin rows are given (null: a plain copy). Unturned values are copied as bits.
// Work is by pair (turn_pair_elements: a turned pair, or two elements of the unturned rest; d is
// even, a multiple of 8 on the GPU).
template <int kDtype>
__device__ void copy_rows_turned(const KvAppendParams& p, const void* src_base, int64_t src_off, void* dst_base,
                                 int64_t dst_off, int64_t dst_head_stride, int heads, int d, const float* cos,
                                 const float* sin) {
    using Elem = AppendElem<kDtype>;
    constexpr int kBf16 = kDtype == kAppendBf16;
    const Elem* __restrict__ src = static_cast<const Elem*>(src_base) + src_off;
    Elem* __restrict__ dst = static_cast<Elem*>(dst_base) + dst_off;
    const bool turn = kDtype != kAppendE4m3 && cos != nullptr;
    const int half = turn ? p.rotary_half : 0;
    const int row_pairs = d / 2, pairs = heads * row_pairs;
    // Pair `pair`'s row h, its index r in the row, and the two elements it covers: the same in
    // the load loop and the store loop below.
    const auto locate = [&](int pair, int& h, int& r) {
        h = pair / row_pairs;
        r = pair - h * row_pairs;
        return turn_pair_elements(r, half, p.interleaved);
    };
    for (int first = threadIdx.x; first < pairs; first += kAppendThreads * kPairsInFlight) {
        Elem x0[kPairsInFlight], x1[kPairsInFlight];
        float c[kPairsInFlight], s[kPairsInFlight];
#pragma unroll
        for (int j = 0; j < kPairsInFlight; ++j) {
            const int pair = first + j * kAppendThreads;
            if (pair >= pairs) break;
            int h, r;
            const int2 e = locate(pair, h, r);
            x0[j] = src[h * d + e.x];
            x1[j] = src[h * d + e.y];
            if (r < half) {
                c[j] = cos[r];
                s[j] = sin[r];
            }
        }
#pragma unroll
        for (int j = 0; j < kPairsInFlight; ++j) {
            const int pair = first + j * kAppendThreads;
            if (pair >= pairs) break;
            int h, r;
            const int2 e = locate(pair, h, r);
            Elem* to = dst + h * dst_head_stride;
            if constexpr (kDtype != kAppendE4m3) {
                if (r < half) {
                    const float2 y = turn_pair(to_f32<kBf16>(x0[j]), to_f32<kBf16>(x1[j]), c[j], s[j]);
                    x0[j] = from_f32<kBf16>(y.x);
                    x1[j] = from_f32<kBf16>(y.y);
                }
            }
            to[e.x] = x0[j];
            to[e.y] = x1[j];
        }
    }
}

// Where sequence b's key j lives: the cache's (slot, row), or slot -1 where it does not exist
// (past the cache, a page past the pool, a cache row past the cache).
struct CacheRow {
    int64_t slot, row;
};
__device__ __forceinline__ CacheRow cache_row(const KvAppendParams& p, int b, uint32_t j) {
    if (p.page_table != nullptr) {
        if (j >= (uint32_t)p.max_pages * (uint32_t)p.rows) return {-1, 0};
        const uint32_t page = p.page_table[(int64_t)b * p.max_pages + j / p.rows];
        return {page < (uint32_t)p.slots ? (int64_t)page : -1, j % p.rows};
    }
    const uint32_t row = p.kv_batch_idx != nullptr ? p.kv_batch_idx[b] : (uint32_t)b;
    return {j < (uint32_t)p.rows && row < (uint32_t)p.slots ? (int64_t)row : -1, j};
}

__device__ void check_sequence(const KvAppendParams& p, int b) {
    const uint64_t keys = (uint64_t)p.cache_seqlens[b] + p.seqlen_new;
    const bool paged = p.page_table != nullptr;
    const uint64_t capacity = paged ? (uint64_t)p.max_pages * p.rows : (uint64_t)p.rows;
    uint32_t err = 0;
    if (keys > capacity) err |= kKeysPastCache;
    if (p.cos != nullptr && keys > (uint64_t)p.positions) err |= kPastRotary;
    if (paged && keys <= capacity) {
        const int pages = (int)((keys + p.rows - 1) / p.rows);
        for (int i = threadIdx.x; i < pages; i += kAppendThreads)
            if (p.page_table[(int64_t)b * p.max_pages + i] >= (uint32_t)p.slots) err |= kPagePastPool;
    }
    if (!paged && p.kv_batch_idx != nullptr && p.kv_batch_idx[b] >= (uint32_t)p.slots) err |= kBatchIdxPastCache;
    // Every thread's bits, gathered: one OR per bit over the block.
    uint32_t all = 0;
#pragma unroll
    for (int bit = 0; bit < 4; ++bit)
        if (__syncthreads_or(err & (1u << bit))) all |= 1u << bit;
    if (threadIdx.x == 0) {
        p.seqused[b] = all ? 0u : (uint32_t)keys;
        if (all) atomicOr(p.status, all);
    }
}

template <int kDtype> __device__ void kv_append(const KvAppendParams& p) {
    // The forward kernel after this one sets up meanwhile (a programmatic dependent launch; it
    // waits for this grid before it reads anything).
    let_dependents_start();
    const int b = blockIdx.y;
    const int x = blockIdx.x;
    if (x == 0) {
        check_sequence(p, b);
        return;
    }
    const uint32_t len = p.cache_seqlens[b];
    const auto angle = [&](uint32_t pos, const float*& cos, const float*& sin) {
        cos = sin = nullptr;
        if (p.cos == nullptr) return;
        if (pos < (uint32_t)p.positions) {
            cos = p.cos + (int64_t)pos * p.rotary_half;
            sin = p.sin + (int64_t)pos * p.rotary_half;
        } else if (threadIdx.x == 0) {
            atomicOr(p.status, kPastRotary);  // a q position past the tables: left unturned
        }
    };
    const float *cos, *sin;
    if (x <= p.seqlen_new) {
        const int i = x - 1;
        const CacheRow at = cache_row(p, b, len + i);
        if (at.slot < 0) return;  // check_sequence reports it
        angle(len + i, cos, sin);
        copy_rows_turned<kDtype>(p, p.k_new, b * p.k_new_strides[0] + i * p.k_new_strides[1], p.k_cache,
                                 at.slot * p.k_slot_stride + at.row * p.k_row_stride, p.k_head_stride, p.kv_heads,
                                 p.head_dim, cos, sin);
        copy_rows_turned<kDtype>(p, p.v_new, b * p.v_new_strides[0] + i * p.v_new_strides[1], p.v_cache,
                                 at.slot * p.v_slot_stride + at.row * p.v_row_stride, p.v_head_stride, p.kv_heads,
                                 p.head_dim_v, nullptr, nullptr);
        return;
    }
    const int i = x - 1 - p.seqlen_new;
    const int64_t token = (int64_t)b * p.seqlen_q + i;
    angle(len + (p.q_per_token ? i : 0), cos, sin);
    const int64_t q_off = token * p.heads * p.head_dim;
    copy_rows_turned<kDtype>(p, p.q, q_off, p.q_rot, q_off, p.head_dim, p.heads, p.head_dim, cos, sin);
}

}  // namespace fa3

extern "C" __global__ void __launch_bounds__(fa3::kAppendThreads) kvcache_append_bf16(const __grid_constant__ fa3::KvAppendParams p) {
    fa3::kv_append<fa3::kAppendBf16>(p);
}
extern "C" __global__ void __launch_bounds__(fa3::kAppendThreads) kvcache_append_f16(const __grid_constant__ fa3::KvAppendParams p) {
    fa3::kv_append<fa3::kAppendF16>(p);
}
extern "C" __global__ void __launch_bounds__(fa3::kAppendThreads) kvcache_append_e4m3(const __grid_constant__ fa3::KvAppendParams p) {
    fa3::kv_append<fa3::kAppendE4m3>(p);
}
