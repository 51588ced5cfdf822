// linear_rows: y = x · wᵀ (+ bias) for a few rows of x (2-64 tokens of a batched decode step) and
// a linear layer's weight w (n × k, row-major), on the tensor cores: wgmma (m64 × N tokens × k16,
// f32 accumulation, one rounding per output), w as the A operand and x as B, both read from
// shared memory. At these sizes the product is bound by reading w once (docs/kernels/
// model-fused.md, "linear_rows").
//
// Layout of the work:
// - A CTA (one warpgroup) owns kBlockRows = 128 outputs (rows of w, two m64 tiles) and a range of
//   k, for every token of x (N = 8 * kTiles token slots, zeros past the batch). Every CTA reads
//   all of x over its k range from L2, so the more outputs a CTA owns, the less L2 traffic per
//   weight byte (64 tokens over 128 outputs: half a byte of x per byte of w).
// - The k range is cut in chunks of 64 (128 bytes of a row), streamed into shared memory by a
//   cp.async pipeline of kStages chunks of w and x together, each stored K-major in the 128-byte
//   swizzle that wgmma's descriptors read (16-byte unit u of row r at u ^ (r % 8)).
// - Where the rows alone would leave SMs idle (a 2048 × 2048 projection has 16 row blocks), the
//   grid splits k over a cluster of `split` CTAs (1-8); each CTA leaves its partial outputs in its
//   shared memory and the cluster sums them through distributed shared memory, so one launch does
//   the whole product, without a workspace or a second kernel.
// - The weight's first chunks are requested before `griddepcontrol.wait` (a programmatic
//   dependent launch): no kernel writes w, so they load while the kernel before drains.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../primitives/cp_async.cuh"
#include "../primitives/dependent_launch.cuh"
#include "../primitives/wgmma.cuh"
#include "dtype.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kBlockRows = 128;          // outputs of a CTA: two m64 tiles
constexpr int kChunk = 64;               // k of one pipeline stage: 8 units of 16 bytes a row
constexpr int kUnits = kChunk * 2 / 16;  // 16-byte units of a row's chunk
constexpr int kStages = 4;               // chunks in flight: 3 loading while one is multiplied
constexpr int kThreads = 128;            // one warpgroup
constexpr int kMaxSplit = 8;             // CTAs of a cluster, at most (the portable limit)

// Shared memory of one stage: kBlockRows rows of w, then 8 * kTiles rows of x, kUnits units each
// (a whole number of 1024-byte swizzle atoms).
template <int kTiles>
__host__ __device__ constexpr int stage_units() {
    return (kBlockRows + 8 * kTiles) * kUnits;
}

// Where unit u of row r of a stage sits: the 128-byte swizzle of wgmma's K-major operands.
__device__ __forceinline__ int swizzled(int r, int u) { return r * kUnits + (u ^ (r & 7)); }

// After each CTA of the cluster has left its partial outputs of the block in `partial` (shared
// memory, [token][row] f32): CTA `part` sums its share of them over the cluster, four rows at a
// time, adds the bias and writes them.
template <typename T>
__device__ __forceinline__ void sum_partials_and_store(float* partial, const T* __restrict__ bias, T* __restrict__ y,
                                                       int tokens, int n, int row0) {
    const int split = gridDim.x, part = blockIdx.x;
    cg::cluster_group cluster = cg::this_cluster();
    if (split > 1) {
        cluster.sync();
    } else {
        __syncthreads();
    }
    // Only real tokens' outputs; the partial of every CTA of the cluster is requested before any
    // is added (distributed shared memory has the latency of L2, not of shared memory).
    const int quads = tokens * kBlockRows / 4;
    const int share = (quads + split - 1) / split;
    const int end = min(quads, (part + 1) * share);
    for (int e = part * share + threadIdx.x; e < end; e += kThreads) {
        const int token = e * 4 / kBlockRows, r = e * 4 % kBlockRows;
        float4 parts[kMaxSplit];
#pragma unroll
        for (int q = 0; q < kMaxSplit; ++q) {
            if (q < split) {
                const float* from = split > 1 ? cluster.map_shared_rank(partial, q) : partial;
                parts[q] = reinterpret_cast<const float4*>(from)[e];
            }
        }
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < kMaxSplit; ++q) {
            if (q < split) {
                sum[0] += parts[q].x;
                sum[1] += parts[q].y;
                sum[2] += parts[q].z;
                sum[3] += parts[q].w;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = row0 + r + j;
            if (row < n) y[(size_t)token * n + row] = from_f<T>(bias != nullptr ? sum[j] + to_f(bias[row]) : sum[j]);
        }
    }
    // No CTA leaves while another may still read its shared memory.
    if (split > 1) cluster.sync();
}

// Queues chunk `chunk` of this CTA's w rows into a stage (zeros past n).
template <typename T, int kTiles>
__device__ __forceinline__ void load_w(uint4* stage, const T* __restrict__ w, int row0, int n, int k, int chunk,
                                       uint64_t policy) {
#pragma unroll
    for (int i = 0; i < kBlockRows * kUnits / kThreads; ++i) {
        const int idx = threadIdx.x + i * kThreads;
        const int r = idx / kUnits, u = idx % kUnits;
        const bool valid = row0 + r < n;
        const T* src = w + (size_t)(valid ? row0 + r : 0) * k + chunk * kChunk + u * 8;
        fa3::copy_16_or_zero_once(stage + swizzled(r, u), src, valid, policy);
    }
}
// ... and of x: every token slot of the kernel's tiles, zeros past the batch.
template <typename T, int kTiles>
__device__ __forceinline__ void load_x(uint4* stage, const T* __restrict__ x, int tokens, int k, int chunk) {
    uint4* xs = stage + kBlockRows * kUnits;
    for (int idx = threadIdx.x; idx < 8 * kTiles * kUnits; idx += kThreads) {
        const int r = idx / kUnits, u = idx % kUnits;
        const bool valid = r < tokens;
        const T* src = x + (size_t)(valid ? r : 0) * k + chunk * kChunk + u * 8;
        fa3::copy_16_or_zero(xs + swizzled(r, u), src, valid);
    }
}

// wgmma's input type of T.
template <typename T> constexpr int kWgmmaType = fa3::DT_BF16;
template <> constexpr int kWgmmaType<__half> = fa3::DT_F16;

template <typename T, int kTiles>
__device__ void linear_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                            T* __restrict__ y, int tokens, int n, int k) {
    extern __shared__ __align__(1024) uint4 smem[];
    constexpr int kN = 8 * kTiles;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int split = gridDim.x, part = blockIdx.x;  // the cluster is the grid's x: split CTAs
    const int row0 = blockIdx.y * kBlockRows;
    const int chunks = k / kChunk;
    const int first = part * chunks / split, last = (part + 1) * chunks / split;
    const int count = last - first;
    auto stage = [&](int i) { return smem + (i % kStages) * stage_units<kTiles>(); };

    // The first stages' weights are requested before the wait for the kernel that writes x.
    const uint64_t once = fa3::evict_first_policy();
    for (int i = 0; i < kStages - 1 && i < count; ++i) load_w<T, kTiles>(stage(i), w, row0, n, k, first + i, once);
    fa3::wait_for_prerequisites();  // w is no kernel's output, x is
    for (int i = 0; i < kStages - 1; ++i) {
        if (i < count) load_x<T, kTiles>(stage(i), x, tokens, k, first + i);
        fa3::commit_copies();  // one group per stage, empty or not, so the wait below counts stages
    }

    float acc[2][kN / 2];  // the two m64 tiles' wgmma accumulators
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < kN / 2; ++j) acc[m][j] = 0.f;
    for (int i = 0; i < count; ++i) {
        fa3::wait_copies<kStages - 2>();  // this thread's copies of stage i have landed
        // cp.async writes through the generic proxy; wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();  // ... every thread's; and stage i - 1's wgmmas are done (waited below)
        const int next = i + kStages - 1;
        if (next < count) {
            load_w<T, kTiles>(stage(next), w, row0, n, k, first + next, once);
            load_x<T, kTiles>(stage(next), x, tokens, k, first + next);
        }
        fa3::commit_copies();
        const uint32_t w_lo = fa3::smem_desc_lo(fa3::smem_u32(stage(i)), 16);
        const uint32_t x_lo = fa3::smem_desc_lo(fa3::smem_u32(stage(i) + kBlockRows * kUnits), 16);
        fa3::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kChunk / 16; ++kk) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                fa3::wgmma_ss<kN, kWgmmaType<T>>(acc[m], fa3::smem_desc_at<1024>(w_lo, m * 64 * 128 + kk * 32),
                                                 fa3::smem_desc_at<1024>(x_lo, kk * 32), 1);
            }
        }
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();  // before the next iteration's loads overwrite this stage
#pragma unroll
        for (int m = 0; m < 2; ++m) fa3::fence_operand(acc[m]);
    }
    fa3::wait_copies<0>();
    __syncthreads();

    // Partial outputs to shared memory (stage memory, free now), [token][row] in f32, from
    // wgmma's accumulator layout: warp w, lane (g, t) holds rows 16w + g and + 8 of each m64
    // tile, tokens 8j + 2t and + 1.
    float* partial = reinterpret_cast<float*>(smem);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) {
            const int token = 8 * j + 2 * t, r = m * 64 + warp * 16 + g;
            partial[token * kBlockRows + r] = acc[m][4 * j + 0];
            partial[(token + 1) * kBlockRows + r] = acc[m][4 * j + 1];
            partial[token * kBlockRows + r + 8] = acc[m][4 * j + 2];
            partial[(token + 1) * kBlockRows + r + 8] = acc[m][4 * j + 3];
        }
    }
    sum_partials_and_store(partial, bias, y, tokens, n, row0);
}

}  // namespace

// One kernel per dtype and tile count (token slots 8, 16, 32, 64); the dynamic shared memory is
// kStages stages of stage_units<TILES>() 16-byte units, 1024-byte aligned.
#define LINEAR_ROWS(T, SUFFIX, TILES)                                                                              \
    extern "C" __global__ void __launch_bounds__(kThreads) linear_rows_##SUFFIX##_##TILES(                          \
        const T* x, const T* w, const T* bias, T* y, int tokens, int n, int k) {                                    \
        linear_rows<T, TILES>(x, w, bias, y, tokens, n, k);                                                         \
    }
#define LINEAR_ROWS_ALL(T, SUFFIX) \
    LINEAR_ROWS(T, SUFFIX, 1)      \
    LINEAR_ROWS(T, SUFFIX, 2)      \
    LINEAR_ROWS(T, SUFFIX, 4)      \
    LINEAR_ROWS(T, SUFFIX, 8)

LINEAR_ROWS_ALL(__nv_bfloat16, bf16)
LINEAR_ROWS_ALL(__half, f16)
