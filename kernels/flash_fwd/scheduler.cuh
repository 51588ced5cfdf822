// Which tile a CTA works on and the key range that tile needs.
//
// Persistent grid: one CTA per SM loops over the tiles (query tile, head, batch). Its first tile
// is blockIdx.x; the next one is either
//   - static striding (p.tile_counter null; unmasked fixed-length calls, where all tiles cost the
//     same): every gridDim.x-th tile after the current one, or
//   - dynamic (causal/windows, varlen, KV caches): gridDim.x + atomicAdd(p.tile_counter, 1), a
//     global counter, so a CTA that finished early takes the next unclaimed tile. The counter is
//     zero at launch: the last CTA to stop claiming resets it (and its own count of finished
//     CTAs) for the next launch on the stream, so the host keeps one buffer per device and no
//     memset precedes a launch (nor sits in a captured CUDA graph).
// Query tiles are numbered last first: under a causal mask the last tiles see the most keys. The
// (batch, head) pairs are cut into sections whose K/V fit in L2 together (FA3's order; the host
// sizes them, `l2_section_pairs` in params.rs); a section runs its longest tiles of every pair
// first, then the next longest, so the CTAs running at the same time share the section's K/V in
// L2 and the launch ends on the shortest tiles of the last section. (Sections of one pair, the
// order before version 28, left the last pairs' long tiles to the end: a launch tail of up to
// half a long tile, measured 5-6% of a d128 causal 2k-8k call.)
//
// A scheduler thread claims the tiles and hands each index to the TMA thread and the consumer
// warpgroups through one slot in shared memory (tile_idx, tile_full / tile_empty barriers); an
// index past the last tile tells everyone to stop.
#pragma once
#include "../primitives/mbarrier.cuh"
#include "params.cuh"
#include "traits.cuh"

namespace fa3 {

struct TileInfo {
    int m_block, head, kv_head, batch;
    int split;                // split-KV: which share of the key blocks (0 without splits)
    int seqlen_q, seqlen_k;   // this sequence's lengths
    int q_row0, k_row0;       // TMA row coordinate of the sequence's first token
    int tma_batch;            // TMA batch coordinate of Q and O (0 for varlen)
    int kv_batch;             // TMA batch coordinate of K and V: tma_batch, or the sequence's
                              // cache row (kv_batch_idx)
    int64_t out_tok0;         // token index of the sequence's first query in out
    int64_t lse_row0;         // lse index of (head, query 0) of the tile's (first) head
    int n_min, n_max;         // key blocks [n_min, n_max) that some row of the tile sees
    int full_lo, full_hi;     // keys [full_lo, full_hi) are visible to every row of the tile
};

// The keys [lo, hi) that query i sees (bottom-right aligned window; params.rs key_range).
__device__ __forceinline__ void key_range(const FwdParams& p, int i, int sq, int sk, int& lo, int& hi) {
    int diag = i + sk - sq;
    lo = p.window_left < 0 ? 0 : max(diag - p.window_left, 0);
    hi = p.window_right < 0 ? sk : min(diag + p.window_right + 1, sk);
    lo = min(lo, sk);
    hi = max(hi, lo);
}

__device__ __forceinline__ int num_tiles(const FwdParams& p) {
    return p.num_m_blocks.d * p.tile_heads.d * p.batch * p.num_splits.d;
}

// Tile row r -> its query (index in the sequence) and q head. Rows past the last packed query
// group get query = seqlen_q, i.e. past the end: never stored.
__device__ __forceinline__ void row_position(const FwdParams& p, const TileInfo& t, int r, int& query, int& head) {
    const int m0 = t.m_block * p.q_tile_queries;
    if (p.pack_gqa) {
        int head_in_group;
        const int q = p.group.divmod(r, head_in_group);
        query = q < p.q_tile_queries ? m0 + q : t.seqlen_q;
        head = t.head + head_in_group;
    } else {
        query = m0 + r;
        head = t.head;
    }
}

// The attention-sink logits (log2 units) of this thread's two rows, tile rows r and r + 8: -inf
// without sinks, and for split-KV partials (the combine adds the sink once).
__device__ __forceinline__ void row_sinks_log2(const FwdParams& p, const TileInfo& t, int r, float (&z)[2]) {
    z[0] = z[1] = -INFINITY;
    if (p.sinks == nullptr || p.num_splits.d > 1) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int query, head;
        row_position(p, t, r + 8 * h, query, head);
        z[h] = p.sinks[head] * 1.4426950408889634f;
    }
}

// Decodes tile index `tile`; false when the tile lies past its sequence's end (varlen).
template <class Tr> __device__ __forceinline__ bool get_tile(const FwdParams& p, int tile, TileInfo& t) {
    // Splits innermost (consecutive CTAs take the key shares of one tile), then the pairs of a
    // section, then query tiles, then sections. Sections bound how many heads' K/V the CTAs
    // running at the same time read (heads inner over all heads streamed them from HBM and ran up
    // to 25% slower at seqlen 512, version 4).
    int in_section, hb_in_section, tile_head;
    const int share = p.num_splits.divmod(tile, t.split);
    const int section = p.l2_section_tiles.divmod(share, in_section);
    const FastDiv& pairs = section < p.l2_full_sections ? p.l2_section : p.l2_last_section;
    const int m_rev = pairs.divmod(in_section, hb_in_section);
    const int hb = section * p.l2_section.d + hb_in_section;
    t.m_block = p.num_m_blocks.d - 1 - m_rev;
    t.batch = p.tile_heads.divmod(hb, tile_head);
    if (p.pack_gqa) {  // a tile covers every q head of its kv head; t.head is the first
        t.kv_head = tile_head;
        t.head = t.kv_head * p.group.d;
    } else {
        t.head = tile_head;
        t.kv_head = p.group.div(t.head);
    }
    if (p.cu_q != nullptr) {
        int q0 = (int)p.cu_q[t.batch], k0 = (int)p.cu_k[t.batch];
        t.seqlen_q = (int)p.cu_q[t.batch + 1] - q0;
        t.seqlen_k = (int)p.cu_k[t.batch + 1] - k0;
        t.q_row0 = q0;
        t.k_row0 = k0;
        t.tma_batch = 0;
        t.out_tok0 = q0;
        t.lse_row0 = (int64_t)t.head * p.lse_head_stride + q0;
    } else {
        t.seqlen_q = p.seqlen_q;
        t.seqlen_k = p.seqlen_k;
        t.q_row0 = 0;
        t.k_row0 = 0;
        t.tma_batch = t.batch;
        t.out_tok0 = (int64_t)t.batch * p.seqlen_q;
        t.lse_row0 = (int64_t)t.batch * p.lse_batch_stride + (int64_t)t.head * p.lse_head_stride;
    }
    if (p.seqused_k != nullptr) {
        // A KV cache's key count, clamped to what the cache holds; its keys start at the cache
        // row's (or page table's) first. Varlen queries over a cache come with cu_k = cu_q (the
        // host's), whose key fields this replaces, and a contiguous cache's rows through
        // kv_batch_idx. The load's value differs per lane as far as ptxas knows; redux.sync over
        // the lanes running this code (all of a consumer warp, the one TMA thread) puts it in a
        // uniform register, as receive_tile does for the tile index.
        const uint32_t used = __reduce_max_sync(__activemask(), p.seqused_k[t.batch]);
        t.seqlen_k = (int)min(used, (uint32_t)p.seqlen_k);
        t.k_row0 = 0;
    }
    t.kv_batch = t.tma_batch;
    if (p.kv_batch_idx != nullptr) t.kv_batch = (int)__reduce_max_sync(__activemask(), p.kv_batch_idx[t.batch]);
    int m0 = t.m_block * p.q_tile_queries;
    if (m0 >= t.seqlen_q) return false;
    int m1 = min(m0 + p.q_tile_queries, t.seqlen_q) - 1;
    int lo0, hi0, lo1, hi1;
    key_range(p, m0, t.seqlen_q, t.seqlen_k, lo0, hi0);
    key_range(p, m1, t.seqlen_q, t.seqlen_k, lo1, hi1);
    // lo and hi never decrease with i: the union of the rows' ranges is [lo0, hi1), the
    // intersection [lo1, hi0).
    t.n_min = lo0 / Tr::kBlockN;
    t.n_max = hi1 > lo0 ? (hi1 + Tr::kBlockN - 1) / Tr::kBlockN : t.n_min;
    t.full_lo = lo1;
    t.full_hi = hi0;
    if (p.num_splits.d > 1) {
        // The split's share of the tile's key blocks; a share past the end is empty (n_max ==
        // n_min) and stores a zero partial with LSE -inf, which the combine weighs 0.
        const int per_split = p.num_splits.div(t.n_max - t.n_min + p.num_splits.d - 1);
        const int lo = t.n_min + t.split * per_split;
        t.n_min = min(lo, t.n_max);
        t.n_max = min(lo + per_split, t.n_max);
        t.n_max = max(t.n_max, t.n_min);
    }
    return true;
}

// The tile after `tile` for this CTA (scheduler thread only).
__device__ __forceinline__ int next_tile(const FwdParams& p, int tile) {
    if (p.tile_counter == nullptr) return tile + (int)gridDim.x;
    return (int)gridDim.x + atomicAdd(p.tile_counter, 1);
}

// The scheduler thread (lane 0 of the producer warpgroup's second warp, so that the TMA thread
// keeps its few registers for the loads): claims this CTA's k-th tile once the (k-1)-th has been
// read by every consumer thread and fully issued by the TMA thread (tile_empty: 128 per consumer
// warpgroup + 1 arrivals), i.e. a couple of key blocks before the CTA finishes it, so a claim
// reflects real progress. The TMA thread waits for the index before the next tile's Q load; with
// two Q buffers (d <= 128) that load still lands before the consumers need it unless the atomic
// is slow.
template <class Tr> __device__ void scheduler(const FwdParams& p, SharedStorage<Tr>& s) {
    int tile = blockIdx.x;
    for (int k = 0;; ++k) {
        mbar_wait(&s.tile_empty, (k & 1) ^ 1);  // passes at once for k = 0
        if (k > 0) tile = next_tile(p, tile);
        s.tile_idx = tile;
        mbar_arrive(&s.tile_full);  // release: the store is visible to the waiters
        if (tile >= num_tiles(p)) {  // everyone stops on this index
            // Done claiming; the last CTA to get here (no other will touch the counter again in
            // this launch) zeroes both words for the next one.
            if (p.tile_counter != nullptr && atomicAdd(p.tile_counter + 1, 1) == (int)gridDim.x - 1) {
                p.tile_counter[0] = 0;
                p.tile_counter[1] = 0;
            }
            break;
        }
    }
}

// The k-th tile index of this CTA, for the TMA thread and the consumer threads. The consumers
// release the slot at once (release = true); the TMA thread after issuing the tile's loads.
// `lanes`: the calling warp's lanes (one thread, or the page warp's 32).
template <class Tr>
__device__ __forceinline__ int receive_tile(SharedStorage<Tr>& s, int k, bool release, unsigned lanes = 1u) {
    mbar_wait(&s.tile_full, k & 1);
    const int tile = s.tile_idx;
    if (release) mbar_arrive(&s.tile_empty);
    // The value is the same in every lane, but ptxas cannot know that for a shared-memory load;
    // redux.sync's result lives in a uniform register, so the tile's fields, loop bounds and ring
    // counters stay on the uniform datapath as they did with blockIdx-based striding (without it
    // the whole kernel ran 5-8% slower, full and causal).
    return (int)__reduce_max_sync(release ? 0xffffffffu : lanes, (unsigned)tile);
}

}  // namespace fa3
