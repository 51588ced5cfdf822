// What the epilogues share: the named barrier ids and the output's 16-bit pairs.
#pragma once

#include "../primitives/convert.cuh"
#include "params.cuh"
#include "traits.cuh"

namespace fa3 {

// Named barriers: 1..3 order the consumer warpgroups' GEMMs (mainloop.cuh), 4..6 are each
// consumer warpgroup's own epilogue barrier, 7 joins the fp8 V^T writer's two warps
// (fp8_vt_fill.cuh).
constexpr int kPingpongBarrier0 = 1;
constexpr int kEpilogueBarrier0 = 4;
constexpr int kVtFillBarrier = 7;
__device__ __forceinline__ int epilogue_barrier(int wg) { return kEpilogueBarrier0 + wg; }

// A pair of output values as 16 bits each: the kernel's dtype, or for fp8 kernels bf16 or f16 as
// the call asks (a uniform select in the epilogue).
template <class Tr> __device__ __forceinline__ uint32_t pack_out(bool out_f16, float lo, float hi) {
    if constexpr (Tr::kFp8) {
        return out_f16 ? pack16x2<DT_F16>(lo, hi) : pack16x2<DT_BF16>(lo, hi);
    } else {
        return pack16x2<Tr::kDtype>(lo, hi);
    }
}
template <class Tr> __device__ __forceinline__ uint32_t pack_out(const FwdParams& p, float lo, float hi) {
    return pack_out<Tr>(p.out_f16 != 0, lo, hi);
}

}  // namespace fa3
