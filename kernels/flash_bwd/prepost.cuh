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

// Grid (ceil(max seqlen_q / 128), heads, batch), 256 threads; a warp per row, 8 columns per lane.
template <int kDtype> __device__ void bwd_preprocess(const BwdParams& p) {
    const int head = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq = seq_info(p, b);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t lse_row0 = p.cu_q != nullptr ? (int64_t)head * p.lse_head_stride + seq.q_tok0
                                               : (int64_t)b * p.lse_batch_stride + (int64_t)head * p.lse_head_stride;
    for (int r = warp; r < kPrepRows; r += 8) {
        const int i = blockIdx.x * kPrepRows + r;
        if (i - r >= seq.seqlen_q) return;  // the whole block lies past this sequence (varlen)
        const int64_t slot = (int64_t)head * p.padded_rows + seq.pad0 + i;
        if (i >= seq.seqlen_q) {
            if (lane == 0) {
                p.dpsum[slot] = 0.f;
                p.lse_log2[slot] = INFINITY;
            }
            continue;
        }
        const int64_t tok = seq.q_tok0 + i;
        const uint16_t* o = p.out + (tok * p.heads + head) * p.head_dim_v;
        const uint16_t* d_o = p.dout + (tok * p.heads + head) * p.head_dim_v;
        float acc = 0.f;
        for (int c = lane * 8; c < p.head_dim_v; c += 256) {
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
#pragma unroll
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) {
            p.dpsum[slot] = acc;
            const float lse = p.lse[lse_row0 + i];
            // A row that saw no key has LSE -inf and P = 0 everywhere: +inf gives exp2(s - inf) = 0.
            p.lse_log2[slot] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
        }
    }
}

// Grid (ceil(max seqlen_q / 128), heads, batch), 256 threads: a warp per row, a column pair per lane.
template <int kDtype> __device__ void bwd_postprocess(const BwdParams& p) {
    const int head = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq = seq_info(p, b);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < kPrepRows; r += 8) {
        const int i = blockIdx.x * kPrepRows + r;
        if (i >= seq.seqlen_q) return;
        uint16_t* dq = p.dq + ((seq.q_tok0 + i) * p.heads + head) * p.head_dim;
        for (int c = 2 * lane; c < p.head_dim; c += 64) {
            const float2 a = *reinterpret_cast<const float2*>(p.dq_accum + dq_accum_offset(p, head, seq.pad0 + i, c));
            *reinterpret_cast<uint32_t*>(dq + c) = pack16x2<kDtype>(a.x * p.scale, a.y * p.scale);
        }
    }
}

}  // namespace fa3
