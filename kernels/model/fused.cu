// Small kernels of flash-llama's inference path (Kernels::Fused on the GPU): fused ops that each
// replace two or three candle launches of a decode step, a matrix-vector product for a batch-1
// decode step's projections and the greedy choice of the next token. Arithmetic in f32, one
// rounding per output.
// Compiled by crates/model/build.rs into one sm_90a cubin; launched by crates/model/src/fused/.
#include <stdint.h>

#include <cuda_fp8.h>

#include "../primitives/cp_async.cuh"
#include "argmax.cuh"
#include "dtype.cuh"

namespace {

constexpr int kNormThreads = 256;
// The vector path of add_rms_norm: 16-byte loads, up to kNormIters of them per thread held in
// registers between the sum of squares and the scaling (rows of up to 8192 bf16/f16 elements).
constexpr int kNormIters = 4;

// The sum of `v` over the block (kNormThreads threads), in every thread.
__device__ __forceinline__ float block_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __shared__ float warp_sums[kNormThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < kNormThreads / 32 ? warp_sums[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Whether add_rms_norm's vector path takes a row: 16-byte aligned pointers, whole 16-byte
// vectors, at most kNormIters of them per thread.
template <typename T>
__host__ __device__ constexpr int norm_vector_max_dim() {
    return kNormThreads * (16 / sizeof(T)) * kNormIters;
}

// The vector path of add_rms_norm for one row (the whole block, kNormThreads threads): res = x + h
// rounded to T, out = res * rsqrt(mean(res²) + eps) * w. `res` may be null (not written); `out`
// may be in shared memory. Needs 16-byte aligned pointers and dim a multiple of 16 / sizeof(T) of
// at most norm_vector_max_dim<T>(). Shared by the add_rms_norm kernel and the fused projection
// below, so both give the same bits.
template <typename T>
__device__ __forceinline__ void add_rms_norm_row_vec(const T* __restrict__ x, const T* __restrict__ h,
                                                     const T* w, T* __restrict__ res, T* out, int dim,
                                                     float eps) {
    constexpr int kVec = 16 / sizeof(T);
    float sum = 0.f;
    uint4 r[kNormIters];
#pragma unroll
    for (int k = 0; k < kNormIters; ++k) {
        const int v = threadIdx.x + k * kNormThreads;
        if (v * kVec < dim) {
            const uint4 xv = reinterpret_cast<const uint4*>(x)[v], hv = reinterpret_cast<const uint4*>(h)[v];
            const T* xe = reinterpret_cast<const T*>(&xv);
            const T* he = reinterpret_cast<const T*>(&hv);
            T* re = reinterpret_cast<T*>(&r[k]);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                re[e] = from_f<T>(to_f(xe[e]) + to_f(he[e]));
                const float f = to_f(re[e]);
                sum += f * f;
            }
            if (res != nullptr) reinterpret_cast<uint4*>(res)[v] = r[k];
        }
    }
    const float scale = rsqrtf(block_sum(sum) / dim + eps);
#pragma unroll
    for (int k = 0; k < kNormIters; ++k) {
        const int v = threadIdx.x + k * kNormThreads;
        if (v * kVec < dim) {
            const uint4 wv = reinterpret_cast<const uint4*>(w)[v];
            const T* we = reinterpret_cast<const T*>(&wv);
            const T* re = reinterpret_cast<const T*>(&r[k]);
            uint4 o;
            T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
            for (int e = 0; e < kVec; ++e) oe[e] = from_f<T>(scale * to_f(re[e]) * to_f(we[e]));
            reinterpret_cast<uint4*>(out)[v] = o;
        }
    }
}

// res = x + h (rounded to T, as candle's add), out = res * rsqrt(mean(res²) + eps) * w.
// One block of kNormThreads per row; rows are contiguous, `dim` elements each.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ h, const T* __restrict__ w,
                             T* __restrict__ res, T* __restrict__ out, int dim, float eps) {
    constexpr int kVec = 16 / sizeof(T);
    const size_t row = blockIdx.x;
    const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(h) |
                           reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(res) |
                           reinterpret_cast<uintptr_t>(out)) % 16) == 0;
    x += row * dim;
    h += row * dim;
    res += row * dim;
    out += row * dim;
    if (aligned && dim % kVec == 0 && dim <= norm_vector_max_dim<T>()) {
        add_rms_norm_row_vec<T>(x, h, w, res, out, dim, eps);
        return;
    }
    // Any other row length or alignment: element by element.
    float sum = 0.f;
    for (int c = threadIdx.x; c < dim; c += kNormThreads) {
        const T r = from_f<T>(to_f(x[c]) + to_f(h[c]));
        res[c] = r;
        const float rf = to_f(r);
        sum += rf * rf;
    }
    const float scale = rsqrtf(block_sum(sum) / dim + eps);
    // Each thread reads back only the residuals it wrote itself.
    for (int c = threadIdx.x; c < dim; c += kNormThreads) {
        out[c] = from_f<T>(scale * to_f(res[c]) * to_f(w[c]));
    }
}

// silu(g) * u rounded to T: silu_mul's element, and linear_vector_swiglu's output.
template <typename T>
__device__ __forceinline__ T silu_times(T g, T u) {
    const float gf = to_f(g);
    return from_f<T>(gf / (1.f + __expf(-gf)) * to_f(u));
}

// out (rows, inter) = silu(y[:, :inter]) * y[:, inter:], y (rows, 2 * inter) contiguous.
template <typename T>
__device__ void silu_mul(const T* __restrict__ y, T* __restrict__ out, size_t rows, int inter) {
    const size_t n = rows * inter;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / inter, c = i % inter;
        out[i] = silu_times<T>(y[r * 2 * inter + c], y[r * 2 * inter + inter + c]);
    }
}

// Programmatic dependent launch (sm_90; PTX `griddepcontrol`). The host launches linear_vector
// and rope_store with the launch attribute that lets their blocks start while the kernel before
// them on the stream is still running (`launch_overlapping`, crates/model/src/fused/cuda.rs): a
// projection's block requests its first weights, which nothing on the stream writes, then waits
// for the earlier kernels to finish before it reads its input or writes anything; rope_store's
// blocks only wait (what they save is their launch, ~0.5 us a layer). Kernels that let their
// successor start early call `let_next_kernel_start` once every block of theirs is running; the
// successor's blocks then fill the SMs as this kernel's last wave drains. Both are no-ops for a
// normal launch.
__device__ __forceinline__ void let_next_kernel_start() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_earlier_kernels() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Where rope_store puts a token's rotated k heads and its v heads (y's heads [first, heads)):
// rows of the model's own dtype, k heads then v heads side by side (`row_stride` elements a row).
template <typename T>
struct StoreRows {
    T* cache;
    long long row_stride;
    __device__ void operator()(uint32_t row, int cached_head, int d, int c1, int c2, T r1, T r2) const {
        T* dst = cache + row * row_stride + (size_t)cached_head * d;
        dst[c1] = r1;
        dst[c2] = r2;
    }
};

// The e4m3 cache: two planes of (rows, kv_heads, d), k then v `plane` bytes later. Each stored
// head is multiplied by its quant factor (quant[cached_head], k heads first) and saturated to
// +-448 (__nv_fp8_e4m3's conversion: round to nearest, SATFINITE), as the CPU path's clamp and cast.
struct StoreE4m3 {
    __nv_fp8_e4m3* cache;
    long long plane;
    int kv_heads;
    const float* quant;
    template <typename T>
    __device__ void operator()(uint32_t row, int cached_head, int d, int c1, int c2, T r1, T r2) const {
        const int is_v = cached_head >= kv_heads;
        const int head = cached_head - is_v * kv_heads;
        __nv_fp8_e4m3* dst = cache + is_v * plane + ((size_t)row * kv_heads + head) * d;
        const float f = quant[cached_head];
        dst[c1] = __nv_fp8_e4m3(to_f(r1) * f);
        dst[c2] = __nv_fp8_e4m3(to_f(r2) * f);
    }
};

// Rotary embedding of y (tokens, heads, d), in place, each (token, head) by its own angles:
// cos/sin (tokens, heads, d / 2). Pairs (x[i], x[i + d/2]), or (x[2i], x[2i+1]) if interleaved.
// With `rows` non-null, heads [first, heads) of token t are also stored, rotated, at cache row
// rows[t] by `store` (StoreRows or StoreE4m3).
template <typename T, typename Store>
__device__ void rope_store(T* __restrict__ y, const T* __restrict__ cos, const T* __restrict__ sin, int tokens,
                           int heads, int d, int interleaved, const uint32_t* __restrict__ rows, int first,
                           Store store) {
    wait_for_earlier_kernels();
    const int half = d / 2;
    const size_t n = (size_t)tokens * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t th = i / half;  // token * heads + head
        const int p = i % half;
        const int head = th % heads;
        const size_t t = th / heads;
        const int c1 = interleaved ? 2 * p : p;
        const int c2 = interleaved ? 2 * p + 1 : p + half;
        T* src = y + th * d;
        const float a = to_f(src[c1]), b = to_f(src[c2]);
        const float c = to_f(cos[i]), s = to_f(sin[i]);
        const T r1 = from_f<T>(a * c - b * s), r2 = from_f<T>(a * s + b * c);
        src[c1] = r1;
        src[c2] = r2;
        if (rows != nullptr && head >= first) store(rows[t], head - first, d, c1, c2, r1, r2);
    }
}

// x (tokens, 2 * kv_heads, d), k heads first, stored into an e4m3 cache as StoreE4m3 does,
// without a rotation: an fp8 cache's first write (its scales come from these values) and the
// stores of the composed (separate q/k/v) path.
template <typename T>
__device__ void store_e4m3(const T* __restrict__ x, int tokens, int d, const uint32_t* __restrict__ rows,
                           StoreE4m3 store) {
    const int heads = 2 * store.kv_heads, half = d / 2;
    const size_t n = (size_t)tokens * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t th = i / half;  // token * heads + head
        const int p = i % half;
        store(rows[th / heads], th % heads, d, p, p + half, x[th * d + p], x[th * d + p + half]);
    }
}

// The rotary tables of a step: cos and sin (tokens, per_token) of positions[t] × inv_freq[j],
// the angle and its cos and sin in f32 (as the composed ops: u32 → f32, a product, cosf / sinf),
// then cast. One launch for what was six small candle kernels in a decode step.
template <typename T>
__device__ void rope_angles(const uint32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                            T* __restrict__ cos_out, T* __restrict__ sin_out, int tokens, int per_token) {
    const size_t n = (size_t)tokens * per_token;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float angle = __fmul_rn((float)positions[i / per_token], inv_freq[i % per_token]);
        cos_out[i] = from_f<T>(cosf(angle));
        sin_out[i] = from_f<T>(sinf(angle));
    }
}

// The inputs of a graph-replayed decode step's first layer, in one launch: what were five
// candle kernels (~10 µs a step at batch 1: the key counts + 1, the cache rows, the rotary
// tables, the embedding lookup and the first RMSNorm). Two blocks per row b, so that the tables'
// sines do not wait behind the lookup's dependent loads: blockIdx.y 1 writes the first two items
// below, blockIdx.y 0 the third.
//  - seqlens[b] = lens[b] + 1 (the keys the attention sees); cache_rows[b] = lens[b] +
//    slot_starts[b] where slot_starts is given (a contiguous cache; a paged one's rows come from
//    the host);
//  - cos / sin (rows, per_token) of the angle lens[b] × inv_freq[j], as rope_angles;
//  - x = embed[ids[b]] (a row of NaN for an id past the vocabulary: never a read outside it) and
//    normed = RMSNorm(x) · w with candle's own rmsnorm arithmetic (candle-kernels' reduce.cu: the
//    same block size, 32 threads below 1024 columns and 1024 from there, the same per-thread
//    column stride, warp and block reductions and rounding), so the step computes the bits its
//    eager twin does.
// Every block lets the first projection's blocks start at once (they load weights, then wait).
template <typename T>
__device__ void decode_prologue(const uint32_t* __restrict__ ids, const uint32_t* __restrict__ lens,
                                const uint32_t* __restrict__ slot_starts, const float* __restrict__ inv_freq,
                                const T* __restrict__ embed, const T* __restrict__ norm_w, uint32_t* seqlens,
                                uint32_t* cache_rows, T* cos_out, T* sin_out, T* x_out, T* normed_out, int hidden,
                                int per_token, uint32_t vocab, float eps) {
    let_next_kernel_start();
    const int row = blockIdx.x, tid = threadIdx.x, threads = blockDim.x;
    if (blockIdx.y == 1) {
        // The row's positions and rotary tables, beside the block of its embedding and norm.
        const uint32_t len = lens[row];
        if (tid == 0) {
            seqlens[row] = len + 1;
            if (cache_rows != nullptr) cache_rows[row] = len + slot_starts[row];
        }
        for (int j = tid; j < per_token; j += threads) {
            const float angle = __fmul_rn((float)len, inv_freq[j]);
            cos_out[(size_t)row * per_token + j] = from_f<T>(cosf(angle));
            sin_out[(size_t)row * per_token + j] = from_f<T>(sinf(angle));
        }
        return;
    }
    const uint32_t id = ids[row];
    const T* src = embed + (size_t)(id < vocab ? id : 0) * hidden;
    T* x = x_out + (size_t)row * hidden;
    T* normed = normed_out + (size_t)row * hidden;
    const float nan = __int_as_float(0x7fc00000);
    float sum = 0.f;
    for (int c = tid; c < hidden; c += threads) {
        const T v = id < vocab ? src[c] : from_f<T>(nan);
        x[c] = v;
        const float xi = to_f(v);
        sum += xi * xi;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threads > 32) {
        __shared__ float warp_sums[32];
        if (tid % 32 == 0) warp_sums[tid / 32] = sum;
        __syncthreads();
        sum = warp_sums[tid % 32];
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    const float mean = sum / hidden;
    const float scale = rsqrtf(mean + eps);
    for (int c = tid; c < hidden; c += threads) normed[c] = from_f<T>(scale * to_f(x[c]) * to_f(norm_w[c]));
}

// y (n) = w · x [+ bias] for one row x (k) and w (n, k) row-major (a linear layer's weight): the
// projections of a batch-1 decode step, a matrix-vector product bound by reading w once. One warp
// per output: its lanes stream the output's weight row in 16-byte loads, kMatvecUnroll of them in
// flight per lane, then a warp reduction. k must be a whole number of 16-byte vectors and every
// pointer 16-byte aligned (checked by the caller, which otherwise uses cuBLAS).
//
// Where x comes from is the `Input` policy: a vector in global memory (`PlainInput`, small enough
// to stay in L1/L2), or add + RMSNorm, which would otherwise be a launch of its own before the
// q/k/v, gate/up and output-head projections, computed by every block into shared memory
// (`AddNormInput`). At batch 1 such an op is a few µs of launch and ramp for a few KB of data;
// here it runs while the block's first weight loads are in flight, and gives the same bits as its
// own kernel (the same code: add_rms_norm_row_vec). The down projection's input, silu(gate) * up,
// is written by the gate/up launch itself (linear_vector_swiglu).
constexpr int kMatvecWarps = 8;  // outputs per block
constexpr int kMatvecUnroll = 4;
// Warps per output of the projections without a norm prologue (PlainInput: o, down): two, each
// summing half of the row, in blocks of 2 x 8 warps, so that their blocks stream twice the rows
// at a time (session 29). The add + RMSNorm projections keep one warp per output: more blocks
// means more prologues, measured slower (docs/kernels/model-fused.md, session 28).
constexpr int kMatvecSplit = 2;
// Warps per output of the plain projections over long rows (down: 8,192 inputs): four, in blocks
// of 4 x 8 warps, two blocks an SM (at most 32 registers), so that the 256 blocks of the 1B shape's
// down projection are all resident at once with 64 warps an SM, each warp two rounds of loads.
constexpr int kMatvecLongSplit = 4;

static_assert(kMatvecWarps * 32 == kNormThreads, "AddNormInput runs add_rms_norm's block code");

// Blocks per SM that the add + RMSNorm projections keep room for (48 registers a thread for 16-bit
// types; uncapped, the norm weight's early copy took them to 55, four blocks an SM). f32 is left
// uncapped: capped, it spills.
template <typename T> constexpr int kNormBlocksPerSm = sizeof(T) == 2 ? 5 : 1;

template <typename T>
struct PlainInput {
    const T* x;
    __device__ void preload(int) const {}
    __device__ void prepare(int) const {}
    __device__ uint4 vec(int v) const { return __ldg(reinterpret_cast<const uint4*>(x) + v); }
};

// x = rms_norm(a + b) * w, staged in dynamic shared memory (k elements); block 0 also writes the
// residual a + b to `res`.
template <typename T>
struct AddNormInput {
    T* staged;
    const T* a;
    const T* b;
    const T* w;
    T* res;
    float eps;
    // The norm's weight is constant: each thread copies the vectors it will scale into the staged
    // row before the wait, so that after it the norm waits for one round trip (x and h), not two.
    // The thread then overwrites each vector with its normed value (the same thread, the same
    // slot), so no barrier is needed between the copy and its use.
    __device__ void preload(int k) const {
        constexpr int kVec = 16 / sizeof(T);
        for (int v = threadIdx.x; v < k / kVec; v += kNormThreads) {
            fa3::copy_16_to_shared(reinterpret_cast<uint4*>(staged) + v, reinterpret_cast<const uint4*>(w) + v);
        }
    }
    __device__ void prepare(int k) const {
        fa3::wait_all_copies();
        add_rms_norm_row_vec<T>(a, b, staged, blockIdx.x == 0 ? res : nullptr, staged, k, eps);
        __syncthreads();
    }
    __device__ uint4 vec(int v) const { return reinterpret_cast<const uint4*>(staged)[v]; }
};

// Requests one round of a weight row's vectors for this lane: v0, v0 + 32, ... (kMatvecUnroll of
// them), zeros past v_end.
__device__ __forceinline__ void load_round(uint4 (&wv)[kMatvecUnroll], const uint4* __restrict__ wrow, int v0,
                                           int v_end) {
#pragma unroll
    for (int u = 0; u < kMatvecUnroll; ++u) {
        const int v = v0 + u * 32;
        wv[u] = v < v_end ? __ldg(wrow + v) : make_uint4(0, 0, 0, 0);
    }
}

// This lane's share of one weight row's product with the input, over the row's vectors
// [v_begin, v_end): the round already in `wv` (requested by the caller) is consumed, the next one
// requested, and so on; returns with no load in flight. One order of products for every kernel
// that sums a row in one warp, so their outputs have the same bits.
template <typename T, typename Input>
__device__ __forceinline__ float row_partial(const Input& in, const uint4* __restrict__ wrow, int v_begin, int v_end,
                                             uint4 (&wv)[kMatvecUnroll]) {
    constexpr int kVec = 16 / sizeof(T);
    float acc = 0.f;
    for (int v0 = v_begin + threadIdx.x % 32;;) {
#pragma unroll
        for (int u = 0; u < kMatvecUnroll; ++u) {
            const int v = v0 + u * 32;
            if (v >= v_end) break;
            const uint4 xu = in.vec(v);
            const T* we = reinterpret_cast<const T*>(&wv[u]);
            const T* xe = reinterpret_cast<const T*>(&xu);
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc = fmaf(to_f(we[e]), to_f(xe[e]), acc);
        }
        v0 += 32 * kMatvecUnroll;
        if (v0 >= v_end) break;
        load_round(wv, wrow, v0, v_end);
    }
    return acc;
}

__device__ __forceinline__ float warp_total(float acc) {
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// kSplit warps per output (blocks of kMatvecWarps x kSplit warps): warp w sums slice w % kSplit of
// output w / kSplit's row, and the slices' sums are added in order through shared memory.
template <typename T, int kSplit = 1, typename Input>
__device__ void linear_vector(const Input& in, const T* __restrict__ w, const T* __restrict__ bias,
                              T* __restrict__ y, int n, int k) {
    constexpr int kVec = 16 / sizeof(T);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int col = blockIdx.x * kMatvecWarps + warp / kSplit, slice = warp % kSplit;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)min(col, n - 1) * k);
    const int vecs = k / kVec;
    const int v_begin = slice * vecs / kSplit, v_end = (slice + 1) * vecs / kSplit;
    uint4 wv[kMatvecUnroll];
    let_next_kernel_start();
    // The first weights are requested before the input is ready: they do not depend on it.
    load_round(wv, wrow, v_begin + lane, v_end);
    in.preload(k);
    wait_for_earlier_kernels();
    in.prepare(k);
    float acc = col < n ? row_partial<T>(in, wrow, v_begin, v_end, wv) : 0.f;
    acc = warp_total(acc);
    if constexpr (kSplit > 1) {
        __shared__ float slice_sums[kMatvecWarps * kSplit];
        if (lane == 0) slice_sums[warp] = acc;
        __syncthreads();
        if (slice != 0) return;
        for (int i = 1; i < kSplit; ++i) acc += slice_sums[warp + i];
    }
    if (lane == 0 && col < n) y[col] = from_f<T>(acc + (bias != nullptr ? to_f(bias[col]) : 0.f));
}

// A batch-1 MLP's gate/up projection that hands the down projection its input: act (inter) =
// silu(g) * u, where g and u are the products of the input with rows i and inter + i of the fused
// gate/up weight w (2 inter, k). One warp per index i sums both rows, in the order and with the
// roundings of linear_vector's one-warp form (g and u rounded to T, then silu_times), so act has
// the bits of the gate/up launch followed by silu_mul. The down projection then reads act as a
// plain input instead of computing SiLU x up in each of its blocks.
template <typename T, typename Input>
__device__ void linear_vector_swiglu(const Input& in, const T* __restrict__ w, T* __restrict__ act, int inter,
                                     int k) {
    constexpr int kVec = 16 / sizeof(T);
    const int lane = threadIdx.x % 32;
    const int i = blockIdx.x * kMatvecWarps + threadIdx.x / 32;
    const int vecs = k / kVec;
    const uint4* gate_row = reinterpret_cast<const uint4*>(w + (size_t)min(i, inter - 1) * k);
    const uint4* up_row = gate_row + (size_t)inter * vecs;
    uint4 wv[kMatvecUnroll];
    let_next_kernel_start();
    // Only the norm weight is copied before the wait. The gate rows' first round is requested
    // after it: requested before, it lands while the attention and o run, and o's reads after
    // its own wait queue behind it (traced: o 4.38 against 3.90 µs a layer, gate/up 18.45 against
    // 18.77; docs/kernels/model-fused.md, session 45).
    in.preload(k);
    wait_for_earlier_kernels();
    load_round(wv, gate_row, lane, vecs);
    in.prepare(k);
    if (i >= inter) return;
    float g = row_partial<T>(in, gate_row, 0, vecs, wv);
    load_round(wv, up_row, lane, vecs);
    float u = row_partial<T>(in, up_row, 0, vecs, wv);
    g = warp_total(g);
    u = warp_total(u);
    if (lane == 0) act[i] = silu_times<T>(from_f<T>(g + 0.f), from_f<T>(u + 0.f));
}

// The greedy choice of each row of logits x (rows, cols), contiguous: out[row] = the index of the
// row's largest value, the first one on ties; NaNs are never chosen (a row of NaNs gives 0). As
// flash_llama::sampling::argmax on the host.
//
// Two launches: a row is cut in chunks of kArgmaxChunk elements, block (chunk, row) of the first
// finds its chunk's best (argmax_chunks), and one warp per row of the second picks among the
// chunks' (argmax_finish). One block per row (a vocabulary-wide row is 256 KB of bf16) took
// 11.6 us in the 1B model's replayed decode step on an H200: one SM streaming the row alone.
constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxLoads = 2;  // 16-byte loads per thread, all in flight at once

// Elements per chunk (the host's ARGMAX_CHUNK_BYTES / sizeof(T)).
template <typename T> __host__ __device__ constexpr int argmax_chunk() { return kArgmaxThreads * kArgmaxLoads * (16 / (int)sizeof(T)); }

template <typename T>
__device__ void argmax_chunks(const T* __restrict__ x, float* __restrict__ part_best, uint32_t* __restrict__ part_at,
                              int cols) {
    const int chunk = blockIdx.x, chunks = gridDim.x, row_idx = blockIdx.y;
    const T* row = x + (size_t)row_idx * cols;
    const int begin = chunk * argmax_chunk<T>(), end = min(cols, begin + argmax_chunk<T>());
    float best = 0.f;
    uint32_t at = kNoIndex;
    // Each thread sees its indices in ascending order: a later equal value never replaces an
    // earlier one.
    auto see = [&](float v, int c) {
        if (!isnan(v) && (at == kNoIndex || v > best)) {
            best = v;
            at = c;
        }
    };
    constexpr int kVec = 16 / sizeof(T);
    int tail = begin;
    if (reinterpret_cast<uintptr_t>(row) % 16 == 0) {
        // begin is a whole number of vectors; the chunk's whole vectors, then its tail.
        const int v0 = begin / kVec, v1 = end / kVec;
        const uint4* vrow = reinterpret_cast<const uint4*>(row);
        uint4 raw[kArgmaxLoads];
#pragma unroll
        for (int k = 0; k < kArgmaxLoads; ++k) {
            const int v = v0 + threadIdx.x + k * kArgmaxThreads;
            raw[k] = v < v1 ? vrow[v] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < kArgmaxLoads; ++k) {
            const int v = v0 + threadIdx.x + k * kArgmaxThreads;
            if (v >= v1) break;
            const T* e = reinterpret_cast<const T*>(&raw[k]);
#pragma unroll
            for (int j = 0; j < kVec; ++j) see(to_f(e[j]), v * kVec + j);
        }
        tail = v1 * kVec;
    }
    for (int c = tail + threadIdx.x; c < end; c += kArgmaxThreads) see(to_f(row[c]), c);
    block_argmax<kArgmaxThreads>(best, at);
    if (threadIdx.x == 0) {
        part_best[(size_t)row_idx * chunks + chunk] = best;
        part_at[(size_t)row_idx * chunks + chunk] = at;
    }
}

// One warp per row: the best of the row's chunks (earlier chunks win ties, by index), into
// out[row]; with `bump`, also bump[row] += 1 (a decode step's key counts, advanced where the
// step's token is chosen).
//
// With `host` (page-locked host memory mapped into the device's address space; needs `bump`),
// the token also goes straight to the host: entry (slot, row) of `host`, slot = the row's new
// count & 1 (`host_rows` entries a slot, `host` offset to this launch's first row), is the pair
// (token, count), the count written last behind a system-wide fence. The host spins until the
// count it expects shows and then reads the token; the slot alternates so that the step queued
// behind this one never overwrites a token the host has not read yet. This replaces a copy to
// the host between two replays of a decode graph (a copy-engine turn and ~14 us of idle device).
__device__ void choose_among_chunks(const float* __restrict__ part_best, const uint32_t* __restrict__ part_at, int chunks,
                              uint32_t* __restrict__ out, uint32_t* __restrict__ bump, volatile uint32_t* host,
                              int host_rows) {
    const int row = blockIdx.x;
    float best = 0.f;
    uint32_t at = kNoIndex;
    for (int c = threadIdx.x; c < chunks; c += 32)
        keep_better(best, at, part_best[(size_t)row * chunks + c], part_at[(size_t)row * chunks + c]);
    block_argmax<32>(best, at);
    if (threadIdx.x == 0) {
        const uint32_t token = at == kNoIndex ? 0 : at;
        out[row] = token;
        if (bump != nullptr) {
            const uint32_t count = bump[row] + 1;
            bump[row] = count;
            if (host != nullptr) {
                volatile uint32_t* entry = host + 2 * ((size_t)(count & 1) * host_rows + row);
                entry[0] = token;
                __threadfence_system();
                entry[1] = count;
            }
        }
    }
}

}  // namespace

#define FUSED_OPS(T, SUFFIX)                                                                                         \
    extern "C" __global__ void __launch_bounds__(kNormThreads) add_rms_norm_##SUFFIX(                                 \
        const T* x, const T* h, const T* w, T* res, T* out, int dim, float eps) {                                     \
        let_next_kernel_start(); /* a projection after it (linear_rows) starts loading its weights */                \
        add_rms_norm<T>(x, h, w, res, out, dim, eps);                                                                 \
    }                                                                                                                 \
    extern "C" __global__ void silu_mul_##SUFFIX(const T* y, T* out, unsigned long long rows, int inter) {            \
        let_next_kernel_start(); /* as add_rms_norm: the down projection after it */                                 \
        silu_mul<T>(y, out, rows, inter);                                                                             \
    }                                                                                                                 \
    extern "C" __global__ void rope_angles_##SUFFIX(const uint32_t* positions, const float* inv_freq, T* cos_out,     \
                                                    T* sin_out, int tokens, int per_token) {                          \
        rope_angles<T>(positions, inv_freq, cos_out, sin_out, tokens, per_token);                                     \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) decode_prologue_##SUFFIX(                                     \
        const uint32_t* ids, const uint32_t* lens, const uint32_t* slot_starts, const float* inv_freq, const T* embed,  \
        const T* norm_w, uint32_t* seqlens, uint32_t* cache_rows, T* cos_out, T* sin_out, T* x_out, T* normed_out,    \
        int hidden, int per_token, unsigned vocab, float eps) {                                                       \
        decode_prologue<T>(ids, lens, slot_starts, inv_freq, embed, norm_w, seqlens, cache_rows, cos_out, sin_out,    \
                           x_out, normed_out, hidden, per_token, vocab, eps);                                          \
    }                                                                                                                 \
    extern "C" __global__ void rope_store_##SUFFIX(T* y, const T* cos, const T* sin, int tokens, int heads, int d,   \
                                                   int interleaved, const uint32_t* rows, T* cache,                  \
                                                   long long row_stride, int first) {                                \
        rope_store<T>(y, cos, sin, tokens, heads, d, interleaved, rows, first, StoreRows<T>{cache, row_stride});      \
    }                                                                                                                 \
    extern "C" __global__ void rope_store_e4m3_##SUFFIX(T* y, const T* cos, const T* sin, int tokens, int heads,      \
                                                        int d, int interleaved, const uint32_t* rows,                 \
                                                        __nv_fp8_e4m3* cache, long long plane, int kv_heads,          \
                                                        const float* quant) {                                         \
        rope_store<T>(y, cos, sin, tokens, heads, d, interleaved, rows, heads - 2 * kv_heads,                        \
                      StoreE4m3{cache, plane, kv_heads, quant});                                                      \
    }                                                                                                                 \
    extern "C" __global__ void store_e4m3_##SUFFIX(const T* x, int tokens, int d, const uint32_t* rows,             \
                                                   __nv_fp8_e4m3* cache, long long plane, int kv_heads,               \
                                                   const float* quant) {                                              \
        store_e4m3<T>(x, tokens, d, rows, StoreE4m3{cache, plane, kv_heads, quant});                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kArgmaxThreads) argmax_chunks_##SUFFIX(                             \
        const T* x, float* part_best, uint32_t* part_at, int cols) {                                                  \
        argmax_chunks<T>(x, part_best, part_at, cols);                                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kMatvecWarps * kMatvecSplit * 32) linear_vector_##SUFFIX(            \
        const T* x, const T* w, const T* bias, T* y, int n, int k) {                                                  \
        linear_vector<T, kMatvecSplit>(PlainInput<T>{x}, w, bias, y, n, k);                                           \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kMatvecWarps * kMatvecLongSplit * 32, 2)                             \
        linear_vector_long_##SUFFIX(const T* x, const T* w, const T* bias, T* y, int n, int k) {                      \
        linear_vector<T, kMatvecLongSplit>(PlainInput<T>{x}, w, bias, y, n, k);                                       \
    }                                                                                                                 \
    /* The add + norm forms: the staged row (k elements of T) is the dynamic shared memory. */                        \
    extern "C" __global__ void __launch_bounds__(kMatvecWarps * 32, kNormBlocksPerSm<T>)                              \
        linear_vector_add_norm_##SUFFIX(const T* a, const T* b, const T* norm_w, float eps, T* res, const T* w,       \
                                        const T* bias, T* y, int n, int k) {                                          \
        extern __shared__ uint4 staged_norm_##SUFFIX[];                                                               \
        const AddNormInput<T> in{reinterpret_cast<T*>(staged_norm_##SUFFIX), a, b, norm_w, res, eps};                 \
        linear_vector<T>(in, w, bias, y, n, k);                                                                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kMatvecWarps * 32, kNormBlocksPerSm<T>)                              \
        linear_vector_add_norm_swiglu_##SUFFIX(const T* a, const T* b, const T* norm_w, float eps, T* res,            \
                                               const T* w, T* act, int inter, int k) {                                \
        extern __shared__ uint4 staged_swiglu_##SUFFIX[];                                                             \
        const AddNormInput<T> in{reinterpret_cast<T*>(staged_swiglu_##SUFFIX), a, b, norm_w, res, eps};               \
        linear_vector_swiglu<T>(in, w, act, inter, k);                                                                \
    }

extern "C" __global__ void __launch_bounds__(32) argmax_finish(const float* part_best, const uint32_t* part_at,
                                                                int chunks, uint32_t* out, uint32_t* bump,
                                                                uint32_t* host, int host_rows) {
    choose_among_chunks(part_best, part_at, chunks, out, bump, host, host_rows);
}

FUSED_OPS(__nv_bfloat16, bf16)
FUSED_OPS(__half, f16)
FUSED_OPS(float, f32)
