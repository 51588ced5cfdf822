// Warp-specialisation primitives: register reallocation between warpgroups, named barriers.
#pragma once
#include <cstdint>

namespace fa3 {

// setmaxnreg moves registers between warpgroups of a CTA: the producer gives its registers back,
// the consumers (which hold the accumulators) take them. Needs a register cap at entry
// (__launch_bounds__(threads, 1)) and must be executed by every thread of the warpgroup.
template <int N> __device__ __forceinline__ void warpgroup_reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void warpgroup_reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// exp2 on the SFU; ex2.approx(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace fa3
