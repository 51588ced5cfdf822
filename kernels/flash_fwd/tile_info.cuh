// A tile's decoded fields (TileInfo) and the shared-memory slots that hand them out (TileSlot):
// written by the scheduler thread (scheduler.cuh), read by the TMA thread and the consumers.
#pragma once
#include <cstdint>

namespace fa3 {

// (receive_tile copies a plain kernel's first four and last four words only, and makes the others:
// keep the indices first and the key range last.)
struct alignas(16) TileInfo {
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

// A slot through which the scheduler thread hands out one of a CTA's tiles: the index (past the
// last tile: stop) and that tile decoded once, by the scheduler thread, so that the consumers copy
// it and the producer threads read it in place instead of each running get_tile's chain of
// divisions (and, for varlen and KV caches, its global loads) at the tile boundary, where the
// consumers wait for it.
struct TileSlot {
    TileInfo info;
    int idx;
    int valid;  // get_tile's answer: 0 when the tile lies past its sequence's end (varlen)
};

}  // namespace fa3
