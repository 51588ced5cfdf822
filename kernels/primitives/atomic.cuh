// Global-memory reductions and the acquire/release pair of a semaphore, for accumulating partial
// results of several CTAs into one f32 buffer (the backward's dQ).
#pragma once
#include <cstdint>

#include "tma.cuh"  // bulk groups (commit / wait) and the async-proxy fence

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

// Bulk reduction shared -> global: adds `bytes` (a multiple of 16, both addresses 16-byte aligned)
// of f32 values from shared memory to global memory element-wise, in L2, issued by one thread to
// the bulk copy engine (far fewer L2 transactions than per-element red instructions). Completion
// is tracked per thread through bulk async-groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gdst, const float* ssrc, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gdst),
                 "r"((uint32_t)__cvta_generic_to_shared(ssrc)), "r"(bytes)
                 : "memory");
}

}  // namespace fa3
