// The producer: one thread of the producer warpgroup issues every copy. K and V of the CTA's key
// block are loaded once; Q, dO (TMA) and the per-row lse_log2 and dpsum (bulk copies) of each
// query block go through a kStages-deep ring, each slot guarded by a "full" barrier (bytes
// landed) and an "empty" barrier (both consumer warpgroups are done with it).
#pragma once
#include "../primitives/mbarrier.cuh"
#include "../primitives/tma.cuh"
#include "block.cuh"
#include "traits.cuh"

namespace fa3 {

template <class Tr>
__device__ __forceinline__ void load_rows(const TmaDesc* desc, uint16_t* dst, uint64_t* bar, int rows, int row,
                                          int head, int batch) {
    // One box per 64-column block: a 128-byte swizzle span is the widest box row TMA allows.
#pragma unroll
    for (int c = 0; c < Tr::kColBlocks; ++c) tma_load_4d(desc, dst + c * rows * 64, bar, c * 64, row, head, batch);
}

template <class Tr> __device__ void bwd_producer(const BwdParams& p, BwdSharedStorage<Tr>& s, const KeyBlock& kb) {
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_do);
    const int key_row = kb.seq.k_row0 + kb.n * Tr::kBlockN;
    mbar_arrive_expect_tx(&s.bar_kv, 2 * Tr::kKVBytes);
    load_rows<Tr>(&p.tma_k, s.k, &s.bar_kv, Tr::kBlockN, key_row, kb.kv_head, kb.seq.tma_batch);
    load_rows<Tr>(&p.tma_v, s.v, &s.bar_kv, Tr::kBlockN, key_row, kb.kv_head, kb.seq.tma_batch);

    int it = 0;
    for (int g = 0; g < p.group; ++g) {
        const int head = kb.kv_head * p.group + g;
        for (int m = kb.m_min; m < kb.m_max; ++m, ++it) {
            const int stage = it % Tr::kStages;
            const uint32_t phase = (it / Tr::kStages) & 1;
            mbar_wait(&s.empty[stage], phase ^ 1);  // passes at once in round 0
            mbar_arrive_expect_tx(&s.full[stage], 2 * Tr::kQBytes + 2 * Tr::kBlockM * 4);
            const int q_row = kb.seq.q_row0 + m * Tr::kBlockM;
            load_rows<Tr>(&p.tma_q, s.q[stage], &s.full[stage], Tr::kBlockM, q_row, head, kb.seq.tma_batch);
            load_rows<Tr>(&p.tma_do, s.dout[stage], &s.full[stage], Tr::kBlockM, q_row, head, kb.seq.tma_batch);
            const int64_t row = (int64_t)head * p.padded_rows + kb.seq.pad0 + m * Tr::kBlockM;
            bulk_load(s.lse_log2[stage], p.lse_log2 + row, Tr::kBlockM * 4, &s.full[stage]);
            bulk_load(s.dpsum[stage], p.dpsum + row, Tr::kBlockM * 4, &s.full[stage]);
        }
    }
}

}  // namespace fa3
