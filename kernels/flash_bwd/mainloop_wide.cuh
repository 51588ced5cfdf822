// A consumer warpgroup of the head dim 256 ("wide") backward: both consumer warpgroups share the
// CTA's 64 keys; warpgroup w owns columns [128w, 128w + 128) of dK, dV and dQ and half of the
// scores. Per query block (64 queries), with h = this warpgroup's 32 queries:
//   Sᵀ_h  = K·Q_hᵀ,  dPᵀ_h = V·dO_hᵀ     wgmma, both operands K-major          (64 x 32 each)
//   Pᵀ_h, dSᵀ_h as in mainloop.cuh (probs_grads), both -> shared memory (the pt and ds buffers)
//   named barrier over both consumer warpgroups: Pᵀ and dSᵀ (64 x 64) complete
//   dQ_w  = dS·K_w      two 64 x 64 wgmma tiles, A = dSᵀ and B = K read transposed
//   dV_w += Pᵀ·dO_w,  dK_w += dSᵀ·Q_w     wgmma, A = Pᵀ / dSᵀ (K-major), B read transposed
//   dQ_w's two tiles go to the f32 accumulator in global memory with vector reductions from
//   registers while dV and dK are still in flight (no shared memory left for staging).
// Pᵀ and dSᵀ live in shared memory (not registers as in mainloop.cuh) because each warpgroup
// needs all 64 queries of them but computes only 32.
#pragma once
#include "../primitives/warp.cuh"
#include "mainloop.cuh"

namespace fa3 {

// acc (64 keys x kAccCols) += A·B: A = Pᵀ or dSᵀ (64 keys x kBlockM queries, one 128-byte swizzled
// row per key, K-major: k-step kk is the 32-byte slice of 16 queries); B = dO or Q, this
// warpgroup's column blocks (MN-major: LBO steps between 64-column blocks, SBO between groups of
// 8 query rows; k-step kk = 16 query rows).
template <class Tr>
__device__ __forceinline__ void issue_ss_bt(float (&acc)[Tr::kAccRegs], uint32_t a_base, uint32_t b_base) {
    const uint32_t a_lo = desc_lo<Tr>(a_base, 16), b_lo = desc_lo<Tr>(b_base, Tr::kBlockM * 128);
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockM / 16; ++kk)
        wgmma_ss_bt<Tr::kAccCols, Tr::kDtype>(acc, smem_desc_at<1024>(a_lo, kk * 32),
                                              smem_desc_at<1024>(b_lo, kk * 16 * 128), 1);
}

// dq (64 queries x 64 columns) = dS·K_c: A = dSᵀ (keys x queries) and B = column block c of K
// (keys x head dim), both MN-major; k-step kk = 16 keys = 16 rows of 128 bytes.
template <class Tr> __device__ __forceinline__ void issue_dq(float (&dq)[32], uint32_t ds_base, uint32_t k_block) {
    const uint32_t ds_lo = desc_lo<Tr>(ds_base, Tr::kBlockN * 128), k_lo = desc_lo<Tr>(k_block, Tr::kBlockN * 128);
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
        wgmma_ss_tt<64, Tr::kDtype>(dq, smem_desc_at<1024>(ds_lo, kk * 16 * 128),
                                    smem_desc_at<1024>(k_lo, kk * 16 * 128), kk > 0 ? 1 : 0);
}

template <class Tr>
__device__ void bwd_consumer_wide(const BwdParams& p, BwdSharedStorage<Tr>& s, const KeyBlock& kb, int wg, int tid,
                                  float (&dk)[Tr::kAccRegs], float (&dv)[Tr::kAccRegs]) {
    static_assert(Tr::kWide && Tr::kAccCols == 128 && Tr::kBlockN == 64, "the head dim 256 shape");
    const int warp = tid / 32, lane = tid % 32, quad_lane = lane % 4;
    const int key = kb.n * Tr::kBlockN + warp * 16 + lane / 4;  // this thread's first key; +8 the second
    const QueryInterval seen_by[2] = {query_interval(p, key, kb.seq.seqlen_q, kb.seq.seqlen_k),
                                      query_interval(p, key + 8, kb.seq.seqlen_q, kb.seq.seqlen_k)};
    const int q_half = wg * Tr::kSCols;  // this warpgroup's first query (column) of the scores
#pragma unroll
    for (int i = 0; i < Tr::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

    const uint32_t k_base = smem_u32(s.k), v_base = smem_u32(s.v);
    // This warpgroup's two 64-column blocks of K, Q and dO.
    const uint32_t k_cols = k_base + 2 * wg * Tr::kBlockN * 128;
    const uint32_t qd_cols = 2 * wg * Tr::kBlockM * 128;
    mbar_wait(&s.bar_kv, 0);

    int it = 0;
    for (int g = 0; g < p.group; ++g) {
        const int head = kb.kv_head * p.group + g;
        for (int m = kb.m_min; m < kb.m_max; ++m, ++it) {
            const int stage = it % Tr::kStages;
            const uint32_t phase = (it / Tr::kStages) & 1;
            const uint32_t q_base = smem_u32(s.q[stage]), do_base = smem_u32(s.dout[stage]);
            mbar_wait(&s.full[stage], phase);

            // ---- Sᵀ and dPᵀ of this warpgroup's 32 queries, two groups in flight together
            float st[Tr::kSRegs], dpt[Tr::kSRegs];
            wgmma_fence();
            issue_k_major<Tr>(st, k_base, q_base + q_half * 128);
            wgmma_commit();
            issue_k_major<Tr>(dpt, v_base, do_base + q_half * 128);
            wgmma_commit();
            block_scores_to_grads<Tr>(p, kb, st, dpt, smem_u32(s.lse_log2[stage]), smem_u32(s.dpsum[stage]), seen_by, m,
                                      q_half, quad_lane);

            // ---- Pᵀ and dSᵀ (16-bit) into this warpgroup's query chunks of the buffers (last read
            // two query blocks ago, before the previous barrier), then wait for the other half
            const uint32_t pt_buf = smem_u32(s.pt[it & 1]), ds_buf = smem_u32(s.ds[it & 1]);
            {
                uint32_t frag[Tr::kSCols / 16][4];
                to_a_operand<Tr>(st, frag);
                store_ds<Tr>(pt_buf, frag, warp * 16, q_half / 8, lane);
                to_a_operand<Tr>(dpt, frag);
                store_ds<Tr>(ds_buf, frag, warp * 16, q_half / 8, lane);
            }
            fence_proxy_async_smem();  // the async proxy (wgmma) must see the stores
            named_barrier_sync(kBarDsReady, 256);

            // ---- dQ's two tiles first (their reductions then run under dV and dK), then dV, dK
            float dq0[32], dq1[32];
            fence_operand(dv);
            fence_operand(dk);
            wgmma_fence();
            issue_dq<Tr>(dq0, ds_buf, k_cols);
            wgmma_commit();
            issue_dq<Tr>(dq1, ds_buf, k_cols + Tr::kBlockN * 128);
            wgmma_commit();
            issue_ss_bt<Tr>(dv, pt_buf, do_base + qd_cols);
            issue_ss_bt<Tr>(dk, ds_buf, q_base + qd_cols);
            wgmma_commit();

            float* shares = dq_share_ptr<Tr>(p, kb, head, m, 2 * wg);
            const bool ordered = p.dq_semaphore != nullptr;
            if (ordered) dq_turn_wait<Tr>(p, kb, head, m, wg, tid);
            wgmma_wait<2>();
            fence_operand(dq0);
            red_add_dq_share(shares, dq0, tid);
            wgmma_wait<1>();
            fence_operand(dq1);
            red_add_dq_share(shares + kDqShare, dq1, tid);
            if (ordered) dq_turn_release<Tr>(p, kb, head, m, wg, tid);
            wgmma_wait<0>();
            fence_operand(dv);
            fence_operand(dk);
            mbar_arrive(&s.empty[stage]);  // Q, dO, lse_log2, dpsum of this stage are no longer read
        }
    }
}

// The epilogue: no shared memory is left to stage dK and dV (d64/d128 stage them,
// store_dk_dv_staged), so this warpgroup stores its columns [wg·kAccCols, ...) of all the block's
// keys straight from registers, dK times the softmax scale, in 16-byte pieces: each quad of lanes
// first swaps its column pairs (quad_transpose_u32, as the forward's store_o_direct) so that a
// lane holds 8 consecutive columns. Keys past the sequence end and padding columns of a rounded-up
// head dim (a multiple of 8) are skipped.
template <class Tr>
__device__ __forceinline__ void store_dk_dv_wide(const BwdParams& p, const KeyBlock& kb,
                                                 const float (&dk)[Tr::kAccRegs], const float (&dv)[Tr::kAccRegs],
                                                 int wg, int tid) {
    static_assert(Tr::kWide, "head dims 64 and 128 stage dK and dV (store_dk_dv_staged)");
    static_assert(Tr::kAccRegs % 16 == 0, "whole 32-column groups");
    const int warp = tid / 32, lane = tid % 32, quad_lane = lane % 4;
    const int key0 = kb.n * Tr::kBlockN + warp * 16 + lane / 4;
    const int col0 = wg * Tr::kAccCols;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = key0 + 8 * h;
        const bool key_in_sequence = key < kb.seq.seqlen_k;  // the same for the quad's four lanes
        const int64_t row = (kb.seq.k_tok0 + key) * p.kv_heads + kb.kv_head;
        uint16_t* dk_row = p.dk + row * p.head_dim;
        uint16_t* dv_row = p.dv + row * p.head_dim_v;
#pragma unroll
        for (int m = 0; m < Tr::kAccRegs / 16; ++m) {
            // The quad's 32 columns col0 + 32m..: lane q holds columns 8j + 2q, + 1 of the groups
            // j = 4m..4m+3; after the transpose it holds group 4m + q whole.
            uint32_t wk[4], wv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int j = 4 * m + k;
                wk[k] = pack16x2<Tr::kDtype>(dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
                wv[k] = pack16x2<Tr::kDtype>(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
            }
            quad_transpose_u32(wk, quad_lane);
            quad_transpose_u32(wv, quad_lane);
            const int col = col0 + 8 * (4 * m + quad_lane);
            if (key_in_sequence && col < p.head_dim)
                *reinterpret_cast<uint4*>(dk_row + col) = make_uint4(wk[0], wk[1], wk[2], wk[3]);
            if (key_in_sequence && col < p.head_dim_v)
                *reinterpret_cast<uint4*>(dv_row + col) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
        }
    }
}

}  // namespace fa3
