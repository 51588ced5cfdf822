// Opt-in timeline of one CTA, for finding where a kernel's cycles go (build with
// FA3_NVCC_FLAGS=-DFA3_TRACE; scripts/trace_timeline.py reads the output). Thread 0 of each
// warpgroup of CTA 0 stamps the SM clock at numbered points of its loop into a global buffer (the
// kernels leave no shared memory to spare), for the loop iterations [kTraceFirst, kTraceFirst +
// kTraceIters) and at the tile boundaries of a few tiles; with FA3_TRACE=1 in the environment the
// host then launches fa3_trace_dump, which prints one line per (warpgroup, iteration): "FA3T wg
// iter t0 .. t7", and per (warpgroup, tile): "FA3E wg tile t0 .. t7". Without -DFA3_TRACE every
// stamp compiles away. ptxas does not move instructions across a clock read, so the stamps also
// pin the order of what lies between them: a traced build measures phase lengths, not A/B results.
#pragma once
#include <cstdint>
#include <cstdio>

namespace fa3 {

#ifdef FA3_TRACE
#ifdef FA3_TRACE_WARPS
// FA3_NVCC_FLAGS="-DFA3_TRACE -DFA3_TRACE_WARPS": lane 0 of every warp stamps, as "warpgroup"
// wg + 4·(warp within its warpgroup), so that one run shows how far a warpgroup's warps drift
// apart (scripts/trace_timeline.py --serial --warps; forward-fp8.md, version 11).
constexpr int kTraceWGs = 16, kTracePoints = 8;
#else
constexpr int kTraceWGs = 4, kTracePoints = 8;
#endif
// Loop stamps ("FA3T"): iterations [kTraceFirst, kTraceFirst + kTraceIters) of the key-block loop.
constexpr int kTraceFirst = 16, kTraceIters = 48;
__device__ uint32_t trace_buf[kTraceWGs][kTraceIters][kTracePoints];
// Tile stamps ("FA3E"; the tile boundary: tail, epilogue, the next tile's first block), by the
// CTA's tile count for tiles [kTraceFirstTile, kTraceFirstTile + kTraceTiles); consumers' point 7:
// the next tile's slot wait passed (scheduler.cuh receive_tile).
constexpr int kTraceFirstTile = 1, kTraceTiles = 12;
__device__ uint32_t trace_edge_buf[kTraceWGs][kTraceTiles][kTracePoints];
// Boundary detail stamps ("FA3F", same tiles): inside the epilogue (epilogue.cuh: 0 entry, 1
// staging free, 2 staged, 3 fenced, 4 store recorded (issued later: PendingStore), 5 done, LSE
// included) and the step to the next tile (kernel.cu: 7 its receive starts, 6 it is received, its
// fields copied from the scheduler thread's slot).
__device__ uint32_t trace_fine_buf[kTraceWGs][kTraceTiles][kTracePoints];

// The SM's cycle counter (a volatile read, so that ptxas keeps it where it stands).
__device__ __forceinline__ uint32_t sm_clock() {
    uint32_t c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
    return c;
}

// Thread 0 of warpgroup wg in CTA 0 (with FA3_TRACE_WARPS lane 0 of each of its warps) writes the
// clock into row i (skipped outside [0, kRows)).
template <int kRows>
__device__ __forceinline__ void clock_stamp(uint32_t (&buf)[kTraceWGs][kRows][kTracePoints], int wg, int i,
                                            int point) {
#ifdef FA3_TRACE_WARPS
    const bool stamps = threadIdx.x % 32 == 0;
    const int row = wg + 4 * (threadIdx.x % 128 / 32);
#else
    const bool stamps = threadIdx.x % 128 == 0;
    const int row = wg;
#endif
    if (blockIdx.x == 0 && stamps && i >= 0 && i < kRows) buf[row][i][point] = sm_clock();
}
__device__ __forceinline__ void trace_stamp(int wg, int iter, int point) {
    clock_stamp(trace_buf, wg, iter - kTraceFirst, point);
}
#ifdef FA3_TRACE_CTA
// Per-CTA mode (FA3_NVCC_FLAGS="-DFA3_TRACE -DFA3_TRACE_CTA"), for launches of a single tile per
// CTA such as split-KV decode calls: every CTA stamps the global timer (ns, comparable across SMs)
// at the tile-boundary points of its first tile and at its life points (trace_life, below); the
// dump prints, per point, the min / mean / max over the CTAs relative to the first CTA's entry.
constexpr int kTraceCtas = 264, kTraceLife = 8;
__device__ unsigned long long trace_cta_edges[kTraceCtas][kTraceWGs][kTracePoints];
__device__ unsigned long long trace_cta_life[kTraceCtas][kTraceLife];
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ void trace_edge(int wg, int tile, int point) {
    if (tile == 0 && threadIdx.x % 128 == 0 && blockIdx.x < kTraceCtas)
        trace_cta_edges[blockIdx.x][wg][point] = global_ns();
}
// Point 0: entry, 1: barriers initialised (thread 0); 2: the TMA thread done; 3: the first
// consumer warpgroup done; the TMA thread's start: 4 registers handed over, 5 descriptors
// prefetched, 6 first tile index received; 7: the first consumer warpgroup's registers taken.
__device__ __forceinline__ void trace_life(int point) {
    if (blockIdx.x < kTraceCtas) trace_cta_life[blockIdx.x][point] = global_ns();
}
#else
__device__ __forceinline__ void trace_edge(int wg, int tile, int point) {
    clock_stamp(trace_edge_buf, wg, tile - kTraceFirstTile, point);
}
__device__ __forceinline__ void trace_fine(int wg, int tile, int point) {
    clock_stamp(trace_fine_buf, wg, tile - kTraceFirstTile, point);
}
__device__ __forceinline__ void trace_life(int) {}
#endif
#if !defined(FA3_TRACE_CTA)
// The fp8 V^T writer ("FA3W 0 unit t0 .. t7"): lane 0 of the writer warp (fp8_vt_fill.cuh) in CTA
// 0, by the count of units it took, for units [kTraceFirstTile, kTraceFirstTile + kTraceTiles).
__device__ uint32_t trace_writer_buf[1][kTraceTiles][kTracePoints];
__device__ __forceinline__ void trace_writer(int unit, int point) {
    const int i = unit - kTraceFirstTile;
    if (blockIdx.x == 0 && i >= 0 && i < kTraceTiles) trace_writer_buf[0][i][point] = sm_clock();
}
#else
__device__ __forceinline__ void trace_writer(int, int) {}
#endif

// One line per (warpgroup, row): "TAG wg index t0 .. t7", index = first + row.
template <int kWGs, int kRows>
__device__ __forceinline__ void print_stamps(const char* tag, const uint32_t (&buf)[kWGs][kRows][kTracePoints],
                                             int first) {
    for (int w = 0; w < kWGs; ++w)
        for (int i = 0; i < kRows; ++i) {
            const uint32_t* t = buf[w][i];
            printf("%s %d %d %u %u %u %u %u %u %u %u\n", tag, w, i + first, t[0], t[1], t[2], t[3], t[4], t[5], t[6],
                   t[7]);
        }
}
#ifdef FA3_TRACE_CTA
// One line per recorded point: "FA3C name ctas min mean max" (ns after the first entry), for the
// launch numbered `launch` when it is a multiple of 64; the buffers are cleared for the next
// launch either way.
__device__ __forceinline__ void trace_dump_ctas(int launch) {
    unsigned long long base = ~0ull;
    for (int c = 0; c < kTraceCtas; ++c)
        if (trace_cta_life[c][0] != 0 && trace_cta_life[c][0] < base) base = trace_cta_life[c][0];
    const bool show = launch % 64 == 0 && base != ~0ull;
    if (show) printf("FA3C launch %d\n", launch);
    auto summary = [&](const char* name, int wg, int point, bool life) {
        unsigned long long lo = ~0ull, hi = 0, sum = 0;
        int n = 0;
        for (int c = 0; c < kTraceCtas; ++c) {
            unsigned long long& v = life ? trace_cta_life[c][point] : trace_cta_edges[c][wg][point];
            if (v != 0 && v >= base) {
                const unsigned long long d = v - base;
                lo = d < lo ? d : lo;
                hi = d > hi ? d : hi;
                sum += d;
                ++n;
            }
            v = 0;
        }
        if (show && n > 0) printf("FA3C %s %d %llu %llu %llu\n", name, n, lo, sum / n, hi);
    };
    // The consumers' and the TMA thread's tile points first (they read the life entries' base),
    // then the life points, whose entry stamp is cleared last.
    const char* producer[4] = {"p.tile", "p.q_issued", "p.k_issued", "p.v_issued"};
    const char* consumer[7] = {"c.tile", "c.q_landed", "c.s_retired", "c.softmax", "c.loop_exit", "c.pv_retired",
                               "c.epilogue"};
    for (int i = 0; i < 4; ++i) summary(producer[i], 0, i, false);
    for (int w = 1; w < kTraceWGs; ++w)
        for (int i = 0; i < 7; ++i) summary(consumer[i], w, i, false);
    const char* life[kTraceLife] = {"entry",        "init",          "producer_exit",   "consumer_exit",
                                    "p.regs_given", "p.desc_prefetched", "p.tile_index", "c.regs_taken"};
    for (int i = kTraceLife - 1; i >= 0; --i) summary(life[i], 0, i, true);
}
#endif
// Prints the buffers (a kernel of its own, launched after the traced one when FA3_TRACE is set in
// the environment: a printf inside a wgmma kernel makes ptxas serialise every wgmma).
__device__ __forceinline__ void trace_dump(int launch) {
#ifdef FA3_TRACE_CTA
    trace_dump_ctas(launch);
#else
    (void)launch;
    print_stamps("FA3T", trace_buf, kTraceFirst);
    print_stamps("FA3E", trace_edge_buf, kTraceFirstTile);
    print_stamps("FA3F", trace_fine_buf, kTraceFirstTile);
    print_stamps("FA3W", trace_writer_buf, kTraceFirstTile);
#endif
}
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
__device__ __forceinline__ void trace_edge(int, int, int) {}
__device__ __forceinline__ void trace_writer(int, int) {}
__device__ __forceinline__ void trace_life(int) {}
#endif
#if !defined(FA3_TRACE) || defined(FA3_TRACE_CTA)
__device__ __forceinline__ void trace_fine(int, int, int) {}
#endif

}  // namespace fa3
