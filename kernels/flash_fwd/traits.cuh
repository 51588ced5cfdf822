// Compile-time shape of one kernel instantiation and its shared-memory layout.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../primitives/wgmma_ops.cuh"
#include "tile_info.cuh"

namespace fa3 {

// kHeadDim: the (padded) head dim of q, k and v; kBlockN: keys per pipeline stage;
// kDtype: DT_BF16, DT_F16 or DT_E4M3 (fp8 inputs, bf16/f16 output); kConsumerWGs: consumer
// warpgroups of 64 query rows each (one: the decode kernels, two CTAs per SM, kCtasPerSm); kTransposeV (fp8): V as the caller laid it out, transposed in
// shared memory by the kernel (transpose_v.cuh), instead of V^T from the pre-pass.
// kClusterCombine: split-KV shares merged in a thread-block cluster (cluster_combine.cuh), in
// kernels of their own. kPageWarp: small-page caches' page indices looked up by a warp of their
// own (load.cuh page_warp), in kernels of their own. kPlain (fp8): the options of options.cuh
// compiled out, for the calls without them.
template <int kHeadDim_, int kBlockN_, int kDtype_, int kConsumerWGs_ = 2, bool kTransposeV_ = false,
          bool kClusterCombine_ = false, bool kPageWarp_ = false, bool kPlain_ = false>
struct FwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kDtype = kDtype_;
    static constexpr int kConsumerWGs = kConsumerWGs_;
    // FP8 kernels read q, k, v as e4m3 and V transposed (keys contiguous, written by the pre-pass
    // in fp8_prepass.cuh or, with kTransposeV, by two producer warps in shared memory), apply
    // descales, and write a 16-bit output. docs/kernels/forward-fp8.md.
    static constexpr bool kFp8 = kDtype_ == DT_E4M3;
    static constexpr bool kTransposeV = kFp8 && kTransposeV_;
    // A plain kernel (options.cuh) reads pack-GQA, varlen, split-KV, softcap, direct stores and
    // per-block descales as off, and serves no cache either: the fp8 `_plain` kernels, which the
    // host picks for calls without those options (forward.rs, OwnKernel::Plain).
    static constexpr bool kPlain = kFp8 && kPlain_;
    // Whether the kernel may serve a KV-cache call (a page table, key counts per sequence, cache
    // rows). fp8 cache calls take the kTransposeV kernels (forward.rs pick_fp8), so the other fp8
    // kernels compile the cache paths out: with them, ptxas spilled 308 / 520 bytes at d256, 188 /
    // 316 at d128 on 256 keys and 136 / 248 at d64 on three warpgroups; without, 156 / 240, 56 / 76
    // and 84 / 128, at the same speed (docs/kernels/forward-fp8.md, sessions 70-71).
    static constexpr bool kServesCache = (!kFp8 || kTransposeV) && !kPlain;
    // The consumer warpgroup's index made warp-uniform once, through redux.sync (kernel.cu), so
    // that ptxas keeps what derives from it (this warpgroup's Q rows, the operand descriptors,
    // barrier ids) on the uniform datapath: the descriptors then need no redux.sync at a tile's
    // start nor before each wgmma (OperandDescs). fp8 kernels without kTransposeV only: spills
    // d256 plain 64 / 92 bytes → 8 / 8, and +0.2..+7.3% over the 30 fp8 cells of an H200 A/B;
    // the 16-bit kernels lost up to 14% with it (d64 unmasked) and keep the per-thread index, as
    // do the kTransposeV kernels (fp8 KV caches: one round of their A/B read neutral;
    // docs/kernels/forward-fp8.md, version 21).
    static constexpr bool kUniformWarpgroup = kFp8 && !kTransposeV;
    static constexpr int kElemBytes = kFp8 ? 1 : 2;
    using Elem = typename std::conditional<kFp8, uint8_t, uint16_t>::type;
    static constexpr int kBlockM = 64 * kConsumerWGs;  // query rows per tile
    static constexpr int kThreads = 128 * (1 + kConsumerWGs);
    static constexpr int kStages = 2;
    // Q buffers: with two, the producer loads the next tile's Q while the consumers still work
    // on the current one (no room at d256: fp8's O staging tile takes the second buffer's place).
    // (fp8's one-byte tiles leave room for both next to d128's 256-key K and V^T rings.)
    // (16-bit d128 on one consumer warpgroup, two CTAs per SM: one, for the room.)
    static constexpr bool kTwoCtasD128 = kConsumerWGs_ == 1 && kHeadDim_ == 128 && !kFp8;
    static constexpr int kQStages = kHeadDim_ <= 128 && (kBlockN_ <= 128 || kFp8) && !kTwoCtasD128 ? 2 : 1;
    // CTAs resident per SM: one (a CTA's shared memory fills most of the SM), or two for the
    // one-warpgroup decode kernels, whose tiles are a sequence's few query rows: two CTAs run two
    // independent chains of key blocks per SM (docs/kernels/kvcache.md, session 38).
    static constexpr int kCtasPerSm = kConsumerWGs == 1 ? 2 : 1;
    // setmaxnreg split of a CTA's registers (128 producer + 128·kConsumerWGs consumer threads;
    // 64K per SM over kCtasPerSm CTAs).
    // 2 consumer warpgroups: 40 / 232 leaves the producer's TMA loop spill-free; d256's consumers
    // need 240 (they spill at 232), so its producer gets 24 (and spills a few values to local
    // memory). 3 consumer warpgroups: 32 / 160 (128·32 + 384·160 = 65536). 1 (two CTAs per SM):
    // 40 / 216 (128·40 + 128·216 = 32768).
    static constexpr bool kWideConsumers = kHeadDim_ > 128 || kBlockN_ > 128;  // also fp8 d128's 256 keys
    static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : kWideConsumers ? 24 : 40;
    static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : kConsumerWGs == 1 ? 216 : kWideConsumers ? 240 : 232;
    static_assert(kConsumerWGs >= 1 && kConsumerWGs <= 3, "1, 2 or 3 consumer warpgroups");
    static_assert(128 * kProducerRegs + 128 * kConsumerWGs * kConsumerRegs <= 65536 / kCtasPerSm, "register split");
    // Tiles are stored as column blocks of [rows][kColElems] elements, swizzled by TMA, the layout
    // wgmma reads through its descriptors: 128-byte rows (1024-byte atoms of 8 rows) when a row
    // of the head dim is a multiple of 128 bytes, else 64-byte rows (64B swizzle, 512-byte atoms):
    // head dim 96 in 16 bits, head dim 64 in fp8.
    static constexpr int kSwizzle = (kHeadDim_ * kElemBytes) % 128 == 0 ? 128 : 64;  // bytes per row of a column block
    static constexpr int kColElems = kSwizzle / kElemBytes;
    static constexpr int kAtomBytes = 8 * kSwizzle;  // 8 rows: the wgmma SBO
    static constexpr int kColBlocks = kHeadDim / kColElems;
    // One wgmma k-step reads 32 bytes of each row: 16 elements of 16 bits, 32 of e4m3.
    static constexpr int kStepElems = 32 / kElemBytes;
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * kElemBytes;
    // FP8: V^T tiles are kHeadDim rows of kBlockN keys, in 128-byte (128-key) column blocks (a
    // block that were no multiple of 128 keys would load its last column block whole; P·V's
    // k-steps stop at kBlockN).
    static constexpr int kVtColBlocks = kFp8 ? (kBlockN + 127) / 128 : 0;
    static_assert(!kFp8 || kBlockN % 32 == 0, "fp8 key blocks are whole k-steps of 32 keys");
    static_assert(!kTransposeV || kBlockN == 128, "the in-kernel V transpose moves 128-key blocks");
    // Bytes of one V stage: V (16 bits), or V^T's column blocks (fp8).
    static constexpr uint32_t kVStageBytes = kFp8 ? kVtColBlocks * 128 * kHeadDim : kKVBytes;
    // Head-dim rows of one V^T TMA box (load.cuh load_vt_block): at most 128, so that d256's column
    // block is two boxes and the in-kernel writer's 128 x 128 unit is one (fp8_vt_fill.cuh).
    static constexpr int kVtBoxRows = kHeadDim_ < 128 ? kHeadDim_ : 128;
    // kTransposeV: V lands (TMA) in K's layout in the `v_raw` ring (two stages, one at d256 for
    // room), and warps 2 and 3 of the producer warpgroup (with the second consumer warpgroup in
    // decode calls, transpose_v.cuh) write it transposed into the V ring.
    static constexpr int kTransposeThreads = kTransposeV ? 64 : 0;
    static constexpr int kVRawStages = kTransposeV && kHeadDim_ <= 128 ? 2 : 1;
    static constexpr int kVRawElems = kTransposeV ? kBlockN * kHeadDim : 16;
    // The output: 16-bit, staged (TMA-store epilogue) in column blocks of kOutColElems elements
    // (the input's layout for 16-bit kernels; 64 columns, 128-byte rows for fp8).
    static constexpr int kOutSwizzle = kFp8 ? 128 : kSwizzle;
    static constexpr int kOutColElems = kOutSwizzle / 2;
    static constexpr int kOutColBlocks = kHeadDim / kOutColElems;
    // The epilogue stages O in shared memory and TMA-stores it (d <= 128 with 128-key blocks, and
    // every fp8 kernel but d256 with kTransposeV; d256 and the 176-key blocks in 16 bits, and that
    // one, have no room next to Q and the K/V rings, and store straight from registers).
    static constexpr bool kTmaStoreO =
        kFp8 ? !(kTransposeV && kHeadDim_ > 128) : (kHeadDim_ <= 128 && kBlockN_ <= 128);
    // O written in 16-byte pieces (epilogue.cuh). The direct store (16-bit d192 and d256, varlen
    // tails, pack-GQA): each quad of lanes swaps its column pairs first, then one 16-byte global
    // store per lane (session 58, H200, against 4-byte stores in one call: 16-bit d256 +6..+10% at
    // 512-2k keys, +2..+3% at 4k; the direct path forced on d128, fp8 +4..+10%, bf16 +2..+7%). The
    // staged store into the TMA store's tile: one stmatrix per 8 columns of a warp's 16 rows
    // instead of four 4-byte stores (session 59: fp8 d64 +1%, fp8 d128 -1..+2%, 16-bit even).
    // Not in fp8 d256 on the pre-pass, whose consumers spill at 240 registers: the direct code
    // (compiled there only for varlen tails) grew its spill loads from 184 to 336 bytes and its
    // calls ran 1-7% slower, stmatrix to 332 bytes and 1-3% slower; it keeps 4-byte stores. The
    // plain d256 kernel (options.cuh) spills less and takes stmatrix (session 72: 104 / 160 → 92 /
    // 144 bytes of spills, within noise on an H200).
    static constexpr bool kWideStoresO = !(kFp8 && !kTransposeV && kHeadDim_ == 256 && !kPlain);
    // The staging tile holds the column blocks of kOutPasses passes at a time: fp8 d256 stages O in
    // two passes of 128 columns (32 KiB), so that the other 32 KiB hold the V^T writer's unit
    // (kVtFill; its smem was full). The epilogue stages a pass, has its bulk stores read it, then
    // stages the next (epilogue.cuh).
    static constexpr int kOutPasses = kFp8 && !kTransposeV && kHeadDim_ == 256 ? 2 : 1;
    static constexpr int kOutPassBlocks = kOutColBlocks / kOutPasses;
    static_assert(kOutColBlocks % kOutPasses == 0, "whole column blocks per pass");
    // Split-KV shares merged in a thread-block cluster (cluster_combine.cuh): kernels of their own
    // (the `_cm` instantiations in kernel.cu), since compiled into the others the code moved their
    // register allocation and made them 2-6% slower (docs/kernels/kvcache.md, session 34). The
    // merge stages a share's rows in the O staging tile.
    static constexpr bool kClusterCombine = kClusterCombine_;
    static_assert(!kClusterCombine || (kTmaStoreO && kConsumerWGs_ == 2 && !kFp8), "cluster merge: 16-bit, 2 WGs, staged O");
    // The softmax's lazy running max and the O rescale it lets the consumers skip (softmax.cuh,
    // mainloop.cuh rescale_o; version 29): every kernel but the 16-bit three-warpgroup d64 one,
    // whose 160 registers measured 4-7% slower with it. The fp8 one (P in a quarter of S's
    // registers) gains 2-6% from 8k keys with it, loses 1-3% at 1k-2k (forward-fp8.md, version 6).
    static constexpr bool kLazyMax = kConsumerWGs != 3 || kFp8;
    // The one-warpgroup decode kernels: a warp's rows that lie past the tile's last query (decode
    // tiles: seqlen_q x group rows of 64, 4 for the Llama-3.2-1B shape) skip the softmax, their p
    // set to 0 (softmax.cuh `live`); with two CTAs per SM their consumers' warp 0 share an SMSP.
    static constexpr bool kSkipPaddingRows = kConsumerWGs == 1;
    // Every 4th exponential on the FMA pipe (softmax.cuh kExp2FmaEvery): fp8 d128 on 128-key
    // blocks, +2..+4% there; every 8th in fp8 d64 on two warpgroups (the masked calls under 2k
    // queries), +3..+4% (version 7); every other kernel measured 1-14% slower with it
    // (forward-fp8.md), fp8 d64 on three warpgroups 3.5-5% slower at every 8th or 16th.
    // The boundary blocks' row masks made per block instead of held (mainloop.cuh row_mask): fp8
    // d256, whose consumers spill at 240 registers (125 -> 72 spill instructions; H200, same call:
    // +1..+7%). The other kernels measured -3.5..+5% with it (noise-level or worse), and keep it held.
    static constexpr bool kRowMaskPerBlock = kFp8 && !kTransposeV && kHeadDim_ == 256;
    static constexpr int kExp2FmaEvery = !kFp8 || kTransposeV ? 0
                                         : kHeadDim_ == 128 && kBlockN_ == 128 ? 4
                                         : kHeadDim_ == 64 && kConsumerWGs == 2 ? 8
                                                                                : 0;
    // Paged caches of small pages, 16 bits (load.cuh page_warp): warp 3 of the producer
    // warpgroup looks up each key block's page indices into a ring kPageSlots blocks deep, a box
    // of at least 16 rows each. Kernels of their own (the `_pw` instantiations in kernel.cu):
    // compiled into the default ones it left their SASS rescheduled and their contiguous split
    // calls 2-5% slower (docs/kernels/kvcache.md, session 35).
    static constexpr bool kPageWarp = kPageWarp_;
    static_assert(!kPageWarp || (!kFp8 && !kClusterCombine_), "page warp: 16-bit kernels without the cluster merge");
    static constexpr int kPageSlots = kPageWarp ? 4 : 1;
    static constexpr int kMaxBlockBoxes = kPageWarp ? kBlockN / 16 : 1;
    static_assert(kMaxBlockBoxes <= 32, "one page warp lane per box");
    // K and V tiles in 8-row groups (kPageWarp kernels): [8-row group][column block][8 rows]
    // [kColElems] instead of [column block][kBlockN rows][kColElems], so that the rows of a page,
    // every column of them, are one contiguous region that one TMA box fills (load.cuh
    // issue_page_box): at d128 a page of 16 keys is one issue instead of two. The wgmma
    // descriptors step between column blocks by kKVColBlockBytes and between 8-row groups (K's
    // SBO, V's 8-key groups) by kKVGroupBytes. With one column block (d64) both layouts are the same.
    static constexpr bool kKVRowGroups = kPageWarp;
    static constexpr uint32_t kKVColBlockBytes = kKVRowGroups ? kAtomBytes : kBlockN * kSwizzle;
    static constexpr uint32_t kKVGroupBytes = kKVRowGroups ? kColBlocks * kAtomBytes : kAtomBytes;
    // The consumer loop without intra-warpgroup overlap (mainloop.cuh consumer_serial): fp8 d128 on
    // 256-key blocks, the shape of cuDNN's fp8 kernel (docs/kernels/forward-fp8.md, version 9).
    // There every 4th / 8th exponential on the FMA pipe measured 5% / 1% slower (version 9; every
    // 8th again 5% slower in version 10).
    static constexpr bool kSerialConsumer = kFp8 && kBlockN_ == 256;
    // P·V in this many parts, each issued inside the turn as soon as its P is packed (version 10:
    // 2 parts +1..+3.5%, 4 parts +3..+5%, 8 parts 1-2% under 4).
    static constexpr int kSerialPVParts = 4;
    // The row sums' chains seeded with their first p (softmax.cuh kSeedSums; 4 FADDs fewer per row
    // and exponentiated part): fp8 d128 on 256 keys -0.2..+1.3% (session 55, H200), fp8 d256
    // -0.4..+1.4% (+3.5% at 16k unmasked in a first call, not reproduced); fp8 d64 measured 3%
    // slower with it, the 16-bit kernels even (forward-fp8.md, version 11); fp8 d64 again -0.3..+0.4%
    // against version 17 (session 66).
    static constexpr bool kSeedRowSums = kSerialConsumer || (kFp8 && !kTransposeV && kHeadDim_ == 256);
    // The row max's chains seeded with their first pair of scores (softmax.cuh kSeedMax; 6 FMNMX
    // fewer per block and thread): fp8 d64 +0.7..+1.8%, d256 unmasked -0.1..+1.7% (session 65,
    // H200); bf16 d128 unmasked measured 0.7-1.5% slower with it at 2k-16k, so the 16-bit kernels
    // keep the -inf starts (forward-fp8.md, version 16).
    static constexpr bool kSeedRowMax = kFp8;
    // V^T written by the kernel itself (fp8_vt_fill.cuh; the host's choice per call, fp8.rs
    // VtWriter): every fp8 kernel with the pre-pass's layout. Two writer warps on one unit at a
    // time, 128 keys by up to 128 head-dim bytes (d256: two units per 128 keys, one V^T box each,
    // kVtBoxRows); its shared memory holds the V^T box they store (first, 1024-aligned for the TMA
    // store's 128B swizzle) and the unit's V rows (second). d256 finds the room in its O staging
    // tile (kOutPasses; docs/kernels/forward-fp8.md, "V^T in the kernel").
    static constexpr bool kVtFill = kFp8 && !kTransposeV;
    static constexpr int kVtFillUnitKeys = 128;
    static constexpr int kVtFillUnitCols = kVtBoxRows;
    static constexpr int kVtFillBytes = kVtFill ? 2 * kVtFillUnitKeys * kVtFillUnitCols : 16;
    // fp8 d256's two staging passes (kOutPasses) only while the writer runs: its buffer follows the
    // staging tile, so once it has stopped (or never ran: V^T by the pre-pass) the epilogue stages
    // every column at once in both, and no warpgroup waits inside its epilogue for the first
    // pass's stores to read the staging tile (SharedStorage::vt_fill_stopped; H200, session 72:
    // +1.5..+2.5% at d256 causal 512-2k, ±1% from 4k).
    static constexpr bool kOutWholeWhenFree = kOutPasses == 2 && kVtFill;
    // receive_tile (scheduler.cuh) loads the whole slot before it looks at the index: fp8 +0.2..+3.9%
    // in most cells; bf16 d128 unmasked ran 1-2% slower at 2k-16k with it (ptxas's schedule of its
    // loop, not the copy), so the 16-bit kernels keep the index-first copy (forward-sm90.md v37).
    static constexpr bool kReceiveWholeSlot = kFp8;
    // The consumer loop's ring stage and phase carried in registers and toggled (mainloop.cuh
    // consumer_pingpong) instead of made from the ring counter in each block: 6 instructions fewer
    // a block in fp8 d64 on three warpgroups, +1.1..+1.7% there (H200, session 66). The 16-bit d64
    // three-warpgroup kernels carry it too, where it measured neutral (bf16 d64 0.992-1.001x); the
    // two-warpgroup kernels measured within -1.4..+2.1%, noise-level, and keep the counter.
    static constexpr bool kRingState = kConsumerWGs == 3;
    static constexpr int kSRegs = kBlockN / 2;      // f32 accumulators of S per thread
    static constexpr int kORegs = kHeadDim / 2;     // f32 accumulators of O per thread
    // P as wgmma's register A operand: per k-step 4 registers of 2 (16-bit) or 4 (e4m3) values.
    static constexpr int kPSteps = kBlockN / kStepElems;
    static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "tile shape");
};

template <class Tr> struct SharedStorage {
    alignas(1024) typename Tr::Elem q[Tr::kQStages][Tr::kBlockM * Tr::kHeadDim];
    alignas(1024) typename Tr::Elem k[Tr::kStages][Tr::kBlockN * Tr::kHeadDim];
    alignas(1024) typename Tr::Elem v[Tr::kStages][Tr::kVStageBytes / Tr::kElemBytes];  // fp8: V^T
    alignas(1024) uint16_t o[Tr::kTmaStoreO ? Tr::kBlockM * Tr::kOutColElems * Tr::kOutPassBlocks : 8];  // O staging (kOutPassBlocks blocks of kOutColElems columns)
    alignas(Tr::kVtFill ? 1024 : 16) uint8_t vt_fill[Tr::kVtFillBytes];  // kVtFill: a V^T box, then V rows
    alignas(Tr::kTransposeV ? 1024 : 16) typename Tr::Elem v_raw[Tr::kVRawStages][Tr::kVRawElems];  // V as loaded
    alignas(8) uint64_t bar_q[Tr::kQStages];      // Q of a tile landed
    alignas(8) uint64_t q_empty[Tr::kQStages];    // every consumer warpgroup is done with that Q
    alignas(8) uint64_t full_k[Tr::kStages];      // K of a stage landed
    alignas(8) uint64_t full_v[Tr::kStages];      // V of a stage landed
    alignas(8) uint64_t empty_k[Tr::kStages];     // both consumer warpgroups are done with K of a stage
    alignas(8) uint64_t empty_v[Tr::kStages];     // ... and with V of a stage
    alignas(8) uint64_t full_v_raw[Tr::kVRawStages];  // kTransposeV: V of a stage landed in v_raw
    alignas(8) uint64_t empty_v_raw[Tr::kVRawStages]; // kTransposeV: the transposer warps are done with it
    alignas(8) uint64_t vt_fill_full;             // kVtFill: the writer's unit of V rows landed (fp8_vt_fill.cuh)
    int vt_fill_next[2];                          // kVtFill: the next unit, leader -> the other writer warp
    alignas(8) uint64_t tile_full;                // the scheduler thread published the next tile index
    alignas(8) uint64_t tile_empty;               // the consumers read it and the TMA thread issued its loads
    TileSlot tile[2];                             // tile k in slot k % 2, scheduler -> TMA thread, consumers
    int transpose_stop;                           // kTransposeV: the V ring position past the last block, or -1
    float cluster_lse[Tr::kClusterCombine ? 64 : 1];  // cluster_combine.cuh: this share's row LSEs
    // kPageWarp (last, so that the other kernels' layout stays as it was):
    alignas(8) uint64_t pages_full[Tr::kPageSlots];   // the page warp wrote a block's page indices
    alignas(8) uint64_t pages_empty[Tr::kPageSlots];  // K's and V's boxes of that block went out
    int block_pages[Tr::kPageSlots][Tr::kMaxBlockBoxes];  // a block's page indices, box by box
    int zero;  // 0 (kSerialConsumer: a value ptxas cannot fold, mainloop.cuh consumer_serial)
    // kVtFill (last, as above): the writer has stopped, its buffer is free (one arrival, from the
    // writer's leader or, in calls without the writer, at the start); the TMA thread has stopped
    // reading vt_done (vt_fill_reset).
    alignas(8) uint64_t vt_fill_stopped;
    alignas(8) uint64_t tma_done;
};

}  // namespace fa3
