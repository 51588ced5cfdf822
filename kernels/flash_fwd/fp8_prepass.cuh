// The fp8 forward's pre-pass: V (tokens, kv heads, head_dim_v) in e4m3 -> V^T (sequences, kv heads,
// head_dim_v, keys_padded), so that the kernel's O += P·V reads V as a K-major operand (fp8 wgmma
// has no transposed shared-memory operand). Inside each group of 16 keys the keys are stored in
// the order P's registers hold them (mainloop.cuh, probs_to_a_operand): V^T column 16g + 4q + e
// holds key 16g + 2q + e for e < 2 and key 16g + 8 + 2q + e - 2 otherwise. Keys past a sequence's
// end are zeros (their P is 0, and 0 · NaN would not be).
//
// One CTA moves kPrepassKeys keys of one (sequence, kv head), one thread a 16 × 16-byte square (16
// keys × 16 head-dim bytes) through registers: 16 loads of 16 bytes, each byte transpose of 4
// words in 8 PRMTs, 16 stores of 16 bytes. A warp's loads cover whole 128-byte stretches of V
// rows and its stores 64-byte stretches of V^T rows, and every load of a thread is in flight at
// once: the pass runs at HBM speed, where a shared-memory tile with byte reads took ~3.5x the copy
// time (docs/kernels/forward-fp8.md, "The pre-pass").
#pragma once
#include <cstdint>

#include "params.cuh"

namespace fa3 {

constexpr int kPrepassKeys = 256;
constexpr int kPrepassThreads = 128;

// (a0 b0 c0 d0), (a1 b1 c1 d1), (a2 ...), (a3 ...) from words a, b, c, d: a 4 × 4 byte transpose.
__device__ __forceinline__ void transpose_bytes_4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&t)[4]) {
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    t[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
    t[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    t[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    t[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

__device__ __forceinline__ void fp8_transpose_v(const Fp8PrepassParams& p) {
    const int key0 = blockIdx.x * kPrepassKeys, kv_head = blockIdx.y, seq = blockIdx.z;
    int tok0, seqlen;
    int64_t base;
    if (p.cu_k != nullptr) {
        tok0 = (int)p.cu_k[seq];
        seqlen = (int)p.cu_k[seq + 1] - tok0;
        base = 0;
    } else {
        tok0 = 0;
        seqlen = p.seqlen_k;
        base = (int64_t)seq * p.v_batch_stride;
    }
    const uint8_t* v = p.v + base + (int64_t)kv_head * p.v_head_stride;
    uint8_t* vt = p.vt + ((int64_t)seq * p.kv_heads + kv_head) * p.head_dim_v * p.keys_padded;
    const int squares_per_group = p.head_dim_v / 16;  // 16-byte column blocks of a V row
    constexpr int kGroups = kPrepassKeys / 16;
    // Consecutive threads take consecutive column blocks of one 16-key group: loads of whole V rows.
    for (int i = threadIdx.x; i < kGroups * squares_per_group; i += kPrepassThreads) {
        const int g = i / squares_per_group, col = 16 * (i % squares_per_group);
        const int key_g = key0 + 16 * g;
        if (key_g >= p.keys_padded) break;  // i only grows, and so does g
        uint4 row[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            row[k] = make_uint4(0, 0, 0, 0);
            if (key_g + k < seqlen)
                row[k] = *reinterpret_cast<const uint4*>(v + (int64_t)(tok0 + key_g + k) * p.v_token_stride + col);
        }
        // Word w of a row holds head-dim bytes col + 4w .. col + 4w + 3. V^T row col + 4w + b, word q:
        // byte b of keys 2q, 2q + 1, 8 + 2q, 9 + 2q (P's order above).
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            uint32_t out[4][4];  // [b][q]
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                auto word = [&](int k) {
                    const uint4& r = row[k];
                    return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
                };
                uint32_t t[4];
                transpose_bytes_4x4(word(2 * q), word(2 * q + 1), word(8 + 2 * q), word(9 + 2 * q), t);
#pragma unroll
                for (int b = 0; b < 4; ++b) out[b][q] = t[b];
            }
#pragma unroll
            for (int b = 0; b < 4; ++b)
                *reinterpret_cast<uint4*>(vt + (int64_t)(col + 4 * w + b) * p.keys_padded + key_g) =
                    make_uint4(out[b][0], out[b][1], out[b][2], out[b][3]);
        }
    }
}

}  // namespace fa3
