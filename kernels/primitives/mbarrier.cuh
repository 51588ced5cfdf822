// Shared-memory mbarriers: the producer/consumer handshake of the TMA pipeline.
#pragma once
#include <cstdint>
#include <cstdio>

namespace fa3 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// `count` arrivals complete a phase (plus every byte announced with expect_tx).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialisations visible to the async proxy (TMA) before anyone uses the barriers.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival that also announces `bytes` of transactions (the TMA loads that follow).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

#ifdef FA3_HANG_CHECK
// The waits' FA3_HANG_CHECK form: try_wait (acquire at CTA or, kCluster, at cluster scope) polled
// against the global timer; past 2 s it prints where and traps.
template <bool kCluster> __device__ __forceinline__ void mbar_wait_checked(uint64_t* bar, uint32_t parity) {
    uint64_t t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        uint32_t done;
        if constexpr (kCluster) {
            asm volatile(
                "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2, 1000000;\n"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(smem_u32(bar)), "r"(parity)
                : "memory");
        } else {
            asm volatile(
                "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 1000000;\nselp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(smem_u32(bar)), "r"(parity)
                : "memory");
        }
        if (done) return;
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 2000000000ull) {
            printf("fa3 hang: mbarrier at smem 0x%x parity %u, block %d thread %d\n", smem_u32(bar), parity, blockIdx.x,
                   threadIdx.x);
            __trap();
        }
    }
}
#endif

// Waits until the phase with parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: producers start their "slot empty" waits that way.
// try_wait's suspend-time hint (in ns, an upper bound) lets the waiting thread sleep until the
// phase completes instead of returning after a few cycles: without it a warp waiting a whole tile
// (the scheduler thread) re-polled every ~16 cycles, taking issue slots from the consumer warps
// on its SM sub-partition.
// Built with -DFA3_HANG_CHECK (FA3_NVCC_FLAGS): a wait that lasts over 2 s prints the barrier's
// shared-memory address, the parity, the block and the thread, then traps, so a pipeline
// deadlock shows where it is instead of hanging the process.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef FA3_HANG_CHECK
    mbar_wait_checked<false>(bar, parity);
    return;
#endif
    constexpr uint32_t kSuspendNs = 10000000;
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity), "n"(kSuspendNs)
        : "memory");
}

// mbar_wait with acquire at cluster scope: for bytes that other CTAs of the cluster stored with
// st.async (whose completion releases at cluster scope). FA3_HANG_CHECK applies as to mbar_wait.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
#ifdef FA3_HANG_CHECK
    mbar_wait_checked<true>(bar, parity);
    return;
#endif
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// Whether the phase with parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

}  // namespace fa3
