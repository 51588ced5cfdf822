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

// A value that is the same in every lane of the warp, moved to the uniform datapath: redux.sync's
// result lives in a uniform register, so ptxas keeps what derives from it (loop bounds,
// descriptors) there instead of in per-thread registers plus R2UR moves.
__device__ __forceinline__ uint32_t uniform(uint32_t warp_uniform_value) {
    return __reduce_max_sync(0xffffffffu, warp_uniform_value);
}

// 4-byte store to shared memory through its 32-bit shared-window address (a generic pointer
// into dynamic shared memory may compile to a generic ST).
__device__ __forceinline__ void st_shared_u32(uint32_t smem_addr, uint32_t value) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem_addr), "r"(value) : "memory");
}

// Four 8x8 matrices of 16-bit elements, each row 16 contiguous bytes whose shared-memory address
// lane 8m + r gives (matrix m, row r), loaded transposed: the thread's register m holds the
// elements (row 2·(lane % 4), column lane / 4) in its low half and (row 2·(lane % 4) + 1, same
// column) in its high half.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t smem_addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr)
                 : "memory");
}

// Four 8x8 matrices of 16-bit elements stored: the thread's register m is (matrix m, row lane / 4,
// bytes 4·(lane % 4)..+3); lane 8m + r gives the address of (matrix m, row r).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// exp2 on the SFU; ex2.approx(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace fa3
