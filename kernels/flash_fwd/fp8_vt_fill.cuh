// The fp8 forward's V^T written by the forward kernel itself, in the background (FwdParams::vt_done
// set by the host): the pre-pass's work (fp8_prepass.cuh: the same V^T layout, key order and zeros
// past each sequence's end) done by warps 2 and 3 of the producer warpgroup, idle otherwise in
// these kernels, while the consumers compute. Only the (sequence, kv head) pairs of the first
// tiles must be ready before those tiles' first P·V; the rest is written under the attention
// instead of in a pass before it (docs/kernels/forward-fp8.md, "V^T in the kernel").
//
// Work is cut into units of kVtFillUnitKeys keys of one (sequence, kv head) pair, every column, claimed
// from a global counter in the order of the pairs (sequence-major, kv heads inner: the order in
// which the tile scheduler first reaches them, scheduler.cuh get_tile). A warp publishes each unit
// it wrote by a release add to its pair's count; the TMA thread acquires a pair's full count
// before its first V^T load of the pair (wait_vt_pair), then fences into the async proxy, since
// TMA reads what generic stores wrote.
//
// A unit's V rows land in the warp's staging area in shared memory by cp.async (no registers held
// while they fly, so the 24-40 registers the producer warpgroup keeps after setmaxnreg suffice),
// each row's 16-byte chunks rotated by its position so that the reads below fall in distinct banks;
// then lane (h, g, q) = (lane / 8, lane / 4 % 2, lane % 4) makes V^T word q of the 16-key groups
// g, g + 2 (keys 16g + 2q, + 1, + 8, + 9 in P's order, fp8_prepass.cuh) for the head-dim words h,
// h + 4, ...: four 4-byte shared-memory reads, one 4 x 4 byte transpose and four 4-byte stores
// per word, a warp's store covering 4 V^T rows x 32 contiguous keys (whole 32-byte sectors).
// The next unit's claim (an atomic whose result is used a unit later) and its copies run while
// the current unit is written and published.
#pragma once
#include <cstdint>

#include "../primitives/atomic.cuh"
#include "../primitives/cp_async.cuh"
#include "../primitives/warp.cuh"
#include "fp8_prepass.cuh"
#include "params.cuh"
#include "traits.cuh"

namespace fa3 {

// Makes this thread's generic-proxy global writes visible to the async proxy (TMA) and orders its
// async-proxy reads after what it acquired.
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Where unit u reads and writes.
struct VtFillUnit {
    const uint8_t* v;  // the pair's key 0 (its sequence's first token, its kv head)
    uint8_t* vt;       // the pair's V^T slab
    int key0;          // the unit's first key
    int seqlen;        // the sequence's keys (zeros from there)
};

template <class Tr> __device__ __forceinline__ VtFillUnit vt_fill_unit(const FwdParams& p, int u) {
    const Fp8PrepassParams& s = p.vt_src;
    VtFillUnit w;
    const int pair = u / p.vt_units_per_pair;
    w.key0 = (u - pair * p.vt_units_per_pair) * Tr::kVtFillUnitKeys;
    const int seq = pair / s.kv_heads, kv_head = pair - seq * s.kv_heads;
    int64_t base;
    if (s.cu_k != nullptr) {
        const int tok0 = (int)s.cu_k[seq];
        w.seqlen = (int)s.cu_k[seq + 1] - tok0;
        base = (int64_t)tok0 * s.v_token_stride;
    } else {
        w.seqlen = s.seqlen_k;
        base = (int64_t)seq * s.v_batch_stride;
    }
    w.v = s.v + base + (int64_t)kv_head * s.v_head_stride;
    w.vt = s.vt + (int64_t)pair * s.head_dim_v * s.keys_padded;
    return w;
}

// Byte offset of (unit row r, 16-byte chunk c) in a staging area: chunk c of row r sits at chunk
// (c + rot(r)) % chunks with rot(r) = (r / 2 % 4) + 4 (r / 16 % 2), so that the 8 rows one read
// instruction takes (16g + 2q + e for g < 2, q < 4, e fixed) land in 8 distinct chunks (d128:
// distinct banks; d64's 64-byte rows pair up, two-way). The rows r0 + {0, 1, 8, 9} of one lane
// share their rotation, q + 4 (g % 2).
template <class Tr> __device__ __forceinline__ uint32_t vt_fill_offset(int r, int c) {
    constexpr int kChunks = Tr::kHeadDim / 16;
    const int rot = ((r >> 1) & 3) | (((r >> 4) & 1) << 2);
    return (uint32_t)(r * Tr::kHeadDim + ((c + rot) % kChunks) * 16);
}

// Unit u's V rows into the staging area at shared address `stage` (zeros past the sequence's end),
// one commit group.
template <class Tr> __device__ __forceinline__ void vt_fill_load(const FwdParams& p, int u, uint32_t stage, int lane) {
    constexpr int kChunks = Tr::kHeadDim / 16;
    const VtFillUnit w = vt_fill_unit<Tr>(p, u);
#pragma unroll 1
    for (int j = lane; j < Tr::kVtFillUnitKeys * kChunks; j += 32) {
        const int r = j / kChunks, c = j % kChunks, key = w.key0 + r;
        if (c * 16 >= p.vt_src.head_dim_v) continue;  // d96 on the d128 kernel: V rows of 96 bytes
        const bool valid = key < w.seqlen;
        copy_16_or_zero(stage + vt_fill_offset<Tr>(r, c),
                        w.v + (int64_t)(valid ? key : 0) * p.vt_src.v_token_stride + c * 16, valid);
    }
    commit_copies();
}

// Unit u's V^T words from the staging area (this lane's share, header above). The unit's
// addresses are derived again from u here rather than kept from vt_fill_load: the producer
// warpgroup's 24-40 registers cannot hold them across the loop in vt_fill.
template <class Tr>
__device__ __forceinline__ void vt_fill_write(const FwdParams& p, int u, uint32_t stage, int lane) {
    constexpr int kChunks = Tr::kHeadDim / 16, D = Tr::kHeadDim;
    const VtFillUnit w = vt_fill_unit<Tr>(p, u);
    const int h = lane / 8, g = lane / 4 % 2, q = lane % 4;
    const uint32_t kp = (uint32_t)p.vt_src.keys_padded;
#pragma unroll 1
    for (int gg = g; gg < Tr::kVtFillUnitKeys / 16; gg += 2) {
        const int group_key = w.key0 + 16 * gg;
        if (group_key >= p.vt_src.keys_padded) break;  // past the V^T rows' end (a multiple of 16 keys)
        const int rot = q + 4 * (gg & 1);
        const uint32_t rows = stage + (16 * gg + 2 * q) * D;  // rows r0, r0 + 1, r0 + 8, r0 + 9
        uint8_t* out = w.vt + (int64_t)(4 * h) * kp + group_key + 4 * q;
#pragma unroll 2
        for (int c = h; c < p.vt_src.head_dim_v / 4; c += 4, out += 16 * kp) {
            const uint32_t at = rows + ((c / 4 + rot) % kChunks) * 16 + 4 * (c % 4);
            uint32_t t[4];
            transpose_bytes_4x4(ld_shared_u32(at), ld_shared_u32(at + D), ld_shared_u32(at + 8 * D),
                                ld_shared_u32(at + 9 * D), t);
            *reinterpret_cast<uint32_t*>(out) = t[0];
            *reinterpret_cast<uint32_t*>(out + kp) = t[1];
            *reinterpret_cast<uint32_t*>(out + 2 * kp) = t[2];
            *reinterpret_cast<uint32_t*>(out + 3 * kp) = t[3];
        }
    }
}

// A producer warp's loop (warps 2 and 3; `warp` 0 or 1 picks its staging area): claim, load,
// write, publish, until every unit is claimed.
template <class Tr> __device__ void vt_fill(const FwdParams& p, SharedStorage<Tr>& s, int warp, int lane) {
    static_assert(Tr::kVtFill, "V^T written by the kernel");
    const uint32_t stage = smem_u32(s.vt_fill + warp * (Tr::kVtFillBytes / 2));
    const int units = p.vt_pairs * p.vt_units_per_pair;
    int* claims = p.vt_done + p.vt_pairs;
    int u = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(claims, 1) : 0, 0);
    if (u < units) vt_fill_load<Tr>(p, u, stage, lane);
    while (u < units) {
        // The next claim goes out now; its result is needed after this unit's writes.
        const int claimed = lane == 0 ? atomicAdd(claims, 1) : 0;
        wait_all_copies();
        __syncwarp();
        vt_fill_write<Tr>(p, u, stage, lane);
        __syncwarp();  // every lane's reads of the staging area, before the next unit's copies
        const int next = __shfl_sync(0xffffffffu, claimed, 0);
        if (next < units) vt_fill_load<Tr>(p, next, stage, lane);
        // Every lane's stores, then one release per unit: __syncwarp orders the lanes' writes
        // before lane 0's release add (cumulative), which the TMA thread's acquire pairs with.
        fence_proxy_async_global();
        __syncwarp();
        if (lane == 0) red_release_add(p.vt_done + u / p.vt_units_per_pair, 1);
        u = next;
    }
}

// The TMA thread, before its first V^T load of a pair in calls with the fill: waits until every
// unit of the pair is written (spinning on an acquire load; the warps that write it never wait on
// anything, so this ends), then orders its TMA reads after them.
__device__ __forceinline__ void wait_vt_pair(const FwdParams& p, int pair) {
    while (ld_acquire(p.vt_done + pair) < p.vt_units_per_pair) __nanosleep(64);
    fence_proxy_async_global();
}

}  // namespace fa3
