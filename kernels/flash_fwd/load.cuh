// The producer: one thread of the producer warpgroup issues every TMA copy of the tile (with a
// paged 16-bit cache, a second thread issues V's: paged_v_thread below; in the `_pw` kernels a
// warp looks the pages up: page_warp).
// Q is loaded once; K and V go through kStages-deep rings, each slot guarded by a "full"
// barrier (TMA bytes landed) and an "empty" barrier (both consumer warpgroups are done with it).
// K and V have separate barriers: Q·Kᵀ can start while V is still landing, and a K slot is
// refilled as soon as its S = Q·Kᵀ has retired, while P·V of the same block may still run.
#pragma once
#include "../primitives/mbarrier.cuh"
#include "../primitives/tma.cuh"
#include "../primitives/trace.cuh"
#include "../primitives/warp.cuh"
#include "fp8_vt_fill.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "traits.cuh"
#include "transpose_v.cuh"

namespace fa3 {

template <class Tr>
__device__ __forceinline__ void load_tile_rows(const TmaDesc* desc, typename Tr::Elem* dst, uint64_t* bar, int rows, int row,
                                               int head, int batch) {
    // One box per column block: a box row may not exceed the swizzle span (128 or 64 bytes).
#pragma unroll
    for (int c = 0; c < Tr::kColBlocks; ++c)
        tma_load_4d(desc, dst + c * rows * Tr::kColElems, bar, c * Tr::kColElems, row, head, batch);
}

// Key block n of a paged K or V cache: boxes of p.page_box_rows rows (a divisor of the page size
// and of kBlockN, so a box never crosses a page), each from the page the sequence's page table
// names for its first key. A box wholly past the sequence's keys is not looked up: its row
// coordinate lies past the page (out of the map), which TMA fills with zeros and still counts
// as the box's bytes. A page index past the pool is out of the map too: zeros, never a fault
// (the append kernel reports it, kernels/kvcache/append.cu). Box offsets are multiples of 16 rows
// of 64 or 128 bytes, so the swizzle pattern (1024-byte period) is the whole tile's.

// The page index of the box at row r of key block n (0, not looked up, for a box past the block
// or past the sequence's keys). `pages`: the sequence's row of the page table.
template <class Tr>
__device__ __forceinline__ int box_page(const FwdParams& p, const uint32_t* pages, int n, int r, const TileInfo& t) {
    const int key = n * Tr::kBlockN + r;
    return r < Tr::kBlockN && key < t.seqlen_k ? (int)__ldg(pages + p.page_size.div(key)) : 0;
}

// The box at row r of key block n, from page `page` (one TMA issue per column block).
template <class Tr>
__device__ __forceinline__ void issue_paged_box(const FwdParams& p, const TmaDesc* desc, typename Tr::Elem* dst,
                                                uint64_t* bar, int n, int r, const TileInfo& t, int page) {
    const int key = n * Tr::kBlockN + r;
    int row = p.page_size.d;  // past the page: TMA's zero fill
    if (key < t.seqlen_k) p.page_size.divmod(key, row);
#pragma unroll
    for (int c = 0; c < Tr::kColBlocks; ++c)
        tma_load_4d(desc, dst + (c * Tr::kBlockN + r) * Tr::kColElems, bar, c * Tr::kColElems, row, t.kv_head, page);
}

// Key block n's boxes, their page indices looked up a batch at a time.
template <class Tr>
__device__ __forceinline__ void load_paged_rows(const FwdParams& p, const TmaDesc* desc, typename Tr::Elem* dst,
                                                uint64_t* bar, int n, const TileInfo& t) {
    // The page indices of up to kBatch boxes first, as independent loads in flight together (a
    // load between two TMA issues would wait out its whole latency: the issues are `asm volatile`
    // with a memory clobber), then their issues. kBatch bounds the producer's registers (24 to
    // 40 after setmaxnreg).
    constexpr int kBatch = 4;
    const uint32_t* pages = p.page_table + (int64_t)t.batch * p.max_pages;
    const int box_rows = p.page_box_rows;
    for (int r0 = 0; r0 < Tr::kBlockN; r0 += kBatch * box_rows) {
        int page[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) page[i] = box_page<Tr>(p, pages, n, r0 + i * box_rows, t);
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int r = r0 + i * box_rows;
            if (r >= Tr::kBlockN) break;
            issue_paged_box<Tr>(p, desc, dst, bar, n, r, t, page[i]);
        }
    }
}

// A paged key block of at most two boxes (pages of kBlockN / 2 keys or more): its page indices,
// looked up once for K and kept for V of the same block (the producer issues K one block ahead
// of V), and looked up before the producer waits for K's ring slot, so that the lookup's latency
// runs under the wait instead of between the wait and the issues. Smaller pages keep
// load_paged_rows (up to 8 boxes a block: their indices would not fit the producer's registers,
// docs/kernels/kvcache.md).
struct BlockPages {
    int page[2];
};

template <class Tr> __device__ __forceinline__ bool few_block_pages(const FwdParams& p) {
    return Tr::kServesCache && p.page_table != nullptr && 2 * p.page_box_rows >= Tr::kBlockN;
}

template <class Tr> __device__ __forceinline__ BlockPages lookup_block_pages(const FwdParams& p, int n, const TileInfo& t) {
    const uint32_t* pages = p.page_table + (int64_t)t.batch * p.max_pages;
    BlockPages bp;
#pragma unroll
    for (int i = 0; i < 2; ++i) bp.page[i] = box_page<Tr>(p, pages, n, i * p.page_box_rows, t);
    return bp;
}

// The boxes of key block n from the pages `bp` names.
template <class Tr>
__device__ __forceinline__ void issue_block_pages(const FwdParams& p, const TmaDesc* desc, typename Tr::Elem* dst,
                                                  uint64_t* bar, int n, const TileInfo& t, const BlockPages& bp) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = i * p.page_box_rows;
        if (r >= Tr::kBlockN) break;
        issue_paged_box<Tr>(p, desc, dst, bar, n, r, t, bp.page[i]);
    }
}

// K or V key block n: the caller's rows, a contiguous cache's row, or a paged cache's pages.
template <class Tr>
__device__ __forceinline__ void load_kv_block(const FwdParams& p, const TmaDesc* desc, typename Tr::Elem* dst,
                                              uint64_t* bar, int n, const TileInfo& t) {
    if (Tr::kServesCache && p.page_table != nullptr) {
        load_paged_rows<Tr>(p, desc, dst, bar, n, t);
    } else {
        load_tile_rows<Tr>(desc, dst, bar, Tr::kBlockN, t.k_row0 + n * Tr::kBlockN, t.kv_head, t.kv_batch);
    }
}

// FP8 with V^T (pre-pass or in-kernel writer): key block n of V^T (head_dim rows x kBlockN keys),
// one box of kVtBoxRows rows per 128-key column block (the last one whole, traits.cuh
// kVtColBlocks; d256: two boxes); V^T holds every sequence padded to its own rows, so the
// coordinates are (key, head-dim row, kv head, sequence) for fixed-length and varlen calls alike.
template <class Tr>
__device__ __forceinline__ void load_vt_block(const FwdParams& p, uint8_t* dst, uint64_t* bar, int n, const TileInfo& t) {
#pragma unroll
    for (int c = 0; c < Tr::kVtColBlocks; ++c) {
#pragma unroll
        for (int r = 0; r < Tr::kHeadDim; r += Tr::kVtBoxRows)
            tma_load_4d(&p.tma_v, dst + c * Tr::kHeadDim * 128 + r * 128, bar, n * Tr::kBlockN + c * 128, r, t.kv_head,
                        t.batch);
    }
}

// Paged caches of small pages (16 or 32 keys), 16-bit kernels: V's boxes are issued by a second
// thread (warp 2 of the producer warpgroup, idle otherwise), so that a block's K and V issues
// (2 × kBlockN / page boxes per column block: 32 at pages of 16 and d128) and their page-table
// loads run side by side instead of one after the other in the TMA thread. Pages of 64 keys or
// more (at most 2 boxes per column block) gained nothing from it (0.99-1.01x at batch >= 8, same
// call) and keep one thread. FP8 caches go through the in-kernel V transpose (kTransposeV), which keeps warps 2 and
// 3 for itself; their V stays with the TMA thread.
template <class Tr> __device__ __forceinline__ bool paged_v_thread(const FwdParams& p) {
    if constexpr (Tr::kPageWarp) return true;  // the host launches them for small pages only
    return !Tr::kFp8 && p.page_table != nullptr && p.page_box_rows < 64;
}

// The page warp (kPageWarp kernels, small pages: paged_v_thread): per key block, in the producers'
// order, lane i looks up the page of the block's box i, all in one round trip, into a ring of
// kPageSlots slots in shared memory (pages_full: 32 arrivals, each lane's after its store;
// pages_empty: the TMA thread after K's issues and the V thread after V's). Without it the
// issuing threads look 8 indices a block up themselves, two dependent round trips per block on
// their path (their 40 registers hold 4 at a time, load_paged_rows); here the lookups run up to
// kPageSlots blocks ahead and the first block's take one.
template <class Tr> __device__ void page_warp(const FwdParams& p, SharedStorage<Tr>& s, int lane) {
    int it = 0;
    for (int k = 0;; ++k) {
        const TileSlot& tile_slot = hold_tile<Tr>(s, k);
        if (tile_slot.idx >= num_tiles(p)) break;
        const TileInfo& t = tile_slot.info;
        if (tile_slot.valid && t.n_max > t.n_min) {
            const uint32_t* pages = p.page_table + (int64_t)t.batch * p.max_pages;
            for (int n = t.n_max - 1; n >= t.n_min; --n, ++it) {
                const int slot = it % Tr::kPageSlots;
                mbar_wait(&s.pages_empty[slot], ((it / Tr::kPageSlots) & 1) ^ 1);
                if (lane < Tr::kMaxBlockBoxes) {
                    const int page = box_page<Tr>(p, pages, n, lane * p.page_box_rows, t);
                    st_shared_u32(smem_u32(&s.block_pages[slot][lane]), page);
                }
                mbar_arrive(&s.pages_full[slot]);
            }
        }
        // Every lane releases the tile slot after its own reads of the slot (hold_tile), so
        // that the scheduler thread's next write is ordered after all 32 reads. (One arrival from
        // lane 0 left lanes 1-31's reads unordered: compute-sanitizer's racecheck, session 52.)
        mbar_arrive(&s.tile_empty);
    }
}

// The box at row r of key block n in a kPageWarp kernel, from page `page`: page_box_rows rows
// (a whole page of 16 or 32 keys) with every column, in one TMA issue. Their tiles are stored in
// 8-row groups (traits.cuh kKVRowGroups), and the host's 5-D map (columns, 8 rows, column
// block, 8-row group, page · page_units + kv head: PagedKvMaps in crates/flash-attn/src/cuda/
// kvcache.rs) lands the box as [group][column block][8 rows][columns] at the box's first group.
// A box past the sequence's keys has its group coordinate past the page, and a page past the
// pool its last coordinate past the map (clamped, so it cannot wrap into range): TMA's zero
// fill, as in issue_paged_box.
template <class Tr>
__device__ __forceinline__ void issue_page_box(const FwdParams& p, const TmaDesc* desc, typename Tr::Elem* dst,
                                               uint64_t* bar, int n, int r, const TileInfo& t, int page) {
    static_assert(Tr::kKVRowGroups, "tiles in 8-row groups");
    const int key = n * Tr::kBlockN + r;
    int row = p.page_size.d;  // past the page: TMA's zero fill
    if (key < t.seqlen_k) p.page_size.divmod(key, row);
    const int64_t unit = (int64_t)(uint32_t)page * p.page_units + t.kv_head;
    tma_load_5d(desc, dst + r * Tr::kColBlocks * Tr::kColElems, bar, 0, 0, 0, row / 8,
                (int)min(unit, (int64_t)INT32_MAX));
}

// Key block n (ring position `at`) of a small-page cache in a kPageWarp kernel, from the page
// warp's slot: waits for the slot, issues the boxes, releases the slot (two releases: K's, V's).
template <class Tr>
__device__ __forceinline__ void issue_staged_pages(const FwdParams& p, SharedStorage<Tr>& s, const TmaDesc* desc,
                                                   typename Tr::Elem* dst, uint64_t* bar, int n, int at, const TileInfo& t) {
    const int slot = at % Tr::kPageSlots;
    mbar_wait(&s.pages_full[slot], (at / Tr::kPageSlots) & 1);
    const uint32_t pages = smem_u32(s.block_pages[slot]);
    const int box_rows = p.page_box_rows;
#pragma unroll 1
    for (int i = 0, r = 0; r < Tr::kBlockN; ++i, r += box_rows)
        issue_page_box<Tr>(p, desc, dst, bar, n, r, t, (int)ld_shared_u32(pages + 4 * i));
    mbar_arrive(&s.pages_empty[slot]);
}

// Which loads a producer thread issues: the TMA thread Q and K, and V unless a V thread does.
struct ProducerRole {
    bool q_and_k, v;
};

// it: K/V blocks issued so far by this CTA (the ring position, continued across tiles);
// tc: tiles with keys processed so far (the Q buffer and the parity of its barriers).
// vt_ready: fp8 calls whose kernel writes V^T (fp8_vt_fill.cuh), the last (sequence, kv head)
// pair this thread waited for (-1: none yet).
template <class Tr>
__device__ void producer_tile(const FwdParams& p, SharedStorage<Tr>& s, const TileInfo& t, int& it, int tc,
                              ProducerRole role, int& vt_ready) {
    if (!role.q_and_k) {
        // The V thread: V of every key block in the consumers' order, as below.
        for (int n = t.n_max - 1; n >= t.n_min; --n, ++it) {
            const int stage = it % Tr::kStages;
            mbar_wait(&s.empty_v[stage], ((it / Tr::kStages) & 1) ^ 1);
            mbar_arrive_expect_tx(&s.full_v[stage], Tr::kKVBytes);
            if constexpr (Tr::kPageWarp) {
                issue_staged_pages<Tr>(p, s, &p.tma_v, s.v[stage], &s.full_v[stage], n, it, t);
            } else {
                load_paged_rows<Tr>(p, &p.tma_v, s.v[stage], &s.full_v[stage], n, t);
            }
        }
        return;
    }
    // A Q buffer is free once every consumer warpgroup retired its last Q·Kᵀ of the tile that used
    // it (kQStages tiles ago). With two buffers this load goes out as soon as the previous tile's
    // last K/V load did, a few key blocks before the consumers need it.
    const int qs = tc % Tr::kQStages;
    trace_edge(0, tc, 0);
    mbar_wait(&s.q_empty[qs], ((tc / Tr::kQStages) & 1) ^ 1);
    trace_edge(0, tc, 1);
    mbar_arrive_expect_tx(&s.bar_q[qs], p.q_tile_bytes);
    const int q_row = t.q_row0 + t.m_block * p.q_tile_queries;
    if (packs_gqa<Tr>(p)) {
        // Boxes of (column block, group heads, q_tile_queries tokens): rows in the order
        // (token, head in group), i.e. tile row r = token * group + head.
#pragma unroll
        for (int c = 0; c < Tr::kColBlocks; ++c)
            tma_load_5d(&p.tma_q, s.q[qs] + c * Tr::kBlockM * Tr::kColElems, &s.bar_q[qs], c * Tr::kColElems, 0, q_row,
                        t.kv_head, t.tma_batch);
    } else {
        load_tile_rows<Tr>(&p.tma_q, s.q[qs], &s.bar_q[qs], Tr::kBlockM, q_row, t.head, t.tma_batch);
    }

    // K runs one block ahead of V (the order the consumers need them in: Q·Kᵀ of block j+1 is
    // issued with P·V of block j). A K slot frees as soon as its Q·Kᵀ retired, a V slot only after
    // its P·V, so K(j+1) must not queue behind the wait for V(j)'s slot.
    // Pages of kBlockN / 2 keys or more: block n's page indices, from K(n)'s lookup (BlockPages).
    const bool few_pages = !Tr::kPageWarp && few_block_pages<Tr>(p);
    // kPageWarp kernels (small pages only): block n's page indices from the page warp.
    constexpr bool staged_pages = Tr::kPageWarp;
    BlockPages pages_k{}, pages_v{};
    const auto load_k = [&](int n, int at) {
        const int stage = at % Tr::kStages;
        if (few_pages) pages_k = lookup_block_pages<Tr>(p, n, t);
        trace_stamp(0, at, 0);
        // A slot is free once the consumers released it last round (passes at once in round 0).
        mbar_wait(&s.empty_k[stage], ((at / Tr::kStages) & 1) ^ 1);
        trace_stamp(0, at, 1);
        mbar_arrive_expect_tx(&s.full_k[stage], Tr::kKVBytes);
        if constexpr (staged_pages) {
            issue_staged_pages<Tr>(p, s, &p.tma_k, s.k[stage], &s.full_k[stage], n, at, t);
        } else if (few_pages) {
            issue_block_pages<Tr>(p, &p.tma_k, s.k[stage], &s.full_k[stage], n, t, pages_k);
        } else {
            load_kv_block<Tr>(p, &p.tma_k, s.k[stage], &s.full_k[stage], n, t);
        }
    };
    load_k(t.n_max - 1, it);
    trace_edge(0, tc, 2);
    for (int n = t.n_max - 1; n >= t.n_min; --n, ++it) {
        pages_v = pages_k;  // block n's (before K(n - 1) replaces them)
        if (n > t.n_min) load_k(n - 1, it + 1);
        if (!role.v) continue;  // the V thread loads V
        // kTransposeV: V goes to the transposer warps' ring (transpose_v.cuh), which fills the V ring.
        constexpr bool kRaw = Tr::kTransposeV;
        constexpr int kRing = kRaw ? Tr::kVRawStages : Tr::kStages;
        const int stage = it % kRing;
        uint64_t* full = kRaw ? &s.full_v_raw[stage] : &s.full_v[stage];
        uint64_t* empty = kRaw ? &s.empty_v_raw[stage] : &s.empty_v[stage];
        if constexpr (Tr::kVtFill) {
            // V^T written by this launch: the pair's units, before its first load (after K's two
            // first blocks went out, so Q·Kᵀ starts meanwhile).
            const int pair = t.batch * p.vt_src.kv_heads + t.kv_head;
            if (p.vt_done != nullptr && pair != vt_ready) {
                trace_edge(0, tc, 4);
                wait_vt_pair(p, pair);
                trace_edge(0, tc, 5);
                vt_ready = pair;
            }
        }
        trace_stamp(0, it, 2);
        mbar_wait(empty, ((it / kRing) & 1) ^ 1);
        trace_stamp(0, it, 3);
        mbar_arrive_expect_tx(full, kRaw ? Tr::kKVBytes : Tr::kVStageBytes);
        if constexpr (Tr::kFp8 && !kRaw) {
            load_vt_block<Tr>(p, s.v[stage], full, n, t);
        } else if (few_pages) {
            issue_block_pages<Tr>(p, &p.tma_v, kRaw ? s.v_raw[stage] : s.v[stage], full, n, t, pages_v);
        } else {
            load_kv_block<Tr>(p, &p.tma_v, kRaw ? s.v_raw[stage] : s.v[stage], full, n, t);
        }
    }
    trace_edge(0, tc, 3);
}

// A producer thread: the tiles the scheduler thread claims (hold_tile), each tile's loads as
// its role says; it releases the tile index after its issues (tile_empty counts each producer).
template <class Tr> __device__ void producer(const FwdParams& p, SharedStorage<Tr>& s, ProducerRole role) {
    tma_prefetch_desc(&p.tma_q);
    tma_prefetch_desc(&p.tma_k);
    tma_prefetch_desc(&p.tma_v);
    if (role.q_and_k) trace_life(5);
    int it = 0, tc = 0, vt_ready = -1;
    for (int k = 0;; ++k) {
        const TileSlot& tile_slot = hold_tile<Tr>(s, k);
        if (k == 0 && role.q_and_k) trace_life(6);
        if (tile_slot.idx >= num_tiles(p)) break;  // the consumers stop on the same index
        const TileInfo& t = tile_slot.info;  // read in place: this thread holds the slot (hold_tile)
        if (tile_slot.valid && t.n_max > t.n_min) {  // else the consumers skip it too
            producer_tile<Tr>(p, s, t, it, tc, role, vt_ready);
            ++tc;
        }
        mbar_arrive(&s.tile_empty);  // loads issued: the scheduler may claim the next tile
    }
    if constexpr (Tr::kTransposeV) stop_transposer<Tr>(s, it);
}

}  // namespace fa3
