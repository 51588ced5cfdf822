// The backward's small kernels around the main one.
//   preprocess:  D = rowsum(dO ∘ O) in f32 and lse_log2 = LSE · log2(e) per (query, head), into the
//                padded per-head vectors the main kernel bulk-copies (pad rows: D = 0,
//                lse_log2 = +inf, so that their P = 0). (The host zeroes the f32 dQ accumulator.)
//   postprocess: dQ = scale · dq_accum, converted to the output dtype.
#pragma once
#include "../primitives/convert.cuh"
#include "params.cuh"

namespace fa3 {

constexpr int kPrepRows = kRowPad;  // query rows per preprocess CTA (8 warps, 16 rows each)

// Grid (ceil(max seqlen_q / 128), heads, batch), 256 threads. A row is read by a group of G
// lanes, 8 columns (16 bytes) each per load: G the largest power of two with 8 · G ≤ head_dim_v,
// at most 32 (d64 and d96: 8 lanes, four rows per warp at a time; d256: a whole warp), so that no
// lane idles on narrow heads.
template <int kDtype> __device__ void bwd_preprocess(const BwdParams& p) {
    const int head = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq = seq_info(p, b);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (blockIdx.x * kPrepRows >= seq.seqlen_q) return;  // the whole block lies past this sequence (varlen)
    const int group = p.head_dim_v >= 256 ? 32 : p.head_dim_v >= 128 ? 16 : p.head_dim_v >= 64 ? 8 : p.head_dim_v >= 32 ? 4 : p.head_dim_v >= 16 ? 2 : 1;
    const int rows_per_warp = 32 / group, g = lane / group, gl = lane % group;
    const int64_t lse_row0 = p.cu_q != nullptr ? (int64_t)head * p.lse_head_stride + seq.q_tok0
                                               : (int64_t)b * p.lse_batch_stride + (int64_t)head * p.lse_head_stride;
    for (int r0 = warp * rows_per_warp; r0 < kPrepRows; r0 += 8 * rows_per_warp) {
        const int r = r0 + g;
        const int i = blockIdx.x * kPrepRows + r;
        const int64_t slot = (int64_t)head * p.padded_rows + seq.pad0 + i;
        const bool live = i < seq.seqlen_q;
        float acc = 0.f;
        if (live) {
            const int64_t tok = seq.q_tok0 + i;
            const uint16_t* o = p.out + (tok * p.heads + head) * p.head_dim_v;
            const uint16_t* d_o = p.dout + (tok * p.heads + head) * p.head_dim_v;
            for (int c = gl * 8; c < p.head_dim_v; c += 8 * group) {
                // head_dim_v is a multiple of 8 and rows are contiguous: 16-byte aligned vectors.
                const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
                const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
                const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float2 a = unpack16x2<kDtype>(ow[k]), bb = unpack16x2<kDtype>(dw[k]);
                    acc += a.x * bb.x + a.y * bb.y;
                }
            }
        }
        // Within each group of lanes (every lane of the warp takes part).
        for (int off = group / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (gl == 0) {
            if (!live) {
                p.dpsum[slot] = 0.f;
                p.lse_log2[slot] = INFINITY;
            } else {
                p.dpsum[slot] = acc;
                const float lse = p.lse[lse_row0 + i];
                // A row that saw no key has LSE -inf and P = 0 everywhere: +inf gives exp2(s - inf) = 0.
                p.lse_log2[slot] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
            }
        }
    }
}

// Grid (ceil(max seqlen_q / 128), heads, batch), 256 threads; a thread per 8 columns of a row
// (row-major over the block's 128 rows, so a row's 16-byte dq stores are coalesced). In the
// accumulator's register-order layout the 8 values of columns 8c..8c+7 of a row are 8 contiguous
// floats (4 fragment threads x 1 pair): one full 32-byte sector per thread. (head_dim is a
// multiple of 8.)
template <int kDtype> __device__ void bwd_postprocess(const BwdParams& p) {
    const int head = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq = seq_info(p, b);
    const int chunks = p.head_dim / 8;
    const int items = min(kPrepRows, seq.seqlen_q - (int)blockIdx.x * kPrepRows) * chunks;  // rows past the end: none
    constexpr int kUnroll = 4;  // all loads of kUnroll items in flight before their stores
    for (int item0 = threadIdx.x; item0 < items; item0 += kUnroll * blockDim.x) {
        float4 v[kUnroll][2];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int item = item0 + u * blockDim.x;
            if (item < items) {
                const int i = blockIdx.x * kPrepRows + item / chunks, c = (item % chunks) * 8;
                const float4* src =
                    reinterpret_cast<const float4*>(p.dq_accum + dq_accum_offset(p, head, seq.pad0 + i, c));
                v[u][0] = src[0];
                v[u][1] = src[1];
            }
        }
        const float sc = p.scale;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int item = item0 + u * blockDim.x;
            if (item < items) {
                const int i = blockIdx.x * kPrepRows + item / chunks, c = (item % chunks) * 8;
                uint4 out;
                out.x = pack16x2<kDtype>(v[u][0].x * sc, v[u][0].y * sc);
                out.y = pack16x2<kDtype>(v[u][0].z * sc, v[u][0].w * sc);
                out.z = pack16x2<kDtype>(v[u][1].x * sc, v[u][1].y * sc);
                out.w = pack16x2<kDtype>(v[u][1].z * sc, v[u][1].w * sc);
                *reinterpret_cast<uint4*>(p.dq + ((seq.q_tok0 + i) * p.heads + head) * p.head_dim + c) = out;
            }
        }
    }
}

}  // namespace fa3
