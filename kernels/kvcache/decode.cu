// Single-query decode over a 16-bit KV cache on the CUDA cores: flash_attn_with_kvcache calls
// with one query per sequence over short caches (crates/flash-attn/src/cuda/decode.rs says
// which). The forward kernel (kernels/flash_fwd/) runs every other call.
//
// Why a second kernel: a decode step over a short cache reads little (the 1B model's layer at 640
// keys: 640 KiB of K and V) and the forward kernel's launch of big warp-specialised CTAs, its tile
// hand-over and its first loads cost ~10 µs a layer under a CUDA graph, most of a batch-1 step's
// attention (docs/kernels/kvcache.md, "A decode CTA's timeline"). This kernel is small CTAs that
// load all their keys at once and merge their shares in a thread-block cluster: one HBM round
// trip for K and V, a few hundred instructions per thread, one DSMEM merge.
//
// Grid (shares, kv_heads, batch) in clusters of `shares` CTAs along x, 256 threads each. CTA
// (rank, kv head, b) attends the GQA group of q heads over kv head `kv head` of sequence b (the
// group's `group` rows), over share `rank` of the sequence's keys: keys [lo, len) cut in `shares`
// even parts, lo the window's first key. Per chunk of kKeys keys, two chunks in flight (cp.async,
// every thread its own rows, so scattered pages cost no more than a contiguous cache):
//   1. scores: thread (key, head lane) takes the dot products of its key's row with its rows of q;
//   2. the online softmax: warp w owns rows w, w + warps, ...: the chunk's max and sum by shuffles,
//      p written back over the scores, and each row's rescale of O;
//   3. P·V: thread (row, 16-byte column segment, key slice) accumulates 8 columns in registers.
// Then the key slices' sums meet in shared memory, each row is normalised (its share's LSE beside
// it), and the cluster's CTAs merge the shares through distributed shared memory with the forward
// kernel's cluster merge arithmetic (kernels/flash_fwd/share_merge.cuh): lse = log Σ exp(lse_s),
// O = Σ exp(lse_s − lse) O_s, an attention sink once.
//
// Keys past the cache (a slot or page past the pool) read as zeros, as the forward kernel's TMA
// loads read them: they take part in the softmax with score 0 and value 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "../primitives/cluster.cuh"
#include "../primitives/convert.cuh"
#include "../primitives/cp_async.cuh"
#include "../primitives/mbarrier.cuh"
#include "../primitives/warp.cuh"
#include "../flash_fwd/share_merge.cuh"

namespace fa3 {

// Mirrored field for field by `DecodeParams` in crates/flash-attn/src/cuda/decode.rs.
struct DecodeParams {
    const void* q;                  // (batch, heads, head_dim), contiguous
    const void* k_cache;            // element strides below; the last dim contiguous
    const void* v_cache;
    const uint32_t* seqused;        // (batch): the keys each sequence attends to
    const uint32_t* kv_batch_idx;   // (batch) or null: sequence b reads cache slot b
    const uint32_t* page_table;     // (batch, max_pages) or null: a contiguous cache
    const float* sinks;             // (heads) or null
    void* out;                      // (batch, heads, head_dim), contiguous, q's dtype
    float* lse;                     // (batch, heads)
    int64_t k_slot_stride, k_row_stride, k_head_stride;
    int64_t v_slot_stride, v_row_stride, v_head_stride;
    int heads, group;               // q heads; q heads per kv head (at most kDecodeMaxGroup)
    int slots;                      // the caches' first dim: sequences, or pages
    int rows;                       // the caches' second dim: keys per sequence, or per page
    int max_pages;                  // the page table's columns (paged)
    int capacity;                   // keys a sequence can hold: rows, or max_pages · rows
    int window_left;                // keys more than this left of the query are masked; -1: none
    float scale_log2;               // scores times this in log2 units (softcap: cap · log2 e)
    float softcap_pre;              // != 0: s <- tanh(s · softcap_pre) first (scale / cap)
};

// Threads per CTA (the host launches __launch_bounds__'s count). The kernel runs at about one CTA
// per SM (decode.rs), where its time is a chain of dependent steps: 256 threads shorten each
// thread's part of it (the 1B shape's batch-1 call 0.86x the time of 128 threads; at two CTAs
// per SM, batch 4, 128 threads were faster: docs/kernels/kvcache.md, session 39).
constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeMaxGroup = 16;  // MAX_GROUP in decode.rs

template <int kD> struct DecodeTraits {
    static_assert(kD == 64 || kD == 128, "head dims 64 and 128");
    static constexpr int kKeys = kD == 64 ? 64 : 32;  // keys per chunk: static shared memory under 48 KiB
    static constexpr int kSegs = kD / 8;              // 16-byte segments of a row
    static constexpr int kPitch = kD + 8;             // a shared row: an odd number of 16-byte units,
                                                      // so 8 rows' same segment hit 8 different banks
    static constexpr int kHeadLanes = kDecodeThreads / kKeys;       // score step: threads per key
    // P·V step: (row, segment) items per thread at most
    static constexpr int kItemsPerThread = (kDecodeMaxGroup * kSegs + kDecodeThreads - 1) / kDecodeThreads;
    static constexpr int kRowsPerWarp = kDecodeMaxGroup / kDecodeWarps;  // softmax step
};

template <int kD> struct DecodeSmem {
    using Tr = DecodeTraits<kD>;
    uint16_t k[2][Tr::kKeys][Tr::kPitch];  // two chunks; after the loop, the key slices' sums
    uint16_t v[2][Tr::kKeys][Tr::kPitch];
    float q[kDecodeMaxGroup][kD];           // q rows as f32; after the loop, this share's O rows
    float s[kDecodeMaxGroup][Tr::kKeys + 1];  // scores, then p (an odd pitch: rows apart in banks)
    float alpha[kDecodeMaxGroup];           // each row's rescale of O for this chunk
    float row_max[kDecodeMaxGroup];         // after the loop: each row's max and sum (log2 units)
    float row_sum[kDecodeMaxGroup];
    float lse[kDecodeMaxGroup];             // this share's LSE per row (natural log), for the merge
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int kD, int kDtype> __device__ __forceinline__ void decode(const DecodeParams& p) {
    using Tr = DecodeTraits<kD>;
    constexpr int kKeys = Tr::kKeys, kSegs = Tr::kSegs;
    __shared__ __align__(16) DecodeSmem<kD> sm;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rank = blockIdx.x, shares = gridDim.x, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = p.group, head0 = kv_head * group;

    // q's rows (contiguous in q), first: they do not wait for the key count.
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p.q) + ((int64_t)b * p.heads + head0) * (kD / 2);
    for (int i = tid; i < group * kD / 2; i += kDecodeThreads) {
        const float2 f = unpack16x2<kDtype>(q[i]);
        (&sm.q[0][0])[2 * i] = f.x;
        (&sm.q[0][0])[2 * i + 1] = f.y;
    }

    // This share's keys: [lo, len) cut in `shares` even parts.
    const int len = (int)min(p.seqused[b], (uint32_t)p.capacity);
    const int lo = p.window_left >= 0 ? max(0, len - 1 - p.window_left) : 0;
    const int per = (len - lo + shares - 1) / shares;
    const int start = min(lo + rank * per, len), end = min(start + per, len);
    const int chunks = (end - start + kKeys - 1) / kKeys;
    // A contiguous cache's slot (as int64: an index past i32 must fail the `< slots` check below).
    const int64_t slot = p.page_table == nullptr ? (p.kv_batch_idx != nullptr ? (int64_t)p.kv_batch_idx[b] : b) : 0;
    const char* k_base = reinterpret_cast<const char*>(p.k_cache) + 2 * (int64_t)kv_head * p.k_head_stride;
    const char* v_base = reinterpret_cast<const char*>(p.v_cache) + 2 * (int64_t)kv_head * p.v_head_stride;
    const uint32_t* pages = p.page_table != nullptr ? p.page_table + (int64_t)b * p.max_pages : nullptr;

    // Chunk c's K and V rows into stage c % 2 (rows past the share zero-filled), one commit group
    // per call whether or not the chunk exists, so that the loop's wait counts stay uniform.
    auto issue = [&](int c) {
        if (c < chunks) {
            const int key0 = start + c * kKeys, st = c & 1;
            for (int i = tid; i < kKeys * kSegs; i += kDecodeThreads) {
                const int row = i / kSegs, seg = i % kSegs, key = key0 + row;
                bool valid = key < end;
                int64_t cache_slot = slot, cache_row = key;
                if (valid && p.page_table != nullptr) {
                    cache_slot = pages[key / p.rows];
                    cache_row = key % p.rows;
                }
                valid = valid && cache_slot < p.slots;
                const char* k_src = k_base;
                const char* v_src = v_base;
                if (valid) {
                    k_src += 2 * (cache_slot * p.k_slot_stride + cache_row * p.k_row_stride + 8 * seg);
                    v_src += 2 * (cache_slot * p.v_slot_stride + cache_row * p.v_row_stride + 8 * seg);
                }
                cp_async_16(smem_u32(&sm.k[st][row][8 * seg]), k_src, valid);
                cp_async_16(smem_u32(&sm.v[st][row][8 * seg]), v_src, valid);
            }
        }
        cp_async_commit();
    };
    issue(0);
    issue(1);

    // The softmax step's rows: warp w owns rows w + kDecodeWarps · i, their running max and sum
    // (log2 units).
    float row_max[Tr::kRowsPerWarp], row_sum[Tr::kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerWarp; ++i) {
        row_max[i] = -INFINITY;
        row_sum[i] = 0.f;
    }
    // The P·V step's items: (row, segment) pairs, each over `slices` interleaved key slices.
    const int items = group * kSegs;
    const int slices = max(1, min(kKeys, kDecodeThreads / items));
    float acc[Tr::kItemsPerThread][8];
#pragma unroll
    for (int j = 0; j < Tr::kItemsPerThread; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;

    for (int c = 0; c < chunks; ++c) {
        const int st = c & 1, key0 = start + c * kKeys, live = min(kKeys, end - key0);
        cp_async_wait<1>();  // this thread's copies of chunk c (chunk c + 1 may be in flight)
        __syncthreads();     // everyone's, and q's rows

        // 1. Scores, in log2 units; keys past the share -inf. The key's row is read once into
        // registers, then each of this thread's q rows (a loop with a runtime bound) runs four
        // independent FMA chains over it. (Version 1 unrolled the rows with a branch each, and
        // every q load was then waited for alone: 1.2-1.4x the time.)
        {
            const int key = tid % kKeys, head_lane = tid / kKeys;  // head_lane is warp-uniform
            uint4 k_row[kSegs];
#pragma unroll
            for (int seg = 0; seg < kSegs; ++seg) k_row[seg] = *reinterpret_cast<const uint4*>(&sm.k[st][key][8 * seg]);
            for (int h = head_lane; h < group; h += Tr::kHeadLanes) {
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int seg = 0; seg < kSegs; ++seg) {
                    float kf[8];
                    unpack16x8<kDtype>(k_row[seg], kf);
                    const float4 q0 = *reinterpret_cast<const float4*>(&sm.q[h][8 * seg]);
                    const float4 q1 = *reinterpret_cast<const float4*>(&sm.q[h][8 * seg + 4]);
                    part[0] = fmaf(q0.x, kf[0], part[0]);
                    part[1] = fmaf(q0.y, kf[1], part[1]);
                    part[2] = fmaf(q0.z, kf[2], part[2]);
                    part[3] = fmaf(q0.w, kf[3], part[3]);
                    part[0] = fmaf(q1.x, kf[4], part[0]);
                    part[1] = fmaf(q1.y, kf[5], part[1]);
                    part[2] = fmaf(q1.z, kf[6], part[2]);
                    part[3] = fmaf(q1.w, kf[7], part[3]);
                }
                float s = (part[0] + part[1]) + (part[2] + part[3]);
                if (p.softcap_pre != 0.f) s = tanhf(s * p.softcap_pre);
                sm.s[h][key] = key < live ? s * p.scale_log2 : -INFINITY;
            }
        }
        __syncthreads();

        // 2. The online softmax of each row over this chunk.
#pragma unroll
        for (int i = 0; i < Tr::kRowsPerWarp; ++i) {
            const int h = warp + kDecodeWarps * i;
            if (h < group) {  // warp-uniform
                float x[kKeys / 32];
                float mx = -INFINITY;
#pragma unroll
                for (int u = 0; u < kKeys / 32; ++u) {
                    x[u] = sm.s[h][lane + 32 * u];
                    mx = fmaxf(mx, x[u]);
                }
                mx = warp_max(mx);
                const float new_max = fmaxf(row_max[i], mx);
                // A row with no live key yet keeps p = 0 (exp2(-inf) = 0) without -inf - -inf.
                const float ref = new_max == -INFINITY ? 0.f : new_max;
                const float alpha = fast_exp2(row_max[i] - ref);
                float sum = 0.f;
#pragma unroll
                for (int u = 0; u < kKeys / 32; ++u) {
                    x[u] = fast_exp2(x[u] - ref);
                    sum += x[u];
                    sm.s[h][lane + 32 * u] = x[u];
                }
                row_sum[i] = row_sum[i] * alpha + warp_sum(sum);
                row_max[i] = new_max;
                if (lane == 0) sm.alpha[h] = alpha;
            }
        }
        __syncthreads();

        // 3. O = alpha · O + P·V for this thread's items.
#pragma unroll
        for (int j = 0; j < Tr::kItemsPerThread; ++j) {
            const int idx = tid + kDecodeThreads * j;
            if (idx < items * slices) {
                const int slice = idx / items, item = idx - slice * items;
                const int h = item / kSegs, seg = item - h * kSegs;
                const float a = sm.alpha[h];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] *= a;
#pragma unroll 4
                for (int key = slice; key < live; key += slices) {
                    const float pk = sm.s[h][key];
                    float vf[8];
                    unpack16x8<kDtype>(*reinterpret_cast<const uint4*>(&sm.v[st][key][8 * seg]), vf);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(pk, vf[e], acc[j][e]);
                }
            }
        }
        __syncthreads();  // stage st and the scores are free again
        issue(c + 2);
    }
    cp_async_wait<0>();  // nothing may land in the K stages reused below

    // This share's rows: the key slices' sums added, normalised, with their LSE.
#pragma unroll
    for (int i = 0; i < Tr::kRowsPerWarp; ++i) {
        const int h = warp + kDecodeWarps * i;
        if (h < group && lane == 0) {
            sm.row_max[h] = row_max[i];
            sm.row_sum[h] = row_sum[i];
        }
    }
    float* slice_sums = reinterpret_cast<float*>(&sm.k[0][0][0]);  // [slices · items][8]
    static_assert(sizeof(sm.k) >= kDecodeThreads * Tr::kItemsPerThread * 8 * sizeof(float), "slice sums fit");
#pragma unroll
    for (int j = 0; j < Tr::kItemsPerThread; ++j) {
        const int idx = tid + kDecodeThreads * j;
        if (idx < items * slices) {
            float4* dst = reinterpret_cast<float4*>(slice_sums + 8 * idx);
            dst[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            dst[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
        }
    }
    __syncthreads();
    for (int i = tid; i < group * kD; i += kDecodeThreads) {
        const int h = i / kD, col = i - h * kD;
        const int item = h * kSegs + col / 8, e = col % 8;
        float o = 0.f;
        for (int s = 0; s < slices; ++s) o += slice_sums[8 * (s * items + item) + e];
        const float l = sm.row_sum[h];
        sm.q[h][col] = l > 0.f ? o / l : 0.f;
    }
    if (tid < group) {
        const float l = sm.row_sum[tid];
        sm.lse[tid] = l > 0.f ? (sm.row_max[tid] + log2f(l)) * 0.69314718055994531f : -INFINITY;
    }

    // The shares' merge: item (row, column pair) idx by the CTA of rank idx % shares.
    cluster_arrive_release();
    cluster_wait();  // every share's rows are in its shared memory
    constexpr int kPairs = kD / 2;
    for (int idx = rank + shares * tid; idx < group * kPairs; idx += shares * kDecodeThreads) {
        const int h = idx / kPairs, col = 2 * (idx - h * kPairs);
        float lse_s[kClusterMaxShares];
        float2 o_s[kClusterMaxShares];
        gather_shares(smem_u32(&sm.lse[h]), smem_u32(&sm.q[h][col]), shares, lse_s, o_s);
        const float sink = p.sinks != nullptr ? p.sinks[head0 + h] : -INFINITY;
        float merged_lse;
        const float2 o = merge_shares(lse_s, o_s, sink, merged_lse);
        const int64_t row = (int64_t)b * p.heads + head0 + h;
        reinterpret_cast<uint32_t*>(p.out)[(row * kD + col) / 2] = pack16x2<kDtype>(o.x, o.y);
        if (col == 0) p.lse[row] = merged_lse;
    }
    // No CTA exits (freeing its shared memory) before every CTA has read it.
    cluster_arrive_release();
    cluster_wait();
}

}  // namespace fa3

#define FA3_DECODE_KERNEL(name, D, DTYPE)                                                                 \
    extern "C" __global__ void __launch_bounds__(fa3::kDecodeThreads) name(const __grid_constant__ fa3::DecodeParams p) { \
        fa3::decode<D, fa3::DTYPE>(p);                                                                    \
    }
FA3_DECODE_KERNEL(kvcache_decode_d64_bf16, 64, DT_BF16)
FA3_DECODE_KERNEL(kvcache_decode_d64_f16, 64, DT_F16)
FA3_DECODE_KERNEL(kvcache_decode_d128_bf16, 128, DT_BF16)
FA3_DECODE_KERNEL(kvcache_decode_d128_f16, 128, DT_F16)
