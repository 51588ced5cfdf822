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
constexpr int kTraceWGs = 4, kTraceFirst = 16, kTraceIters = 48, kTracePoints = 8;
__device__ uint32_t trace_buf[kTraceWGs][kTraceIters][kTracePoints];

__device__ __forceinline__ void trace_stamp(int wg, int iter, int point) {
    const int i = iter - kTraceFirst;
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && i >= 0 && i < kTraceIters) {
        uint32_t c;
        asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
        trace_buf[wg][i][point] = c;
    }
}
// Tile stamps (the tile boundary: tail, epilogue, the next tile's first block), by the CTA's tile
// count for tiles [kTraceFirstTile, kTraceFirstTile + kTraceTiles): "FA3E wg tile t0 .. t7".
constexpr int kTraceFirstTile = 1, kTraceTiles = 12;
__device__ uint32_t trace_edge_buf[kTraceWGs][kTraceTiles][kTracePoints];

__device__ __forceinline__ void trace_edge(int wg, int tile, int point) {
    const int i = tile - kTraceFirstTile;
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && i >= 0 && i < kTraceTiles) {
        uint32_t c;
        asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
        trace_edge_buf[wg][i][point] = c;
    }
}
// Prints the buffer (a kernel of its own, launched after the traced one when FA3_TRACE is set in
// the environment: a printf inside a wgmma kernel makes ptxas serialise every wgmma).
__device__ __forceinline__ void trace_dump() {
    for (int w = 0; w < kTraceWGs; ++w)
        for (int i = 0; i < kTraceIters; ++i) {
            const uint32_t* t = trace_buf[w][i];
            printf("FA3T %d %d %u %u %u %u %u %u %u %u\n", w, i + kTraceFirst, t[0], t[1], t[2], t[3], t[4], t[5],
                   t[6], t[7]);
        }
    for (int w = 0; w < kTraceWGs; ++w)
        for (int i = 0; i < kTraceTiles; ++i) {
            const uint32_t* t = trace_edge_buf[w][i];
            printf("FA3E %d %d %u %u %u %u %u %u %u %u\n", w, i + kTraceFirstTile, t[0], t[1], t[2], t[3], t[4],
                   t[5], t[6], t[7]);
        }
}
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
__device__ __forceinline__ void trace_edge(int, int, int) {}
#endif

}  // namespace fa3
