// The tensor memory accelerator: bulk tensor copies global <-> shared, described by a CUtensorMap
// encoded on the host (cuTensorMapEncodeTiled) and passed in the __grid_constant__ kernel params.
// Loads complete on an mbarrier; stores are tracked per thread in bulk groups.
#pragma once
#include <cstdint>

#include "mbarrier.cuh"

namespace fa3 {

// The 128-byte opaque CUtensorMap, without including cuda.h.
struct alignas(64) TmaDesc {
    uint64_t opaque[16];
};

// Pulls the descriptor into the constant cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

// Loads the box at coordinates (c0 innermost .. c3) into shared memory at `dst`; completion is
// signalled to `bar` as transaction bytes. Out-of-bounds elements are filled with zeros.
__device__ __forceinline__ void tma_load_4d(const TmaDesc* desc, void* dst, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
        : "memory");
}

// The same for a 5-D map (pack-GQA's Q: head_dim, q head in group, token, kv head, batch).
__device__ __forceinline__ void tma_load_5d(const TmaDesc* desc, void* dst, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_u32(bar))
        : "memory");
}

// Stores the box at coordinates (c0 .. c3) from shared memory at `src`; elements outside the
// tensor are not written. Shared-memory writes of other threads must be fenced into the async
// proxy first (fence_proxy_async_smem + a barrier).
__device__ __forceinline__ void tma_store_4d(const TmaDesc* desc, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
            reinterpret_cast<uint64_t>(desc)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src))
        : "memory");
}

// Closes the issuing thread's pending bulk stores into one group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's store groups still read their shared-memory source.
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's bulk groups are still incomplete (their global writes or
// reductions not yet performed).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (TMA, and
// wgmma reading shared memory): needed between st.shared and a TMA store or wgmma of the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Makes this thread's generic-proxy global writes visible to the async proxy (TMA) and orders its
// async-proxy reads after what it acquired.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Copies `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory with the bulk copy engine; completion is signalled to `bar` as transaction bytes.
// The backward streams its per-row f32 vectors (log2-LSE, rowsum(dO∘O)) this way.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}

}  // namespace fa3
