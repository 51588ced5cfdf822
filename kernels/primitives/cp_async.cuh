// Ampere-style asynchronous copies (cp.async, sm_80+): each thread moves 16 bytes from global to
// shared memory without a register round trip, and many are in flight per thread at once. Where
// one TMA thread would issue a box per row (rows scattered over pages or cache slots), every
// thread of the CTA issues its own rows' copies in parallel.
#pragma once
#include <cstdint>

namespace fa3 {

// 16 bytes from `src` to the shared::cta address `dst`; with `valid` false nothing is read and
// the 16 bytes are zero-filled (src-size 0), so `src` may then be any address.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const uint32_t src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Closes the calling thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of the calling thread's groups are still in flight (the newest ones).
// Each thread waits for its own copies only: a barrier must follow before other threads read them.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace fa3
