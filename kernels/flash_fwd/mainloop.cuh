// A consumer warpgroup: 64 query rows of the tile against every key block the producer streams.
//   S  = Q·Kᵀ      wgmma, A = Q and B = K both from 128B-swizzled shared memory (K-major)
//   P  = softmax   online, fp32 in registers (softmax.cuh); masks only on boundary blocks
//   O += P·V       wgmma, A = P from registers (16-bit), B = V from shared memory read transposed
// FP8 kernels (Tr::kFp8): the same with e4m3 operands (k = 32 per instruction), P converted to
// e4m3 in registers, V^T (the pre-pass's) as a K-major B, and the descales (TileScales).
#pragma once
#include <type_traits>
#include <utility>

#include "../primitives/mbarrier.cuh"
#include "../primitives/trace.cuh"
#include "../primitives/wgmma.cuh"
#include "epilogue.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "softmax.cuh"
#include "traits.cuh"
#include "transpose_v.cuh"

namespace fa3 {

// A position in the K/V ring (blocks consumed so far): unsigned, so that its stage (it % kStages)
// and phase ((it / kStages) & 1) compile to a mask and a shift, not signed division's fix-ups.
using RingCount = uint32_t;

// Per-thread view of the rows it owns, for masking.
struct RowMask {
    int lo[2], hi[2];  // visible keys [lo, hi) of the thread's two rows
};

// The visible keys of the thread's rows (tile rows row_in_tile and + 8): held across the key loop,
// or (FwdTraits::kRowMaskPerBlock) made again at each boundary block, four registers fewer next
// to S, P and O.
template <class Tr> __device__ __forceinline__ RowMask row_mask(const FwdParams& p, const TileInfo& t, int row_in_tile) {
    RowMask rm;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int query, head;
        row_position<Tr>(p, t, row_in_tile + 8 * h, query, head);
        key_range(p, query, t.seqlen_q, t.seqlen_k, rm.lo[h], rm.hi[h]);
    }
    return rm;
}

// Sets the thread's scores of columns c = 8j + e (a compile-time constant) past `hi` (and, kLo,
// before `lo`) to -inf: limits in column units, so each compare takes c as an immediate.
template <bool kLo, int kSRegs>
__device__ __forceinline__ void mask_columns(float (&s)[kSRegs], const int (&lo)[2], const int (&hi)[2]) {
#pragma unroll
    for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = 8 * j + e;
                if ((kLo && c < lo[h]) || c >= hi[h]) s[4 * j + 2 * h + e] = -INFINITY;
            }
        }
    }
}

// Sets masked scores to -inf. k0: the first key of the block; col0 = 2 * (lane % 4).
// The thread's score of column c is key k0 + col0 + c, so the limits are moved to column units
// once (mask_columns): one ISETP and one FSEL a score and row bound, where key-unit compares took
// a VIADD per column pair besides. A row's lower bound cuts the block only in windowed calls:
// without it (causal, and every block right of a window's left edge) only the upper bound is
// compared.
template <int kSRegs>
__device__ __forceinline__ void apply_mask(float (&s)[kSRegs], const RowMask& rm, int k0, int col0) {
    const int base = k0 + col0;
    const int lo[2] = {rm.lo[0] - base, rm.lo[1] - base}, hi[2] = {rm.hi[0] - base, rm.hi[1] - base};
    if (lo[0] <= 0 && lo[1] <= 0) {
        mask_columns<false>(s, lo, hi);
    } else {
        mask_columns<true>(s, lo, hi);
    }
}

// The consumers' online softmax (softmax.cuh), lazy or exact as the traits choose.
// FP8 kernels scale p by 2^8 for P's e4m3 rounding (softmax.cuh).
template <class Tr>
using Softmax =
    OnlineSoftmax<Tr::kSRegs, Tr::kLazyMax, Tr::kFp8 ? 8 : 0, Tr::kExp2FmaEvery, Tr::kSeedRowSums, Tr::kSeedRowMax>;

// O's rows times the softmax's correction factors (rows r and r + 8 of the thread) from its last
// step. With the lazy max, skipped when no row of the warp moved its reference max there (factors
// exactly 1): after the first blocks nearly always, which takes kHeadDim / 2 multiplies per thread
// off the chain between a block's P·V and the next issue (version 29). The step's vote says so
// (softmax.moved), without comparing the factors again.
template <class Tr>
__device__ __forceinline__ void rescale_o(float (&o)[Tr::kORegs], const float (&corr)[2], const Softmax<Tr>& softmax) {
    if constexpr (Tr::kLazyMax) {
        if (!softmax.moved) return;
    }
#pragma unroll
    for (int j = 0; j < Tr::kORegs / 4; ++j) {
        o[4 * j + 0] *= corr[0];
        o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1];
        o[4 * j + 3] *= corr[1];
    }
}

// ---------------------------------------------------------------------------------------------
// The consumer: intra-warpgroup overlap + inter-warpgroup pingpong.
//  * Overlap: Q·Kᵀ of block j+1 and P·V of block j are issued together; the softmax of block
//    j+1 runs while P·V of block j is still on the tensor cores (wgmma_wait<1>).
//  * Pingpong: named barriers hand the tensor cores from warpgroup to warpgroup in a ring
//    (0 -> 1 [-> 2] -> 0), so one warpgroup's softmax overlaps the others' GEMMs. Warpgroup 0
//    issues first.
// ---------------------------------------------------------------------------------------------

// Named barrier of consumer warpgroup wg's turn at the tensor cores (0 is __syncthreads; the
// epilogue's barriers follow, epilogue.cuh).
__device__ __forceinline__ int sched_barrier(int wg) { return kPingpongBarrier0 + wg; }

// Whether the consumer warpgroups take turns at the tensor cores: not where one computes (a
// one-warpgroup kernel, or a solo call: `solo`, transpose_v.cuh solo_consumer).
template <class Tr> __device__ __forceinline__ bool takes_turns(bool solo) { return Tr::kConsumerWGs > 1 && !solo; }

// The ring runs across tiles: each warpgroup takes n + 1 turns per tile of n key blocks (the same
// n for all), so warpgroup 0's first Q·Kᵀ of the next tile follows the last warpgroup's tail P·V
// of this one, and each warpgroup's epilogue overlaps the others' GEMMs. (A ring restarted per
// tile made warpgroup 0 wait for the last warpgroup's epilogue at every tile boundary.) Started
// once before the first tile (warpgroup 0 goes first) and closed once after the last.
template <int kWGs> __device__ __forceinline__ void pingpong_ring_start(int wg) {
    if (wg == kWGs - 1) named_barrier_arrive(sched_barrier(0), 256);
}
// The last warpgroup's final arrive on warpgroup 0's barrier is still pending: consume it so no
// barrier is left half-arrived at exit.
__device__ __forceinline__ void pingpong_ring_end(int wg) {
    if (wg == 0) named_barrier_sync(sched_barrier(0), 256);
}

// Descriptor low words (smem_desc_lo) of this warpgroup's Q rows (in Q buffer q_stage) and of
// stage 0 of the K and V rings; stage s of a ring is kStageStep further. Column blocks are
// Tr::kSwizzle bytes wide: a tile of `rows` rows keeps block c at c * rows * kSwizzle bytes (K and
// V: at c * kKVColBlockBytes, which differs in the kPageWarp kernels, traits.cuh kKVRowGroups).
template <class Tr> struct OperandDescs {
    static constexpr uint32_t kStageStep = Tr::kKVBytes >> 4;     // s.k[1] - s.k[0], in 16-byte units
    static constexpr uint32_t kVStageStep = Tr::kVStageBytes >> 4;  // s.v[1] - s.v[0]
    uint32_t q_, k0, v0;
    __device__ __forceinline__ OperandDescs(SharedStorage<Tr>& s, int wg, int q_stage)
        : q_(uniform_desc(smem_desc_lo(smem_u32(s.q[q_stage]) + wg * 64 * Tr::kSwizzle, 16))),
          k0(uniform_desc(smem_desc_lo(smem_u32(s.k[0]), 16))),
          v0(uniform_desc(smem_desc_lo(smem_u32(s.v[0]), Tr::kFp8 ? 16 : Tr::kKVColBlockBytes))) {}
    // With a per-thread warpgroup index (not kUniformWarpgroup) ptxas cannot know these are the
    // same in every lane: the ring position lives in per-thread registers, and uniform() moves
    // each result back to the uniform datapath so the wgmma loop adds its k-step offsets there.
    // Q's too, re-made uniform at each use: kept across the loop, ptxas holds it in a per-thread
    // register and then spent an R2UR (and its latency) before every Q·Kᵀ k-step's wgmma. With
    // kUniformWarpgroup every input is uniform already, and the descriptors stay on the uniform
    // datapath without a redux.sync.
    // A descriptor on the uniform datapath: as it is with kUniformWarpgroup, else through uniform().
    static __device__ __forceinline__ uint32_t uniform_desc(uint32_t desc) {
        return Tr::kUniformWarpgroup ? desc : uniform(desc);
    }
    __device__ __forceinline__ uint32_t q() const { return uniform_desc(q_); }
    __device__ __forceinline__ uint32_t k(int stage) const { return uniform_desc(k0 + stage * kStageStep); }
    __device__ __forceinline__ uint32_t v(int stage) const { return uniform_desc(v0 + stage * kVStageStep); }
};

// S = Q·Kᵀ: k-step kk reads column block kk / kSteps and its 32-byte slice kk % kSteps of the rows
// (kSteps = 4 k-steps of 32 bytes per 128-byte row, 2 per 64-byte row; 16 elements of 16 bits or
// 32 of e4m3 per k-step). K's column blocks and 8-row groups are kKVColBlockBytes and
// kKVGroupBytes apart (traits.cuh: the kPageWarp kernels store K and V in 8-row groups).
template <class Tr>
__device__ __forceinline__ void issue_qk(float (&sc)[Tr::kSRegs], uint32_t q_lo, uint32_t k_lo) {
    constexpr int kSteps = Tr::kSwizzle / 32, W = Tr::kSwizzle;
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / Tr::kStepElems; ++kk) {
        const uint32_t off = (kk / kSteps), in_row = (kk % kSteps) * 32;
        wgmma_ss<Tr::kBlockN, Tr::kDtype>(sc, smem_desc_at<Tr::kAtomBytes, W>(q_lo, off * Tr::kBlockM * W + in_row),
                                          smem_desc_at<Tr::kKVGroupBytes, W>(k_lo, off * Tr::kKVColBlockBytes + in_row),
                                          kk > 0 ? 1 : 0);
    }
}

// O += P·V: k-step kk reads keys 16kk..16kk+15 of V, MN-major (LBO: the step between column
// blocks, set in the low word; SBO: between groups of 8 keys).
// FP8: V^T is K-major (keys contiguous, 128-key column blocks of kHeadDim rows): k-step kk reads
// the 32-byte slice kk % 4 of column block kk / 4.
template <class Tr, int kK0 = 0, int kK1 = Tr::kPSteps>
__device__ __forceinline__ void issue_pv(float (&o)[Tr::kORegs], const uint32_t (&pa)[Tr::kPSteps][4],
                                         uint32_t v_lo) {
#pragma unroll
    for (int kk = kK0; kk < kK1; ++kk) {
        if constexpr (Tr::kFp8) {
            wgmma_rs<Tr::kHeadDim, Tr::kDtype>(
                o, pa[kk], smem_desc_at<1024, 128>(v_lo, (kk / 4) * Tr::kHeadDim * 128 + (kk % 4) * 32));
        } else {
            wgmma_rs<Tr::kHeadDim, Tr::kDtype>(o, pa[kk],
                                               smem_desc_at<Tr::kKVGroupBytes, Tr::kSwizzle>(v_lo, kk * 2 * Tr::kKVGroupBytes));
        }
    }
}

// What a tile's scores and output are multiplied by, FP8 kernels: the call's constants times the
// descales of the tile (q's of this warpgroup's rows, k's and v's of the kv head). 16-bit kernels
// read the call's constants straight from the parameters and never build one.
struct TileScales {
    float scale_log2;               // FwdParams::scale_log2 · |q descale · k descale| (no softcap)
    float softcap_pre;              // FwdParams::softcap_pre · q descale · k descale
    int negate;                     // FwdParams::negate, flipped when q descale · k descale < 0
    float v_descale;
    const float* k_block_descale;   // per-block K descales of the tile's (sequence, kv head), else null
};

template <class Tr>
__device__ __forceinline__ TileScales tile_scales(const FwdParams& p, const TileInfo& t, int wg) {
    TileScales ts;
    const int q_blocks = max(q_descale_blocks<Tr>(p), 1), k_blocks = max(k_descale_blocks<Tr>(p), 1);
    // A warpgroup whose rows all lie past the sequence's end (the last tile) reads the last
    // block's descale: its rows are never stored.
    const int q_block = q_descale_blocks<Tr>(p) > 0 ? min(t.m_block * Tr::kConsumerWGs + wg, q_descale_blocks<Tr>(p) - 1) : 0;
    const int q_head = p.q_descale_per_kv_head ? t.kv_head : t.head;
    float qk = p.q_descale == nullptr
                   ? 1.f
                   : p.q_descale[(int64_t)t.batch * p.q_descale_batch_stride + q_head * q_blocks + q_block];
    ts.k_block_descale = nullptr;
    if (p.k_descale != nullptr) {
        const float* k_descale = p.k_descale + (int64_t)t.batch * p.k_descale_batch_stride + t.kv_head * k_blocks;
        if (k_descale_blocks<Tr>(p) > 0) {
            ts.k_block_descale = k_descale;
        } else {
            qk *= *k_descale;
        }
    }
    ts.v_descale = p.v_descale == nullptr ? 1.f : p.v_descale[(int64_t)t.batch * p.v_descale_batch_stride + t.kv_head];
    ts.softcap_pre = softcap_pre<Tr>(p) * qk;
    ts.negate = p.negate ^ (qk < 0.f);
    ts.scale_log2 = softcap_pre<Tr>(p) != 0.f ? p.scale_log2 : fmaxf(p.scale_log2 * fabsf(qk), 1e-30f);
    return ts;
}

// Per-block K descales (one per kFp8KBlockKeys keys) times key block n's raw scores. A longer key
// block (d128's 256 keys) spans several: each 8-column group of the accumulators lies in one (128
// is a multiple of 8, and so is every key block's first key).
template <class Tr>
__device__ __forceinline__ void scale_by_k_blocks(const FwdParams& p, float (&sc)[Tr::kSRegs], const TileScales& ts,
                                                  int n) {
    if constexpr (Tr::kBlockN == kFp8KBlockKeys) {
        const float kd = ts.k_block_descale[n];
#pragma unroll
        for (int i = 0; i < Tr::kSRegs; ++i) sc[i] *= kd;
    } else {
        const int k0 = n * Tr::kBlockN, first = k0 / kFp8KBlockKeys;
        constexpr int kSpan = (Tr::kBlockN + kFp8KBlockKeys - 1) / kFp8KBlockKeys + 1;
        float kd[kSpan];
#pragma unroll
        for (int b = 0; b < kSpan; ++b) kd[b] = ts.k_block_descale[min(first + b, p.k_descale_blocks - 1)];
#pragma unroll
        for (int j = 0; j < Tr::kSRegs / 4; ++j) {
            const int b = (k0 + 8 * j) / kFp8KBlockKeys - first;
            float d = kd[0];
#pragma unroll
            for (int c = 1; c < kSpan; ++c) d = b == c ? kd[c] : d;
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[4 * j + e] *= d;
        }
    }
}

// The scores' scale (log2 units) of a key block, plain or not: the tile's for fp8, the call's otherwise.
template <class Tr> __device__ __forceinline__ float scores_scale_log2(const FwdParams& p, const TileScales& ts) {
    if constexpr (Tr::kFp8) return ts.scale_log2;
    else return p.scale_log2;
}

// Whether a key block's scores flip sign (a negative scale): the tile's for fp8 (the descales'
// signs included), the call's otherwise.
template <class Tr> __device__ __forceinline__ int scores_negate(const FwdParams& p, const TileScales& ts) {
    if constexpr (Tr::kFp8) return ts.negate;
    else return p.negate;
}

// Softcap / sign and boundary mask of one S block, in place (fp32); returns the scores' scale (log2
// units) for the softmax. FP8: per-block K descales multiply the raw scores first; the tile's
// scales replace the call's. (plain_blocks names the blocks that skip it: a new step here needs its
// condition there too.)
template <class Tr>
__device__ __forceinline__ float prepare_scores(const FwdParams& p, const TileScales& ts, const TileInfo& t,
                                                const RowMask& held_mask, int row_in_tile, float (&sc)[Tr::kSRegs],
                                                int n, int quad_lane) {
    float softcap = softcap_pre<Tr>(p);
    if constexpr (Tr::kFp8) {
        if (ts.k_block_descale != nullptr) scale_by_k_blocks<Tr>(p, sc, ts, n);
        softcap = ts.softcap_pre;
    }
    if (softcap_pre<Tr>(p) != 0.f) {
#pragma unroll
        for (int i = 0; i < Tr::kSRegs; ++i) sc[i] = tanhf(sc[i] * softcap);
    } else if (scores_negate<Tr>(p, ts)) {
#pragma unroll
        for (int i = 0; i < Tr::kSRegs; ++i) sc[i] = -sc[i];
    }
    const int k0 = n * Tr::kBlockN;
    if (!(k0 >= t.full_lo && k0 + Tr::kBlockN <= t.full_hi)) {
        apply_mask(sc, Tr::kRowMaskPerBlock ? row_mask<Tr>(p, t, row_in_tile) : held_mask, k0, 2 * quad_lane);
    }
    return scores_scale_log2<Tr>(p, ts);
}

// The key blocks of a tile that prepare_scores would leave as they are (no per-block descale,
// softcap, sign flip or mask), as a range made once per tile: such a block skips it with one
// compare and branch, where its several tests cost issue slots in every block (forward-fp8.md
// version 17).
struct PlainBlocks {
    int lo;         // the first plain block
    unsigned span;  // plain blocks: lo .. lo + span (none: lo past every block)
    __device__ __forceinline__ bool has(int n) const { return unsigned(n - lo) <= span; }
};
template <class Tr>
__device__ __forceinline__ PlainBlocks plain_blocks(const FwdParams& p, const TileScales& ts, const TileInfo& t) {
    bool tile_plain = softcap_pre<Tr>(p) == 0.f && !scores_negate<Tr>(p, ts);
    if constexpr (Tr::kFp8) tile_plain = tile_plain && ts.k_block_descale == nullptr;
    // Blocks n with n·kBlockN >= full_lo and (n + 1)·kBlockN <= full_hi.
    const int lo = (t.full_lo + Tr::kBlockN - 1) / Tr::kBlockN, end = t.full_hi / Tr::kBlockN;
    if (!tile_plain || end <= lo) return PlainBlocks{1 << 30, 0u};
    return PlainBlocks{lo, unsigned(end - 1 - lo)};
}

// prepare_scores (where the block needs it) and the online softmax of one S block, in place.
template <class Tr>
__device__ __forceinline__ void scores_to_probs(const FwdParams& p, const TileScales& ts, const TileInfo& t,
                                                const RowMask& held_mask, int row_in_tile, Softmax<Tr>& softmax,
                                                float (&sc)[Tr::kSRegs], const PlainBlocks& plain,
                                                int n, int quad_lane, float (&corr)[2], unsigned live = 3u) {
    const float scale_log2 = plain.has(n)
                                 ? scores_scale_log2<Tr>(p, ts)
                                 : prepare_scores<Tr>(p, ts, t, held_mask, row_in_tile, sc, n, quad_lane);
    softmax.step(sc, scale_log2, corr, live);
}

// P to 16 bits, laid out as wgmma's register A operand: k-step kk's four registers are the
// accumulator pairs 8kk..8kk+7 in order (rows r, r+8; columns +0, +8).
// FP8: k-step kk (32 keys) wants in register 2·g + h row r (+8 for h = 1), keys 16g + 4q + 0..3
// (q = lane % 4); the thread holds keys 16g + {2q, 2q+1, 8+2q, 9+2q} of those rows (accumulator
// groups 4kk + 2g and + 1). Packing those four as they are computes P·V with the keys of each
// 16-key group permuted (key 4q + e <- 2q + e for e < 2, 8 + 2q + e - 2 otherwise): the pre-pass
// stores V^T with the same permutation, so no register moves between lanes.
template <class Tr, int kK0 = 0, int kK1 = Tr::kPSteps>
__device__ __forceinline__ void probs_to_a_operand(const float (&sc)[Tr::kSRegs], uint32_t (&pa)[Tr::kPSteps][4]) {
    if constexpr (Tr::kFp8) {
#pragma unroll
        for (int kk = kK0; kk < kK1; ++kk) {
#pragma unroll
            for (int g = 0; g < 2; ++g) {
                const int j0 = 4 * kk + 2 * g, j1 = j0 + 1;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    pa[kk][2 * g + h] = pack_e4m3x4(sc[4 * j0 + 2 * h], sc[4 * j0 + 2 * h + 1], sc[4 * j1 + 2 * h],
                                                    sc[4 * j1 + 2 * h + 1]);
            }
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < Tr::kPSteps; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = pack16x2<Tr::kDtype>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
        }
    }
}

// Whether every row of consumer warpgroup wg lies past the tile's last query: in decode a packed
// GQA group (seqlen_q x group rows, 8 for one query and 8 q heads per kv head) fills part of the
// first warpgroup's 64 rows, and the second one's rows are all padding. (Packed rows run in query
// order, so the warpgroup's first row decides.)
template <class Tr> __device__ __forceinline__ bool rows_past_end(const FwdParams& p, const TileInfo& t, int wg) {
    if constexpr (Tr::kConsumerWGs == 1) return false;  // a tile exists only where its first row does
    int query, head;
    row_position<Tr>(p, t, wg * 64, query, head);
    return query >= t.seqlen_q;
}

// The tile of a warpgroup whose rows are all past the end (rows_past_end): no GEMM, no softmax, no
// output. It keeps every handshake of consumer_pingpong in the same order, so the others run as
// before without its turns: the pingpong barriers (its turn is passed on at once), and the K/V
// ring's and Q's releases, each after the wait for the load it releases (an arrival before the
// load could count towards the slot's previous phase).
template <class Tr>
__device__ void consumer_idle(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t, int wg, int tid, RingCount& it,
                              int tc, PendingStore& pending) {
    issue_pending_store<Tr>(p, s, wg, tid, pending);
    constexpr int kWGs = Tr::kConsumerWGs;
    const int my_bar = sched_barrier(wg), next_bar = sched_barrier(wg + 1 == kWGs ? 0 : wg + 1);
    constexpr int kBoth = 256;
    const int qs = tc % Tr::kQStages;
    mbar_wait(&s.bar_q[qs], (tc / Tr::kQStages) & 1);
    {
        const int stage = it % Tr::kStages;
        mbar_wait(&s.full_k[stage], (it / Tr::kStages) & 1);
        named_barrier_sync(my_bar, kBoth);
        named_barrier_arrive(next_bar, kBoth);
        mbar_arrive(&s.empty_k[stage]);
    }
    for (int n = t.n_max - 1; n > t.n_min; --n, ++it) {
        const int stage = it % Tr::kStages, next = (it + 1) % Tr::kStages;
        mbar_wait(&s.full_k[next], ((it + 1) / Tr::kStages) & 1);
        named_barrier_sync(my_bar, kBoth);
        mbar_wait(&s.full_v[stage], (it / Tr::kStages) & 1);
        named_barrier_arrive(next_bar, kBoth);
        mbar_arrive(&s.empty_k[next]);
        mbar_arrive(&s.empty_v[stage]);
    }
    mbar_arrive(&s.q_empty[qs]);
    {
        const int stage = it % Tr::kStages;
        mbar_wait(&s.full_v[stage], (it / Tr::kStages) & 1);
        named_barrier_sync(my_bar, kBoth);
        named_barrier_arrive(next_bar, kBoth);
        mbar_arrive(&s.empty_v[stage]);
        ++it;
    }
}

// pending: this warpgroup's O of its previous tile, staged but not yet stored (epilogue.cuh).
template <class Tr>
__device__ void consumer_pingpong(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t, int wg, int tid,
                                  RingCount& it, int tc, PendingStore& pending) {
    if (rows_past_end<Tr>(p, t, wg)) {
        consumer_idle<Tr>(p, s, t, wg, tid, it, tc, pending);
        return;
    }
    const int warp = tid / 32, lane = tid % 32;
    const int row_in_tile = wg * 64 + warp * 16 + lane / 4;
    const int quad_lane = lane % 4;
    constexpr int kWGs = Tr::kConsumerWGs;
    const int my_bar = sched_barrier(wg), next_bar = sched_barrier(wg + 1 == kWGs ? 0 : wg + 1);
    constexpr int kBoth = 256;  // a warpgroup waiting on its barrier + the one before it arriving
    const bool pingpong = takes_turns<Tr>(solo_consumer<Tr>(p));
    trace_edge(wg + 1, tc, 0);

    RowMask held_mask;  // unused with kRowMaskPerBlock
    if constexpr (!Tr::kRowMaskPerBlock) held_mask = row_mask<Tr>(p, t, row_in_tile);

    float o[Tr::kORegs];
#pragma unroll
    for (int i = 0; i < Tr::kORegs; ++i) o[i] = 0.f;
    Softmax<Tr> softmax;
    softmax.init();
    float sc[Tr::kSRegs];
    uint32_t pa[Tr::kPSteps][4];
    float corr[2];
    TileScales ts{};
    if constexpr (Tr::kFp8) ts = tile_scales<Tr>(p, t, wg);
    const PlainBlocks plain = plain_blocks<Tr>(p, ts, t);
    // Which of this thread's two rows (the same for the whole warp: rows 16·warp + 0..7 and
    // + 8..15) hold a real query; a tile's real rows are a prefix (row_position).
    unsigned live = 3u;
    if constexpr (Tr::kSkipPaddingRows) {
        const int queries = min(p.q_tile_queries, t.seqlen_q - t.m_block * p.q_tile_queries);
        const int real_rows = packs_gqa<Tr>(p) ? queries * p.group.d : queries;
        const int r0 = wg * 64 + warp * 16;
        live = (r0 < real_rows ? 1u : 0u) | (r0 + 8 < real_rows ? 2u : 0u);
    }

    const int qs = tc % Tr::kQStages;
    const OperandDescs<Tr> desc(s, wg, qs);
    mbar_wait(&s.bar_q[qs], (tc / Tr::kQStages) & 1);
    trace_edge(wg + 1, tc, 1);

    // Prologue: S of the first (last-indexed) block alone.
    int n = t.n_max - 1;
    {
        const int stage = it % Tr::kStages;
        mbar_wait(&s.full_k[stage], (it / Tr::kStages) & 1);
        if (pingpong) named_barrier_sync(my_bar, kBoth);
        wgmma_fence();
        issue_qk<Tr>(sc, desc.q(), desc.k(stage));
        wgmma_commit();
        if (pingpong) named_barrier_arrive(next_bar, kBoth);
        // The previous tile's O store (thread 0), under this S.
        issue_pending_store<Tr>(p, s, wg, tid, pending);
        wgmma_wait<0>();
        fence_operand(sc);
        trace_edge(wg + 1, tc, 2);
        mbar_arrive(&s.empty_k[stage]);
    }
    scores_to_probs<Tr>(p, ts, t, held_mask, row_in_tile, softmax, sc, plain, n, quad_lane, corr, live);
    probs_to_a_operand<Tr>(sc, pa);
    trace_edge(wg + 1, tc, 3);
    // Whether the K block the next iteration issues against has already landed (two consumer
    // warpgroups: probed below, where the probe's ~100-cycle latency hides under the P
    // conversion, so the loop top skips a wait that sits on warpgroup 0's critical path;
    // version 23). Three warpgroups measured 1-3% slower with it and always wait.
    bool k_ready = false;

    // Tr::kRingState: the ring position's stage and phase carried in two registers and toggled,
    // instead of made from `it` in every block.
    static_assert(!Tr::kRingState || Tr::kStages == 2, "the ring state toggles two stages");
    uint32_t ring_stage = it % Tr::kStages, ring_phase = (it / Tr::kStages) & 1;
    for (; n > t.n_min; --n, ++it) {
        uint32_t stage, next, phase, next_phase;
        if constexpr (Tr::kRingState) {
            stage = ring_stage;
            next = ring_stage ^ 1u;
            phase = ring_phase;
            next_phase = ring_phase ^ ring_stage;
            ring_stage = next;
            ring_phase = next_phase;
        } else {
            stage = it % Tr::kStages;
            next = (it + 1) % Tr::kStages;
            phase = (it / Tr::kStages) & 1;
            next_phase = ((it + 1) / Tr::kStages) & 1;
        }
        trace_stamp(wg + 1, it, 0);
        if (!k_ready) mbar_wait(&s.full_k[next], next_phase);
        trace_stamp(wg + 1, it, 1);
        if (pingpong) named_barrier_sync(my_bar, kBoth);
        trace_stamp(wg + 1, it, 2);
        wgmma_fence();
        issue_qk<Tr>(sc, desc.q(), desc.k(next));  // S of block n-1
        wgmma_commit();
        // O (through block n+1) to the running max of block n, whose P·V comes next: with three
        // consumer warpgroups here, while Q·Kᵀ runs; with two after this iteration's P·V (below).
        if constexpr (kWGs == 3) rescale_o<Tr>(o, corr, softmax);
        mbar_wait(&s.full_v[stage], phase);
        fence_operand(o);
        wgmma_fence();
        issue_pv<Tr>(o, pa, desc.v(stage));  // O += P·V of block n
        wgmma_commit();
        if (pingpong) named_barrier_arrive(next_bar, kBoth);
        trace_stamp(wg + 1, it, 3);
        wgmma_wait<1>();  // S done; P·V may still run
        fence_operand(sc);
        trace_stamp(wg + 1, it, 4);
        mbar_arrive(&s.empty_k[next]);
        // The softmax of block n-1, in fp32 in S's registers; P (one register copy, as FA3) is
        // overwritten only after P·V of block n retired. In the SASS most of the softmax runs after
        // wait<0> (ptxas places the wait as early as its basic block allows; FA3's SASS has about
        // two thirds of its softmax there too). Forcing all of it above the wait measured ±1.5% on
        // d128/d256 and −7% on d64 (docs/kernels/forward-sm90.md, version 20), so it stays as is.
        scores_to_probs<Tr>(p, ts, t, held_mask, row_in_tile, softmax, sc, plain, n - 1, quad_lane, corr, live);
        trace_stamp(wg + 1, it, 5);
        wgmma_wait<0>();
        fence_operand(o);
        trace_stamp(wg + 1, it, 6);
        // Keep P alive until its wgmma has retired, or the compiler may put P of the next block
        // into the same registers while the tensor cores still read them (ptxas then serialises
        // every wgmma, warning C7513).
#pragma unroll
        for (int kk = 0; kk < Tr::kPSteps; ++kk) fence_operand(pa[kk]);
        mbar_arrive(&s.empty_v[stage]);
        if constexpr (kWGs != 3) {
            // The next iteration issues against ring position it + 2: with two stages, this
            // iteration's K slot (its S retired one iteration ago), refilled.
            static_assert(Tr::kStages == 2, "the K probe assumes a two-stage ring");
            k_ready = __all_sync(0xffffffffu, mbar_test(&s.full_k[stage], ((it + 2) / Tr::kStages) & 1));
        }
        probs_to_a_operand<Tr>(sc, pa);
        // Two warpgroups: O (now through block n) to the running max of block n-1 here, after the
        // wait (FA3's order), not between the two GEMMs' issue, where the multiplies delay P·V and
        // the other warpgroup's turn. Measured (same call, interleaved): d128 and d256 +0..3%;
        // d64 on three warpgroups lost 1.5..3% with it, so that kernel keeps the other place.
        if constexpr (kWGs != 3) rescale_o<Tr>(o, corr, softmax);
        trace_stamp(wg + 1, it, 7);
    }

    // Every Q·Kᵀ of the tile has retired: the producer may load the next tile's Q.
    mbar_arrive(&s.q_empty[qs]);
    trace_edge(wg + 1, tc, 4);

    // Tail: P·V of the last block.
    float inv_sum[2], lse[2];
    {
        const int stage = it % Tr::kStages;
        const uint32_t phase = (it / Tr::kStages) & 1;
        if constexpr (kWGs == 3) rescale_o<Tr>(o, corr, softmax);
        mbar_wait(&s.full_v[stage], phase);
        if (pingpong) named_barrier_sync(my_bar, kBoth);
        fence_operand(o);
        wgmma_fence();
        issue_pv<Tr>(o, pa, desc.v(stage));
        wgmma_commit();
        if (pingpong) named_barrier_arrive(next_bar, kBoth);
        // The row sums' reduction and the LSE need only the softmax state: under the tail P·V.
        float sink_log2[2];
        row_sinks_log2<Tr>(p, t, row_in_tile, sink_log2);
        if constexpr (Tr::kFp8) {
            softmax.finalize(inv_sum, lse, sink_log2);
            inv_sum[0] *= ts.v_descale;
            inv_sum[1] *= ts.v_descale;
        } else {
            softmax.finalize(inv_sum, lse, sink_log2);
        }
        wgmma_wait<0>();
        fence_operand(o);
        trace_edge(wg + 1, tc, 5);
        mbar_arrive(&s.empty_v[stage]);
        ++it;
    }

    epilogue<Tr>(p, s, t, o, inv_sum, lse, wg, tid, row_in_tile, quad_lane, pending, tc);
    trace_edge(wg + 1, tc, 6);
}

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}): a loop
// whose index is a compile-time constant in the body.
template <class F, int... I>
__device__ __forceinline__ void for_each_index_impl(F& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F> __device__ __forceinline__ void for_each_index(F& f) {
    for_each_index_impl(f, std::make_integer_sequence<int, N>{});
}

// ---------------------------------------------------------------------------------------------
// The consumer without intra-warpgroup overlap (FwdTraits::kSerialConsumer, fp8 d128 on 256-key
// blocks; the loop of cuDNN's fp8 kernel, read from its SASS): per key block S = Q·Kᵀ, wait, the
// max, the exponentials, O += P·V, wait. No block's S is in flight beside another block's P, so a
// 256-key block fits the consumers' 240 registers (S 128 + O 64, P packed from S's registers),
// where consumer_pingpong's 256-key blocks spilled 368 bytes. The warpgroups take turns at the
// exponentials instead of at the GEMM issue: one warpgroup's exponentials (at d128 as long as its
// two GEMMs on the tensor cores) run while the other's GEMMs and max run.
// ---------------------------------------------------------------------------------------------
// consumer_idle's counterpart for the serial loop: a warpgroup whose rows are all past the end
// keeps every handshake of consumer_serial in its order (one turn a block), each release after
// the wait for the load it releases.
template <class Tr>
__device__ void consumer_serial_idle(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t, int wg, int tid,
                                     RingCount& it, int tc, PendingStore& pending) {
    issue_pending_store<Tr>(p, s, wg, tid, pending);
    constexpr int kWGs = Tr::kConsumerWGs;
    const int my_bar = sched_barrier(wg), next_bar = sched_barrier(wg + 1 == kWGs ? 0 : wg + 1);
    constexpr int kBoth = 256;
    const int qs = tc % Tr::kQStages;
    mbar_wait(&s.bar_q[qs], (tc / Tr::kQStages) & 1);
    for (int n = t.n_max - 1; n >= t.n_min; --n, ++it) {
        const int stage = it % Tr::kStages;
        const uint32_t phase = (it / Tr::kStages) & 1;
        mbar_wait(&s.full_k[stage], phase);
        mbar_arrive(&s.empty_k[stage]);
        named_barrier_sync(my_bar, kBoth);
        named_barrier_arrive(next_bar, kBoth);
        mbar_wait(&s.full_v[stage], phase);
        mbar_arrive(&s.empty_v[stage]);
    }
    mbar_arrive(&s.q_empty[qs]);
}

template <class Tr>
__device__ void consumer_serial(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t, int wg, int tid, RingCount& it,
                                int tc, PendingStore& pending) {
    if (rows_past_end<Tr>(p, t, wg)) {
        consumer_serial_idle<Tr>(p, s, t, wg, tid, it, tc, pending);
        return;
    }
    const int warp = tid / 32, lane = tid % 32;
    const int row_in_tile = wg * 64 + warp * 16 + lane / 4;
    const int quad_lane = lane % 4;
    constexpr int kWGs = Tr::kConsumerWGs;
    const int my_bar = sched_barrier(wg), next_bar = sched_barrier(wg + 1 == kWGs ? 0 : wg + 1);
    constexpr int kBoth = 256;
    const bool pingpong = takes_turns<Tr>(solo_consumer<Tr>(p));

    RowMask held_mask;
    if constexpr (!Tr::kRowMaskPerBlock) held_mask = row_mask<Tr>(p, t, row_in_tile);
    float o[Tr::kORegs];
#pragma unroll
    for (int i = 0; i < Tr::kORegs; ++i) o[i] = 0.f;
    Softmax<Tr> softmax;
    softmax.init();
    float corr[2];
    TileScales ts{};
    if constexpr (Tr::kFp8) ts = tile_scales<Tr>(p, t, wg);
    const PlainBlocks plain = plain_blocks<Tr>(p, ts, t);

    const int qs = tc % Tr::kQStages;
    const OperandDescs<Tr> desc(s, wg, qs);
    // The previous tile's O store (thread 0), under Q's wait.
    issue_pending_store<Tr>(p, s, wg, tid, pending);
    mbar_wait(&s.bar_q[qs], (tc / Tr::kQStages) & 1);

    for (int n = t.n_max - 1; n >= t.n_min; --n, ++it) {
        const int stage = it % Tr::kStages;
        const uint32_t phase = (it / Tr::kStages) & 1;
        float sc[Tr::kSRegs];
        trace_stamp(wg + 1, it, 0);
        mbar_wait(&s.full_k[stage], phase);
        trace_stamp(wg + 1, it, 1);
        float m[2][2];
        softmax.max_begin(m);
        wgmma_fence();
        issue_qk<Tr>(sc, desc.q(), desc.k(stage));
        wgmma_commit();
        wgmma_wait<0>();
        fence_operand(sc);
        trace_stamp(wg + 1, it, 2);
        mbar_arrive(&s.empty_k[stage]);
        // V's wait here, where its latency (a barrier probe, ~100 cycles even for a V that landed
        // long ago) hides under the max's FMNMX chains; before the sync it delayed the turn, and
        // inside the turn the exponentials behind it (session 55: +0.4..+1.4%).
        mbar_wait(&s.full_v[stage], phase);
        // The scores' max before the turn: only the exponentials wait for the other warpgroup's.
        float scale_log2;
        if (plain.has(n)) {
            scale_log2 = scores_scale_log2<Tr>(p, ts);
        } else {
            scale_log2 = prepare_scores<Tr>(p, ts, t, held_mask, row_in_tile, sc, n, quad_lane);
        }
        softmax.template max_cols<0, Tr::kSRegs / 4>(sc, m);
        softmax.update_max_from(m, scale_log2, corr);
        trace_stamp(wg + 1, it, 3);
        // O (through the block before) to this block's reference max before the turn: inside it
        // the rescale held up the exponentials behind it.
        rescale_o<Tr>(o, corr, softmax);
        fence_operand(o);
        // The exponentials pinned inside the turn: they touch only registers, so ptxas moves them
        // across bar.sync / bar.arrive (the two barriers ended up side by side after the whole
        // softmax, and the warpgroups' exponentials ran at the same time: 0.90-0.93x the time).
        // Each exponential takes the scale plus a zero read from shared memory after the sync, and
        // the arrive's barrier id adds the row sums ANDed with that zero.
        int zero = 0;
        if (pingpong) {
            named_barrier_sync(my_bar, kBoth);
            zero = static_cast<int>(ld_shared_u32(smem_u32(&s.zero)));
        }
        trace_stamp(wg + 1, it, 4);
        uint32_t pa[Tr::kPSteps][4];
        // P·V in kSerialPVParts parts, each issued as soon as its keys' P is packed, under the
        // next part's exponentials: only the last part's P·V is left after the turn.
        constexpr int kParts = Tr::kSerialPVParts;
        constexpr int kJ = Tr::kSRegs / 4 / kParts, kK = Tr::kPSteps / kParts;
        auto part = [&](auto index) {
            constexpr int i = decltype(index)::value;
            softmax.template exponentiate_part<i * kJ, (i + 1) * kJ>(sc, scale_log2 + __int_as_float(zero), corr);
            probs_to_a_operand<Tr, i * kK, (i + 1) * kK>(sc, pa);
            if constexpr (i == kParts - 1) {
                if (pingpong) {
                    const int sums = __float_as_int(softmax.row_sum[0]) ^ __float_as_int(softmax.row_sum[1]);
                    named_barrier_arrive(next_bar + (sums & zero), kBoth);
                }
                trace_stamp(wg + 1, it, 5);
            }
            wgmma_fence();
            issue_pv<Tr, i * kK, (i + 1) * kK>(o, pa, desc.v(stage));
            wgmma_commit();
        };
        for_each_index<kParts>(part);
        trace_stamp(wg + 1, it, 6);
        wgmma_wait<0>();
        fence_operand(o);
        trace_stamp(wg + 1, it, 7);
#pragma unroll
        for (int kk = 0; kk < Tr::kPSteps; ++kk) fence_operand(pa[kk]);
        mbar_arrive(&s.empty_v[stage]);
    }
    mbar_arrive(&s.q_empty[qs]);

    float inv_sum[2], lse[2];
    float sink_log2[2];
    row_sinks_log2<Tr>(p, t, row_in_tile, sink_log2);
    if constexpr (Tr::kFp8) {
        softmax.finalize(inv_sum, lse, sink_log2);
        inv_sum[0] *= ts.v_descale;
        inv_sum[1] *= ts.v_descale;
    } else {
        softmax.finalize(inv_sum, lse, sink_log2);
    }
    epilogue<Tr>(p, s, t, o, inv_sum, lse, wg, tid, row_in_tile, quad_lane, pending, tc);
}

}  // namespace fa3
