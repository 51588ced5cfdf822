// Warpgroup matrix multiply (sm_90a): shared-memory matrix descriptors and the
// fence / commit / wait protocol around wgmma.mma_async.
#pragma once
#include <cstdint>

#include "wgmma_ops.cuh"

namespace fa3 {

// A shared-memory matrix descriptor for tiles stored in the 128-byte swizzle layout that TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 bytes), 8 rows forming
// a 1024-byte swizzle atom. Field layout (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  base offset (0: every atom we point into is 1024-byte aligned)
//   bits 62-63  swizzle mode (1 = 128B)
//
// K-major operand (the reduction dimension is contiguous: Q and K): SBO is the step between
// groups of 8 rows (1024 B); LBO is unused when an instruction's 16-element K slice stays inside
// one 128-byte row, which is always true here, so it is set to 1 by convention.
// MN-major operand (V read as B = V with N = head dim contiguous): LBO is the step between
// 64-column blocks of the N dimension, SBO the step between groups of 8 K rows (1024 B).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    uint64_t desc = 0;
    desc |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
    desc |= (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16;
    desc |= (uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32;
    desc |= (uint64_t)1 << 62;
    return desc;
}

// The same descriptor in two parts, for loops that step through a tile: the low word (start
// address and LBO) is computed once per buffer and advanced by adding byte_offset >> 4 (no carry
// leaves the 14-bit address field: shared memory is < 256 KiB); the high word (SBO, swizzle) is
// a constant. Keeping the low word in a uniform register (see uniform()) lets the wgmma loop
// issue back to back instead of rebuilding every descriptor with integer ops.
__device__ __forceinline__ uint32_t smem_desc_lo(uint32_t smem_addr, uint32_t lbo_bytes) {
    return ((smem_addr & 0x3FFFF) >> 4) | (((lbo_bytes >> 4) & 0x3FFF) << 16);
}
// The descriptor's swizzle-mode field (bits 62-63) for a swizzle span of kSwizzleBytes: 1 = 128B,
// 2 = 64B. A 64B-swizzled tile has rows of 32 16-bit elements and 512-byte atoms of 8 rows (TMA's
// CU_TENSOR_MAP_SWIZZLE_64B); the head dim 96 kernels use it, as 96 is no multiple of 64.
template <int kSwizzleBytes> __host__ __device__ constexpr uint32_t swizzle_mode() {
    static_assert(kSwizzleBytes == 128 || kSwizzleBytes == 64, "128B or 64B swizzle");
    return kSwizzleBytes == 128 ? 1u : 2u;
}

template <uint32_t kSboBytes, int kSwizzleBytes = 128>
__device__ __forceinline__ uint64_t smem_desc_at(uint32_t lo, uint32_t byte_offset) {
    // bits 32-45 SBO, 62-63 swizzle mode
    constexpr uint32_t hi = ((kSboBytes >> 4) & 0x3FFF) | (swizzle_mode<kSwizzleBytes>() << 30);
    return ((uint64_t)hi << 32) | (lo + (byte_offset >> 4));
}

// Orders this warpgroup's register and shared-memory accesses before the wgmmas that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Tells the compiler the accumulators may change here, so it neither reads them before the wait
// nor moves their uses across the asynchronous wgmma.
template <int R> __device__ __forceinline__ void fence_operand(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R> __device__ __forceinline__ void fence_operand(uint32_t (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

}  // namespace fa3
