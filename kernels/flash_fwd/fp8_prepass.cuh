// The fp8 forward's pre-pass: V (tokens, kv heads, head_dim_v) in e4m3 -> V^T (sequences, kv heads,
// head_dim_v, keys_padded), so that the kernel's O += P·V reads V as a K-major operand (fp8 wgmma
// has no transposed shared-memory operand). Inside each group of 16 keys the keys are stored in
// the order P's registers hold them (mainloop.cuh, probs_to_a_operand): V^T column 16g + 4q + e
// holds key 16g + 2q + e for e < 2 and key 16g + 8 + 2q + e - 2 otherwise. Keys past a sequence's
// end are zeros (their P is 0, and 0 · NaN would not be).
//
// One CTA moves prepass_keys(d) keys of one (sequence, kv head): 16 KiB or less of V rows land in
// shared memory by cp.async (no registers held while they fly, so 13 CTAs an SM keep most of V
// in flight at once; zeros past the sequence's end; V is read once, so it goes evict-first and
// leaves L2 to V^T and K), then each thread takes (16-key group, 4-byte column) items: 16 4-byte
// shared-memory reads, four 4 × 4 byte transposes of 8 PRMTs, 4 stores of 16 bytes. Consecutive
// lanes take consecutive groups of one column, so a warp's stores cover whole 128-byte stretches
// of V^T rows; a row's 16-byte chunks sit rotated by its group index, so those lanes' reads fall
// in different banks. (Version 2, a 16 × 16-byte square per thread through registers, held 64
// registers of data while its loads flew: 4 CTAs an SM and 18 µs for 32 MiB of V on an H200;
// docs/kernels/forward-fp8.md, "The pre-pass".)
#pragma once
#include <cstdint>

#include "../primitives/cp_async.cuh"
#include "params.cuh"

namespace fa3 {

constexpr int kPrepassThreads = 128;
// Keys per CTA: 16 KiB of V or less (crates/flash-attn/src/cuda/fp8.rs, prepass_keys, keeps the
// same rule for the grid).
__host__ __device__ constexpr int prepass_keys(int head_dim) { return head_dim > 128 ? 64 : 128; }
constexpr int kPrepassTileBytes = 128 * 128;
static_assert(prepass_keys(128) * 128 <= kPrepassTileBytes && prepass_keys(256) * 256 <= kPrepassTileBytes,
              "the V rows of a CTA fit the tile at every fp8 head dim (multiples of 16 up to 256)");

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
    __shared__ alignas(16) uint8_t tile[kPrepassTileBytes];
    const int keys = prepass_keys(p.head_dim_v);
    const int key0 = blockIdx.x * keys, kv_head = blockIdx.y, seq = blockIdx.z;
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
    const int d = p.head_dim_v, chunks = d / 16;  // 16-byte chunks per V row
    // Chunk c of key r sits at chunk (c + r / 16) % chunks of the tile's row r.
    auto at = [&](int r, int c) { return r * d + ((c + r / 16) % chunks) * 16; };
    const uint64_t once = evict_first_policy();
    for (int i = threadIdx.x; i < keys * chunks; i += kPrepassThreads) {
        const int r = i / chunks, c = i % chunks, key = key0 + r;
        const bool valid = key < seqlen;
        copy_16_or_zero_once(&tile[at(r, c)], v + (int64_t)(tok0 + (valid ? key : 0)) * p.v_token_stride + c * 16, valid,
                             once);
    }
    commit_copies();
    wait_all_copies();
    __syncthreads();
    // V^T row 4w + b, word q of group g: byte b of column word w of keys 16g + 2q, + 2q + 1,
    // + 8 + 2q, + 9 + 2q (P's order above).
    const int groups = keys / 16, words = d / 4;
    for (int i = threadIdx.x; i < groups * words; i += kPrepassThreads) {
        const int g = i % groups, w = i / groups;
        const int key_g = key0 + 16 * g;
        if (key_g >= p.keys_padded) continue;
        uint32_t col[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) col[k] = *reinterpret_cast<const uint32_t*>(&tile[at(16 * g + k, w / 4) + 4 * (w % 4)]);
        uint32_t out[4][4];  // [b][q]
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t t[4];
            transpose_bytes_4x4(col[2 * q], col[2 * q + 1], col[8 + 2 * q], col[9 + 2 * q], t);
#pragma unroll
            for (int b = 0; b < 4; ++b) out[b][q] = t[b];
        }
#pragma unroll
        for (int b = 0; b < 4; ++b)
            *reinterpret_cast<uint4*>(vt + (int64_t)(4 * w + b) * p.keys_padded + key_g) =
                make_uint4(out[b][0], out[b][1], out[b][2], out[b][3]);
    }
}

}  // namespace fa3
