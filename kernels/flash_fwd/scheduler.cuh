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
// A scheduler thread claims the tiles, decodes each one (get_tile) and hands it to the TMA thread
// and the consumer warpgroups through two slots in shared memory (TileSlot, tile k in slot k % 2;
// tile_full / tile_empty barriers); an index past the last tile tells everyone to stop.
#pragma once
#include "../primitives/mbarrier.cuh"
#include "../primitives/trace.cuh"
#include "../primitives/warp.cuh"
#include "options.cuh"
#include "params.cuh"
#include "tile_info.cuh"
#include "traits.cuh"

namespace fa3 {

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
template <class Tr> __device__ __forceinline__ void row_position(const FwdParams& p, const TileInfo& t, int r, int& query, int& head) {
    const int m0 = t.m_block * p.q_tile_queries;
    if (packs_gqa<Tr>(p)) {
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
template <class Tr> __device__ __forceinline__ void row_sinks_log2(const FwdParams& p, const TileInfo& t, int r, float (&z)[2]) {
    z[0] = z[1] = -INFINITY;
    if (p.sinks == nullptr || is_split<Tr>(p)) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int query, head;
        row_position<Tr>(p, t, r + 8 * h, query, head);
        z[h] = p.sinks[head] * 1.4426950408889634f;
    }
}

// A fixed-length call's lengths and coordinates of tile t's sequence, from t.batch and t.head.
__device__ __forceinline__ void fixed_length_fields(const FwdParams& p, TileInfo& t) {
    t.seqlen_q = p.seqlen_q;
    t.seqlen_k = p.seqlen_k;
    t.q_row0 = 0;
    t.k_row0 = 0;
    t.tma_batch = t.batch;
    t.out_tok0 = (int64_t)t.batch * p.seqlen_q;
    t.lse_row0 = (int64_t)t.batch * p.lse_batch_stride + (int64_t)t.head * p.lse_head_stride;
}

// Decodes tile index `tile`; false when the tile lies past its sequence's end (varlen).
template <class Tr> __device__ __forceinline__ bool get_tile(const FwdParams& p, int tile, TileInfo& t) {
    // Splits innermost (consecutive CTAs take the key shares of one tile), then the pairs of a
    // section, then query tiles, then sections. Sections bound how many heads' K/V the CTAs
    // running at the same time read (heads inner over all heads streamed them from HBM and ran up
    // to 25% slower at seqlen 512, version 4).
    int in_section, hb_in_section, tile_head;
    int share;
    if constexpr (Tr::kPlain) {  // one split (options.cuh)
        share = tile;
        t.split = 0;
    } else {
        share = p.num_splits.divmod(tile, t.split);
    }
    const int section = p.l2_section_tiles.divmod(share, in_section);
    const FastDiv& pairs = section < p.l2_full_sections ? p.l2_section : p.l2_last_section;
    const int m_rev = pairs.divmod(in_section, hb_in_section);
    const int hb = section * p.l2_section.d + hb_in_section;
    t.m_block = p.num_m_blocks.d - 1 - m_rev;
    t.batch = p.tile_heads.divmod(hb, tile_head);
    if (packs_gqa<Tr>(p)) {  // a tile covers every q head of its kv head; t.head is the first
        t.kv_head = tile_head;
        t.head = t.kv_head * p.group.d;
    } else {
        t.head = tile_head;
        t.kv_head = p.group.div(t.head);
    }
    if (is_varlen<Tr>(p)) {
        int q0 = (int)p.cu_q[t.batch], k0 = (int)p.cu_k[t.batch];
        t.seqlen_q = (int)p.cu_q[t.batch + 1] - q0;
        t.seqlen_k = (int)p.cu_k[t.batch + 1] - k0;
        t.q_row0 = q0;
        t.k_row0 = k0;
        t.tma_batch = 0;
        t.out_tok0 = q0;
        t.lse_row0 = (int64_t)t.head * p.lse_head_stride + q0;
    } else {
        fixed_length_fields(p, t);
    }
    if (Tr::kServesCache && p.seqused_k != nullptr) {
        // A KV cache's key count, clamped to what the cache holds; its keys start at the cache
        // row's (or page table's) first. Varlen queries over a cache come with cu_k = cu_q (the
        // host's), whose key fields this replaces, and a contiguous cache's rows through
        // kv_batch_idx. (Only the scheduler thread decodes tiles, so these are plain loads.)
        const uint32_t used = p.seqused_k[t.batch];
        t.seqlen_k = (int)min(used, (uint32_t)p.seqlen_k);
        t.k_row0 = 0;
    }
    t.kv_batch = t.tma_batch;
    if (Tr::kServesCache && p.kv_batch_idx != nullptr) t.kv_batch = (int)p.kv_batch_idx[t.batch];
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
    if (is_split<Tr>(p)) {
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

// Claims `tile` and decodes it into `slot`.
template <class Tr> __device__ __forceinline__ void fill_slot(const FwdParams& p, TileSlot& slot, int tile) {
    slot.idx = tile;
    if (tile < num_tiles(p)) slot.valid = get_tile<Tr>(p, tile, slot.info);
}

// The scheduler thread (lane 0 of the producer warpgroup's second warp, so that the TMA thread
// keeps its few registers for the loads). It decodes each tile (get_tile) before publishing it:
// the consumers then copy the fields at their tile boundary instead of each warp running the
// chain of divisions and, for varlen and KV caches, its global loads there (forward-sm90.md
// version 35). Tile k lives in slot k % 2.
// - With the atomic counter (causal, windows, varlen, caches, and calls whose last query tile
//   idles a consumer warpgroup: forward.rs) it claims tile k once tile k - 1 has
//   been read by every consumer thread and fully issued by the producers (tile_empty: 128 per
//   consumer warpgroup + one per producer thread), i.e. a couple of key blocks before the CTA
//   finishes it, so a claim reflects real progress: a tile held in reserve for a whole tile's
//   time unbalances the CTAs' ends (causal d256 -7..-11%, forward-sm90.md, session 61).
// - Statically strided calls claim and decode tile k + 1 as soon as tile k is published, so that
//   it is ready when the readers release tile k (version 36).
// The TMA thread waits for the tile before the next tile's Q load; with two Q buffers (d <= 128)
// that load still lands before the consumers need it unless the atomic is slow.
template <class Tr> __device__ void scheduler(const FwdParams& p, SharedStorage<Tr>& s) {
    const bool claim_ahead = p.tile_counter == nullptr;
    int tile = blockIdx.x;
    fill_slot<Tr>(p, s.tile[0], tile);
    for (int k = 0;; ++k) {
        mbar_wait(&s.tile_empty, (k & 1) ^ 1);  // tile k - 1 read and issued (passes at once for k = 0)
        if (k > 0 && !claim_ahead) {
            tile = next_tile(p, tile);
            fill_slot<Tr>(p, s.tile[k & 1], tile);
        }
        mbar_arrive(&s.tile_full);  // publishes slot k % 2; release: its stores are visible to the waiters
        if (tile >= num_tiles(p)) {  // everyone stops on this index
            // Done claiming; the last CTA to get here (no other will touch the counter again in
            // this launch) zeroes both words for the next one.
            if (p.tile_counter != nullptr && atomicAdd(p.tile_counter + 1, 1) == (int)gridDim.x - 1) {
                p.tile_counter[0] = 0;
                p.tile_counter[1] = 0;
            }
            break;
        }
        if (claim_ahead) {
            // Into the slot of tile k - 1, which every reader released before the wait above passed.
            tile = next_tile(p, tile);
            fill_slot<Tr>(p, s.tile[(k + 1) & 1], tile);
        }
    }
}

// The k-th tile of this CTA for the consumer threads: waits for the slot, copies the tile's
// decoded fields into `t`, releases the slot at once (the scheduler thread may claim the next
// tile) and returns the index (past the last tile: stop); `valid` says whether the tile lies
// within its sequence (t is defined only for an index before the last tile). wg, tc: the
// consumer warpgroup and its tile count, for -DFA3_TRACE's stamp only.
template <class Tr>
__device__ __forceinline__ int receive_tile(const FwdParams& p, SharedStorage<Tr>& s, int k, TileInfo& t, bool& valid,
                                           int wg, int tc) {
    mbar_wait(&s.tile_full, k & 1);
    trace_edge(wg, tc - 1, 7);  // -DFA3_TRACE: the slot's wait passed (FA3E point 7 of the tile before)
    // Every value is the same in every lane, but ptxas cannot know that for a shared-memory load:
    // uniform() keeps the tile's fields, loop bounds and ring counters on the uniform datapath
    // (without it the whole kernel ran 5-8% slower, full and causal, when only the index came this
    // way).
    static_assert(sizeof(TileInfo) % 16 == 0, "TileInfo is copied in 16-byte words");
    constexpr int kWords = sizeof(TileInfo) / 16;
    uint32_t w[kWords * 4];
    int tile;
    if constexpr (Tr::kReceiveWholeSlot) {
        // Every word at once, index and fields, through the shared window: one shared-memory round
        // trip where the index-first copy below takes two (and generic loads). A stop slot's
        // fields are stale or never written: read and left unused.
        const uint32_t slot_addr = smem_u32(&s.tile[k & 1]);
#pragma unroll
        for (int i = 0; i < kWords; ++i) ld_shared_v4(slot_addr + 16 * i, w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
        uint32_t idx_word, valid_word;
        ld_shared_v2(slot_addr + offsetof(TileSlot, idx), idx_word, valid_word);
        tile = (int)uniform(idx_word);
        // A plain kernel's tile (fixed length, one split, no cache: options.cuh) moves only its
        // indices and key range; the other fields follow from the parameters, as get_tile makes
        // them (22 redux.sync a tile → 9).
        constexpr int kPlainFrom = offsetof(TileInfo, n_min) / 4, kPlainTo = offsetof(TileInfo, split) / 4;
#pragma unroll
        for (int i = 0; i < kWords * 4; ++i) {
            if (!Tr::kPlain || i < kPlainTo || i >= kPlainFrom) w[i] = uniform(w[i]);
        }
        memcpy(&t, w, sizeof(TileInfo));
        valid = (tile < num_tiles(p)) & (uniform(valid_word) != 0);
        if constexpr (Tr::kPlain) {
            t.split = 0;
            fixed_length_fields(p, t);
            t.kv_batch = t.batch;
            valid = tile < num_tiles(p);
        }
    } else {
        const TileSlot& slot = s.tile[k & 1];
        tile = (int)uniform((uint32_t)slot.idx);
        valid = false;
        if (tile < num_tiles(p)) {
#pragma unroll
            for (int i = 0; i < kWords; ++i) {
                const uint4 v = reinterpret_cast<const uint4*>(&slot.info)[i];
                w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < kWords * 4; ++i) w[i] = uniform(w[i]);
            memcpy(&t, w, sizeof(TileInfo));
            valid = uniform((uint32_t)slot.valid) != 0;
        }
    }
    mbar_arrive(&s.tile_empty);
    return tile;
}

// The k-th tile of this CTA for the producer threads (the TMA thread, a paged cache's V thread and
// page warp), which keep the slot until their last issue for the tile and then release it
// themselves (tile_empty): they read the fields in place, where they use them, instead of holding
// a copy in their few registers. Returns the slot (its index past the last tile: stop).
template <class Tr> __device__ __forceinline__ const TileSlot& hold_tile(SharedStorage<Tr>& s, int k) {
    mbar_wait(&s.tile_full, k & 1);
    return s.tile[k & 1];
}

}  // namespace fa3
