// Fused ops of flash-llama's training path (Kernels::Trainable), forward and backward: RMSNorm,
// RoPE, SiLU(gate) × up and the embedding lookup. Arithmetic in f32, one rounding per output. The
// weight gradients of RMSNorm and of the embedding are reduced in a fixed order (per-chunk
// partial sums, then a sum over the chunks), so gradients are deterministic. Compiled by
// crates/model/build.rs into an sm_90a cubin; launched by crates/model/src/train_ops/cuda.rs.
// The CPU loops of crates/model/src/train_ops/mod.rs compute the same things.
#include <stdint.h>

#include "dtype.cuh"

namespace {

// Rows per block of the row kernels: one warp per row.
constexpr int kRowWarps = 8;
// Threads per block of the column and elementwise kernels.
constexpr int kThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// y = x * rsqrt(mean(x²) + eps) * w over rows of `dim` contiguous elements; x, y (rows, dim).
template <typename T>
__device__ void rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, size_t rows,
                             int dim, float eps) {
    const size_t row = (size_t)blockIdx.x * kRowWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    x += row * dim;
    y += row * dim;
    float ss = 0.f;
    for (int c = lane; c < dim; c += 32) {
        const float v = to_f(x[c]);
        ss += v * v;
    }
    const float r = rsqrtf(warp_sum(ss) / dim + eps);
    for (int c = lane; c < dim; c += 32) y[c] = from_f<T>(to_f(x[c]) * r * to_f(w[c]));
}

// dx of RMSNorm: with r = rsqrt(mean(x²) + eps), g = dy * w,
// dx = r * g - x * r³ * mean(g * x). Also stores r per row (for dw).
template <typename T>
__device__ void rms_norm_bwd_dx(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                T* __restrict__ dx, float* __restrict__ rstd, size_t rows, int dim, float eps) {
    const size_t row = (size_t)blockIdx.x * kRowWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    x += row * dim;
    dy += row * dim;
    dx += row * dim;
    float ss = 0.f, dot = 0.f;
    for (int c = lane; c < dim; c += 32) {
        const float v = to_f(x[c]);
        ss += v * v;
        dot += to_f(dy[c]) * to_f(w[c]) * v;
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float r = rsqrtf(ss / dim + eps);
    const float k = r * r * r * dot / dim;
    for (int c = lane; c < dim; c += 32) dx[c] = from_f<T>(r * to_f(dy[c]) * to_f(w[c]) - k * to_f(x[c]));
    if (lane == 0) rstd[row] = r;
}

// partial[chunk][c] = sum over the chunk's rows of dy * x * rstd (column c). Grid (column
// blocks, chunks); each thread owns one column of one chunk: a fixed summation order.
template <typename T>
__device__ void rms_norm_bwd_dw(const T* __restrict__ x, const T* __restrict__ dy, const float* __restrict__ rstd,
                                float* __restrict__ partial, size_t rows, int dim, int rows_per_chunk) {
    const int c = blockIdx.x * kThreads + threadIdx.x;
    if (c >= dim) return;
    const size_t r0 = (size_t)blockIdx.y * rows_per_chunk;
    const size_t r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.f;
    for (size_t r = r0; r < r1; ++r) acc += to_f(dy[r * dim + c]) * to_f(x[r * dim + c]) * rstd[r];
    partial[(size_t)blockIdx.y * dim + c] = acc;
}

// out[c] = sum over chunks of partial[chunk][c], in chunk order.
template <typename T>
__device__ void column_sum(const float* __restrict__ partial, T* __restrict__ out, int chunks, int dim) {
    const int c = blockIdx.x * kThreads + threadIdx.x;
    if (c >= dim) return;
    float acc = 0.f;
    for (int k = 0; k < chunks; ++k) acc += partial[(size_t)k * dim + c];
    out[c] = from_f<T>(acc);
}

// Rotary embedding of x (tokens, heads, d) into y, every head of token t by the angles of row t
// of cos/sin (tokens, d / 2), sin times `sign` (-1: the inverse rotation, i.e. the backward).
// Pairs (x[i], x[i + d/2]), or (x[2i], x[2i+1]) if interleaved.
template <typename T>
__device__ void rope(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                     T* __restrict__ y, int tokens, int heads, int d, int interleaved, float sign) {
    const int half = d / 2;
    const size_t n = (size_t)tokens * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t th = i / half;  // token * heads + head
        const int p = i % half;
        const size_t t = th / heads;
        const int c1 = interleaved ? 2 * p : p;
        const int c2 = interleaved ? 2 * p + 1 : p + half;
        const float a = to_f(x[th * d + c1]), b = to_f(x[th * d + c2]);
        const float c = to_f(cos[t * half + p]), s = sign * to_f(sin[t * half + p]);
        y[th * d + c1] = from_f<T>(a * c - b * s);
        y[th * d + c2] = from_f<T>(a * s + b * c);
    }
}

// out = silu(g) * u, elementwise over n.
template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]);
        out[i] = from_f<T>(gv / (1.f + __expf(-gv)) * to_f(u[i]));
    }
}

// With s = sigmoid(g): dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s; out = [dg; du].
template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dy,
                           T* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]);
        const float s = 1.f / (1.f + __expf(-gv));
        out[i] = from_f<T>(d * uv * s * (1.f + gv * (1.f - s)));
        out[n + i] = from_f<T>(d * gv * s);
    }
}

// Embedding rows: out[t][c] = w[ids[t]][c], out (tokens, dim).
template <typename T>
__device__ void embedding_fwd(const T* __restrict__ w, const uint32_t* __restrict__ ids, T* __restrict__ out,
                              size_t tokens, int dim) {
    const size_t n = tokens * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = w[(size_t)ids[i / dim] * dim + i % dim];
    }
}

// Embedding backward, first pass: the tokens sorted by id (perm) are cut into chunks that never
// straddle two ids; partial[k][c] = sum of dy[perm[i]][c] over chunk k = [bounds[k], bounds[k+1]).
// Grid (chunks, column blocks).
template <typename T>
__device__ void embedding_bwd_partial(const T* __restrict__ dy, const uint32_t* __restrict__ perm,
                                      const uint32_t* __restrict__ bounds, float* __restrict__ partial, int dim) {
    const int c = blockIdx.y * kThreads + threadIdx.x;
    if (c >= dim) return;
    const size_t k = blockIdx.x;
    float acc = 0.f;
    for (uint32_t i = bounds[k]; i < bounds[k + 1]; ++i) acc += to_f(dy[(size_t)perm[i] * dim + c]);
    partial[(size_t)k * dim + c] = acc;
}

// Second pass: dw[v][c] = sum of the partials of row v's chunks [row_chunks[v], row_chunks[v+1])
// in order (0 for ids that do not occur). Grid (vocab, column blocks).
template <typename T>
__device__ void embedding_bwd_rows(const float* __restrict__ partial, const uint32_t* __restrict__ row_chunks,
                                   T* __restrict__ dw, int dim) {
    const int c = blockIdx.y * kThreads + threadIdx.x;
    if (c >= dim) return;
    const size_t v = blockIdx.x;
    float acc = 0.f;
    for (uint32_t k = row_chunks[v]; k < row_chunks[v + 1]; ++k) acc += partial[(size_t)k * dim + c];
    dw[v * dim + c] = from_f<T>(acc);
}

}  // namespace

#define TRAIN_OPS(T, SUFFIX)                                                                                         \
    extern "C" __global__ void __launch_bounds__(kRowWarps * 32) rms_norm_fwd_##SUFFIX(                               \
        const T* x, const T* w, T* y, unsigned long long rows, int dim, float eps) {                                  \
        rms_norm_fwd<T>(x, w, y, rows, dim, eps);                                                                     \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kRowWarps * 32) rms_norm_bwd_dx_##SUFFIX(                            \
        const T* x, const T* w, const T* dy, T* dx, float* rstd, unsigned long long rows, int dim, float eps) {       \
        rms_norm_bwd_dx<T>(x, w, dy, dx, rstd, rows, dim, eps);                                                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads) rms_norm_bwd_dw_##SUFFIX(                                  \
        const T* x, const T* dy, const float* rstd, float* partial, unsigned long long rows, int dim,                 \
        int rows_per_chunk) {                                                                                         \
        rms_norm_bwd_dw<T>(x, dy, rstd, partial, rows, dim, rows_per_chunk);                                          \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads) column_sum_##SUFFIX(const float* partial, T* out,          \
                                                                              int chunks, int dim) {                 \
        column_sum<T>(partial, out, chunks, dim);                                                                     \
    }                                                                                                                 \
    extern "C" __global__ void rope_##SUFFIX(const T* x, const T* cos, const T* sin, T* y, int tokens, int heads,    \
                                             int d, int interleaved, float sign) {                                   \
        rope<T>(x, cos, sin, y, tokens, heads, d, interleaved, sign);                                                 \
    }                                                                                                                 \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T* g, const T* u, T* out, unsigned long long n) {            \
        swiglu_fwd<T>(g, u, out, n);                                                                                  \
    }                                                                                                                 \
    extern "C" __global__ void embedding_fwd_##SUFFIX(const T* w, const uint32_t* ids, T* out,                      \
                                                      unsigned long long tokens, int dim) {                          \
        embedding_fwd<T>(w, ids, out, tokens, dim);                                                                   \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads) embedding_bwd_partial_##SUFFIX(                            \
        const T* dy, const uint32_t* perm, const uint32_t* bounds, float* partial, int dim) {                         \
        embedding_bwd_partial<T>(dy, perm, bounds, partial, dim);                                                     \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads) embedding_bwd_rows_##SUFFIX(                               \
        const float* partial, const uint32_t* row_chunks, T* dw, int dim) {                                           \
        embedding_bwd_rows<T>(partial, row_chunks, dw, dim);                                                          \
    }                                                                                                                 \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T* g, const T* u, const T* dy, T* out,                       \
                                                   unsigned long long n) {                                           \
        swiglu_bwd<T>(g, u, dy, out, n);                                                                              \
    }

// ---- The optimizer step on the GPU (train::optim::AdamW::update): three launches for the whole
// model and no wait for the host. Every parameter tensor is cut into chunks of at most
// kOptimChunk elements (one block each, listed in a table the host uploads), then:
//   1. optim_grad_sq_sums: each chunk's sum of squared gradients;
//   2. optim_clip: their total in a fixed order (so a step is deterministic and --resume
//      bit-exact), the global norm, the clip scale, and whether to skip the step (a gradient or
//      the loss not finite: the weights stay as they were and the host reports the divergence);
//   3. optim_adamw: the update of every chunk, reading the scale written by step 2.

// One chunk of one parameter tensor; the host writes the same layout (five u64 words,
// crates/model/src/train_ops/cuda.rs: `OptimChunk`).
struct OptimChunk {
    float* p;
    const float* g;
    float* m;
    float* v;
    unsigned int len;
    unsigned int decayed;  // a matrix: weight decay applies
};

// The block's sum of v (every thread gets it); deterministic: a fixed tree over fixed lanes.
static __device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();  // warp_sums may still be read by a previous call
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < warps ? warp_sums[lane] : 0.f;
    return warp_sum(v);
}

extern "C" __global__ void __launch_bounds__(kThreads)
    optim_grad_sq_sums(const OptimChunk* __restrict__ chunks, float* __restrict__ partials) {
    const OptimChunk c = chunks[blockIdx.x];
    float s = 0.f;
    for (unsigned int i = threadIdx.x; i < c.len; i += kThreads) {
        const float g = c.g[i];
        s += g * g;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block of kThreads. stats: [global norm, clip scale, 1 if the step is skipped].
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_clip(const float* __restrict__ partials, unsigned int n, const float* __restrict__ loss, float clip,
               float* __restrict__ stats) {
    float s = 0.f;
    for (unsigned int i = threadIdx.x; i < n; i += kThreads) s += partials[i];
    s = block_sum(s);
    if (threadIdx.x == 0) {
        // The host's arithmetic: the norm and the scale in f64, the scale rounded once.
        const double norm = sqrt((double)s);
        const bool skip = !isfinite(s) || !isfinite(*loss);
        stats[0] = (float)norm;
        stats[1] = (clip > 0.f && norm > (double)clip) ? (float)((double)clip / norm) : 1.f;
        stats[2] = skip ? 1.f : 0.f;
    }
}

// AdamW with decoupled weight decay: p <- p * decay - lr * m_hat / (sqrt(v_hat) + eps), the same
// arithmetic in the same order as the composed candle ops of AdamW::update on the CPU.
extern "C" __global__ void __launch_bounds__(kThreads)
    optim_adamw(const OptimChunk* __restrict__ chunks, const float* __restrict__ stats, float lr, float beta1,
                float beta2, float eps, float matrix_decay, float correction1, float correction2) {
    if (stats[2] != 0.f) return;
    const float grad_scale = stats[1];
    const OptimChunk c = chunks[blockIdx.x];
    const float decay = c.decayed ? matrix_decay : 1.f;
    for (unsigned int i = threadIdx.x; i < c.len; i += kThreads) {
        const float gi = c.g[i] * grad_scale;
        const float mi = c.m[i] * beta1 + gi * (1.f - beta1);
        const float vi = c.v[i] * beta2 + gi * gi * (1.f - beta2);
        c.m[i] = mi;
        c.v[i] = vi;
        const float update = (mi / correction1) / (sqrtf(vi / correction2) + eps);
        c.p[i] = c.p[i] * decay - update * lr;
    }
}

TRAIN_OPS(__nv_bfloat16, bf16)
TRAIN_OPS(__half, f16)
TRAIN_OPS(float, f32)
