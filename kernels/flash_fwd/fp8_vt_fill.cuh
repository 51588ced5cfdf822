// The fp8 forward's V^T written by the forward kernel itself, in the background (FwdParams::vt_done
// set by the host): the pre-pass's work (fp8_prepass.cuh: the same V^T layout, key order and zeros
// past each sequence's end) done by warps 2 and 3 of the producer warpgroup, idle otherwise in
// these kernels, while the consumers compute. Only the (sequence, kv head) pairs of the first
// tiles must be ready before those tiles' first P·V; the rest is written under the attention
// instead of in a pass before it (docs/kernels/forward-fp8.md, "V^T in the kernel").
//
// Work is cut into units of kVtFillUnitKeys (128) keys by kVtFillUnitCols (up to 128) head-dim
// bytes of one (sequence, kv head) pair: one box of the V^T map the TMA thread loads with (d256:
// two units per 128 keys). Units are claimed from a global counter in the order of the pairs
// (sequence-major, kv heads inner: the order in which the tile scheduler first reaches them,
// scheduler.cuh get_tile). The two warps hold almost nothing in registers, so
// they fit the 24 registers the 256-key d128 kernel leaves its producers:
// - the unit's V rows land in shared memory by one TMA load (`in`, through FwdParams::tma_v_rows:
//   V as the caller laid it out, in K's swizzled layout);
// - each warp transposes half of them (alternate 32-byte column pairs) with ldmatrix.trans, two
//   byte permutes and stmatrix per 512 bytes (transpose_v.cuh transpose_v_step, the kTransposeV
//   kernels' step) into `out`, the V^T box;
// - lane 0 of warp 2 stores the box with one TMA store, waits until its writes are performed, and
//   publishes the unit by a release add to its pair's count; the TMA thread acquires a pair's
//   full count before its first V^T load of the pair (wait_vt_pair), then fences into the async
//   proxy.
// docs/kernels/forward-fp8.md, "V^T in the kernel", versions 5-7.
#pragma once
#include <cstdint>

#include "../primitives/atomic.cuh"
#include "../primitives/mbarrier.cuh"
#include "../primitives/warp.cuh"
#include "../primitives/tma.cuh"
#include "../primitives/trace.cuh"
#include "output.cuh"
#include "transpose_v.cuh"
#include "params.cuh"
#include "traits.cuh"

namespace fa3 {

// Where unit u lies: its pair (sequence seq, kv head), its first key and head-dim byte, and the
// TMA coordinates of its V rows (tma_v_rows: col0, key row, kv head, batch; varlen calls address a
// sequence by its first token, in batch 0). A pair's units run keys-inner: key units
// (keys_padded / kVtFillUnitKeys, rounded up) of its first head-dim bytes, then of the next.
struct VtFillUnit {
    int pair, seq, kv_head, key0, col0, seqlen, row, batch;
};

template <class Tr> __device__ __forceinline__ VtFillUnit vt_fill_unit(const FwdParams& p, int u) {
    constexpr int kUnitKeys = Tr::kVtFillUnitKeys, kUnitCols = Tr::kVtFillUnitCols;
    const Fp8PrepassParams& src = p.vt_src;
    VtFillUnit w;
    w.pair = u / p.vt_units_per_pair;
    const int in_pair = u - w.pair * p.vt_units_per_pair;
    // One unit of columns up to d128: no division.
    const int key_units = (src.keys_padded + kUnitKeys - 1) / kUnitKeys;
    const int col_unit = Tr::kHeadDim > kUnitCols ? in_pair / key_units : 0;
    w.key0 = (in_pair - col_unit * key_units) * kUnitKeys;
    w.col0 = col_unit * kUnitCols;
    w.seq = w.pair / src.kv_heads;
    w.kv_head = w.pair - w.seq * src.kv_heads;
    if (src.cu_k != nullptr) {
        const int tok0 = (int)src.cu_k[w.seq];
        w.seqlen = (int)src.cu_k[w.seq + 1] - tok0;
        w.row = tok0 + w.key0;
        w.batch = 0;
    } else {
        w.seqlen = src.seqlen_k;
        w.row = w.key0;
        w.batch = w.seq;
    }
    return w;
}

// Lane 0: unit u's V rows into `in` by one TMA load (zeros past the tensor's rows and past
// head_dim_v), completing on `full`.
template <class Tr>
__device__ __forceinline__ void vt_fill_load(const FwdParams& p, int u, SharedStorage<Tr>& s, uint8_t* in) {
    const VtFillUnit w = vt_fill_unit<Tr>(p, u);
    mbar_arrive_expect_tx(&s.vt_fill_full, Tr::kVtFillUnitKeys * Tr::kVtFillUnitCols);
    tma_load_4d(&p.tma_v_rows, in, &s.vt_fill_full, w.col0, w.row, w.kv_head, w.batch);
}

// The launch leaves vt_done zeroed for the next one, so the host zeroes it once, not per call
// (crates/flash-attn/src/cuda/mod.rs vt_fill_counts; a memset per call cost a stream operation).
// Warp 2, after its CTA's writer loop: lane 0 waits until its CTA's TMA thread has stopped
// reading the counts, then counts the CTA done (vt_done[vt_pairs + 1]); the last CTA, whose
// atomic follows every other CTA's claims, publications and reads (fences on both sides), clears
// all of them.
template <class Tr> __device__ __forceinline__ void vt_fill_reset(const FwdParams& p, SharedStorage<Tr>& s, int lane) {
    int last = 0;
    if (lane == 0) {
        mbar_wait(&s.tma_done, 0);
        __threadfence();
        last = atomicAdd(p.vt_done + p.vt_pairs + 1, 1) == (int)gridDim.x - 1;
        __threadfence();
    }
    if (__shfl_sync(0xffffffffu, last, 0)) {
        for (int i = lane; i < p.vt_pairs + 2; i += 32) p.vt_done[i] = 0;
    }
}

// The writer's loop, on warps 2 and 3 of the producer warpgroup (w = 0, 1): claim a unit,
// transpose it (each warp half of its head-dim bytes), store it, publish it, until every unit is
// claimed. Lane 0 of warp 2 (the leader) claims, loads, stores and publishes; the warps meet at
// one named barrier per unit (kVtFillBarrier), where the leader hands over the next unit's
// index. The next unit's claim flies while the current one is transposed, its load is issued
// once the store has read `out` (so a unit's landed rows also say that `out` is free), and the
// leader's wait for the store's writes and its release overlap the other warp's next transpose.
template <class Tr> __device__ void vt_fill(const FwdParams& p, SharedStorage<Tr>& s, int w, int lane) {
    static_assert(Tr::kVtFill, "V^T written by the kernel");
    constexpr int kUnitKeys = Tr::kVtFillUnitKeys, kUnitCols = Tr::kVtFillUnitCols, kGroups = kUnitKeys / 16;
    uint8_t* in = s.vt_fill + kUnitKeys * kUnitCols;
    const uint32_t in_addr = smem_u32(in), out_addr = smem_u32(s.vt_fill);
    const TransposeLane l = transpose_lane(lane);
    const bool leader = w == 0 && lane == 0;
    const int units = p.vt_pairs * p.vt_units_per_pair;
    int* claims = p.vt_done + p.vt_pairs;
    if (leader) {
        const int first = atomicAdd(claims, 1);
        st_shared_u32(smem_u32(&s.vt_fill_next[1]), (uint32_t)first);
        if (first < units) vt_fill_load<Tr>(p, first, s, in);
    }
    named_barrier_sync(kVtFillBarrier, 64);
    int u = (int)ld_shared_u32(smem_u32(&s.vt_fill_next[1]));
    for (int taken = 0; u < units; ++taken) {
        // The next claim goes out now; its result is needed after this unit's transpose.
        const int claimed = leader ? atomicAdd(claims, 1) : 0;
        if (leader) trace_writer(taken, 0);
        mbar_wait(&s.vt_fill_full, taken & 1);
        if (leader) trace_writer(taken, 1);
        if (p.vt_src.cu_k != nullptr) {
            // Varlen: rows past the sequence's end hold the next sequence's keys; V^T has zeros
            // there (the pre-pass's layout), so they are cleared before the transpose.
            const VtFillUnit v = vt_fill_unit<Tr>(p, u);
            constexpr int kChunks = kUnitCols / 16;
            for (int j = max(v.seqlen - v.key0, 0) * kChunks + 32 * w + lane; j < kUnitKeys * kChunks; j += 64)
                st_shared_zero_16(in_addr + j * 16);
            named_barrier_sync(kVtFillBarrier, 64);
        }
        // V rows -> the V^T box, this warp's 32-byte column pairs.
#pragma unroll 1
        for (int pair = w; pair < kUnitCols / 32; pair += 2) {
#pragma unroll
            for (int g = 0; g < kGroups; ++g) transpose_v_step<Tr>(in_addr, out_addr, l, g, pair);
        }
        if (leader) trace_writer(taken, 2);
        // The generic-proxy accesses of both buffers, before the async proxy's: the store reads
        // `out`, the next load overwrites `in`. Slot taken % 2 is read by the other warp after the
        // barrier; the leader writes it again two units later, after the other warp passed the
        // barrier between (its read comes first).
        fence_proxy_async_smem();
        if (leader) st_shared_u32(smem_u32(&s.vt_fill_next[taken & 1]), (uint32_t)claimed);
        named_barrier_sync(kVtFillBarrier, 64);
        const int next = (int)ld_shared_u32(smem_u32(&s.vt_fill_next[taken & 1]));
        if (leader) {
            // One box through the V^T map the TMA thread loads with (keys past keys_padded and
            // rows past head_dim_v are not written). Published once its writes are performed:
            // the release pairs with the TMA thread's acquire (wait_vt_pair).
            const VtFillUnit v = vt_fill_unit<Tr>(p, u);
            tma_store_4d(&p.tma_v, s.vt_fill, v.key0, v.col0, v.kv_head, v.seq);
            bulk_commit_group();
            bulk_wait_group_read<0>();  // `out` read: the next unit's rows may land
            if (next < units) vt_fill_load<Tr>(p, next, s, in);
            trace_writer(taken, 3);
            bulk_wait_group<0>();
            trace_writer(taken, 4);
            fence_proxy_async_global();
            red_release_add(p.vt_done + v.pair, 1);
            trace_writer(taken, 5);
        }
        __syncwarp();
        u = next;
    }
    // Every unit's load has landed, its transpose passed the barrier and its store has been
    // performed: the buffer is free (the epilogue's whole staging, traits.cuh kOutWholeWhenFree).
    if (leader) mbar_arrive(&s.vt_fill_stopped);
    if (w == 0) vt_fill_reset<Tr>(p, s, lane);
}

// The TMA thread, before its first V^T load of a pair in calls with the fill: waits until every
// unit of the pair is written (spinning on an acquire load; the warps that write it never wait on
// anything, so this ends), then orders its TMA reads after them.
__device__ __forceinline__ void wait_vt_pair(const FwdParams& p, int pair) {
    while (ld_acquire(p.vt_done + pair) < p.vt_units_per_pair) __nanosleep(64);
    fence_proxy_async_global();
}

}  // namespace fa3
