// Thread-block clusters (sm_90): the cluster-wide barrier and distributed shared memory, the
// shared memory of the other CTAs of the cluster addressed through `mapa`.
#pragma once
#include <cstdint>

namespace fa3 {

// The cluster barrier, split into its arrival and its wait: a waiting thread returns once every
// thread of the cluster has arrived or exited (an exited thread never holds it up). A thread
// waits for one phase before it arrives for the next. The arrival's release and the wait's
// acquire order the arriving threads' earlier memory accesses (shared memory included) before the
// waiting threads' later ones. The CTAs of a cluster run at the same time, so a phase's
// completion also says that every CTA has started (and none has exited) for the accesses that
// follow it.
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// An arrival that orders nothing: for a phase whose only message is "this CTA has started" (its
// wait then guards the first stores into another CTA's shared memory).
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}

// The shared::cluster address of the variable at `smem_addr` (a shared::cta address) in the
// cluster's CTA of rank `rank`.
// (Not volatile: an address computation, which the compiler may schedule ahead of its use.)
__device__ __forceinline__ uint32_t cluster_map(uint32_t smem_addr, uint32_t rank) {
    uint32_t remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr), "r"(rank));
    return remote;
}

// Loads from another CTA's shared memory (shared::cluster addresses).
__device__ __forceinline__ float ld_cluster_f32(uint32_t remote) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
__device__ __forceinline__ float2 ld_cluster_f32x2(uint32_t remote) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
    return v;
}

// Stores into another CTA's shared memory (shared::cluster addresses) that complete their bytes
// on an mbarrier of that CTA (`remote_bar`, a shared::cluster address): the receiver waits on its
// mbarrier for the bytes it expects (mbar_wait_cluster), with no cluster barrier between.
__device__ __forceinline__ void st_async_f32(uint32_t remote, float v, uint32_t remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(remote), "f"(v),
                 "r"(remote_bar)
                 : "memory");
}
__device__ __forceinline__ void st_async_f32x2(uint32_t remote, float a, float b, uint32_t remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(remote),
                 "f"(a), "f"(b), "r"(remote_bar)
                 : "memory");
}

}  // namespace fa3
