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
constexpr int kTraceWGs = 4, kTracePoints = 8;
// Loop stamps ("FA3T"): iterations [kTraceFirst, kTraceFirst + kTraceIters) of the key-block loop.
constexpr int kTraceFirst = 16, kTraceIters = 48;
__device__ uint32_t trace_buf[kTraceWGs][kTraceIters][kTracePoints];
// Tile stamps ("FA3E"; the tile boundary: tail, epilogue, the next tile's first block), by the
// CTA's tile count for tiles [kTraceFirstTile, kTraceFirstTile + kTraceTiles).
constexpr int kTraceFirstTile = 1, kTraceTiles = 12;
__device__ uint32_t trace_edge_buf[kTraceWGs][kTraceTiles][kTracePoints];

// Thread 0 of warpgroup wg in CTA 0 writes the clock into row i (skipped outside [0, kRows)).
template <int kRows>
__device__ __forceinline__ void clock_stamp(uint32_t (&buf)[kTraceWGs][kRows][kTracePoints], int wg, int i,
                                            int point) {
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && i >= 0 && i < kRows) {
        uint32_t c;
        asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
        buf[wg][i][point] = c;
    }
}
__device__ __forceinline__ void trace_stamp(int wg, int iter, int point) {
    clock_stamp(trace_buf, wg, iter - kTraceFirst, point);
}
__device__ __forceinline__ void trace_edge(int wg, int tile, int point) {
    clock_stamp(trace_edge_buf, wg, tile - kTraceFirstTile, point);
}

// One line per (warpgroup, row): "TAG wg index t0 .. t7", index = first + row.
template <int kRows>
__device__ __forceinline__ void print_stamps(const char* tag, const uint32_t (&buf)[kTraceWGs][kRows][kTracePoints],
                                             int first) {
    for (int w = 0; w < kTraceWGs; ++w)
        for (int i = 0; i < kRows; ++i) {
            const uint32_t* t = buf[w][i];
            printf("%s %d %d %u %u %u %u %u %u %u %u\n", tag, w, i + first, t[0], t[1], t[2], t[3], t[4], t[5], t[6],
                   t[7]);
        }
}
// Prints both buffers (a kernel of its own, launched after the traced one when FA3_TRACE is set in
// the environment: a printf inside a wgmma kernel makes ptxas serialise every wgmma).
__device__ __forceinline__ void trace_dump() {
    print_stamps("FA3T", trace_buf, kTraceFirst);
    print_stamps("FA3E", trace_edge_buf, kTraceFirstTile);
}
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
__device__ __forceinline__ void trace_edge(int, int, int) {}
#endif

}  // namespace fa3
