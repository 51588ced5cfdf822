// A consumer warpgroup: 64 keys of the CTA's key block against every query block the producer
// streams. Per query block (kBlockM queries), with w = this warpgroup's 64 keys:
//   Sᵀ  = K_w·Qᵀ        wgmma, both operands K-major in shared memory      (64 x kBlockM)
//   dPᵀ = V_w·dOᵀ       wgmma, likewise
//   Pᵀ  = exp2(Sᵀ·scale·log2e − lse_log2)   (softcap: through tanh), masked on boundary blocks
//   dSᵀ = Pᵀ ∘ (dPᵀ − D)                    (softcap: times 1 − tanh²)
//   dV += Pᵀ·dO,  dK += dSᵀ·Q   wgmma, A = Pᵀ / dSᵀ from registers, B = dO / Q read transposed
//   dSᵀ -> shared memory; after a named barrier over both consumer warpgroups:
//   dQ  = dS·K (this warpgroup's 64 x 64 share)  wgmma, A = dSᵀ and B = K both read transposed,
//   staged in shared memory and handed to a dQ writer warp of the producer warpgroup, which adds
//   it to the f32 dq_accum in global memory with one bulk reduce-add (deterministic mode: the
//   consumers add it with vector reductions in key-block order through a per-(head, query block)
//   semaphore).
// dS here leaves out the softmax scale, which the epilogue (dK) and the postprocess (dQ) apply.
#pragma once
#include "../primitives/atomic.cuh"
#include "../primitives/convert.cuh"
#include "../primitives/mbarrier.cuh"
#include "../primitives/warp.cuh"
#include "../primitives/wgmma.cuh"
#include "block.cuh"
#include "traits.cuh"

namespace fa3 {

// Named barriers (0 is __syncthreads): dSᵀ of a query block is in shared memory (both consumer
// warpgroups, 256 threads); per-warpgroup barriers (128 threads: the deterministic dQ hand-off,
// the dK/dV epilogue); the dQ hand-off between consumer warpgroup wg and its writer warp (128 +
// 32 threads): "full" once the share is staged, "empty" once the bulk engine has read it.
constexpr int kBarDsReady = 1;
__device__ __forceinline__ int wg_barrier(int wg) { return 2 + wg; }
constexpr int kDqHandoffThreads = 128 + 32;
__device__ __forceinline__ int dq_full_barrier(int wg) { return 4 + wg; }
__device__ __forceinline__ int dq_empty_barrier(int wg) { return 6 + wg; }

// Low word of a wgmma descriptor (smem_desc_lo). d128 keeps it on the uniform datapath
// (uniform(): a warp reduction, the k-step offsets are then uniform adds); for d64 that measured
// 3-4% slower than leaving it to ptxas (H100, same call), for d128 1.5% faster.
template <class Tr> __device__ __forceinline__ uint32_t desc_lo(uint32_t smem_addr, uint32_t lbo_bytes) {
    if constexpr (Tr::kBlockM == 64) return uniform(smem_desc_lo(smem_addr, lbo_bytes));
    else return smem_desc_lo(smem_addr, lbo_bytes);
}

template <class Tr>
__device__ __forceinline__ void issue_k_major(float (&acc)[Tr::kSRegs], uint32_t a_base, uint32_t b_base) {
    // A: 64 of kBlockN key rows (K or V), B: kSCols of kBlockM query rows (Q or dO); both K-major
    // over the head dim: k-step kk is column block kk / 4, 32-byte slice kk % 4 inside the
    // swizzled row.
    // Descriptor low words (desc_lo) plus compile-time k-step offsets.
    const uint32_t a_lo = desc_lo<Tr>(a_base, 16), b_lo = desc_lo<Tr>(b_base, 16);
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
        const uint32_t off = kk / 4, in_row = (kk % 4) * 32;
        wgmma_ss<Tr::kSCols, Tr::kDtype>(acc, smem_desc_at<1024>(a_lo, off * Tr::kBlockN * 128 + in_row),
                                          smem_desc_at<1024>(b_lo, off * Tr::kBlockM * 128 + in_row), kk > 0 ? 1 : 0);
    }
}

template <class Tr>
__device__ __forceinline__ void issue_rs(float (&acc)[Tr::kAccRegs], const uint32_t (&a)[Tr::kBlockM / 16][4],
                                         uint32_t b_base) {
    // B (queries x head dim, head dim contiguous) read MN-major: LBO steps between 64-column
    // blocks of the head dim, SBO between groups of 8 query rows; k-step kk = 16 query rows.
    const uint32_t b_lo = desc_lo<Tr>(b_base, Tr::kBlockM * 128);
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockM / 16; ++kk)
        wgmma_rs<Tr::kHeadDim, Tr::kDtype>(acc, a[kk], smem_desc_at<1024>(b_lo, kk * 16 * 128));
}

// Two f32 of shared memory (the per-row vectors lse_log2 / dpsum) with an explicit shared load:
// through a generic pointer the compiler emits generic 64-bit loads.
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

// Pᵀ (and with kGrads dSᵀ) of one query block, in place: st (scores) becomes Pᵀ, dpt (dPᵀ)
// becomes dSᵀ. Without kGrads dpt is not touched (it may still be in flight) and grads()
// finishes dSᵀ later. seen_by: the queries that see this thread's two keys (rows key, key + 8);
// i0: the query of the tile's column 0; lse / dpsum: shared addresses of the stage's vectors.
// kMasked: the block is not fully visible (per-entry causal / window / sequence-end test,
// invisible entries get Pᵀ = dSᵀ = 0);
// kSoftcap: logits through tanh, dSᵀ times 1 − tanh² (needs kGrads). Specialised so that the
// common case (unmasked, no softcap) is one FFMA + EX2 (+ FADD + FMUL) per entry.
template <class Tr, bool kMasked, bool kSoftcap, bool kGrads>
__device__ __forceinline__ void probs_grads(const BwdParams& p, const KeyBlock& kb, float (&st)[Tr::kSRegs],
                                            float (&dpt)[Tr::kSRegs], uint32_t lse, uint32_t dpsum,
                                            const QueryInterval (&seen_by)[2], int i0, int quad_lane) {
    static_assert(kGrads || !kSoftcap, "softcap computes Pᵀ and dSᵀ together");
    const float scale_log2 = p.scale_log2;
    const float softcap_pre = p.softcap_pre;
#pragma unroll
    for (int j = 0; j < Tr::kSRegs / 4; ++j) {
        const int col = 8 * j + 2 * quad_lane;  // query column of accumulator pairs 4j.. (rows key, key + 8)
        const float2 l = ld_shared_f32x2(lse + col * 4);
        float2 dd = make_float2(0.f, 0.f);
        if constexpr (kGrads) dd = ld_shared_f32x2(dpsum + col * 4);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            bool vis[2] = {true, true};
            if constexpr (kMasked) {
                const int i = i0 + col + e;
#pragma unroll
                for (int h = 0; h < 2; ++h) vis[h] = i >= seen_by[h].lo && i <= seen_by[h].hi;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 4 * j + 2 * h + e;
                float x = st[r];
                float dtanh = 1.f;
                if constexpr (kSoftcap) {
                    const float t = tanhf(x * softcap_pre);
                    dtanh = 1.f - t * t;
                    x = t;
                }
                float prob = fast_exp2(x * scale_log2 - (e ? l.y : l.x));
                if constexpr (kMasked) prob = vis[h] ? prob : 0.f;
                st[r] = prob;
                if constexpr (kGrads) {
                    float g = prob * (dpt[r] - (e ? dd.y : dd.x));
                    if constexpr (kSoftcap) g *= dtanh;
                    if constexpr (kMasked) g = vis[h] ? g : 0.f;
                    dpt[r] = g;
                }
            }
        }
    }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − D), in place in dpt (no softcap; masked entries have Pᵀ = 0 and dPᵀ finite).
template <class Tr>
__device__ __forceinline__ void grads(const float (&st)[Tr::kSRegs], float (&dpt)[Tr::kSRegs], uint32_t dpsum,
                                      int quad_lane) {
#pragma unroll
    for (int j = 0; j < Tr::kSRegs / 4; ++j) {
        const int col = 8 * j + 2 * quad_lane;
        const float2 dd = ld_shared_f32x2(dpsum + col * 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            dpt[4 * j + 2 * h] = st[4 * j + 2 * h] * (dpt[4 * j + 2 * h] - dd.x);
            dpt[4 * j + 2 * h + 1] = st[4 * j + 2 * h + 1] * (dpt[4 * j + 2 * h + 1] - dd.y);
        }
    }
}

// Waits for Sᵀ and dPᵀ (the two newest wgmma groups) and turns them into Pᵀ and dSᵀ (f32, in
// place). kPUnderDp (d128, no softcap): Pᵀ while dPᵀ is still in flight, then dSᵀ.
template <class Tr, bool kMasked, bool kSoftcap>
__device__ __forceinline__ void scores_to_grads(const BwdParams& p, const KeyBlock& kb, float (&st)[Tr::kSRegs],
                                                float (&dpt)[Tr::kSRegs], uint32_t lse, uint32_t dpsum,
                                                const QueryInterval (&seen_by)[2], int i0, int quad_lane) {
    if constexpr (Tr::kPUnderDp && !kSoftcap) {
        wgmma_wait<1>();
        fence_operand(st);
        probs_grads<Tr, kMasked, false, false>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
        wgmma_wait<0>();
        fence_operand(dpt);
        grads<Tr>(st, dpt, dpsum, quad_lane);
    } else {
        wgmma_wait<0>();
        fence_operand(st);
        fence_operand(dpt);
        probs_grads<Tr, kMasked, kSoftcap, true>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
    }
}

// scores_to_grads for query block m, with one uniform branch per block picking the specialised
// math (softcap or not, masked or not). q0: the score tile's first query within the block (0, or
// the wide warpgroup's half); lse / dpsum: the stage's vectors, from the block's first row.
template <class Tr>
__device__ __forceinline__ void block_scores_to_grads(const BwdParams& p, const KeyBlock& kb, float (&st)[Tr::kSRegs],
                                                      float (&dpt)[Tr::kSRegs], uint32_t lse, uint32_t dpsum,
                                                      const QueryInterval (&seen_by)[2], int m, int q0,
                                                      int quad_lane) {
    const int i0 = m * Tr::kBlockM + q0;
    lse += q0 * 4;
    dpsum += q0 * 4;
    const bool masked = !block_unmasked<Tr>(p, kb, m);
    if (p.softcap_pre != 0.f) {
        if (masked) scores_to_grads<Tr, true, true>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
        else scores_to_grads<Tr, false, true>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
    } else {
        if (masked) scores_to_grads<Tr, true, false>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
        else scores_to_grads<Tr, false, false>(p, kb, st, dpt, lse, dpsum, seen_by, i0, quad_lane);
    }
}

// Accumulator pairs 8kk..8kk+7 are the four A registers of k-step kk (rows r, r+8; columns +0, +8).
template <class Tr>
__device__ __forceinline__ void to_a_operand(const float (&acc)[Tr::kSRegs], uint32_t (&a)[Tr::kSCols / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < Tr::kSCols / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[kk][r] = pack16x2<Tr::kDtype>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
    }
}

// Writes this warp's dSᵀ (or Pᵀ; 16 key rows x kSCols queries, 16-bit) into the swizzled
// [kBlockN][64] column blocks of a kBlockN x kBlockM buffer with stmatrix, from query chunk
// q_chunk0 on (a chunk is 8 queries, one 16-byte unit of the 128-byte swizzle): the A-operand
// registers dsa[kk] are exactly the four 8x8 fragments of rows (0-7, 8-15) x query chunks
// (2kk, 2kk + 1); lane L gives the address of row L % 8 of fragment L / 8.
template <class Tr>
__device__ __forceinline__ void store_ds(uint32_t ds, const uint32_t (&dsa)[Tr::kSCols / 16][4], int warp_row0,
                                         int q_chunk0, int lane) {
    const int frag = lane / 8, x = lane % 8;
    const uint32_t row_addr = ds + (warp_row0 + (frag % 2) * 8 + x) * 128;
#pragma unroll
    for (int kk = 0; kk < Tr::kSCols / 16; ++kk) {
        const int q_chunk = q_chunk0 + 2 * kk + frag / 2;
        const uint32_t chunk = (q_chunk % 8) ^ x;
        const uint32_t addr = row_addr + (q_chunk / 8) * Tr::kBlockN * 128 + (chunk << 4);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(dsa[kk][0]),
                     "r"(dsa[kk][1]), "r"(dsa[kk][2]), "r"(dsa[kk][3])
                     : "memory");
    }
}

// Deterministic mode: dQ shares of query block m are added in key-block order, per (head, query
// block) through a semaphore that each consumer warpgroup of a key block bumps once when its
// shares are in. dq_turn_wait returns once every earlier key block (both warpgroups) is done.
template <class Tr>
__device__ __forceinline__ int* dq_semaphore(const BwdParams& p, const KeyBlock& kb, int head, int m) {
    return p.dq_semaphore + ((int64_t)kb.batch * p.heads + head) * p.num_m_blocks + m;
}
template <class Tr>
__device__ __forceinline__ void dq_turn_wait(const BwdParams& p, const KeyBlock& kb, int head, int m, int wg,
                                             int tid) {
    const int turn = Tr::kConsumerWGs * (kb.n - first_key_block<Tr>(p, kb, m));
    if (tid == 0) {
        while (ld_acquire(dq_semaphore<Tr>(p, kb, head, m)) < turn) {
        }
    }
    named_barrier_sync(wg_barrier(wg), 128);
}
template <class Tr>
__device__ __forceinline__ void dq_turn_release(const BwdParams& p, const KeyBlock& kb, int head, int m, int wg,
                                                int tid) {
    __threadfence();
    named_barrier_sync(wg_barrier(wg), 128);
    if (tid == 0) red_release_add(dq_semaphore<Tr>(p, kb, head, m), 1);
}

// Adds one 64 x 64 share of dQ from registers with vector reductions (coalesced: thread tid's
// pairs are 8 bytes apart).
__device__ __forceinline__ void red_add_dq_share(float* share, const float (&dq)[32], int tid) {
#pragma unroll
    for (int pair = 0; pair < 16; ++pair) red_add_f32x2(share + (pair * 128 + tid) * 2, dq[2 * pair], dq[2 * pair + 1]);
}

// Adds this warpgroup's 64 x 64 share of dQ (f32, without the scale) to the accumulator block of
// (head, query block m). Default: the share is staged in shared memory in register order (once
// the writer warp has freed the buffer), and the writer warp adds it with a
// single bulk reduce-add: the consumers only store and arrive. Deterministic: vector reductions in
// key-block order.
template <class Tr>
__device__ __forceinline__ void add_dq(const BwdParams& p, BwdSharedStorage<Tr>& s, const KeyBlock& kb,
                                       const float (&dq)[32], int head, int m, int wg, int tid) {
    if (p.dq_semaphore == nullptr) {
        const uint32_t stage = smem_u32(s.dq_share[wg]) + tid * 8;
        named_barrier_sync(dq_empty_barrier(wg), kDqHandoffThreads);
#pragma unroll
        for (int pair = 0; pair < 16; ++pair)
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(stage + pair * 128 * 8), "f"(dq[2 * pair]),
                         "f"(dq[2 * pair + 1])
                         : "memory");
        fence_proxy_async_smem();  // the bulk engine (async proxy) reads what st.shared wrote
        named_barrier_arrive(dq_full_barrier(wg), kDqHandoffThreads);
        return;
    }
    dq_turn_wait<Tr>(p, kb, head, m, wg, tid);
    red_add_dq_share(dq_share_ptr<Tr>(p, kb, head, m, wg), dq, tid);
    dq_turn_release<Tr>(p, kb, head, m, wg, tid);
}

template <class Tr>
__device__ void bwd_consumer(const BwdParams& p, BwdSharedStorage<Tr>& s, const KeyBlock& kb, int wg, int tid,
                             float (&dk)[Tr::kAccRegs], float (&dv)[Tr::kAccRegs]) {
    const int warp = tid / 32, lane = tid % 32, quad_lane = lane % 4;
    const int key_in_tile = wg * 64 + warp * 16 + lane / 4;  // this thread's first key row; +8 the second
    const int key = kb.n * Tr::kBlockN + key_in_tile;
    const QueryInterval seen_by[2] = {query_interval(p, key, kb.seq.seqlen_q, kb.seq.seqlen_k),
                                      query_interval(p, key + 8, kb.seq.seqlen_q, kb.seq.seqlen_k)};
#pragma unroll
    for (int i = 0; i < Tr::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

    // This warpgroup's 64 key rows inside each 128-row column block of K and V.
    const uint32_t k_rows = smem_u32(s.k) + wg * 64 * 128, v_rows = smem_u32(s.v) + wg * 64 * 128;
    // dQ operands of this warpgroup's share: d64 takes query rows [64 wg, 64 wg + 64) of dS (a
    // column block of dSᵀ) and all of K; d128 all of dS and K's column block wg.
    const uint32_t ds_share = Tr::kDqSplitRows ? wg * Tr::kBlockN * 128 : 0;
    const uint32_t k_share = smem_u32(s.k) + (Tr::kDqSplitRows ? 0 : wg * Tr::kBlockN * 128);
    mbar_wait(&s.bar_kv, 0);

    int it = 0;
    for (int g = 0; g < p.group; ++g) {
        const int head = kb.kv_head * p.group + g;
        for (int m = kb.m_min; m < kb.m_max; ++m, ++it) {
            const int stage = it % Tr::kStages;
            const uint32_t phase = (it / Tr::kStages) & 1;
            const uint32_t q_base = smem_u32(s.q[stage]), do_base = smem_u32(s.dout[stage]);
            mbar_wait(&s.full[stage], phase);

            // ---- Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, two groups in flight together
            float st[Tr::kSRegs], dpt[Tr::kSRegs];
            wgmma_fence();
            issue_k_major<Tr>(st, k_rows, q_base);
            wgmma_commit();
            issue_k_major<Tr>(dpt, v_rows, do_base);
            wgmma_commit();

            // ---- Pᵀ, dSᵀ (d128: Pᵀ while dPᵀ is still in flight), then both as 16-bit A operands;
            // one uniform branch per query block picks the specialised math
            uint32_t pa[Tr::kSCols / 16][4], dsa[Tr::kSCols / 16][4];
            block_scores_to_grads<Tr>(p, kb, st, dpt, smem_u32(s.lse_log2[stage]), smem_u32(s.dpsum[stage]), seen_by, m,
                                      0, quad_lane);
            to_a_operand<Tr>(st, pa);
            to_a_operand<Tr>(dpt, dsa);

            // ---- dSᵀ to shared memory for dQ (its buffer was last read two query blocks ago,
            // before the previous dS barrier); then dV += Pᵀ·dO
            uint8_t* ds = reinterpret_cast<uint8_t*>(s.ds[it & 1]);
            store_ds<Tr>(smem_u32(ds), dsa, key_in_tile - lane / 4, 0, lane);
            fence_operand(dv);
            wgmma_fence();
            issue_rs<Tr>(dv, pa, do_base);
            wgmma_commit();
            // The async proxy (wgmma) must see the dS stores.
            fence_proxy_async_smem();
            named_barrier_sync(kBarDsReady, 256);

            // ---- dQ share = dS·K: A = dSᵀ (keys x queries) and B = K (keys x head dim), both
            // MN-major; k-step kk = 16 keys = 16 rows of 128 bytes. Then dK += dSᵀ·Q, issued
            // before dQ is read back so that the dQ hand-off runs under it.
            float dq[32];
            const uint32_t ds_base = smem_u32(ds) + ds_share;
            const uint32_t ds_lo = desc_lo<Tr>(ds_base, Tr::kBlockN * 128);
            const uint32_t kt_lo = desc_lo<Tr>(k_share, Tr::kBlockN * 128);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
                wgmma_ss_tt<64, Tr::kDtype>(dq, smem_desc_at<1024>(ds_lo, kk * 16 * 128),
                                            smem_desc_at<1024>(kt_lo, kk * 16 * 128), kk > 0 ? 1 : 0);
            wgmma_commit();
            wgmma_wait<1>();  // dV done: pa is free, dO no longer read
#pragma unroll
            for (int kk = 0; kk < Tr::kBlockM / 16; ++kk) fence_operand(pa[kk]);
            fence_operand(dv);
            fence_operand(dk);
            wgmma_fence();
            issue_rs<Tr>(dk, dsa, q_base);
            wgmma_commit();
            wgmma_wait<1>();  // dQ done; dK still running
            fence_operand(dq);
            add_dq<Tr>(p, s, kb, dq, head, m, wg, tid);
            wgmma_wait<0>();
            fence_operand(dk);
#pragma unroll
            for (int kk = 0; kk < Tr::kBlockM / 16; ++kk) fence_operand(dsa[kk]);
            mbar_arrive(&s.empty[stage]);  // Q, dO, lse_log2, dpsum of this stage are no longer read
        }
    }
    // The writer's last bulk read is done: the staging buffer is free for the dK/dV epilogue.
    if (p.dq_semaphore == nullptr) named_barrier_sync(dq_empty_barrier(wg), kDqHandoffThreads);
}

// A writer warp of the producer warpgroup: for every query block, waits until consumer warpgroup
// wg has staged its dQ share, adds it to the accumulator with one bulk reduce-add and frees the
// staging buffer once the bulk engine has read it, so that the consumers only store and arrive.
// (Before this warp, a consumer thread issued the reduce-add after a 128-thread barrier and waited
// for the engine's read before the next dS barrier.) The key block is derived again here rather
// than passed in: values live across the producer warpgroup's setmaxnreg would have to fit its
// 24 registers.
template <class Tr> __device__ void bwd_dq_writer(const BwdParams& p, BwdSharedStorage<Tr>& s, int wg, int lane) {
    KeyBlock kb;
    get_key_block<Tr>(p, kb);
#pragma unroll 1
    for (int g = 0; g < p.group; ++g) {
        const int head = kb.kv_head * p.group + g;
#pragma unroll 1
        for (int m = kb.m_min; m < kb.m_max; ++m) {
            named_barrier_arrive(dq_empty_barrier(wg), kDqHandoffThreads);
            named_barrier_sync(dq_full_barrier(wg), kDqHandoffThreads);
            if (lane == 0) {
                bulk_reduce_add_f32(dq_share_ptr<Tr>(p, kb, head, m, wg), s.dq_share[wg], kDqShare * 4);
                bulk_commit_group();
                bulk_wait_group_read<0>();
            }
            __syncwarp();
        }
    }
    // The last share is read: the consumers may reuse the buffer (the dK/dV epilogue).
    named_barrier_arrive(dq_empty_barrier(wg), kDqHandoffThreads);
    if (lane == 0) bulk_wait_group<0>();  // shared memory must outlive the last bulk reduce-add
}

__device__ __forceinline__ uint4 ld_shared_u32x4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// One of dK, dV of this warpgroup's 64 keys through its dQ staging buffer (free once the loop has
// ended): 16-bit pairs stored with the 16-byte chunks of each row XOR-swizzled by row % 8
// (conflict-free), then read back as whole 16-byte chunks and written as full rows (coalesced
// 16-byte stores; keys past the sequence end and padding columns skipped). Stored straight from
// registers, a warp's 4-byte stores covered 8 rows x 16 bytes; staging them gained 2-9% on the
// whole kernel (docs/kernels/backward-sm90.md, version 18).
template <class Tr>
__device__ __forceinline__ void store_rows_staged(const BwdParams& p, const KeyBlock& kb, uint32_t stage,
                                                  const float (&acc)[Tr::kAccRegs], float mul, uint16_t* out,
                                                  int cols, int wg, int tid) {
    constexpr int kRowBytes = Tr::kHeadDim * 2, kChunks = kRowBytes / 16;
    const int warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 + lane / 4 + 8 * h;
#pragma unroll
        for (int j = 0; j < Tr::kAccRegs / 4; ++j)
            st_shared_u32(stage + row * kRowBytes + ((j ^ (row % 8)) * 16) + (lane % 4) * 4,
                          pack16x2<Tr::kDtype>(acc[4 * j + 2 * h] * mul, acc[4 * j + 2 * h + 1] * mul));
    }
    named_barrier_sync(wg_barrier(wg), 128);
    const int key0 = kb.n * Tr::kBlockN + wg * 64;
#pragma unroll
    for (int idx = tid; idx < 64 * kChunks; idx += 128) {
        const int row = idx / kChunks, c = idx % kChunks;
        const uint4 v = ld_shared_u32x4(stage + row * kRowBytes + ((c ^ (row % 8)) * 16));
        const int key = key0 + row;
        if (key < kb.seq.seqlen_k && c * 8 < cols)
            *reinterpret_cast<uint4*>(out + ((kb.seq.k_tok0 + key) * p.kv_heads + kb.kv_head) * cols + c * 8) = v;
    }
    named_barrier_sync(wg_barrier(wg), 128);  // read back before the next tensor is staged
}

template <class Tr>
__device__ __forceinline__ void store_dk_dv_staged(const BwdParams& p, BwdSharedStorage<Tr>& s, const KeyBlock& kb,
                                                   const float (&dk)[Tr::kAccRegs], const float (&dv)[Tr::kAccRegs],
                                                   int wg, int tid) {
    const uint32_t stage = smem_u32(s.dq_share[wg]);
    store_rows_staged<Tr>(p, kb, stage, dk, p.scale, p.dk, p.head_dim, wg, tid);
    store_rows_staged<Tr>(p, kb, stage, dv, 1.f, p.dv, p.head_dim_v, wg, tid);
}

}  // namespace fa3
