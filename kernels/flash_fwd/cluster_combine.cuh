// Split-KV merged inside the forward launch (FwdParams::cluster_combine): the key shares of a tile
// run as one thread-block cluster and merge their rows through distributed shared memory, so no
// partial goes to global memory and no combine kernel follows (combine.cuh does the same
// arithmetic over global partials for every other split call).
//
// Why: in a CUDA-graph decode step the combine's launch costs ~3.3 µs a layer behind the
// attention's drain, and in an eager call a second launch's host time; a merge by the last CTA
// through a global ticket cost more than either (docs/kernels/kvcache.md, sessions 19 and 32).
// Inside a cluster the shares' CTAs run at the same time on one GPC and read each other's shared
// memory directly, and every CTA merges a part of the tile, so no SM walks all of it.
//
// Only the `_cm` kernels compile it (FwdTraits::kClusterCombine: 16 bits, head dims 64 and 128,
// two consumer warpgroups), so the kernels every other call runs are as without it. The host asks
// for it where it holds and measured faster (crates/flash-attn/src/cuda/forward.rs):
//   - single-query decode: a tile's rows (seqlen_q x group with pack-GQA) at most 16, all in the
//     first consumer warpgroup's 64;
//   - each CTA takes exactly one (tile, share): grid = tiles x shares in static order, so CTA b
//     is share b % shares of tile b / shares and rank b % shares of its cluster of `shares` CTAs;
//   - at most 8 shares (a portable cluster size), CTAs for at most half the SMs, every cluster
//     resident at once;
//   - the O staging tile of the TMA-store epilogue, unused by split calls, holds the share's 64
//     rows in f32.
//
// Protocol: every CTA's first consumer warpgroup writes its normalised O rows into its staging
// tile and their LSEs into cluster_lse; a cluster barrier (release / acquire); each CTA merges the
// (row, column pair) items i with i % shares == its rank (lse = log Σ_s exp(lse_s), O = Σ_s
// exp(lse_s - lse) · O_s, an attention sink once), reading every share's tile through DSMEM, and
// stores O and the LSE; a second cluster barrier keeps every CTA's shared memory alive until all
// reads are done. The CTAs' other threads hold the barriers up only until they exit.
#pragma once
#include <cmath>

#include "../primitives/cluster.cuh"
#include "../primitives/warp.cuh"
#include "output.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "share_merge.cuh"
#include "traits.cuh"

namespace fa3 {

// What the merge (steps 2 and 3 below) reads, gathered by the caller: the call takes them by value
// (registers), where reads of FwdParams through a reference would each be a load.
struct ClusterMerge {
    int shares;               // the cluster's CTAs (the tile's key shares); this one's rank
    int rank;
    int rows;                 // the tile's real rows (a prefix of its 64)
    int pairs;                // column pairs of a row: head_dim_v / 2
    int group;                // pack-GQA: q heads per row group (row r = query r / group, head r % group); 0: none
    int first_query, first_head;
    int head_dim_v;
    int out_f16;
    uint16_t* out;            // the tile's first query's row of out
    int64_t out_row_stride;
    float* lse;               // the tile's first head's LSE of its first query
    int64_t lse_head_stride;
    const float* sinks;       // null: none
};

// Steps 2 and 3 for the first consumer warpgroup once its rows are staged: a call, not inlined,
// so that the main loop keeps the register allocation it has without the merge (inlined into the
// shared kernels, as first built, it moved the whole consumer's allocation and the calls that do
// not merge ran 2-7% slower; session 34). Its fields come by value: read through a FwdParams
// reference each was a dependent load, and the merge measured ~5% slower that way.
template <class Tr> __device__ __noinline__ void cluster_merge(SharedStorage<Tr>* sp, const ClusterMerge m, int tid) {
    SharedStorage<Tr>& s = *sp;
    constexpr int kD = Tr::kHeadDim;
    const float* part = reinterpret_cast<const float*>(s.o);
    cluster_arrive_release();
    cluster_wait();  // every share's rows are staged
    // 2. This CTA's part of the merge: items rank, rank + shares, ... of the tile's real rows'
    // column pairs, spread over the warpgroup.
    for (int idx = m.rank + m.shares * tid; idx < m.rows * m.pairs; idx += m.shares * 128) {
        const int r = idx / m.pairs, col = 2 * (idx - r * m.pairs);
        const int query = m.first_query + (m.group ? r / m.group : r);
        const int head_in_tile = m.group ? r % m.group : 0;
        // Every share's LSE and O pair at once (one DSMEM round trip): a share without keys wrote
        // zeros and -inf, which weigh nothing.
        float lse_s[kClusterMaxShares];
        float2 o_s[kClusterMaxShares];
        gather_shares(smem_u32(&s.cluster_lse[r]), smem_u32(part + r * kD + col), m.shares, lse_s, o_s);
        // An attention sink is one more term of the denominator (the shares leave it out).
        const float sink = m.sinks != nullptr ? m.sinks[m.first_head + head_in_tile] : -INFINITY;
        float merged_lse;
        const float2 acc = merge_shares(lse_s, o_s, sink, merged_lse);
        const int q_in_tile = query - m.first_query;
        uint16_t* out = m.out + q_in_tile * m.out_row_stride + (int64_t)head_in_tile * m.head_dim_v;
        *reinterpret_cast<uint32_t*>(out + col) = pack_out<Tr>(m.out_f16 != 0, acc.x, acc.y);
        if (col == 0) m.lse[(int64_t)head_in_tile * m.lse_head_stride + q_in_tile] = merged_lse;
    }
    // 3. No CTA exits (freeing its shared memory) before every CTA has read it.
    cluster_arrive_release();
    cluster_wait();
}

// One consumer warpgroup's part of a cluster merge: wg, tid, row_in_tile and quad_lane as in
// epilogue(); o, inv_sum and lse this share's rows.
template <class Tr>
__device__ __forceinline__ void cluster_combine(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t,
                                                const float (&o)[Tr::kORegs], const float (&inv_sum)[2],
                                                const float (&lse)[2], int wg, int tid, int row_in_tile,
                                                int quad_lane) {
    if constexpr (Tr::kClusterCombine) {
        if (wg != 0) return;  // its rows lie past the tile's (the host's condition)
        constexpr int kD = Tr::kHeadDim;
        float* part = reinterpret_cast<float*>(s.o);  // [64 rows][kD] f32 in the staging tile
        static_assert(sizeof(s.o) >= 64 * kD * sizeof(float), "the staging tile holds 64 f32 rows");
        // 1. This share's rows and LSEs into this CTA's shared memory.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row_in_tile + 8 * h;
#pragma unroll
            for (int j = 0; j < Tr::kORegs / 4; ++j) {
                const int col = 8 * j + 2 * quad_lane;
                *reinterpret_cast<float2*>(part + r * kD + col) =
                    make_float2(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
            }
            if (quad_lane == 0) s.cluster_lse[r] = lse[h];
        }
        ClusterMerge m;
        m.shares = p.num_splits.d;
        m.rank = t.split;
        m.first_query = t.m_block * p.q_tile_queries;
        const int queries = min(p.q_tile_queries, t.seqlen_q - m.first_query);
        m.group = p.pack_gqa ? p.group.d : 0;
        m.rows = min(64, p.pack_gqa ? queries * p.group.d : queries);
        m.pairs = p.head_dim_v / 2;
        m.first_head = t.head;
        m.head_dim_v = p.head_dim_v;
        m.out_f16 = p.out_f16;
        m.out = reinterpret_cast<uint16_t*>(p.out) + (t.out_tok0 + m.first_query) * p.out_row_stride +
                (int64_t)t.head * p.head_dim_v;
        m.out_row_stride = p.out_row_stride;
        m.lse = p.lse + t.lse_row0 + m.first_query;
        m.lse_head_stride = p.lse_head_stride;
        m.sinks = p.sinks;
        cluster_merge<Tr>(&s, m, tid);
    }
}

}  // namespace fa3
