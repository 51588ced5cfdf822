// Copies of 16 bytes from global to shared memory that skip the registers (cp.async, sm_80+):
// each thread's copies complete for that thread after a wait, so a block barrier (or a fence to
// the async proxy, for wgmma) must follow before other threads read them. The model's kernels
// stage weights and activations with them (kernels/model/fused.cu, linear_rows.cu).
#pragma once
#include <cstdint>

#include "mbarrier.cuh"  // smem_u32

namespace fa3 {

// 16 bytes from src to dst.
__device__ __forceinline__ void copy_16_to_shared(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

// 16 bytes to the shared-memory address `dst` (smem_u32), or zeros where `valid` is false (a
// source size of 0 reads nothing).
__device__ __forceinline__ void copy_16_or_zero(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void copy_16_or_zero(void* dst, const void* src, bool valid) {
    copy_16_or_zero(smem_u32(dst), src, valid);
}

// An L2 policy for data read once: evicted first, so that data that other CTAs read stays.
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// copy_16_or_zero under an L2 policy (evict_first_policy).
__device__ __forceinline__ void copy_16_or_zero_once(void* dst, const void* src, bool valid, uint64_t policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(valid ? 16 : 0), "l"(policy)
                 : "memory");
}

// Closes this thread's group of copies issued since the last commit.
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending> __device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Waits for all of this thread's copies, committed or not.
__device__ __forceinline__ void wait_all_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace fa3
