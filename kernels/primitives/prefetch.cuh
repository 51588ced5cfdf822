// Cache prefetches: start a global-memory line's trip into a cache without a register waiting for
// it (the paged K/V loads prefetch the next key block's page-table entries this way).
#pragma once
#include <cstdint>

namespace fa3 {

// The line holding *addr into L1 (and L2 on the way).
__device__ __forceinline__ void prefetch_l1(const void* addr) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(reinterpret_cast<uint64_t>(addr)));
}

}  // namespace fa3
