// The fp8 forward's pre-pass: V (tokens, kv heads, head_dim_v) in e4m3 -> V^T (sequences, kv heads,
// head_dim_v, keys_padded), so that the kernel's O += P·V reads V as a K-major operand (fp8 wgmma
// has no transposed shared-memory operand). Inside each group of 16 keys the keys are stored in
// the order P's registers hold them (mainloop.cuh, probs_to_a_operand): V^T column 16g + 4q + e
// holds key 16g + 2q + e for e < 2 and key 16g + 8 + 2q + e - 2 otherwise. Keys past a sequence's
// end are zeros (their P is 0, and 0 · NaN would not be). One CTA moves 64 keys of one (sequence,
// kv head): 16-byte loads of V rows into shared memory, 16-byte stores of V^T rows.
#pragma once
#include <cstdint>

#include "params.cuh"

namespace fa3 {

constexpr int kPrepassKeys = 64;
constexpr int kPrepassThreads = 256;

__device__ __forceinline__ void fp8_transpose_v(const Fp8PrepassParams& p) {
    // +16 bytes per row: the transposed reads of one warp then spread over the banks.
    __shared__ alignas(16) uint8_t tile[kPrepassKeys][256 + 16];
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
    const int chunks = p.head_dim_v / 16;  // 16-byte chunks per V row
    for (int i = threadIdx.x; i < kPrepassKeys * chunks; i += kPrepassThreads) {
        const int r = i / chunks, c = i % chunks, key = key0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (key < seqlen) val = *reinterpret_cast<const uint4*>(v + (int64_t)(tok0 + key) * p.v_token_stride + c * 16);
        *reinterpret_cast<uint4*>(&tile[r][c * 16]) = val;
    }
    __syncthreads();
    uint8_t* vt = p.vt + ((int64_t)seq * p.kv_heads + kv_head) * p.head_dim_v * p.keys_padded;
    constexpr int kGroups = kPrepassKeys / 16;
    for (int i = threadIdx.x; i < p.head_dim_v * kGroups; i += kPrepassThreads) {
        const int d = i / kGroups, g = i % kGroups;
        if (key0 + 16 * g >= p.keys_padded) continue;
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t word = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = 16 * g + (e < 2 ? 2 * q + e : 8 + 2 * q + e - 2);
                word |= (uint32_t)tile[key][d] << (8 * e);
            }
            w[q] = word;
        }
        *reinterpret_cast<uint4*>(vt + (int64_t)d * p.keys_padded + key0 + 16 * g) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

}  // namespace fa3
