// The backward kernels' parameters: one POD passed by value as a __grid_constant__ parameter to
// all three kernels (preprocess, main, postprocess), so the TMA descriptors live in parameter
// space. Mirrored field for field by `BwdParams` in crates/flash-attn/src/cuda/backward.rs.
#pragma once
#include <cstdint>

#include "../primitives/tma.cuh"

namespace fa3 {

struct alignas(64) BwdParams {
    // 4-D maps (head_dim, tokens, heads, batch) over q, k, v and dO with their own strides
    // (varlen: batch = 1, sequences addressed by token offset). Boxes: kBlockM rows for q and dO,
    // kBlockN rows for k and v.
    TmaDesc tma_q;
    TmaDesc tma_k;
    TmaDesc tma_v;
    TmaDesc tma_do;
    const uint16_t* out;     // the forward's output O: (total_q, heads, head_dim_v), contiguous
    const uint16_t* dout;    // dO, same layout
    const float* lse;        // the forward's LSE (natural log): (batch, heads, seqlen_q) or (heads, total_q)
    float* lse_log2;         // (heads, padded_rows): LSE * log2(e), +inf for rows that see no key or pad
    float* dpsum;            // (heads, padded_rows): D = rowsum(dO ∘ O), 0 in pad rows
    float* dq_accum;         // f32 dQ / scale summed over key blocks, zeroed by the host; blocked layout (dq_accum_offset)
    int* dq_semaphore;       // deterministic mode: (batch, heads, num_m_blocks) counters, zeroed; else null
    uint16_t* dq;            // (total_q, heads, head_dim), contiguous, q's dtype
    uint16_t* dk;            // (total_k, kv_heads, head_dim)
    uint16_t* dv;            // (total_k, kv_heads, head_dim_v)
    const uint32_t* cu_q;    // varlen: batch + 1 cumulative offsets; null for fixed-length calls
    const uint32_t* cu_k;
    int64_t lse_head_stride;
    int64_t lse_batch_stride;  // fixed-length only
    int64_t padded_rows;       // rows per head of lse_log2 / dpsum (see padded_row0)
    int seqlen_q;            // fixed-length calls: every sequence's length; varlen: the maximum
    int seqlen_k;
    int batch;
    int heads;
    int kv_heads;
    int group;               // heads / kv_heads
    int head_dim;
    int head_dim_v;
    int head_dim_padded;     // kHeadDim of the main kernel's instantiation
    int block_m;             // kBlockM of the main kernel's instantiation (dq_accum's blocks)
    int window_left;         // -1: unbounded
    int window_right;        // -1: unbounded; causal is 0
    float scale_log2;        // scale * log2(e) (softcap: cap * log2(e)); may be 0 or negative
    float softcap_pre;       // != 0: t = tanh(s * softcap_pre), logit = cap * t, softcap_pre = scale / cap
    float scale;             // the softmax scale: dQ = scale · dS·K, dK = scale · dSᵀ·Q
    int num_m_blocks;        // query blocks per (batch, head): ceil(max seqlen_q / kBlockM)
};

// Per-row vectors (lse_log2, dpsum) are padded per sequence so that every query block starts on a
// 16-byte boundary (a bulk copy's alignment) and may read a whole block: sequence b starts at
// (cu_q[b] / 128 + b) * 128, which is >= the previous start plus its length rounded up to 128.
constexpr int kRowPad = 128;
__device__ __forceinline__ int64_t padded_row0(int q0, int b) { return ((int64_t)(q0 / kRowPad) + b) * kRowPad; }

// The dQ accumulator is laid out the way the main kernel produces it, so that each consumer
// warpgroup adds a 64 x 64 share of a query block with one contiguous bulk reduce-add:
//   [head][padded row / block_m][share][pair (16)][thread (128)][2 floats]
// A query block (block_m padded rows x head_dim_padded f32 columns) holds dq_shares(p) shares of
// 64 x 64: block_m = 128 (d64) splits its rows in two, block_m = 64 (d128, d256) its columns in
// two or four. Inside a share, element (row, col) sits where the wgmma accumulator fragment keeps
// it: thread 32·(row / 16) + 4·(row % 8) + (col % 8) / 2, accumulator 4·(col / 8) + 2·((row % 16)
// / 8) + col % 2, stored as pairs so that the kernel's shared-memory staging writes are
// conflict-free 8-byte stores (and its direct vector reductions coalesced).
// The main kernel passes its compile-time block_m and shares (no runtime 64-bit division per
// query block), the postprocess the launch's.
constexpr int kDqShare = 64 * 64;
__device__ __forceinline__ int64_t dq_share_base(int64_t padded_rows, int block_m, int shares, int head,
                                                 int64_t padded_row, int share) {
    return (((int64_t)head * (padded_rows / block_m) + padded_row / block_m) * shares + share) * kDqShare;
}
__device__ __forceinline__ int dq_share_offset(int row, int col) {
    const int thread = 32 * (row / 16) + 4 * (row % 8) + (col % 8) / 2;
    const int pair = 2 * (col / 8) + (row % 16) / 8;
    return (pair * 128 + thread) * 2 + col % 2;
}
__device__ __forceinline__ int64_t dq_accum_offset(const BwdParams& p, int head, int64_t padded_row, int col) {
    const int rr = (int)(padded_row % p.block_m);
    const int share = p.block_m == 128 ? rr / 64 : col / 64;
    const int row = p.block_m == 128 ? rr % 64 : rr;
    const int shares = p.block_m * p.head_dim_padded / kDqShare;
    return dq_share_base(p.padded_rows, p.block_m, shares, head, padded_row, share) + dq_share_offset(row, col % 64);
}

// Sequence b's lengths and first token (TMA coordinates), fixed-length or varlen.
struct SeqInfo {
    int seqlen_q, seqlen_k;
    int q_row0, k_row0;    // TMA row coordinate of the sequence's first token
    int tma_batch;         // TMA batch coordinate (0 for varlen)
    int64_t q_tok0, k_tok0;  // token index of the first query / key in the packed outputs
    int64_t pad0;          // padded_row0 of the sequence
};

__device__ __forceinline__ SeqInfo seq_info(const BwdParams& p, int b) {
    SeqInfo s;
    if (p.cu_q != nullptr) {
        const int q0 = (int)p.cu_q[b], k0 = (int)p.cu_k[b];
        s.seqlen_q = (int)p.cu_q[b + 1] - q0;
        s.seqlen_k = (int)p.cu_k[b + 1] - k0;
        s.q_row0 = q0;
        s.k_row0 = k0;
        s.tma_batch = 0;
        s.q_tok0 = q0;
        s.k_tok0 = k0;
        s.pad0 = padded_row0(q0, b);
    } else {
        s.seqlen_q = p.seqlen_q;
        s.seqlen_k = p.seqlen_k;
        s.q_row0 = 0;
        s.k_row0 = 0;
        s.tma_batch = b;
        s.q_tok0 = (int64_t)b * p.seqlen_q;
        s.k_tok0 = (int64_t)b * p.seqlen_k;
        s.pad0 = padded_row0(b * p.seqlen_q, b);
    }
    return s;
}

// The keys [lo, hi) that query i sees (bottom-right aligned window; params.rs key_range).
__device__ __forceinline__ void key_range(const BwdParams& p, int i, int sq, int sk, int& lo, int& hi) {
    const int diag = i + sk - sq;
    lo = p.window_left < 0 ? 0 : max(diag - p.window_left, 0);
    hi = p.window_right < 0 ? sk : min(diag + p.window_right + 1, sk);
    lo = min(lo, sk);
    hi = max(hi, lo);
}

}  // namespace fa3
