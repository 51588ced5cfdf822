// Compile-time shape of one backward instantiation and its shared-memory layout.
#pragma once
#include <cstdint>

namespace fa3 {

// Two shapes of CTA, both with one producer and two consumer warpgroups:
//
// Head dims 64 and 128: the CTA owns kBlockN = 128 keys of one (kv head, sequence); consumer
// warpgroup w holds the gradients dK, dV of keys [64w, 64w + 64) in registers while query blocks
// of kBlockM rows stream past. kBlockM is 128 for head dim 64 and 64 for head dim 128, which keeps
// every warpgroup's share of dQ = dS·K (kBlockM x kHeadDim) one 64 x 64 wgmma tile: d64 splits
// dQ's rows between the warpgroups, d128 its columns.
//
// Head dim 256 ("wide"): all of dK and dV for 128 keys would not fit in registers, so the CTA
// owns kBlockN = 64 keys and the warpgroups split the head dim instead: warpgroup w holds columns
// [128w, 128w + 128) of dK and dV of all 64 keys. Each computes the scores of half the kBlockM =
// 64 queries (Sᵀ, dPᵀ: 64 keys x 32 queries), writes its Pᵀ and dSᵀ to shared memory, and after
// a barrier reads both halves back as the A operand of dV += Pᵀ·dO and dK += dSᵀ·Q (its columns)
// and of dQ = dS·K (its columns, two 64 x 64 tiles).
template <int kHeadDim_, int kDtype_> struct BwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kDtype = kDtype_;
    static constexpr bool kWide = kHeadDim > 128;
    static constexpr int kBlockN = kWide ? 64 : 128;
    static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
    static constexpr bool kDqSplitRows = kBlockM == 128;
    // Pᵀ computed while dPᵀ is still in flight (FA3's order; softcap computes both after the
    // wait, dSᵀ needs the tanh of the scores). A switch for measurements: both head dims gain.
    static constexpr bool kPUnderDp = true;
    static constexpr int kConsumerWGs = 2;
    static constexpr int kThreads = 128 * (1 + kConsumerWGs);
    static constexpr int kStages = 2;
    // 24 x 128 + 240 x 256 = 64512 registers: the consumers hold dK and dV (kAccRegs f32 each
    // per thread) across the whole loop, plus Sᵀ and dPᵀ (kSRegs each).
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static constexpr int kColBlocks = kHeadDim / 64;
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;   // also dO's
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * 2;  // K's, also V's
    // A warpgroup's score tile (Sᵀ, dPᵀ): 64 keys x kSCols queries.
    static constexpr int kSCols = kWide ? kBlockM / 2 : kBlockM;
    static constexpr int kSRegs = kSCols / 2;  // f32 accumulators of Sᵀ (and dPᵀ) per thread
    // A warpgroup's dK (and dV): 64 keys x kAccCols head-dim columns.
    static constexpr int kAccCols = kWide ? kHeadDim / 2 : kHeadDim;
    static constexpr int kAccRegs = kAccCols / 2;
    // dQ tiles of 64 x 64 per query block (the shares of the dq accumulator's layout).
    static constexpr int kDqShares = kBlockM * kHeadDim / (64 * 64);
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dims 64, 128 and 256");
    static_assert(kWide || kDqShares == kConsumerWGs, "each consumer warpgroup computes one 64 x 64 share of dQ");
};

template <class Tr> struct BwdSharedStorage {
    alignas(1024) uint16_t k[Tr::kBlockN * Tr::kHeadDim];
    alignas(1024) uint16_t v[Tr::kBlockN * Tr::kHeadDim];
    alignas(1024) uint16_t q[Tr::kStages][Tr::kBlockM * Tr::kHeadDim];
    alignas(1024) uint16_t dout[Tr::kStages][Tr::kBlockM * Tr::kHeadDim];
    // dSᵀ (keys x queries) of the last two query blocks: the A operand of dQ = dS·K, read
    // transposed (wide: also of dK += dSᵀ·Q). Two buffers so that a warpgroup writes block j+1
    // while the other may still read block j.
    alignas(1024) uint16_t ds[2][Tr::kBlockN * Tr::kBlockM];
    // Wide only: Pᵀ likewise, the A operand of dV += Pᵀ·dO (else Pᵀ stays in registers).
    alignas(1024) uint16_t pt[Tr::kWide ? 2 : 0][Tr::kBlockN * Tr::kBlockM];
    // Each consumer warpgroup's 64 x 64 share of dQ (f32) on its way to the bulk reduce-add, in the
    // accumulator's register order (dq_share_offset). Wide: no room left; its shares go to global
    // memory with vector reductions straight from registers.
    alignas(128) float dq_share[Tr::kWide ? 0 : Tr::kConsumerWGs][64 * 64];
    alignas(16) float lse_log2[Tr::kStages][Tr::kBlockM];
    alignas(16) float dpsum[Tr::kStages][Tr::kBlockM];
    alignas(8) uint64_t bar_kv;                // K and V of the CTA landed
    alignas(8) uint64_t full[Tr::kStages];     // Q, dO, lse_log2, dpsum of a stage landed
    alignas(8) uint64_t empty[Tr::kStages];    // both consumer warpgroups are done with a stage
};

}  // namespace fa3
