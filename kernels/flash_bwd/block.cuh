// Which query blocks one CTA (key block n of one kv head and sequence) visits, and which of
// them need a mask.
//
// Query i sees keys [lo(i), hi(i)) (key_range; both non-decreasing in i). Keys [k0, k1) are seen
// by the queries with hi(i) > k0 and lo(i) < k1, a contiguous range [i_min, i_max):
//   hi(i) > k0  <=>  i >= k0 - (sk - sq) - window_right      (no right window: every i)
//   lo(i) < k1  <=>  i <  k1 - (sk - sq) + window_left       (no left window: every i)
#pragma once
#include "params.cuh"

namespace fa3 {

struct KeyBlock {
    int n, kv_head, batch;
    SeqInfo seq;
    int m_min, m_max;  // query blocks [m_min, m_max) of every head of the group see some key of the block
};

template <class Tr> __device__ __forceinline__ bool get_key_block(const BwdParams& p, KeyBlock& kb) {
    kb.n = blockIdx.x;
    kb.kv_head = blockIdx.y;
    kb.batch = blockIdx.z;
    kb.seq = seq_info(p, kb.batch);
    const int sq = kb.seq.seqlen_q, sk = kb.seq.seqlen_k;
    const int k0 = kb.n * Tr::kBlockN;
    if (k0 >= sk) return false;  // past this sequence's keys (varlen): nothing to do
    const int k1 = min(k0 + Tr::kBlockN, sk);
    const int i_min = p.window_right < 0 ? 0 : max(0, k0 - (sk - sq) - p.window_right);
    const int i_max = p.window_left < 0 ? sq : min(sq, k1 - (sk - sq) + p.window_left);
    kb.m_min = i_min / Tr::kBlockM;
    kb.m_max = i_max > i_min ? (i_max + Tr::kBlockM - 1) / Tr::kBlockM : kb.m_min;
    return true;
}

// Share `share` (a 64 x 64 tile, kDqShares per block) of the f32 dQ accumulator block of
// (head, query block m) of the CTA's sequence.
template <class Tr>
__device__ __forceinline__ float* dq_share_ptr(const BwdParams& p, const KeyBlock& kb, int head, int m, int share) {
    return p.dq_accum +
           dq_share_base(p.padded_rows, Tr::kBlockM, Tr::kDqShares, head, kb.seq.pad0 + m * Tr::kBlockM, share);
}

// The queries [lo, hi] that see key `key` of a sequence (key_range turned around: query i sees
// the key iff lo <= i <= hi; empty when hi < lo). A consumer thread computes it once for each of
// its two key rows, so that a boundary block's element mask is two compares per entry.
struct QueryInterval {
    int lo, hi;
};
__device__ __forceinline__ QueryInterval query_interval(const BwdParams& p, int key, int sq, int sk) {
    const int64_t diag0 = (int64_t)key - (sk - sq);  // the query whose diagonal is this key
    QueryInterval r;
    r.lo = p.window_right < 0 ? 0 : (int)max((int64_t)0, diag0 - p.window_right);
    r.hi = p.window_left < 0 ? sq - 1 : (int)min((int64_t)sq - 1, diag0 + p.window_left);
    if (key >= sk) r.hi = -1;  // past the sequence's keys: seen by none
    return r;
}

// True when every query of block m sees every key of the CTA's block: no element mask needed.
template <class Tr> __device__ __forceinline__ bool block_unmasked(const BwdParams& p, const KeyBlock& kb, int m) {
    const int sq = kb.seq.seqlen_q, sk = kb.seq.seqlen_k;
    const int i0 = m * Tr::kBlockM, i1 = i0 + Tr::kBlockM - 1;
    if (i1 >= sq) return false;
    int lo0, hi0, lo1, hi1;
    key_range(p, i0, sq, sk, lo0, hi0);
    key_range(p, i1, sq, sk, lo1, hi1);
    const int k0 = kb.n * Tr::kBlockN;
    return lo1 <= k0 && hi0 >= k0 + Tr::kBlockN;
}

// Deterministic mode: the first key block that visits query block m; the CTAs of key blocks
// n_lo, n_lo + 1, ... add their share of dQ in that order (block m of query i0 = m * kBlockM
// is seen by key block n iff n * kBlockN + kBlockN > lo(i0), with the same formulas as above).
template <class Tr> __device__ __forceinline__ int first_key_block(const BwdParams& p, const KeyBlock& kb, int m) {
    if (p.window_left < 0) return 0;
    const int x = m * Tr::kBlockM + kb.seq.seqlen_k - kb.seq.seqlen_q - p.window_left;
    return max(x, 0) / Tr::kBlockN;
}

}  // namespace fa3
