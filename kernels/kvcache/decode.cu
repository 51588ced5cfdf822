// Single-query decode over a 16-bit KV cache on the CUDA cores: flash_attn_with_kvcache calls
// with one query per sequence over short caches (crates/flash-attn/src/cuda/decode.rs says
// which). The forward kernel (kernels/flash_fwd/) runs every other call.
//
// Why a second kernel: a decode step over a short cache reads little (the 1B model's layer at 640
// keys: 640 KiB of K and V) and the forward kernel's launch of big warp-specialised CTAs, its tile
// hand-over and its first loads cost ~10 µs a layer under a CUDA graph, most of a batch-1 step's
// attention (docs/kernels/kvcache.md, "A decode CTA's timeline"). This kernel is small CTAs whose
// warps each load their keys at once and work alone until the merge: one HBM round trip for K
// and V, a few hundred instructions per thread, one exchange through distributed shared memory.
//
// Grid (shares, kv_heads, batch) in clusters of `shares` CTAs along x (a power of two up to 8),
// 256 threads each. CTA (rank, kv head, b) attends the GQA group of q heads over kv head `kv head`
// of sequence b (the group's `group` rows), over share `rank` of the sequence's keys: keys
// [lo, len) cut in `shares` even parts, lo the window's first key; each warp takes an even slice
// of the share, kKeys keys a step (every lane issues its own loads from global memory, so scattered
// pages cost one lookup per key):
//   1. scores: kLanesPerKey lanes per key, each a dot product of 32 of the key's elements (held in
//      registers) with every row of q (shared memory), the parts added by shuffles;
//   2. the online softmax of every row over the step (a warp max each), p through the warp's rows
//      of shared memory, each row's rescale of O;
//   3. P·V: each lane accumulates kCols columns of every row, over every key of the step (V's
//      columns loaded into registers with the key rows).
// Then the merge: each CTA merges its warps' rows (max, sum, unnormalised O) in its shared memory
// and sends them (st.async) into the shared memory of the cluster's CTA that owns each (row,
// column); each CTA waits on its inbox mbarrier for the bytes it owns and merges the shares:
// M = max m, O = Σ 2^(m − M) o / L, L = Σ 2^(m − M) l (an attention sink once more in L),
// LSE = (M + log2 L) ln 2.
//
// Keys past the cache (a slot or page past the pool) read as zeros, as the forward kernel's TMA
// loads read them: they take part in the softmax with score 0 and value 0.
//
// The append, fused (a call with at most one new key per sequence, `seqlen_new` 0 or 1): the
// append kernel's work (append.cu) done inside this one, so that a decode step is one launch.
// Sequence b holds keys cache_seqlens[b] + seqlen_new; q and the new key turn to position
// cache_seqlens[b]. Every CTA turns its q rows in shared memory; the CTA whose share holds the new
// key (the sequence's last) turns it, stores it and its value row into the cache and keeps them
// in shared memory, where the warp whose slice holds the key takes them instead of the cache
// row it loaded. Each CTA checks its sequence as the append kernel does (`checked`): a sequence
// with an error reads as empty (its shares send nothing), and the first share of kv head 0 ORs
// the error bits into the status word.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "../primitives/cluster.cuh"
#include "../primitives/convert.cuh"
#include "../primitives/dependent_launch.cuh"
#include "../primitives/mbarrier.cuh"
#include "../primitives/warp.cuh"
#include "../flash_fwd/share_merge.cuh"
#include "append.cuh"

namespace fa3 {

// Mirrored field for field by `DecodeParams` in crates/flash-attn/src/cuda/decode.rs.
struct DecodeParams {
    const void* q;                  // (batch, heads, head_dim): token rows q_batch_stride apart
    void* k_cache;                  // element strides below; the last dim contiguous
    void* v_cache;
    const uint32_t* seqused;        // (batch): the keys each sequence attends to, less seqlen_new
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
    // The fused append (null / 0 where the call has none of it).
    const void* k_new;              // (batch, kv_heads, head_dim): token rows *_new_batch_stride apart
    const void* v_new;
    const float* rotary_cos;        // (positions, rotary_half); null: no rotary
    const float* rotary_sin;
    uint32_t* status;               // error bits (append.cuh), ORed in; null: none
    int64_t q_batch_stride;         // elements
    int64_t k_new_batch_stride, v_new_batch_stride;
    int seqlen_new;                 // 0 or 1: keys past seqused[b], the new key's
    int checked;                    // 1: check each sequence as the append kernel does
    int rotary_half, rotary_interleaved, positions;
};

// Threads per CTA (the host launches __launch_bounds__'s count): eight warps, each attending its
// own slice of the share's keys with no block barrier until the slices merge.
constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeMaxGroup = 16;  // MAX_GROUP in decode.rs (8 at d128: max_group there)

template <int kD> struct DecodeTraits {
    static_assert(kD == 64 || kD == 128, "head dims 64 and 128");
    static constexpr int kElems = 32;                // a lane holds 32 elements of a key's row: 4 x 16 bytes
    static constexpr int kSegs = kElems / 8;
    static constexpr int kLanesPerKey = kD / kElems;
    static constexpr int kKeys = 32 / kLanesPerKey;  // keys a warp takes per step
    static constexpr int kCols = kD / 32;            // P.V: the output columns of a lane
};

// The merge: each CTA first merges its warps' rows in its own shared memory, then sends its share's
// rows (max, sum, unnormalised O) to the CTAs that own them; CTA `rank` owns items (row h,
// column) h · kD + col in [rank · owned, (rank + 1) · owned), owned = group · kD / shares.
// The dynamic shared memory of a CTA whose GQA group has `group` rows, in floats after the inbox
// (decode.rs `smem_bytes` mirrors it):
//   inbox                                the mbarrier the merge's bytes arrive on (16 bytes)
//   q      [group][kD]                   q's rows as f32
//   p      [warps][group][kKeys]         each warp's probabilities of its current step
//   part_o [warps][group][kD]            each warp's unnormalised O rows,
//   part_m [warps][group]                their max (log2 units)
//   part_l [warps][group]                and sum
//   recv_o [shares][owned]               every share's O at this CTA's items (group · kD)
//   recv_m [shares][group]               every share's rows' max, at most kClusterMaxShares shares
//   recv_l [shares][group]               and sum
//   new_k, new_v [kD] (16-bit)           the fused append's new key, turned, and its value row
template <int kD> struct DecodeSmem {
    uint64_t* inbox;
    float *q, *p, *part_o, *part_m, *part_l, *recv_o, *recv_m, *recv_l;
    uint16_t *new_k, *new_v;
    __device__ DecodeSmem(float* base, int group) {
        inbox = reinterpret_cast<uint64_t*>(base);
        q = base + 4;
        p = q + group * kD;
        part_o = p + kDecodeWarps * group * DecodeTraits<kD>::kKeys;
        part_m = part_o + kDecodeWarps * group * kD;
        part_l = part_m + kDecodeWarps * group;
        recv_o = part_l + kDecodeWarps * group;
        recv_m = recv_o + group * kD;
        recv_l = recv_m + kClusterMaxShares * group;
        new_k = reinterpret_cast<uint16_t*>(recv_l + kClusterMaxShares * group);
        new_v = new_k + kD;
    }
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

// 16-bit values from global memory on the read-only path, zeros if !ok. The loads are volatile
// with a memory clobber, so they go out in program order: K's rows (which the scores wait for)
// before V's many small loads.
__device__ __forceinline__ uint4 load16_or_zero(const void* src, bool ok) {
    uint4 x = make_uint4(0, 0, 0, 0);
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "+r"(x.x), "+r"(x.y), "+r"(x.z), "+r"(x.w)
        : "l"(src), "r"((int)ok)
        : "memory");
    return x;
}
template <int kBytes> struct Chunk;
template <> struct Chunk<4> { using T = uint32_t; };
template <> struct Chunk<8> { using T = uint2; };
template <int kBytes> __device__ __forceinline__ typename Chunk<kBytes>::T load_or_zero(const char* src, bool ok) {
    using T = typename Chunk<kBytes>::T;
    T x{};
    if (ok) x = __ldg(reinterpret_cast<const T*>(src));
    return x;
}

// A warp's step over keys [key0, key0 + kKeys) ∩ [.., end): the key rows of lane's key (lane /
// kLanesPerKey, elements kElems · (lane % kLanesPerKey)..+kElems) and every key's kCols value columns of
// the lane, from global memory into registers. Keys past `end` load nothing (zeros); keys on a
// slot or page past the pool read as zeros, as the forward kernel's TMA loads read them.
template <int kD> struct DecodeStep {
    using Tr = DecodeTraits<kD>;
    uint4 k[Tr::kSegs];
    typename Chunk<2 * Tr::kCols>::T v[Tr::kKeys];
};

// `page_shift`: log2 of the page size (pages hold a power of two of keys, 16 to 256).
template <int kD>
__device__ __forceinline__ void load_step(const DecodeParams& p, DecodeStep<kD>& st, int key0, int end, uint32_t slot,
                                          const uint32_t* pages, int page_shift, const char* k_base,
                                          const char* v_base, int lane) {
    using Tr = DecodeTraits<kD>;
    const int key = key0 + lane / Tr::kLanesPerKey;
    const bool valid = key < end;
    uint32_t cache_slot = slot, cache_row = key;
    if (pages != nullptr) {
        cache_slot = valid ? pages[key >> page_shift] : 0u;
        cache_row = key & (p.rows - 1);
    }
    const bool k_ok = valid && cache_slot < (uint32_t)p.slots;
    const uint4* k_src = reinterpret_cast<const uint4*>(
        k_base + 2 * ((int64_t)cache_slot * p.k_slot_stride + (int64_t)cache_row * p.k_row_stride +
                      Tr::kElems * (lane % Tr::kLanesPerKey)));
#pragma unroll
    for (int seg = 0; seg < Tr::kSegs; ++seg) st.k[seg] = load16_or_zero(k_src + seg, k_ok);
    const char* v_lane = v_base + 2 * Tr::kCols * lane;
    if (pages == nullptr) {  // one slot: row after row
        const bool slot_ok = slot < (uint32_t)p.slots;
        const char* v_src = v_lane + 2 * ((int64_t)slot * p.v_slot_stride + (int64_t)key0 * p.v_row_stride);
#pragma unroll
        for (int j = 0; j < Tr::kKeys; ++j)
            st.v[j] = load_or_zero<2 * Tr::kCols>(v_src + 2 * (int64_t)j * p.v_row_stride, slot_ok && key0 + j < end);
    } else {
#pragma unroll
        for (int j = 0; j < Tr::kKeys; ++j) {
            // Key j's page, as its key lane looked it up.
            const uint32_t v_slot = __shfl_sync(0xffffffffu, cache_slot, j * Tr::kLanesPerKey);
            const int v_key = key0 + j;
            st.v[j] = load_or_zero<2 * Tr::kCols>(
                v_lane + 2 * ((int64_t)v_slot * p.v_slot_stride + (int64_t)(v_key & (p.rows - 1)) * p.v_row_stride),
                v_key < end && v_slot < (uint32_t)p.slots);
        }
    }
}

// A diagnostic: built with FA3_NVCC_FLAGS=-DFA3_DECODE_TRACE, lane 0 of each warp of the first two
// shares of kv head 0 prints its clock at each stage boundary (cycles since the CTA's start), one
// line per warp and call: run the benchmark's kvcache_decode pass with BENCH_DECODE_ONCE
// (docs/kernels/kvcache.md, session 40, has where the time went).
enum DecodeStamp {
    kStart, kRanges, kQ, kIssued, kScores, kSoftmax, kKeysDone, kSums, kStarted, kSent, kLanded, kMerged, kStamps
};
#ifdef FA3_DECODE_TRACE
#define DECODE_STAMP(stage) (stamps[stage] = clock64())
#else
#define DECODE_STAMP(stage)
#endif

template <int kD, int kDtype, int kG> __device__ __forceinline__ void decode(const DecodeParams& p) {
    static_assert(kG <= kDecodeMaxGroup, "a CTA's rows");
    using Tr = DecodeTraits<kD>;
#ifdef FA3_DECODE_TRACE
    long long stamps[kStamps] = {};
#endif
    DECODE_STAMP(kStart);
    // The kernel after this one may start its blocks now (programmatic dependent launch): in
    // flash-llama's decode step that is the o projection, whose blocks then request their weights
    // while the attention runs and wait (griddepcontrol.wait) for this grid to finish before they
    // read its output. A no-op for a kernel launched normally.
    let_dependents_start();
    constexpr int kKeys = Tr::kKeys, kCols = Tr::kCols, kL = Tr::kLanesPerKey;
    constexpr int kQWords = (kG * kD / 2 + kDecodeThreads - 1) / kDecodeThreads;  // q's u32 words per thread
    extern __shared__ __align__(16) float decode_smem[];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rank = blockIdx.x, shares = gridDim.x, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = p.group, head0 = kv_head * group;
    const DecodeSmem<kD> sm(decode_smem, group);
    // The merge's inbox: every CTA receives every part's max and sum of its rows and their O at
    // its items. Its initialisation is published to the cluster by the first cluster phase, which
    // the senders wait for before their first store.
    if (tid == 0) {
        mbar_init(sm.inbox, 1);
        mbar_init_fence();
        mbar_arrive_expect_tx(sm.inbox, 4 * (group * kD + 2 * gridDim.x * group));
    }
    cluster_arrive_relaxed();

    // The key count and q's rows first: K's and V's loads wait for the one, the scores for both.
    const uint32_t cached = p.seqused[b];  // the keys before the new one: its position and q's
    const uint32_t* q =
        reinterpret_cast<const uint32_t*>(p.q) + ((int64_t)b * p.q_batch_stride + (int64_t)head0 * kD) / 2;
    uint32_t q_words[kQWords];
#pragma unroll
    for (int i = 0; i < kQWords; ++i) {
        const int idx = tid + kDecodeThreads * i;
        q_words[i] = idx < group * kD / 2 ? q[idx] : 0u;
    }

    // This share's keys: [lo, len) cut in `shares` even parts; the share's keys cut in
    // `kDecodeWarps` even slices, one per warp, walked kKeys at a time.
    const uint64_t keys = (uint64_t)cached + p.seqlen_new;
    const int len = (int)min(keys, (uint64_t)p.capacity);
    const int lo = p.window_left >= 0 ? max(0, len - 1 - p.window_left) : 0;
    const int per = (len - lo + shares - 1) / shares;
    const int start = min(lo + rank * per, len), end = min(start + per, len);
    const int per_warp = (end - start + kDecodeWarps - 1) / kDecodeWarps;
    // (Read through a shuffle so that the compiler sees them warp-uniform: the step loop's shuffles
    // then compile without the divergent-warp fallback.)
    const int w_start = __shfl_sync(0xffffffffu, min(start + warp * per_warp, end), 0);
    const int w_end = __shfl_sync(0xffffffffu, min(w_start + per_warp, end), 0);
    // A contiguous cache's slot (unsigned: an index past i32 must fail the `< slots` check).
    const uint32_t slot = p.page_table == nullptr ? (p.kv_batch_idx != nullptr ? p.kv_batch_idx[b] : (uint32_t)b) : 0u;
    DECODE_STAMP(kRanges);
    const char* k_base = reinterpret_cast<const char*>(p.k_cache) + 2 * (int64_t)kv_head * p.k_head_stride;
    const char* v_base = reinterpret_cast<const char*>(p.v_cache) + 2 * (int64_t)kv_head * p.v_head_stride;
    const uint32_t* pages = p.page_table != nullptr ? p.page_table + (int64_t)b * p.max_pages : nullptr;
    const int page_shift = __ffs(p.rows) - 1;  // pages hold a power of two of keys

    // The first step's loads go out now, ahead of q's staging and the append.
    const int my_key = lane / kL, part = lane % kL;  // the lane's key in a step, its part of the row
    DecodeStep<kD> step;
    if (w_start < w_end) load_step<kD>(p, step, w_start, w_end, slot, pages, page_shift, k_base, v_base, lane);

    // The fused append. q and the new key turn to position `cached` (if the tables reach it); the
    // cos and sin of this thread's pairs of q's rows (pair i: row i / (kD / 2), pair i % (kD / 2)),
    // its first pair's also the new key's pair `tid`.
    const int half = p.rotary_half;
    const bool interleaved = p.rotary_interleaved != 0;
    const bool turn = p.rotary_cos != nullptr && cached < (uint32_t)p.positions;
    constexpr int kPairs = (kG * kD / 2 + kDecodeThreads - 1) / kDecodeThreads;
    float cos_r[kPairs], sin_r[kPairs];
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
        const int r = (tid + kDecodeThreads * i) % (kD / 2);
        const bool load = turn && r < half;
        cos_r[i] = load ? p.rotary_cos[(int64_t)cached * half + r] : 1.f;
        sin_r[i] = load ? p.rotary_sin[(int64_t)cached * half + r] : 0.f;
    }
    // The CTA whose share holds the new key (keys [start, end) hold position `cached` only if the
    // key fits the cache) turns it and stores it with its value row, thread t < kD / 2 taking
    // the key's pair t and thread kD / 2 + t the value's elements 2t, 2t + 1.
    const bool holds_new = p.seqlen_new != 0 && (int)cached >= start && (int)cached < end;
    if (holds_new && tid < kD) {
        uint32_t new_slot = slot;
        int64_t new_row = cached;
        if (pages != nullptr) {
            new_slot = pages[cached >> page_shift];
            new_row = cached & (p.rows - 1);
        }
        const bool stored = new_slot < (uint32_t)p.slots;  // a page past the pool: not stored
        if (tid < kD / 2) {
            const uint16_t* src =
                static_cast<const uint16_t*>(p.k_new) + (int64_t)b * p.k_new_batch_stride + (int64_t)kv_head * kD;
            const int2 e = turn_pair_elements(tid, turn ? half : 0, interleaved);
            uint32_t pair = (uint32_t)src[e.x] | (uint32_t)src[e.y] << 16;
            if (turn && tid < half) {
                const float2 x = unpack16x2<kDtype>(pair);
                const float2 y = turn_pair(x.x, x.y, cos_r[0], sin_r[0]);
                pair = pack16x2<kDtype>(y.x, y.y);  // one rounding to the cache's type
            }
            sm.new_k[e.x] = (uint16_t)pair;
            sm.new_k[e.y] = (uint16_t)(pair >> 16);
            if (stored) {
                uint16_t* dst = static_cast<uint16_t*>(p.k_cache) + (int64_t)new_slot * p.k_slot_stride +
                                new_row * p.k_row_stride + (int64_t)kv_head * p.k_head_stride;
                dst[e.x] = (uint16_t)pair;
                dst[e.y] = (uint16_t)(pair >> 16);
            }
        } else {
            const int c = 2 * (tid - kD / 2);
            const uint16_t* src =
                static_cast<const uint16_t*>(p.v_new) + (int64_t)b * p.v_new_batch_stride + (int64_t)kv_head * kD + c;
            const uint16_t v0 = src[0], v1 = src[1];
            sm.new_v[c] = v0;
            sm.new_v[c + 1] = v1;
            if (stored) {
                uint16_t* dst = static_cast<uint16_t*>(p.v_cache) + (int64_t)new_slot * p.v_slot_stride +
                                new_row * p.v_row_stride + (int64_t)kv_head * p.v_head_stride + c;
                dst[0] = v0;
                dst[1] = v1;
            }
        }
    }
    // The append kernel's checks (append.cu check_sequence): a sequence with an error reads as
    // empty. A q position past the tables only sets its bit (q is left unturned).
    uint32_t err = 0;
    if (p.checked) {
        if (keys > (uint64_t)p.capacity) err |= kKeysPastCache;
        if (p.rotary_cos != nullptr && keys > (uint64_t)p.positions) err |= kPastRotary;
        if (pages != nullptr && keys <= (uint64_t)p.capacity) {
            const int used = (int)((keys + p.rows - 1) >> page_shift);
            for (int i = tid; i < used; i += kDecodeThreads)
                if (pages[i] >= (uint32_t)p.slots) err |= kPagePastPool;
        }
        if (pages == nullptr && p.kv_batch_idx != nullptr && slot >= (uint32_t)p.slots) err |= kBatchIdxPastCache;
    }
    const uint32_t status_bits = err | (p.rotary_cos != nullptr && !turn ? kPastRotary : 0u);
    if (status_bits != 0 && p.status != nullptr && rank == 0 && kv_head == 0) atomicOr(p.status, status_bits);

    // q's rows into shared memory (as f32).
#pragma unroll
    for (int i = 0; i < kQWords; ++i) {
        const int idx = tid + kDecodeThreads * i;
        if (idx < group * kD / 2) {
            const float2 f = unpack16x2<kDtype>(q_words[i]);
            sm.q[2 * idx] = f.x;
            sm.q[2 * idx + 1] = f.y;
        }
    }
    __syncthreads();
    if (turn) {  // q's rows turned in place, each rounded once to q's type (the append kernel's q_rot)
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
            const int pair = tid + kDecodeThreads * i, r = pair % (kD / 2);
            if (pair < group * kD / 2 && r < half) {
                float* row = sm.q + pair / (kD / 2) * kD;
                const int2 e = turn_pair_elements(r, half, interleaved);
                const float2 y = turn_pair(row[e.x], row[e.y], cos_r[i], sin_r[i]);
                const float2 rounded = unpack16x2<kDtype>(pack16x2<kDtype>(y.x, y.y));
                row[e.x] = rounded.x;
                row[e.y] = rounded.y;
            }
        }
        __syncthreads();
    }
    DECODE_STAMP(kQ);

    // Each row's running max and sum (log2 units; the sum of this lane's keys) and O columns.
    float row_max[kG], row_sum[kG], acc[kG][kCols];
#pragma unroll
    for (int h = 0; h < kG; ++h) {
        row_max[h] = -INFINITY;
        row_sum[h] = 0.f;
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[h][c] = 0.f;
    }
    float* p_warp = sm.p + warp * group * kKeys;

    for (int key0 = w_start; key0 < w_end; key0 += kKeys) {  // warp-uniform
        const int live = min(kKeys, w_end - key0);
        if (key0 != w_start) load_step<kD>(p, step, key0, w_end, slot, pages, page_shift, k_base, v_base, lane);
        if (holds_new && (int)cached >= key0 && (int)cached < key0 + live) {  // warp-uniform
            // The new key: its turned row and its value from shared memory, in place of the
            // cache row loaded (which this CTA may be writing).
            if (key0 + my_key == (int)cached) {
#pragma unroll
                for (int seg = 0; seg < Tr::kSegs; ++seg)
                    step.k[seg] = *reinterpret_cast<const uint4*>(sm.new_k + Tr::kElems * part + 8 * seg);
            }
#pragma unroll
            for (int j = 0; j < kKeys; ++j)
                if (key0 + j == (int)cached)
                    step.v[j] = *reinterpret_cast<const typename Chunk<2 * kCols>::T*>(sm.new_v + kCols * lane);
        }

        // 1. Scores, in log2 units; keys past the slice and rows past the group -inf. Each K
        // segment is converted once for every row; two FMA chains per row (a key's lanes add
        // their parts). Rows past the group compute on the last row's q and are
        // discarded by selects, not branches, so the rows' steps interleave.
        DECODE_STAMP(kIssued);
        constexpr int kChains = kG >= 16 ? 1 : 2;  // 16 rows: one chain each, in registers
        float dot[kG][kChains];
#pragma unroll
        for (int h = 0; h < kG; ++h)
#pragma unroll
            for (int c = 0; c < kChains; ++c) dot[h][c] = 0.f;
#pragma unroll
        for (int seg = 0; seg < Tr::kSegs; ++seg) {
            float kf[8];
            unpack16x8<kDtype>(step.k[seg], kf);
#pragma unroll
            for (int h = 0; h < kG; ++h) {
                const float* q_row = sm.q + min(h, group - 1) * kD + Tr::kElems * part + 8 * seg;
                const float4 q0 = *reinterpret_cast<const float4*>(q_row);
                const float4 q1 = *reinterpret_cast<const float4*>(q_row + 4);
                const float qf[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) dot[h][e % kChains] = fmaf(qf[e], kf[e], dot[h][e % kChains]);
            }
        }
        float s[kG];
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            float x = dot[h][0];
            if constexpr (kChains == 2) x += dot[h][1];
#pragma unroll
            for (int o = 1; o < kL; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (p.softcap_pre != 0.f) x = tanhf(x * p.softcap_pre);
            s[h] = my_key < live && h < group ? x * p.scale_log2 : -INFINITY;
        }
        DECODE_STAMP(kScores);

        // 2. The online softmax of each row over the step's keys (a warp max each); p for the
        // P.V step goes through the warp's shared rows.
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            const float new_max = fmaxf(row_max[h], warp_max(s[h]));
            // A row with no live key yet keeps p = 0 (exp2(-inf) = 0) without -inf - -inf.
            const float ref = new_max == -INFINITY ? 0.f : new_max;
            const float alpha = fast_exp2(row_max[h] - ref);
            const float pk = fast_exp2(s[h] - ref);
            row_sum[h] = row_sum[h] * alpha + (part == 0 ? pk : 0.f);
            row_max[h] = new_max;
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[h][c] *= alpha;
            if (part == 0 && h < group) p_warp[h * kKeys + my_key] = pk;
        }
        __syncwarp();
        DECODE_STAMP(kSoftmax);

        // 3. O += P.V over the step's keys, four at a time (p of keys past the slice is 0; rows
        // past the group read the last row's p and are never stored).
#pragma unroll
        for (int j4 = 0; j4 < kKeys; j4 += 4) {
            if (j4 < live) {  // warp-uniform
                float vf[4][kCols];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if constexpr (kCols == 2) {
                        const float2 f = unpack16x2<kDtype>(step.v[j4 + u]);
                        vf[u][0] = f.x;
                        vf[u][1] = f.y;
                    } else {
                        const float2 f0 = unpack16x2<kDtype>(step.v[j4 + u].x);
                        const float2 f1 = unpack16x2<kDtype>(step.v[j4 + u].y);
                        vf[u][0] = f0.x;
                        vf[u][1] = f0.y;
                        vf[u][2] = f1.x;
                        vf[u][3] = f1.y;
                    }
                }
#pragma unroll
                for (int h = 0; h < kG; ++h) {
                    const float4 p4 = *reinterpret_cast<const float4*>(p_warp + min(h, group - 1) * kKeys + j4);
                    const float pu[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                    for (int u = 0; u < 4; ++u)
#pragma unroll
                        for (int c = 0; c < kCols; ++c) acc[h][c] = fmaf(pu[u], vf[u][c], acc[h][c]);
                }
            }
        }
        __syncwarp();  // the warp's p rows are free again
    }

    DECODE_STAMP(kKeysDone);
    // This warp's rows into shared memory: the sums over the lanes (all rows at once; rows past the
    // group sum zeros), the max, and each lane's O columns.
    float sums[kG];
#pragma unroll
    for (int h = 0; h < kG; ++h) sums[h] = warp_sum(row_sum[h]);
#pragma unroll
    for (int h = 0; h < kG; ++h) {
        if (h < group) {  // warp-uniform
            if (lane == 0) {
                sm.part_m[warp * group + h] = row_max[h];
                sm.part_l[warp * group + h] = sums[h];
            }
            float* o = sm.part_o + (warp * group + h) * kD + kCols * lane;
            if constexpr (kCols == 2) {
                *reinterpret_cast<float2*>(o) = make_float2(acc[h][0], acc[h][1]);
            } else {
                *reinterpret_cast<float4*>(o) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            }
        }
    }
    const bool empty = __syncthreads_or(err != 0);  // a sequence with an error sends nothing
    DECODE_STAMP(kSums);

    // This share's rows, (row, column pair) items one per thread: the warps' parts merged (M = the
    // warps' max, o = Σ 2^(m − M) o_w, l = Σ 2^(m − M) l_w) and sent with st.async to the item's
    // owner, completing on its inbox; the first 'shares' pairs of each row also send the row's
    // M and l to one owner each.
    const int owned = group * kD / shares;  // a multiple of kCols: kD / 8 · group / shares
    cluster_wait();  // every CTA has started and initialised its inbox
    DECODE_STAMP(kStarted);
    const uint32_t inbox = smem_u32(sm.inbox);
    for (int pair = tid; pair < group * kD / 2; pair += kDecodeThreads) {
        const int h = pair / (kD / 2), col = 2 * pair - h * kD;
        float m[kDecodeWarps], mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) {
            m[w] = sm.part_m[w * group + h];
            mx = fmaxf(mx, m[w]);
        }
        const float ref = mx == -INFINITY ? 0.f : mx;
        float2 o = make_float2(0.f, 0.f);
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) {
            const float e = fast_exp2(m[w] - ref);
            const float2 ow = *reinterpret_cast<const float2*>(sm.part_o + (w * group + h) * kD + col);
            o.x = fmaf(e, ow.x, o.x);
            o.y = fmaf(e, ow.y, o.y);
            l = fmaf(e, sm.part_l[w * group + h], l);
        }
        if (empty) {
            mx = -INFINITY;
            o = make_float2(0.f, 0.f);
            l = 0.f;
        }
        const int item = h * kD + col, owner = item / owned;
        st_async_f32x2(cluster_map(smem_u32(sm.recv_o + rank * owned + item - owner * owned), owner), o.x, o.y,
                       cluster_map(inbox, owner));
        if (col / 2 < shares) {  // this pair sends the row's max and sum to owner col / 2
            const int to = col / 2;
            const uint32_t bar = cluster_map(inbox, to);
            st_async_f32(cluster_map(smem_u32(sm.recv_m + rank * group + h), to), mx, bar);
            st_async_f32(cluster_map(smem_u32(sm.recv_l + rank * group + h), to), l, bar);
        }
    }
    DECODE_STAMP(kSent);
    mbar_wait_cluster(sm.inbox, 0);  // every share's bytes for this CTA have landed
    DECODE_STAMP(kLanded);

    // This CTA's items, in column pairs: 8 lanes a pair, lane `sub` taking share `sub`, their sums
    // meeting by shuffles. The merged row: M = the shares' and the sink's max,
    // O = Σ 2^(m − M) o / L, L = Σ 2^(m − M) l + 2^(sink − M), LSE = (M + log2 L) ln 2. No CTA
    // reads another's shared memory, so none waits to exit.
    static_assert(kClusterMaxShares == 8, "a pair's lanes are one per share");
    const int pairs = owned / 2, sub = lane % kClusterMaxShares;
    for (int base = 0; base < pairs; base += kDecodeThreads / kClusterMaxShares) {  // block-uniform
        const int slot_pair = base + tid / kClusterMaxShares, pair = min(slot_pair, pairs - 1);
        const int item = rank * owned + 2 * pair, h = item / kD;
        constexpr float kLog2e = 1.4426950408889634f;
        const float sink = p.sinks != nullptr ? p.sinks[head0 + h] * kLog2e : -INFINITY;
        const int from = min(sub, shares - 1);  // lanes past the shares read the last share's; weigh 0
        const float m = sub < shares ? sm.recv_m[from * group + h] : -INFINITY;
        const float l = sm.recv_l[from * group + h];
        const float2 o = *reinterpret_cast<const float2*>(sm.recv_o + from * owned + 2 * pair);
        float mx = fmaxf(m, sink);
#pragma unroll
        for (int s = 1; s < kClusterMaxShares; s *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, s));
        const float ref = mx == -INFINITY ? 0.f : mx;
        const float e = fast_exp2(m - ref);
        float2 o_sum = make_float2(e * o.x, e * o.y);
        float l_sum = e * l;
#pragma unroll
        for (int s = 1; s < kClusterMaxShares; s *= 2) {
            o_sum.x += __shfl_xor_sync(0xffffffffu, o_sum.x, s);
            o_sum.y += __shfl_xor_sync(0xffffffffu, o_sum.y, s);
            l_sum += __shfl_xor_sync(0xffffffffu, l_sum, s);
        }
        if (slot_pair < pairs && sub == 0) {
            if (sink != -INFINITY) l_sum += fast_exp2(sink - ref);
            const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
            const int64_t row = (int64_t)b * p.heads + head0 + h;
            const int col = item - h * kD;
            reinterpret_cast<uint32_t*>(p.out)[(row * kD + col) / 2] = pack16x2<kDtype>(o_sum.x * inv, o_sum.y * inv);
            if (col == 0) p.lse[row] = l_sum > 0.f ? (mx + log2f(l_sum)) * 0.69314718055994531f : -INFINITY;
        }
    }
    DECODE_STAMP(kMerged);
#ifdef FA3_DECODE_TRACE
    if (lane == 0 && kv_head == 0 && rank < 2) {
        const long long t0 = stamps[kStart];
        printf("decode trace d%d b%d rank %d/%d warp %d keys %d | ranges %lld q %lld issued %lld scores %lld softmax %lld "
               "keys_done %lld sums %lld started %lld sent %lld landed %lld merged %lld\n",
               kD, b, rank, shares, warp, w_end - w_start, stamps[kRanges] - t0, stamps[kQ] - t0, stamps[kIssued] - t0,
               stamps[kScores] - t0, stamps[kSoftmax] - t0, stamps[kKeysDone] - t0, stamps[kSums] - t0,
               stamps[kStarted] - t0, stamps[kSent] - t0, stamps[kLanded] - t0, stamps[kMerged] - t0);
    }
#endif
}

}  // namespace fa3

// One kernel per head dim, dtype and group bound (GQA groups of up to 4, 8 and, at d64, 16 q
// heads): the rows' state lives in registers, unrolled to the bound (d128 with 16 rows spilled).
// d128 asks for one CTA per SM (its 4-row kernel spilled at the 128 registers that ptxas chose for
// two); d64's 4-row kernel asks for two (128 registers, no spills), which the host's share rule
// finds through the driver's occupancy count (decode.rs `resident_ctas`, `plan`).
#define FA3_DECODE_KERNEL(name, D, DTYPE, ROWS, ...)                                                      \
    extern "C" __global__ void __launch_bounds__(fa3::kDecodeThreads __VA_OPT__(, ) __VA_ARGS__)          \
        name(const __grid_constant__ fa3::DecodeParams p) {                                               \
        fa3::decode<D, fa3::DTYPE, ROWS>(p);                                                              \
    }
FA3_DECODE_KERNEL(kvcache_decode_d64_bf16_g4, 64, DT_BF16, 4, 2)
FA3_DECODE_KERNEL(kvcache_decode_d64_bf16_g8, 64, DT_BF16, 8)
FA3_DECODE_KERNEL(kvcache_decode_d64_bf16_g16, 64, DT_BF16, 16)
FA3_DECODE_KERNEL(kvcache_decode_d64_f16_g4, 64, DT_F16, 4, 2)
FA3_DECODE_KERNEL(kvcache_decode_d64_f16_g8, 64, DT_F16, 8)
FA3_DECODE_KERNEL(kvcache_decode_d64_f16_g16, 64, DT_F16, 16)
FA3_DECODE_KERNEL(kvcache_decode_d128_bf16_g4, 128, DT_BF16, 4, 1)
FA3_DECODE_KERNEL(kvcache_decode_d128_bf16_g8, 128, DT_BF16, 8, 1)
FA3_DECODE_KERNEL(kvcache_decode_d128_f16_g4, 128, DT_F16, 4, 1)
FA3_DECODE_KERNEL(kvcache_decode_d128_f16_g8, 128, DT_F16, 8, 1)
