// Conversions between f32 and pairs of 16-bit values (bf16 or f16) packed in one 32-bit register,
// and from f32 to four e4m3 values in one register (the fp8 kernels' P).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "wgmma_ops.cuh"

namespace fa3 {

// The lower column goes in the lower 16 bits: the layout of wgmma's register A operand and of a
// little-endian 4-byte store.
template <int kDtype> __device__ __forceinline__ uint32_t pack16x2(float lo, float hi) {
    if constexpr (kDtype == DT_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

// The two values of a packed pair as f32 (lower 16 bits first).
template <int kDtype> __device__ __forceinline__ float2 unpack16x2(uint32_t x) {
    if constexpr (kDtype == DT_BF16) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
    } else {
        return __half22float2(*reinterpret_cast<__half2*>(&x));
    }
}

// The eight values of a 16-byte segment (four packed pairs, lowest first) as f32.
template <int kDtype> __device__ __forceinline__ void unpack16x8(const uint4 x, float (&f)[8]) {
    const uint32_t pairs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = unpack16x2<kDtype>(pairs[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

// Four f32 values as e4m3 in one register, the first in the lowest byte (round to nearest,
// saturating to ±448: never NaN from a finite input). cvt puts its first source in the upper byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

}  // namespace fa3
