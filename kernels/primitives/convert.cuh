// Conversions between f32 and pairs of 16-bit values (bf16 or f16) packed in one 32-bit register.
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

}  // namespace fa3
