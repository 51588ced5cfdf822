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
    float* dq_accum;         // (total_q, heads, kHeadDim) f32: dQ / scale, summed over key blocks
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
    int head_dim_padded;     // kHeadDim of the main kernel's instantiation: dq_accum's row length
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
