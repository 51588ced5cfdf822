// The Hopper (sm_90a) FlashAttention-3 backward: preprocess, warp-specialised main kernel
// (TMA + wgmma), postprocess. See docs/kernels/backward-sm90.md.
//
// Main kernel: one CTA per (key block, kv head, sequence) with 3 warpgroups. Warpgroup 0 is the
// producer (one thread issues the copies, two warps hand the consumers' dQ shares to the bulk
// engine; the warpgroup gives its registers away with setmaxnreg); warpgroups 1 and 2 are
// consumers that keep dK and dV of the key block in registers (head dims 64, 128: 64 keys each of
// a block of 128; head dim 256: half the columns each of a block of 64 keys, mainloop_wide.cuh)
// while the query blocks of every q head of the kv head's group stream past. dK and dV are
// therefore complete when the loop ends (GQA sums inside the CTA, no atomics); dQ is summed over
// key blocks in an f32 buffer in global memory.
#include "../primitives/warp.cuh"
#include "load.cuh"
#include "mainloop.cuh"
#include "mainloop_wide.cuh"
#include "prepost.cuh"

namespace fa3 {

template <class Tr> __device__ __forceinline__ void flash_bwd(const BwdParams& p) {
    extern __shared__ uint8_t smem_raw[];
    // TMA's 128B swizzle and the wgmma descriptors assume 1024-byte aligned tiles.
    uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
    BwdSharedStorage<Tr>& s = *reinterpret_cast<BwdSharedStorage<Tr>*>(base);

    KeyBlock kb;
    if (!get_key_block<Tr>(p, kb)) return;  // the same for every thread of the CTA
    const int wg = threadIdx.x / 128;
    const int tid = threadIdx.x % 128;

    if (threadIdx.x == 0) {
        mbar_init(&s.bar_kv, 1);
#pragma unroll
        for (int i = 0; i < Tr::kStages; ++i) {
            mbar_init(&s.full[i], 1);
            mbar_init(&s.empty[i], 128 * Tr::kConsumerWGs);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        warpgroup_reg_dealloc<Tr::kProducerRegs>();
        // Warp 0: the copies; warps 1, 2: the dQ writers of consumer warpgroups 0, 1 (staged
        // shares only: not d256, not the deterministic mode). The warp index goes through the
        // uniform datapath: branching on tid / 32 directly made ptxas spill the producer's loop.
        const int warp = uniform(tid / 32);
        if (warp == 0) {
            if (tid == 0) bwd_producer<Tr>(p, s, kb);
        } else if (!Tr::kWide && warp <= Tr::kConsumerWGs && p.dq_semaphore == nullptr) {
            bwd_dq_writer<Tr>(p, s, warp - 1, tid % 32);
        }
    } else {
        warpgroup_reg_alloc<Tr::kConsumerRegs>();
        float dk[Tr::kAccRegs], dv[Tr::kAccRegs];
        if constexpr (Tr::kWide) bwd_consumer_wide<Tr>(p, s, kb, wg - 1, tid, dk, dv);
        else bwd_consumer<Tr>(p, s, kb, wg - 1, tid, dk, dv);
        if constexpr (Tr::kWide) store_dk_dv_wide<Tr>(p, kb, dk, dv, wg - 1, tid);
        else store_dk_dv_staged<Tr>(p, s, kb, dk, dv, wg - 1, tid);
    }
}

}  // namespace fa3

#define FA3_BWD_KERNEL(NAME, D, DT)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(const __grid_constant__ fa3::BwdParams p) { \
        fa3::flash_bwd<fa3::BwdTraits<D, DT>>(p);                                                        \
    }

// The instantiations (kernels/flash_bwd/instances.h).
#include "instances.h"

extern "C" __global__ void __launch_bounds__(256) flash_bwd_preprocess_bf16(const __grid_constant__ fa3::BwdParams p) {
    fa3::bwd_preprocess<fa3::DT_BF16>(p);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_preprocess_f16(const __grid_constant__ fa3::BwdParams p) {
    fa3::bwd_preprocess<fa3::DT_F16>(p);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_postprocess_bf16(const __grid_constant__ fa3::BwdParams p) {
    fa3::bwd_postprocess<fa3::DT_BF16>(p);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_postprocess_f16(const __grid_constant__ fa3::BwdParams p) {
    fa3::bwd_postprocess<fa3::DT_F16>(p);
}
