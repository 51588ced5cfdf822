// The forward kernel's parameters: one POD passed by value as a __grid_constant__ kernel parameter,
// so the TMA descriptors live in parameter space where cp.async.bulk.tensor can read them.
// Mirrored field for field by `FwdParams` in crates/flash-attn/src/cuda/forward.rs.
#pragma once
#include <cstdint>

#include "../primitives/tma.cuh"

namespace fa3 {

// A divisor fixed per launch, with what divides by it without a division instruction (a runtime
// integer division is ~20 dependent instructions; the tile decode chains four of them): for
// 0 <= n < 2^31, n / d = umulhi(n, mul) >> shift with the host's mul = ceil(2^(31 + l) / d),
// shift = l - 1, l = ceil(log2 d) (Granlund and Montgomery's method; `FastDiv::new` in
// crates/flash-attn/src/params.rs). d = 1 passes n through.
struct FastDiv {
    int d;
    uint32_t mul, shift;
    __device__ __forceinline__ int div(int n) const {
        return d == 1 ? n : (int)(__umulhi((uint32_t)n, mul) >> shift);
    }
    // n / d, with n % d in rem.
    __device__ __forceinline__ int divmod(int n, int& rem) const {
        const int q = div(n);
        rem = n - q * d;
        return q;
    }
};

// The fp8 pre-pass (fp8_prepass.cuh): V (tokens, kv heads, head_dim_v) e4m3 -> V^T (sequences,
// kv heads, head_dim_v, keys_padded), keys permuted inside each group of 16 so that P's
// accumulator registers are wgmma's A operand as they are; zeros past each sequence's end.
struct Fp8PrepassParams {
    const uint8_t* v;
    uint8_t* vt;
    const uint32_t* cu_k;   // varlen: batch + 1 offsets; null: fixed length seqlen_k
    int64_t v_token_stride; // elements (bytes)
    int64_t v_head_stride;
    int64_t v_batch_stride; // fixed length only
    int seqlen_k;           // fixed length: every sequence's keys
    int keys_padded;        // V^T row length: max keys rounded up to 16
    int head_dim_v;
    int kv_heads;
};

struct alignas(64) FwdParams {
    // 4-D maps (head_dim, tokens, heads, batch) over q, k and v with their own strides; varlen
    // calls use batch = 1 and address sequences by token offset.
    TmaDesc tma_q;
    TmaDesc tma_k;
    TmaDesc tma_v;
    TmaDesc tma_o;          // (head_dim_v, tokens, heads, batch) over out, boxes of 64 x 64 (TMA-store
                            // epilogue, kTmaStoreO instantiations)
    TmaDesc tma_v_rows;     // fp8 calls whose kernel writes V^T (vt_done): v as tma_v would map it
                            // for 16 bits, boxes of 128 keys (fp8_vt_fill.cuh); unused otherwise
    void* out;              // (total_q, heads, head_dim_v), contiguous, q's dtype
    float* lse;             // (batch, heads, seqlen_q) or (heads, total_q)
    const uint32_t* cu_q;   // varlen: batch + 1 cumulative offsets; null for fixed-length calls
    const uint32_t* cu_k;
    int* tile_counter;      // dynamic scheduling: [0] tiles claimed so far past the first gridDim.x,
                            // [1] CTAs done claiming; zero at launch, and the last CTA to finish
                            // claiming zeroes both again (scheduler.cuh), so one buffer per device
                            // serves every launch without a memset. Null: static striding.
    int64_t out_row_stride; // elements between tokens of out (heads * head_dim_v)
    int64_t lse_head_stride;
    int64_t lse_batch_stride; // fixed-length only; varlen rows are offset by cu_q[b]
    int seqlen_q;           // fixed-length calls: every sequence's length
    int seqlen_k;
    int heads;
    FastDiv group;          // heads / kv_heads: q heads that share a kv head
    int head_dim_v;         // columns of out actually written
    int window_left;        // -1: unbounded
    int window_right;       // -1: unbounded; causal is 0
    float scale_log2;       // softmax scale * log2(e) (softcap: cap * log2(e)), > 0
    float softcap_pre;      // != 0: s <- tanh(s * softcap_pre) with softcap_pre = scale / cap
    int negate;             // 1 when the softmax scale is negative: s <- -s, scale_log2 = |scale| log2 e
    FastDiv num_m_blocks;   // query tiles per (batch, head): ceil(max seqlen_q / kBlockM)
    int batch;              // sequences
    int direct_store;       // 1: store O straight from registers even where the TMA store applies
    // Pack-GQA (decode-like calls): the `group` q heads of a kv head share one tile, row r being
    // query r / group, head r % group of the tile's first head; tma_q is then a 5-D map
    // (head_dim, q head in group, token, kv head, batch).
    int pack_gqa;
    FastDiv tile_heads;     // heads walked by the tiles: heads, or kv_heads when packing
    int q_tile_queries;     // queries per tile: kBlockM, or kBlockM / group when packing
    uint32_t q_tile_bytes;  // bytes of one Q tile load (the TMA boxes)
    // Split-KV (num_splits > 1; decode-like calls with too few tiles to fill the GPU): split s of
    // a tile takes the s-th share of its key blocks and writes its normalised O (f32) and its LSE
    // into the accumulators below, rows in out's (token, head) order; combine.cuh merges them.
    FastDiv num_splits;
    // Tile order of dynamically scheduled calls (scheduler.cuh, get_tile): the (batch, head) pairs
    // are cut into sections of l2_section pairs (the last one l2_last_section pairs); within a
    // section the query tiles run longest first across all its pairs. l2_section_tiles =
    // l2_section * num_m_blocks. l2_section = 1: pairs outer, each pair's tiles longest first.
    FastDiv l2_section;
    FastDiv l2_last_section;
    FastDiv l2_section_tiles;
    int l2_full_sections;   // sections of l2_section pairs (all but a shorter last one)
    int total_q;            // tokens of q (batch * seqlen_q, or the varlen total)
    float* o_accum;         // (num_splits, total_q, heads, head_dim_v)
    float* lse_accum;       // (num_splits, total_q, heads)
    // FP8 kernels only (FwdTraits::kFp8). tma_v then maps V^T, (keys, head_dim_v, kv heads,
    // sequences), written by the pre-pass (fp8_prepass.cuh). Descales (f32, x = e4m3 value ·
    // descale), null meaning 1.0: q (sequences, heads or kv heads, q_descale_blocks), k
    // (sequences, kv_heads, k_descale_blocks), v (sequences, kv_heads); a block count of 0 means
    // one value per (sequence, head), else one per block of kFp8QBlockRows query rows /
    // kFp8KBlockKeys keys. A sequence's descales start at batch * *_batch_stride (0: one set for
    // every sequence); q_descale_per_kv_head: q's are one per kv head, shared by its group.
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
    int q_descale_blocks;
    int k_descale_blocks;
    int q_descale_batch_stride;
    int k_descale_batch_stride;
    int v_descale_batch_stride;
    int q_descale_per_kv_head;
    int out_f16;            // 1: out is f16, 0: bf16
    // KV cache calls (flash_attn_with_kvcache, crates/flash-attn/src/kvcache.rs; fixed-length
    // layout, p.seqlen_k = the keys one sequence's cache can hold). K and V are then the caches:
    // contiguous, maps (head_dim, seqlen_cache, kv heads, cache rows) read at the sequence's cache
    // row, or paged, maps (head_dim, page_size, kv heads, pages) read in boxes of page_box_rows
    // rows (load.cuh, load_paged_rows). Keys past a sequence's count are masked; their rows in
    // the cache are read (0 · NaN: unused cache memory must hold finite values, as zeros do).
    const uint32_t* seqused_k;    // (batch) keys each sequence attends to, or null: seqlen_k
    const uint32_t* kv_batch_idx; // (batch) cache row of each sequence (contiguous), or null: b
    const uint32_t* page_table;   // (batch, max_pages) page of every page_size keys, or null
    int max_pages;
    FastDiv page_size;
    int page_box_rows;            // gcd(page_size, kBlockN): a box never crosses a page
    // Attention sinks (gpt-oss): one logit per q head (natural-log units, like a scaled score)
    // that joins every row's softmax denominator and never the output; null: none. The LSE
    // includes it (so the backward needs nothing else). Split-KV partials leave it to the combine.
    const float* sinks;
    // kTransposeV kernels only: 1 when every tile's rows fit the first consumer warpgroup's 64
    // (decode: seqlen_q x group <= 64 packed rows), so the second one, idle otherwise, joins the
    // V transposer (transpose_v.cuh) and the first runs without pingpong. Set by the host.
    int solo_consumer;
    // Split-KV calls of the `_cm` kernels only: 1 when the key shares of each tile run as one
    // thread-block cluster and merge through distributed shared memory (cluster_combine.cuh),
    // instead of partials in o_accum / lse_accum and the combine kernel. Set by the host with the
    // launch's cluster size (num_splits), a grid of one CTA per (tile, share), static tile order.
    int cluster_combine;
    // kPageWarp kernels: a paged cache's page stride in kv-head strides (load.cuh issue_page_box;
    // last, so that the other kernels read their parameters where they did).
    int page_units;
    // FP8 calls with V^T written by the kernel itself (fp8_vt_fill.cuh; null vt_done: the
    // pre-pass wrote it before the launch): V and the V^T it fills, as the pre-pass has them;
    // vt_done: vt_pairs counts of units written, one per (sequence, kv head), then the count of
    // units claimed and the count of CTAs done; zero at launch, and cleared by the launch's last
    // CTA (vt_fill_reset). A pair is ready at vt_units_per_pair units.
    Fp8PrepassParams vt_src;
    int* vt_done;
    int vt_units_per_pair;
    int vt_pairs;
};

// Query rows per Q descale block of the fp8 kernels (one consumer warpgroup's rows): mirrored
// by flash_attn3::fp8::Q_BLOCK_ROWS.
constexpr int kFp8QBlockRows = 64;
// Keys per K descale block: flash_attn3::fp8::K_BLOCK_ROWS (the 128-key blocks of the d64 and
// d256 kernels; d128's 256-key blocks span two, mainloop.cuh scale_by_k_blocks).
constexpr int kFp8KBlockKeys = 128;

// The combine kernel's parameters (combine.cuh).
struct CombineParams {
    const float* o_accum;   // as in FwdParams
    const float* lse_accum;
    void* out;              // (total_q, heads, head_dim_v), contiguous
    float* lse;             // the forward's LSE layout (FwdParams::lse)
    int num_splits;
    int total_q;
    int heads;
    int head_dim_v;
    int seqlen_q;           // fixed-length calls: token t is query t % seqlen_q of sequence t / seqlen_q
    int varlen;             // 1: lse is (heads, total_q)
    int64_t lse_head_stride;
    int64_t lse_batch_stride;
    const float* sinks;     // (heads) or null, as FwdParams::sinks
    int warps_per_row;      // 1, 2, 4 or 8 (combine.cuh)
};

}  // namespace fa3
