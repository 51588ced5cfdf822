// Global-memory reductions and the acquire/release pair of a semaphore, for accumulating partial
// results of several CTAs into one f32 buffer (the backward's dQ).
#pragma once
#include <cstdint>

namespace fa3 {

// *addr += (a, b) as one 8-byte vector reduction in L2 (sm_90: red.global.add.v2.f32); addr is
// 8-byte aligned. No return value, so the issuing thread does not wait for it.
__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// Loads a semaphore with acquire semantics at GPU scope: the writes released before the value
// was published are visible to this thread afterwards.
__device__ __forceinline__ int ld_acquire(const int* addr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// Adds to a semaphore with release semantics at GPU scope: this thread's earlier writes (and those
// it observed through a barrier) are visible to whoever acquires the new value.
__device__ __forceinline__ void red_release_add(int* addr, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(addr), "r"(v) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (wgmma and
// TMA reading shared memory). Needed between st.shared and a wgmma that reads the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace fa3
