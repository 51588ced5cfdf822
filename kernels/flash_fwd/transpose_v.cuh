// FP8 (FwdTraits::kTransposeV): V^T in shared memory. fp8 wgmma reads its B operand K-major only,
// so O += P·V needs V with the keys contiguous. TMA lands each V block in K's layout (the `v_raw`
// ring); warps 2 and 3 of the producer warpgroup, idle otherwise, write it transposed into the
// `v` ring that the consumers read. In a call whose tiles all fit the first consumer warpgroup
// (decode, FwdParams::solo_consumer) the second one would idle, so its four warps transpose too:
// six warps, three times the two's rate. Any V the kernel can load this way works, contiguous and
// paged KV caches included, with no pass over V before the call; the KV-cache calls use it
// (version 3 in docs/kernels/forward-fp8.md: on long prefill-shaped calls the two warps cap the
// kernel near 600 TFLOP/s, so those keep the pre-pass, fp8_prepass.cuh).
//
// Key order: inside each group of 16 keys, V^T holds the keys in the order P's registers hold
// them (mainloop.cuh, probs_to_a_operand), so that P needs no register shuffle: V^T column
// 16g + 4q + e holds key 16g + 2q + e for e < 2 and key 16g + 8 + 2q + e - 2 otherwise.
//
// One warp step moves 16 keys x 32 head-dim bytes: ldmatrix.trans reads four 8x8 matrices of
// 16-bit pairs (keys 0-7 and 8-15 of the group, two 16-byte column chunks), which hands lane
// (p = lane / 4, q = lane % 4) keys 2q, 2q + 1 (and 2q + 8, 2q + 9) at head-dim bytes 2p, 2p + 1:
// two byte permutes make the V^T words (2q, 2q + 1, 2q + 8, 2q + 9) of rows 2p and 2p + 1, which
// stmatrix writes as four 8-row matrices. Lanes p >= 4 swap their even and odd rows between the
// two matrices so that each matrix's 8 rows fall in 8 distinct swizzle chunks: ldmatrix and
// stmatrix are then both free of bank conflicts.
#pragma once
#include "../primitives/mbarrier.cuh"
#include "../primitives/tma.cuh"
#include "../primitives/warp.cuh"
#include "params.cuh"
#include "traits.cuh"

namespace fa3 {

// Byte offset of (key, head-dim byte col) in a V block as TMA loads it: column blocks of kColElems
// bytes per row, kBlockN rows each, swizzled (128B: 16-byte chunk ^= row % 8; 64B: ^= row / 2 % 4).
template <class Tr> __device__ __forceinline__ uint32_t v_raw_offset(int key, int col) {
    const uint32_t off = (col / Tr::kColElems) * Tr::kBlockN * Tr::kColElems + key * Tr::kColElems + col % Tr::kColElems;
    constexpr uint32_t kChunkMask = Tr::kSwizzle / 16 - 1;
    return off ^ (((off >> 7) & kChunkMask) << 4);
}

// Byte offset of (head-dim row, key position) in a V^T block: 128-key column blocks of kHeadDim
// rows of 128 bytes, 128B swizzle (what a TMA box of V^T would have written).
template <class Tr> __device__ __forceinline__ uint32_t vt_offset(int row, int pos) {
    const uint32_t off = (pos / 128) * Tr::kHeadDim * 128 + row * 128 + pos % 128;
    return off ^ (((off >> 7) & 7) << 4);
}

// Whether this call's second consumer warpgroup transposes V instead of computing (params.cuh).
template <class Tr> __device__ __forceinline__ bool solo_consumer(const FwdParams& p) {
    return Tr::kTransposeV && Tr::kConsumerWGs == 2 && p.solo_consumer != 0;
}

// Threads that transpose V: the producer's warps 2 and 3, and the second consumer warpgroup of a
// solo call.
template <class Tr> __device__ __forceinline__ int transposer_threads(const FwdParams& p) {
    return Tr::kTransposeThreads + (solo_consumer<Tr>(p) ? 128 : 0);
}

// A lane's fixed part of the transposer's step (below): its ldmatrix row, its stmatrix row and
// the byte permutes that pick its even and odd head-dim bytes.
struct TransposeLane {
    int ld_key, ld_chunk, st_row;
    uint32_t first, second;
};

__device__ __forceinline__ TransposeLane transpose_lane(int lane) {
    const int m = lane / 8, r = lane % 8, p = lane / 4;
    TransposeLane l;
    // This lane's ldmatrix row: key r (+8 in matrices 1 and 3) of the group, in the step's first
    // (matrices 0, 1) or second (2, 3) 16-byte column chunk.
    l.ld_key = r + 8 * (m % 2);
    l.ld_chunk = m / 2;
    // This lane's stmatrix row: V^T row 2r or 2r + 1 (matrices 0 / 1, swapped for r >= 4), +16 in
    // matrices 2 and 3.
    l.st_row = 16 * (m / 2) + 2 * r + ((m % 2) ^ (r >= 4));
    // Bytes (0, 2 | 4, 6) of (x, y): the even head-dim byte of keys (2q, 2q+1 | 2q+8, 2q+9); (1, 3 |
    // 5, 7): the odd one. First register even for lanes p < 4, odd for p >= 4 (the swap above).
    l.first = p < 4 ? 0x6420 : 0x7531;
    l.second = p < 4 ? 0x7531 : 0x6420;
    return l;
}

// One warp step: keys 16g .. 16g + 15 x head-dim bytes 32 pair .. + 31, raw -> vt (shared-memory
// addresses of a block as TMA loads V and of a V^T block).
template <class Tr>
__device__ __forceinline__ void transpose_v_step(uint32_t raw, uint32_t vt, const TransposeLane& l, int g, int pair) {
    uint32_t x[4], w[4];
    ldmatrix_x4_trans(raw + v_raw_offset<Tr>(16 * g + l.ld_key, 16 * (2 * pair + l.ld_chunk)), x);
    w[0] = __byte_perm(x[0], x[1], l.first);
    w[1] = __byte_perm(x[0], x[1], l.second);
    w[2] = __byte_perm(x[2], x[3], l.first);
    w[3] = __byte_perm(x[2], x[3], l.second);
    stmatrix_x4(vt + vt_offset<Tr>(32 * pair + l.st_row, 16 * g), w);
}

// One V block: v_raw -> v (both shared-memory addresses). t: the transposer thread, of `threads`
// (a multiple of 32).
template <class Tr>
__device__ __forceinline__ void transpose_v_block(uint32_t raw, uint32_t vt, int t, int threads) {
    const TransposeLane l = transpose_lane(t % 32);
    const int warp = t / 32, warps = threads / 32;
    constexpr int kGroups = Tr::kBlockN / 16, kSteps = kGroups * (Tr::kHeadDim / 32);
#pragma unroll 2
    for (int step = warp; step < kSteps; step += warps) transpose_v_step<Tr>(raw, vt, l, step % kGroups, step / kGroups);
}

// The transposer warps' loop: the V ring in the TMA thread's order (ring position it, continued
// across tiles), until the position the TMA thread names in transpose_stop. t: 0..threads-1.
template <class Tr> __device__ void v_transposer(SharedStorage<Tr>& s, int t, int threads) {
    for (int it = 0;; ++it) {
        const int raw = it % Tr::kVRawStages, stage = it % Tr::kStages;
        mbar_wait(&s.full_v_raw[raw], (it / Tr::kVRawStages) & 1);
        // A position, not a flag: the TMA thread may name the end while this warp still works on
        // the blocks before it (their barriers completed long ago).
        // Atomic on both sides: the TMA thread may write the word while a warp still reads it
        // for an earlier position (a benign race, but a race: compute-sanitizer's racecheck
        // reported the plain store and volatile load).
        if (atomicOr(&s.transpose_stop, 0) == it) break;
        // V^T's slot is free once the computing warpgroups (both, or the first of a solo call)
        // retired its last P·V.
        mbar_wait(&s.empty_v[stage], ((it / Tr::kStages) & 1) ^ 1);
        transpose_v_block<Tr>(smem_u32(s.v_raw[raw]), smem_u32(s.v[stage]), t, threads);
        // The as-loaded slot is free (TMA may refill it); the generic-proxy stores of V^T are
        // read next by wgmma (the async proxy).
        mbar_arrive(&s.empty_v_raw[raw]);
        fence_proxy_async_smem();
        mbar_arrive(&s.full_v[stage]);
    }
}

// The TMA thread, after its last tile (it: the V blocks it loaded): names ring position it as the
// end and completes that position's phase with an arrival without bytes (the arrive releases the
// store; the transposers' wait acquires it).
template <class Tr> __device__ __forceinline__ void stop_transposer(SharedStorage<Tr>& s, int it) {
    const int raw = it % Tr::kVRawStages;
    mbar_wait(&s.empty_v_raw[raw], ((it / Tr::kVRawStages) & 1) ^ 1);
    atomicExch(&s.transpose_stop, it);
    mbar_arrive(&s.full_v_raw[raw]);
}

}  // namespace fa3
