// Writes the normalised O rows and the LSE of one consumer warpgroup (64 rows of the tile).
//
// TMA-store path (kTmaStoreO: d <= 128, and fp8 d256): the warpgroup writes its O rows into the
// shared staging buffer in TMA's swizzled layout (one stmatrix per 8 columns of a warp's 16 rows;
// traits.cuh kWideStoresO, fp8 d256 keeps 4-byte stores) and one thread issues a bulk tensor store
// per column block, after the epilogue (PendingStore: under the next tile's first S); the store
// drains while the CTA runs its next tile. fp8 d256 stages half the columns at a time (traits.cuh
// kOutPasses: the other half of its staging room holds the V^T writer's unit): the first half's
// stores are issued and read inside the epilogue, the second's are the pending ones. TMA clips rows past
// seqlen_q and columns past head_dim_v. Varlen packs sequences back to back, so a warpgroup whose
// rows run past its sequence's end would overwrite the next sequence: those rows take the direct
// path.
// Direct path (16-bit d192 and d256, and the varlen case above): each quad of lanes swaps its
// 16-bit column pairs (quad_transpose_u32) so that every lane stores 16 contiguous bytes of a row
// (traits.cuh kWideStoresO; fp8 d256 keeps 4-byte stores), skipping rows past the sequence end
// and padding columns.
#pragma once

#include "../primitives/tma.cuh"
#include "../primitives/trace.cuh"
#include "../primitives/warp.cuh"
#include "../primitives/wgmma.cuh"
#include "cluster_combine.cuh"
#include "output.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "traits.cuh"

namespace fa3 {

template <class Tr>
__device__ __forceinline__ void store_o_direct(const FwdParams& p, const TileInfo& t, const float (&o)[Tr::kORegs],
                                               const float (&inv_sum)[2], int row_in_tile, int quad_lane) {
    if constexpr (!Tr::kWideStoresO) {
        // 4-byte stores of the thread's own column pairs (traits.cuh kWideStoresO).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int i, head;
            row_position<Tr>(p, t, row_in_tile + 8 * h, i, head);
            if (i >= t.seqlen_q) continue;
            uint16_t* out = reinterpret_cast<uint16_t*>(p.out) + (t.out_tok0 + i) * p.out_row_stride +
                            (int64_t)head * p.head_dim_v;
#pragma unroll
            for (int j = 0; j < Tr::kORegs / 4; ++j) {
                const int col = 8 * j + 2 * quad_lane;
                if (col < p.head_dim_v) {
                    *reinterpret_cast<uint32_t*>(out + col) =
                        pack_out<Tr>(p, o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
                }
            }
        }
    } else {
        static_assert(Tr::kORegs % 16 == 0, "whole 32-column groups");
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int i, head;
            row_position<Tr>(p, t, row_in_tile + 8 * h, i, head);
            const bool row_in_sequence = i < t.seqlen_q;  // the same for the quad's four lanes
            uint16_t* out = reinterpret_cast<uint16_t*>(p.out) + (t.out_tok0 + i) * p.out_row_stride +
                            (int64_t)head * p.head_dim_v;
#pragma unroll
            for (int m = 0; m < Tr::kORegs / 16; ++m) {
                // The quad's 32 columns 32m..: lane q holds columns 8j + 2q, + 1 of the groups
                // j = 4m..4m+3; after the transpose it holds group 4m + q whole (16 bytes,
                // head_dim_v a multiple of 8).
                uint32_t w[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int j = 4 * m + k;
                    w[k] = pack_out<Tr>(p, o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
                }
                quad_transpose_u32(w, quad_lane);
                const int col = 8 * (4 * m + quad_lane);
                if (row_in_sequence && col < p.head_dim_v)
                    *reinterpret_cast<uint4*>(out + col) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

// Split-KV: this split's normalised O rows (f32 pairs, 8-byte stores) and LSE into the
// accumulators, rows in out's (token, head) order (combine.cuh merges the splits).
template <class Tr>
__device__ __forceinline__ void store_split_partial(const FwdParams& p, const TileInfo& t,
                                                   const float (&o)[Tr::kORegs], const float (&inv_sum)[2],
                                                   const float (&lse)[2], int row_in_tile, int quad_lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int i, head;
        row_position<Tr>(p, t, row_in_tile + 8 * h, i, head);
        if (i >= t.seqlen_q) continue;
        const int64_t row = ((int64_t)t.split * p.total_q + t.out_tok0 + i) * p.heads + head;
        float* dst = p.o_accum + row * p.head_dim_v;
#pragma unroll
        for (int j = 0; j < Tr::kORegs / 4; ++j) {
            const int col = 8 * j + 2 * quad_lane;
            if (col < p.head_dim_v)
                *reinterpret_cast<float2*>(dst + col) =
                    make_float2(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
        }
        if (quad_lane == 0) p.lse_accum[row] = lse[h];
    }
}

// The bulk tensor stores of a warpgroup's staged O rows, which thread 0 of the warpgroup issues
// after the epilogue has returned, where it would wait anyway: under the next tile's first S
// (mainloop.cuh), or at the latest before the staging is written again or the CTA exits. `row` < 0:
// nothing pending. (Issued in the epilogue itself, the stores held the issuing warp for 300-700
// cycles between the epilogue and the next tile: forward-sm90.md, version 34.)
struct PendingStore {
    int row = -1;  // TMA row coordinate of the warpgroup's first row
    int head = 0, batch = 0;
};

// Thread 0 of a warpgroup: the bulk tensor stores of pass `pass`'s column blocks of its staged O
// rows (traits.cuh kOutPasses), at `at`'s coordinates, from the staging tile's blocks `block0`..
// (past the tile's own: the V^T writer's buffer, kOutWholeWhenFree).
template <class Tr>
__device__ __forceinline__ void issue_o_stores(const FwdParams& p, SharedStorage<Tr>& s, int wg, int pass,
                                               const PendingStore& at, int block0 = 0) {
#pragma unroll
    for (int b = 0; b < Tr::kOutPassBlocks; ++b) {
        const int c = pass * Tr::kOutPassBlocks + b;
        if (c * Tr::kOutColElems < p.head_dim_v)
            tma_store_4d(&p.tma_o, s.o + (block0 + b) * Tr::kBlockM * Tr::kOutColElems + wg * 64 * Tr::kOutColElems,
                         c * Tr::kOutColElems, at.row, at.head, at.batch);
    }
    bulk_commit_group();
}

// The pending stores: the last pass's.
template <class Tr>
__device__ __forceinline__ void issue_pending_store(const FwdParams& p, SharedStorage<Tr>& s, int wg, int tid,
                                                    PendingStore& pending) {
    if constexpr (Tr::kTmaStoreO) {
        if (tid != 0 || pending.row < 0) return;
        issue_o_stores<Tr>(p, s, wg, Tr::kOutPasses - 1, pending);
        pending.row = -1;
    }
}

// Stages O's chunks [J0, J1) (8 columns each) of this warpgroup's rows into the staging tile's
// column blocks from J0 / chunks per block - kShift (epilogue below).
template <class Tr, int J0, int J1, int kShift>
__device__ __forceinline__ void stage_o(const FwdParams& p, uint32_t o_smem, const float (&o)[Tr::kORegs],
                                        const float (&inv_sum)[2], int tid, int row_in_tile, int quad_lane) {
    constexpr int kChunks = Tr::kOutSwizzle / 16;
    if constexpr (Tr::kWideStoresO) {
        // One stmatrix per 8-column chunk j of the warp's 16 rows: its two 8 x 8 matrices are
        // rows +0..7 and +8..15, the thread's word of each is its own column pair (the
        // accumulator layout), and lane 8m + i (m < 2) names the shared-memory row of matrix
        // m's row i: 16 contiguous bytes, so each row's chunk is swizzled alone.
        const int lane = tid % 32, m = lane / 8 % 2;
        const int r = row_in_tile - lane / 4 + 8 * m + lane % 8;  // the row this lane addresses
        const int row_xor = (r * Tr::kOutSwizzle / 128) % kChunks;
#pragma unroll
        for (int j = J0; j < J1; ++j) {
            const uint32_t w[2] = {pack_out<Tr>(p, o[4 * j] * inv_sum[0], o[4 * j + 1] * inv_sum[0]),
                                   pack_out<Tr>(p, o[4 * j + 2] * inv_sum[1], o[4 * j + 3] * inv_sum[1])};
            const int c = j / kChunks - kShift, chunk = (j % kChunks) ^ row_xor;
            stmatrix_x2(o_smem + 2 * (c * Tr::kBlockM * Tr::kOutColElems + r * Tr::kOutColElems + chunk * 8), w);
        }
    } else {
        // 4-byte stores of the thread's own column pairs.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row_in_tile + 8 * h;
            const int row_xor = (r * Tr::kOutSwizzle / 128) % kChunks;
#pragma unroll
            for (int j = J0; j < J1; ++j) {
                const int c = j / kChunks - kShift, chunk = (j % kChunks) ^ row_xor;
                const uint32_t elem = c * Tr::kBlockM * Tr::kOutColElems + r * Tr::kOutColElems + chunk * 8 + 2 * quad_lane;
                st_shared_u32(o_smem + 2 * elem,
                              pack_out<Tr>(p, o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]));
            }
        }
    }
}

// wg: the consumer warpgroup (0 or 1); tid: thread in the warpgroup; row_in_tile: the thread's
// first row in the tile (+8 is its second); tc: the CTA's tile count, for -DFA3_TRACE's stamps only.
template <class Tr>
__device__ __forceinline__ void epilogue(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t,
                                         const float (&o)[Tr::kORegs], const float (&inv_sum)[2],
                                         const float (&lse)[2], int wg, int tid, int row_in_tile, int quad_lane,
                                         PendingStore& pending, int tc = -1) {
    trace_fine(wg + 1, tc, 0);
    // (is_split written out: called here, options.cuh's function changed ptxas's schedule of the
    // kernels that are not plain, whose SASS this way stays byte-identical to what it was before.)
    if (!Tr::kPlain && p.num_splits.d > 1) {
        if (Tr::kClusterCombine && p.cluster_combine) {
            cluster_combine<Tr>(p, s, t, o, inv_sum, lse, wg, tid, row_in_tile, quad_lane);
        } else {
            store_split_partial<Tr>(p, t, o, inv_sum, lse, row_in_tile, quad_lane);
        }
        return;
    }
    const int wg_row0 = t.m_block * Tr::kBlockM + wg * 64;  // first query row of this warpgroup
    const bool tma_store =
        Tr::kTmaStoreO && !stores_direct<Tr>(p) && !packs_gqa<Tr>(p) && (!is_varlen<Tr>(p) || wg_row0 + 64 <= t.seqlen_q);
    if (tma_store) {
        const int bar = epilogue_barrier(wg);
        // The staging rows are free once this warpgroup's previous store has read them (issued
        // here if no S came since to issue it under).
        bool whole = false;  // kOutWholeWhenFree: every column at once (the writer has stopped)
        if (tid == 0) {
            issue_pending_store<Tr>(p, s, wg, tid, pending);
            bulk_wait_group_read<0>();
            if constexpr (Tr::kOutWholeWhenFree) whole = mbar_test(&s.vt_fill_stopped, 0);
        }
        if constexpr (Tr::kOutWholeWhenFree) {
            whole = named_barrier_sync_or(bar, 128, whole);  // thread 0's answer, for every thread
        } else {
            named_barrier_sync(bar, 128);
        }
        trace_fine(wg + 1, tc, 1);
        const uint32_t o_smem = smem_u32(s.o);
        const PendingStore at{t.q_row0 + wg_row0, t.head, t.tma_batch};
        // Tile layout as for Q in 16 bits: column block c at c * kBlockM * kOutColElems elements,
        // rows of kOutSwizzle bytes; TMA's swizzle stores the 16-byte chunk u of row r at chunk
        // u ^ ((r * kOutSwizzle / 128) % chunks per row): u ^ (r % 8) for 128B, u ^ (r / 2 % 4) for 64B.
        // Pass `pass` stages column blocks pass * kOutPassBlocks.. into the tile's blocks 0.. (fp8
        // d256: two passes, the first one's stores issued and read in between), or, staged whole,
        // every block into the tile's and then the V^T writer's buffer's (kOutWholeWhenFree).
        constexpr int kPassJ = Tr::kORegs / 4 / Tr::kOutPasses;
        if (Tr::kOutWholeWhenFree && whole) {
            // The first pass's columns into the writer's buffer (the blocks past the tile's), the
            // last pass's into the tile below, where two passes leave them; the first pass's
            // stores go out after the last barrier, without a wait.
            static_assert(!Tr::kOutWholeWhenFree ||
                              offsetof(SharedStorage<Tr>, vt_fill) == offsetof(SharedStorage<Tr>, o) + sizeof(s.o),
                          "the writer's buffer follows the staging tile");
            stage_o<Tr, 0, kPassJ, -Tr::kOutPassBlocks>(p, o_smem, o, inv_sum, tid, row_in_tile, quad_lane);
        } else {
            stage_o<Tr, 0, kPassJ, 0>(p, o_smem, o, inv_sum, tid, row_in_tile, quad_lane);
            if constexpr (Tr::kOutPasses == 2) {
                trace_fine(wg + 1, tc, 2);  // (stamps 2 and 3: the first pass's)
                fence_proxy_async_smem();
                named_barrier_sync(bar, 128);
                trace_fine(wg + 1, tc, 3);
                if (tid == 0) {
                    issue_o_stores<Tr>(p, s, wg, 0, at);
                    bulk_wait_group_read<0>();
                }
                named_barrier_sync(bar, 128);
            }
        }
        if constexpr (Tr::kOutPasses == 2)
            stage_o<Tr, kPassJ, 2 * kPassJ, Tr::kOutPassBlocks>(p, o_smem, o, inv_sum, tid, row_in_tile, quad_lane);
        static_assert(Tr::kOutPasses <= 2, "one or two passes");
        if (Tr::kOutPasses == 1) trace_fine(wg + 1, tc, 2);
        fence_proxy_async_smem();
        named_barrier_sync(bar, 128);
        if (Tr::kOutPasses == 1) trace_fine(wg + 1, tc, 3);
        if (Tr::kOutWholeWhenFree && whole && tid == 0) issue_o_stores<Tr>(p, s, wg, 0, at, Tr::kOutPassBlocks);
        if (tid == 0) pending = at;
        trace_fine(wg + 1, tc, 4);
    } else {
        store_o_direct<Tr>(p, t, o, inv_sum, row_in_tile, quad_lane);
    }
    if (quad_lane == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int i, head;
            row_position<Tr>(p, t, row_in_tile + 8 * h, i, head);
            if (i < t.seqlen_q) p.lse[t.lse_row0 + (int64_t)(head - t.head) * p.lse_head_stride + i] = lse[h];
        }
    }
    trace_fine(wg + 1, tc, 5);
}

// Before the CTA exits: the last O store is issued and has read its shared-memory source.
template <class Tr>
__device__ __forceinline__ void epilogue_drain(const FwdParams& p, SharedStorage<Tr>& s, int wg, int tid,
                                               PendingStore& pending) {
    issue_pending_store<Tr>(p, s, wg, tid, pending);
    if (Tr::kTmaStoreO && tid == 0) bulk_wait_group_read<0>();
}

}  // namespace fa3
