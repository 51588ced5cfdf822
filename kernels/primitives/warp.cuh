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
// named_barrier_sync that also answers whether any of the `count` threads passed `pred` true
// (bar.red.or): one thread's value reaches all of them.
__device__ __forceinline__ bool named_barrier_sync_or(int id, int count, bool pred) {
    uint32_t any;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
        : "=r"(any)
        : "r"((uint32_t)pred), "r"(id), "r"(count)
        : "memory");
    return any != 0;
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

// 16 zero bytes to shared memory (16-byte aligned).
__device__ __forceinline__ void st_shared_zero_16(uint32_t smem_addr) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(smem_addr), "r"(0u) : "memory");
}

// 4-byte load from shared memory through its 32-bit shared-window address.
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t smem_addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr) : "memory");
    return v;
}

// 16 and 8 bytes (aligned) from shared memory through its 32-bit shared-window address.
__device__ __forceinline__ void ld_shared_v4(uint32_t smem_addr, uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(smem_addr)
                 : "memory");
}
__device__ __forceinline__ void ld_shared_v2(uint32_t smem_addr, uint32_t& a, uint32_t& b) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(a), "=r"(b) : "r"(smem_addr) : "memory");
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

// Two 8x8 matrices of 16-bit elements stored, as stmatrix_x4 below: register m is (matrix m, row
// lane / 4, bytes 4·(lane % 4)..+3); lanes 0-15 give the rows' addresses (lane 8m + r: matrix m,
// row r).
__device__ __forceinline__ void stmatrix_x2(uint32_t smem_addr, const uint32_t (&r)[2]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(smem_addr), "r"(r[0]), "r"(r[1])
                 : "memory");
}

// Four 8x8 matrices of 16-bit elements stored: the thread's register m is (matrix m, row lane / 4,
// bytes 4·(lane % 4)..+3); lane 8m + r gives the address of (matrix m, row r).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// A 4 x 4 transpose of 32-bit words across the four lanes of each quad (lanes 4k..4k+3): lane q's
// a[k] moves to lane k's a[q]. Two exchanges of two words each (lanes 2 apart, then 1 apart); every
// lane of the warp must take part. The two steps have one shape but stay written out: as one
// template, ptxas rescheduled 32 forward kernels and bf16 d128 ran 1-2% slower (forward-sm90.md,
// version 32b).
__device__ __forceinline__ void quad_transpose_u32(uint32_t (&a)[4], int quad_lane) {
    // Lanes 2 apart swap the off-diagonal 2 x 2 blocks: the lower lane sends words 2-3, the upper 0-1.
    const bool upper2 = (quad_lane & 2) != 0;
    uint32_t s0 = upper2 ? a[0] : a[2], s1 = upper2 ? a[1] : a[3];
    s0 = __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 = __shfl_xor_sync(0xffffffffu, s1, 2);
    if (upper2) {
        a[0] = s0;
        a[1] = s1;
    } else {
        a[2] = s0;
        a[3] = s1;
    }
    // Lanes 1 apart transpose each 2 x 2 block: the even lane sends words 1 and 3, the odd 0 and 2.
    const bool odd = (quad_lane & 1) != 0;
    uint32_t t0 = odd ? a[0] : a[1], t1 = odd ? a[2] : a[3];
    t0 = __shfl_xor_sync(0xffffffffu, t0, 1);
    t1 = __shfl_xor_sync(0xffffffffu, t1, 1);
    if (odd) {
        a[0] = t0;
        a[2] = t1;
    } else {
        a[1] = t0;
        a[3] = t1;
    }
}

// exp2 on the SFU; ex2.approx(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// exp2 on the FMA and integer pipes instead of the SFU (FA4's trick, here for Hopper): the SFU
// does 16 exp2 per SM per clock, as many as the fp8 tensor cores need per clock at head dim 128
// (bf16 at 64), so the softmax takes a share of its exponentials off it (softmax.cuh).
// 2^x = 2^j · 2^f with j = round(x) and f = x − j in [−0.5, 0.5]: 1.5·2^23 added in round-to-
// nearest leaves j in the sum's low mantissa bits; 2^f is a degree-3 minimax polynomial (relative
// error 7.5e-5, below bf16's and e4m3's rounding of P); 2^j is built as a float's exponent.
// x below −125 gives 2^−125 (the SFU's −inf gives 0: a masked score adds ~1e-38, nothing); a NaN
// stays NaN (max.NaN, then the multiply).
__device__ __forceinline__ float exp2_fma(float x) {
    float xc;
    asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-125.f));
    const float t = __fadd_rn(xc, 12582912.f);  // 1.5 · 2^23
    const float j = __fsub_rn(t, 12582912.f);
    const float f = __fsub_rn(xc, j);
    const float p = fmaf(fmaf(fmaf(5.517166853e-02f, f, 2.426111251e-01f), f, 6.932609677e-01f), f, 9.999280572e-01f);
    const float two_j = __uint_as_float((__float_as_uint(t) << 23) + 0x3f800000u);
    return p * two_j;
}

}  // namespace fa3
