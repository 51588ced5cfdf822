// Writes the normalised O tile and the LSE of one consumer warpgroup straight from registers.
// Each thread stores pairs of 16-bit values (4 bytes) of its two rows; rows past the sequence end
// and columns past head_dim_v (the padding of a rounded-up head dim) are skipped, which handles
// partial tiles and varlen without a bounds-checked TMA store. (Stage 2: stage through shared
// memory and TMA-store full tiles.)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../primitives/wgmma.cuh"
#include "params.cuh"
#include "scheduler.cuh"

namespace fa3 {

template <int kDtype> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    // The lower column goes in the lower 16 bits: the layout of wgmma's register A operand and of
    // a little-endian store.
    if constexpr (kDtype == DT_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

template <class Tr>
__device__ __forceinline__ void epilogue(const FwdParams& p, const TileInfo& t, const float (&o)[Tr::kORegs],
                                         const float (&inv_sum)[2], const float (&lse)[2], int row_in_tile,
                                         int quad_lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = t.m_block * Tr::kBlockM + row_in_tile + 8 * h;
        if (i >= t.seqlen_q) continue;
        uint16_t* out = reinterpret_cast<uint16_t*>(p.out) + (t.out_tok0 + i) * p.out_row_stride +
                        (int64_t)t.head * p.head_dim_v;
#pragma unroll
        for (int j = 0; j < Tr::kORegs / 4; ++j) {
            const int col = 8 * j + 2 * quad_lane;
            if (col < p.head_dim_v) {
                *reinterpret_cast<uint32_t*>(out + col) =
                    pack2<Tr::kDtype>(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
            }
        }
        if (quad_lane == 0) p.lse[t.lse_row0 + i] = lse[h];
    }
}

}  // namespace fa3
