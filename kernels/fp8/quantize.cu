// FP8 (e4m3) quantization of attention inputs on the GPU: the device side of flash_attn3::fp8
// (crates/flash-attn/src/fp8.rs holds the same math on the host, and the results are bit for bit
// the same: every step below is the host's f32 operation on the same operands).
//
// x is (batch, seqlen, heads, head_dim), contiguous, f32/f16/bf16; varlen input is one batch of
// all its tokens. A CTA takes `chunk_rows` sequence positions of one (batch, head). A row
// (head_dim values) lives in the registers of head_dim / 8 consecutive lanes, 8 values each (one
// 16-byte load for 16-bit input), so a warp holds 32 / (head_dim / 8) rows at once. The optional
// rotation runs there too: signs, then the Walsh-Hadamard butterflies (in registers for pairs 1,
// 2 and 4 apart, through lane shuffles beyond), then 1/sqrt(block).
//
// Three modes, chosen by the host per granularity:
//  - kOwnGroup (per block, and per head when the sequence fits one chunk of 64 positions): the
//    CTA's rows are exactly one scale group. Rotated groups of up to 32 KiB of f32 keep their rows
//    in shared memory between the amax and the store ("staged", the rotation runs once); the
//    others read them again, from L2 (a group is at most 128 rows x 256 dims), and rotate them
//    again if asked. HBM sees one pass either way. (Keeping the rows in registers instead, 16
//    warps x 4 rows, measured slower: 85 registers a thread left one CTA per SM; forward-fp8.md.)
//  - kAmaxOnly then kGiven (per tensor, per head over longer sequences): a group spans the whole
//    sequence, so a first launch atomically maxes every CTA's amax into its group and a second
//    one quantizes.
//
// Non-finite input cannot raise an error here without a host sync: its group's amax becomes NaN
// (bits 0x7fffffff, above every finite float's as an integer), so its descale is NaN and the
// attention's output rows that use it are NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../primitives/convert.cuh"

namespace fa3 {

constexpr int kQuantizeWarps = 8;
constexpr int kQuantizeMaxDim = 256;
constexpr int kPerLane = 8;  // values of a row per lane
constexpr uint32_t kNonFiniteAmax = 0x7fffffffu;  // a NaN that atomicMax keeps over any float

enum QuantizeMode : int { kOwnGroup = 0, kAmaxOnly = 1, kGiven = 2 };

// Mirror: crates/flash-attn/src/cuda/quantize.rs, QuantizeParams.
struct Fp8QuantizeParams {
    const void* x;
    uint8_t* out;       // e4m3, x's shape
    uint32_t* amax;     // f32 bits per group: maxed by kAmaxOnly, read by kGiven; unused by kOwnGroup
    float* descale;     // (batch, heads, blocks)
    uint64_t signs[4];  // bit i set: dim i changes sign before the transform
    int seqlen, heads, head_dim;
    int chunk_rows;     // sequence positions per CTA
    int group_rows;     // sequence positions per scale (seqlen for per head and per tensor)
    int blocks;         // scales per (batch, head)
    int hadamard;       // transform block (the largest power of two dividing head_dim); 0: no rotation
    int whole_tensor;   // one amax (amax[0]) for every group
    int mode;
    int staged;         // kOwnGroup: the rotated rows wait in dynamic shared memory (chunk_rows x
                        // head_dim f32) between the amax and the store instead of being read again
};

__device__ __forceinline__ void widen8(const float* src, float (&v)[kPerLane]) {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <class T> __device__ __forceinline__ void widen8(const T* src, float (&v)[kPerLane]) {
    constexpr int kDtype = std::is_same_v<T, __half> ? DT_F16 : DT_BF16;
    unpack16x8<kDtype>(*reinterpret_cast<const uint4*>(src), v);
}

// The lanes of one warp that hold rows: `rows` rows of `lanes` lanes each.
struct RowLanes {
    int lanes, rows;
    int row, part;  // this lane's row within the warp's group (rows: none) and its 8-value part
    __device__ RowLanes(int head_dim, int lane) {
        lanes = head_dim / kPerLane;
        rows = 32 / lanes;
        row = lane / lanes;
        part = lane % lanes;
    }
};

// This lane's 8 values of row `r` (in (batch, seqlen, heads) order), rotated if asked. Lanes past
// the warp's last row (row == rows) load nothing and return zeros.
template <class T>
__device__ __forceinline__ void load_part(const Fp8QuantizeParams& p, const RowLanes& rl, int64_t r, bool active,
                                          float (&v)[kPerLane]) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = 0.f;
    if (active) widen8(static_cast<const T*>(p.x) + r * p.head_dim + rl.part * kPerLane, v);
    if (p.hadamard == 0) return;  // uniform across the CTA
    // Selects rather than p.signs[i / 64]: a run-time index into the parameters would copy them
    // to local memory. Dims part*8 .. part*8+7 share one word.
    const int w = rl.part / 8;
    const uint64_t word = w == 0 ? p.signs[0] : w == 1 ? p.signs[1] : w == 2 ? p.signs[2] : p.signs[3];
    const uint32_t bits = (uint32_t)(word >> ((rl.part % 8) * kPerLane)) & 0xffu;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
        if ((bits >> j) & 1) v[j] = -v[j];
    // Sylvester-order butterflies, as fp8.rs's fwht: the pair (i, i + h) becomes (x_i + x_{i+h},
    // x_i - x_{i+h}). h < 8 pairs values of one lane; h >= 8 pairs this lane with lane ^ (h / 8),
    // always inside one row, since the row's lanes start at a multiple of head_dim / 8, which
    // hadamard / 8 divides.
#pragma unroll
    for (int h = 1; h < kPerLane; h *= 2) {
        if (h >= p.hadamard) break;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            if (j & h) continue;
            const float a = v[j], b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
    }
    for (int h = kPerLane; h < p.hadamard; h *= 2) {
        const int mate = h / kPerLane;
        const bool upper = rl.part & mate;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const float theirs = __shfl_xor_sync(0xffffffffu, v[j], mate);
            v[j] = upper ? theirs - v[j] : v[j] + theirs;
        }
    }
    const float inv_norm = __frcp_rn(__fsqrt_rn((float)p.hadamard));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = __fmul_rn(v[j], inv_norm);
}

// amax / 448 as the host computes it: a subnormal or zero scale becomes 1 (the group is all
// zeros for attention's purposes and stays exactly 0); a non-finite group keeps its NaN.
__device__ __forceinline__ float descale_of(uint32_t amax_bits) {
    const float amax = __uint_as_float(amax_bits);
    if (amax_bits == kNonFiniteAmax) return amax;
    const float d = __fdiv_rn(amax, 448.f);
    return (d >= 1.17549435e-38f) ? d : 1.f;  // FLT_MIN: the smallest normal
}

// This lane's 8 values divided by the descale (times its reciprocal), stored as e4m3.
__device__ __forceinline__ void store_part(const Fp8QuantizeParams& p, const RowLanes& rl, int64_t r,
                                           const float (&v)[kPerLane], float inv) {
    // satfinite: what rounds past 448 becomes 448, as the host's clamp makes it.
    const uint2 packed = make_uint2(
        pack_e4m3x4(__fmul_rn(v[0], inv), __fmul_rn(v[1], inv), __fmul_rn(v[2], inv), __fmul_rn(v[3], inv)),
        pack_e4m3x4(__fmul_rn(v[4], inv), __fmul_rn(v[5], inv), __fmul_rn(v[6], inv), __fmul_rn(v[7], inv)));
    *reinterpret_cast<uint2*>(p.out + r * p.head_dim + rl.part * kPerLane) = packed;
}

__device__ __forceinline__ uint32_t fold_amax(uint32_t m, const float (&v)[kPerLane]) {
    // |v| >= 0, so the f32 bit patterns order as the values do, and NaN (kNonFiniteAmax) above
    // them all.
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const float a = fabsf(v[j]);
        m = max(m, isfinite(a) ? __float_as_uint(a) : kNonFiniteAmax);
    }
    return m;
}

template <class T>
__device__ __forceinline__ void quantize(const Fp8QuantizeParams& p) {
    __shared__ uint32_t warp_amax[kQuantizeWarps];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int pos0 = blockIdx.x * p.chunk_rows;
    const int pos_end = min(pos0 + p.chunk_rows, p.seqlen);
    const RowLanes rl(p.head_dim, lane);
    // A warp's iteration covers positions base .. base + rows - 1; the bounds are warp-uniform,
    // so the shuffles always see every lane.
    const int step = kQuantizeWarps * rl.rows;
    const int base0 = pos0 + warp * rl.rows;
    const int64_t row0 = ((int64_t)batch * p.seqlen) * p.heads + head;  // row of position 0
    const int entry = (batch * p.heads + head) * p.blocks + pos0 / p.group_rows;
    auto row_of = [&](int pos) { return row0 + (int64_t)pos * p.heads; };
    auto active = [&](int pos) { return rl.row < rl.rows && pos < pos_end; };
    extern __shared__ float4 staged_rows[];  // (chunk_rows, head_dim) f32 when p.staged
    auto stage_at = [&](int pos) { return staged_rows + ((pos - pos0) * p.head_dim + rl.part * kPerLane) / 4; };
    float v[kPerLane];

    uint32_t amax;
    if (p.mode == kGiven) {
        amax = p.amax[p.whole_tensor ? 0 : entry];
    } else {
        uint32_t m = 0;
        for (int base = base0; base < pos_end; base += step) {
            const int pos = base + rl.row;
            load_part<T>(p, rl, row_of(pos), active(pos), v);
            m = fold_amax(m, v);
            if (p.staged && active(pos)) {
                stage_at(pos)[0] = make_float4(v[0], v[1], v[2], v[3]);
                stage_at(pos)[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
        }
        m = __reduce_max_sync(0xffffffffu, m);
        if (lane == 0) warp_amax[warp] = m;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < kQuantizeWarps; ++w) m = max(m, warp_amax[w]);
        if (p.mode == kAmaxOnly) {
            if (threadIdx.x == 0) atomicMax(&p.amax[p.whole_tensor ? 0 : entry], m);
            return;
        }
        amax = m;
    }
    const float descale = descale_of(amax);
    const float inv = __frcp_rn(descale);
    if (threadIdx.x == 0 && pos0 % p.group_rows == 0) p.descale[entry] = descale;
    // Unstaged, kOwnGroup reads its rows a second time here, from L2, and rotates them again.
    // Staged rows were written by this same lane (the same position and part) before the
    // __syncthreads above.
    for (int base = base0; base < pos_end; base += step) {
        const int pos = base + rl.row;
        if (p.staged) {
            if (!active(pos)) continue;
            const float4 a = stage_at(pos)[0], b = stage_at(pos)[1];
            const float w[kPerLane] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            store_part(p, rl, row_of(pos), w, inv);
        } else {
            load_part<T>(p, rl, row_of(pos), active(pos), v);
            if (active(pos)) store_part(p, rl, row_of(pos), v, inv);
        }
    }
}

}  // namespace fa3

#define FA3_QUANTIZE(name, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(fa3::kQuantizeWarps * 32)                      \
        name(const fa3::Fp8QuantizeParams p) {                                                   \
        fa3::quantize<T>(p);                                                                     \
    }

FA3_QUANTIZE(fp8_quantize_f32, float)
FA3_QUANTIZE(fp8_quantize_f16, __half)
FA3_QUANTIZE(fp8_quantize_bf16, __nv_bfloat16)
