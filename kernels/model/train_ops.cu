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

// V values of T moved as one load or store (V · sizeof(T) ≤ 16 bytes, aligned to its size).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
    return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
    *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// y = v * rsqrt(mean(v²) + eps) * w over rows of `dim` contiguous elements, v = x, or with a
// residual h (not null) v = x + h rounded to T, also stored in `sum` (the next residual stream):
// the add and the norm of a pre-norm block in one pass, bit for bit the two launches'. One warp
// per row, V values per load (16 bytes where the host found dim and the addresses aligned).
template <typename T, int V>
__device__ void rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ h, const T* __restrict__ w,
                             T* __restrict__ sum, T* __restrict__ y, size_t rows, int dim, float eps) {
    const size_t row = (size_t)blockIdx.x * kRowWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    x += row * dim;
    y += row * dim;
    if (h != nullptr) {
        h += row * dim;
        sum += row * dim;
    }
    // The row's values (x + h rounded to T), V at a time.
    auto values = [&](int c, float* v) {
        const Pack<T, V> xv = load<T, V>(x + c);
        if (h == nullptr) {
#pragma unroll
            for (int k = 0; k < V; ++k) v[k] = to_f(xv.v[k]);
            return;
        }
        const Pack<T, V> hv = load<T, V>(h + c);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = to_f(from_f<T>(to_f(xv.v[k]) + to_f(hv.v[k])));
    };
    float ss = 0.f;
    for (int c = lane * V; c < dim; c += 32 * V) {
        float v[V];
        values(c, v);
        Pack<T, V> s;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            ss += v[k] * v[k];
            s.v[k] = from_f<T>(v[k]);
        }
        if (h != nullptr) store<T, V>(sum + c, s);
    }
    const float r = rsqrtf(warp_sum(ss) / dim + eps);
    for (int c = lane * V; c < dim; c += 32 * V) {
        float v[V];
        values(c, v);
        const Pack<T, V> wv = load<T, V>(w + c);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_f<T>(v[k] * r * to_f(wv.v[k]));
        store<T, V>(y + c, o);
    }
}

// dx of one row of RMSNorm: with r = rsqrt(mean(x²) + eps), g = dy * w,
// dx = r * g - x * r³ * mean(g * x), plus `dres` where not null (the gradient that reaches x
// through the residual stream, added here instead of by another launch). With `dw` (not null:
// the warp's own slice of dim floats) also adds dy * x * r of the row into it, each lane into its
// own columns. Called by the 32 lanes of a warp; returns r. V values per load as in rms_norm_fwd.
template <typename T, int V>
__device__ __forceinline__ float rms_norm_bwd_row(const T* __restrict__ x, const T* __restrict__ w,
                                                  const T* __restrict__ dy, const T* __restrict__ dres,
                                                  T* __restrict__ dx, float* dw, int dim, float eps, int lane) {
    float ss = 0.f, dot = 0.f;
    for (int c = lane * V; c < dim; c += 32 * V) {
        const Pack<T, V> xv = load<T, V>(x + c), dv = load<T, V>(dy + c), wv = load<T, V>(w + c);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float v = to_f(xv.v[k]);
            ss += v * v;
            dot += to_f(dv.v[k]) * to_f(wv.v[k]) * v;
        }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float r = rsqrtf(ss / dim + eps);
    const float k = r * r * r * dot / dim;
    for (int c = lane * V; c < dim; c += 32 * V) {
        const Pack<T, V> xv = load<T, V>(x + c), dv = load<T, V>(dy + c), wv = load<T, V>(w + c);
        Pack<T, V> rv;
        if (dres != nullptr) rv = load<T, V>(dres + c);
        Pack<T, V> o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float res = dres == nullptr ? 0.f : to_f(rv.v[j]);
            o.v[j] = from_f<T>(r * to_f(dv.v[j]) * to_f(wv.v[j]) - k * to_f(xv.v[j]) + res);
            if (dw != nullptr) dw[c + j] += to_f(dv.v[j]) * to_f(xv.v[j]) * r;
        }
        store<T, V>(dx + c, o);
    }
    return r;
}

// dx of RMSNorm, one warp per row; stores r per row for the separate dw kernel (rows wider than
// the fused kernel's shared memory allows).
template <typename T, int V>
__device__ void rms_norm_bwd_dx(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                const T* __restrict__ dres, T* __restrict__ dx, float* __restrict__ rstd, size_t rows,
                                int dim, float eps) {
    const size_t row = (size_t)blockIdx.x * kRowWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const size_t off = row * dim;
    const float r = rms_norm_bwd_row<T, V>(x + off, w, dy + off, dres == nullptr ? nullptr : dres + off, dx + off,
                                           nullptr, dim, eps, lane);
    if (lane == 0) rstd[row] = r;
}

// Rows at most this wide take rms_norm_bwd_fused (kRowWarps slices of dim floats: 48 KiB).
constexpr int kFusedDwMaxDim = 1536;

// dx of RMSNorm and, in the same pass, dw's partial sum over the block's rows [blockIdx.x ·
// rows_per_block, ..): warp w takes rows w, w + kRowWarps, ... and adds dy * x * r into its own
// shared-memory slice; then the block adds the slices in warp order into partial[blockIdx.x].
// A fixed order (deterministic), and x and dy are read once.
template <typename T, int V>
__device__ void rms_norm_bwd_fused(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                   const T* __restrict__ dres, T* __restrict__ dx, float* __restrict__ partial,
                                   size_t rows, int dim, float eps, int rows_per_block) {
    __shared__ float slices[kRowWarps * kFusedDwMaxDim];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* mine = slices + warp * dim;
    // Zeroed in the pattern each lane adds in: its own columns, no other thread's.
    for (int c = lane * V; c < dim; c += 32 * V) {
#pragma unroll
        for (int j = 0; j < V; ++j) mine[c + j] = 0.f;
    }
    const size_t r0 = (size_t)blockIdx.x * rows_per_block;
    const size_t r1 = min(rows, r0 + rows_per_block);
    for (size_t row = r0 + warp; row < r1; row += kRowWarps) {
        const size_t off = row * dim;
        rms_norm_bwd_row<T, V>(x + off, w, dy + off, dres == nullptr ? nullptr : dres + off, dx + off, mine, dim, eps,
                               lane);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < kRowWarps; ++k) acc += slices[k * dim + c];
        partial[(size_t)blockIdx.x * dim + c] = acc;
    }
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

// out[c] = sum over chunks of partial[chunk][c]. Block: 32 columns × 8 lanes of chunks; lane
// group g sums chunks g, g + 8, ... in order, then the 8 sums are added in order: a fixed order.
template <typename T>
__device__ void column_sum(const float* __restrict__ partial, T* __restrict__ out, int chunks, int dim) {
    __shared__ float sums[8][32];
    const int g = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = blockIdx.x * 32 + lane;
    float acc = 0.f;
    if (c < dim) {
        for (int k = g; k < chunks; k += 8) acc += partial[(size_t)k * dim + c];
    }
    sums[g][lane] = acc;
    __syncthreads();
    if (g == 0 && c < dim) {
        float total = 0.f;
        for (int k = 0; k < 8; ++k) total += sums[k][lane];
        out[c] = from_f<T>(total);
    }
}

// Rotary embedding of `heads` heads of d values per token: token t's heads at x + t · x_stride,
// written to y + t · y_stride (rows of a packed q/k/v projection in, or one slice of a packed
// gradient out), every head of token t by the angles of row t of cos/sin (tokens, d / 2), sin
// times `sign` (-1: the inverse rotation, i.e. the backward); sign 0 copies the heads unchanged.
// Pairs (x[i], x[i + d/2]), or (x[2i], x[2i+1]) if interleaved. Each thread takes V pairs: V = 1,
// or (not interleaved, strides and addresses aligned: the host checks) 16 bytes' worth of
// first halves and of second halves per load.
template <typename T, int V>
__device__ void rope(const T* __restrict__ x, size_t x_stride, const T* __restrict__ cos, const T* __restrict__ sin,
                     T* __restrict__ y, size_t y_stride, int tokens, int heads, int d, int interleaved, float sign) {
    const int half = d / 2;
    const int groups = half / V;
    const size_t n = (size_t)tokens * heads * groups;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t th = i / groups;  // token * heads + head
        const int p = (int)(i % groups) * V;
        const size_t t = th / heads;
        const int head = th % heads;
        const T* xr = x + t * x_stride + head * d;
        T* yr = y + t * y_stride + head * d;
        if constexpr (V == 1) {
            const int c1 = interleaved ? 2 * p : p;
            const int c2 = interleaved ? 2 * p + 1 : p + half;
            if (sign == 0.f) {
                yr[c1] = xr[c1];
                yr[c2] = xr[c2];
                continue;
            }
            const float a = to_f(xr[c1]), b = to_f(xr[c2]);
            const float c = to_f(cos[t * half + p]), s = sign * to_f(sin[t * half + p]);
            yr[c1] = from_f<T>(a * c - b * s);
            yr[c2] = from_f<T>(a * s + b * c);
        } else {
            const Pack<T, V> a = load<T, V>(xr + p), b = load<T, V>(xr + p + half);
            if (sign == 0.f) {
                store<T, V>(yr + p, a);
                store<T, V>(yr + p + half, b);
                continue;
            }
            const Pack<T, V> cv = load<T, V>(cos + t * half + p), sv = load<T, V>(sin + t * half + p);
            Pack<T, V> o1, o2;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const float av = to_f(a.v[k]), bv = to_f(b.v[k]);
                const float c = to_f(cv.v[k]), s = sign * to_f(sv.v[k]);
                o1.v[k] = from_f<T>(av * c - bv * s);
                o2.v[k] = from_f<T>(av * s + bv * c);
            }
            store<T, V>(yr + p, o1);
            store<T, V>(yr + p + half, o2);
        }
    }
}

// SiLU(gate) × up over `rows` rows of `cols` values. Row r of the gate is at g + r · in_stride and
// of up at u + r · in_stride: two tensors (in_stride = cols), or the two halves of one packed
// gate/up row (u = g + cols, in_stride = 2 · cols). out is (rows, cols). Each thread moves V
// values per load (V = 16 bytes' worth where the host found the columns, strides and addresses
// aligned to it, else 1).
template <typename T, int V>
__device__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, size_t rows,
                           int cols, size_t in_stride) {
    const int vcols = cols / V;
    const size_t n = rows * vcols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / vcols;
        const int c = (int)(i % vcols) * V;
        const Pack<T, V> gv = *reinterpret_cast<const Pack<T, V>*>(g + r * in_stride + c);
        const Pack<T, V> uv = *reinterpret_cast<const Pack<T, V>*>(u + r * in_stride + c);
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float x = to_f(gv.v[k]);
            o.v[k] = from_f<T>(x / (1.f + __expf(-x)) * to_f(uv.v[k]));
        }
        *reinterpret_cast<Pack<T, V>*>(out + r * cols + c) = o;
    }
}

// With s = sigmoid(g): dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s. Gate and up rows as
// in swiglu_fwd, dy (rows, cols); row r of dg at dg + r · out_stride and of du at du + r ·
// out_stride: [dg; du] stacked (du = dg + rows · cols, out_stride = cols) or one packed
// gradient row (du = dg + cols, out_stride = 2 · cols).
template <typename T, int V>
__device__ void swiglu_bwd(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dy,
                           T* __restrict__ dg, T* __restrict__ du, size_t rows, int cols, size_t in_stride,
                           size_t out_stride) {
    const int vcols = cols / V;
    const size_t n = rows * vcols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / vcols;
        const int c = (int)(i % vcols) * V;
        const Pack<T, V> gv = *reinterpret_cast<const Pack<T, V>*>(g + r * in_stride + c);
        const Pack<T, V> uv = *reinterpret_cast<const Pack<T, V>*>(u + r * in_stride + c);
        const Pack<T, V> dv = *reinterpret_cast<const Pack<T, V>*>(dy + r * cols + c);
        Pack<T, V> dgv, duv;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float x = to_f(gv.v[k]), up = to_f(uv.v[k]), d = to_f(dv.v[k]);
            const float s = 1.f / (1.f + __expf(-x));
            dgv.v[k] = from_f<T>(d * up * s * (1.f + x * (1.f - s)));
            duv.v[k] = from_f<T>(d * x * s);
        }
        *reinterpret_cast<Pack<T, V>*>(dg + r * out_stride + c) = dgv;
        *reinterpret_cast<Pack<T, V>*>(du + r * out_stride + c) = duv;
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

// ---- Cross-entropy over rows of logits (the LM head's output, a chunk of a micro-batch's tokens
// at a time: the full (tokens, vocab) logits never exist at once, nor any f32 copy of them).

// The running (max, sum of exp(x - max)) of a set of values merged with another's.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    // A side with no finite value yet (max -inf) adds nothing (and must not make exp(NaN)).
    s = (m == -INFINITY ? 0.f : s * expf(m - top)) + (m2 == -INFINITY ? 0.f : s2 * expf(m2 - top));
    m = top;
}

// out[row] = (logsumexp of the row, the target's logit; NaN for a target outside the vocabulary),
// f32. One block of kThreads per row: each thread's running (max, sum) over a strided part of the
// row, then merged over the warp and the warps (a fixed order, so deterministic).
template <typename T>
__device__ void ce_logsumexp(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                             float* __restrict__ out, int vocab) {
    __shared__ float warp_m[kThreads / 32], warp_s[kThreads / 32];
    const T* x = logits + (size_t)blockIdx.x * vocab;
    float m = -INFINITY, s = 0.f;
    for (int i = threadIdx.x; i < vocab; i += kThreads) lse_merge(m, s, to_f(x[i]), 1.f);
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kThreads / 32; ++w) lse_merge(m, s, warp_m[w], warp_s[w]);
        const uint32_t t = targets[blockIdx.x];
        out[2 * (size_t)blockIdx.x] = m + logf(s);
        out[2 * (size_t)blockIdx.x + 1] = t < (uint32_t)vocab ? to_f(x[t]) : NAN;
    }
}

// dx = scale · (softmax(row) − one_hot(target)), softmax from the row's logsumexp `lse`; one block
// of kThreads per row.
template <typename T>
__device__ void ce_backward(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                            const float* __restrict__ lse, T* __restrict__ dx, int vocab, float scale) {
    const size_t row = blockIdx.x;
    const T* x = logits + row * vocab;
    T* d = dx + row * vocab;
    const float l = lse[row];
    const uint32_t t = targets[row];
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const float p = expf(to_f(x[i]) - l);
        d[i] = from_f<T>(scale * (p - ((uint32_t)i == t ? 1.f : 0.f)));
    }
}

}  // namespace

#define TRAIN_OPS(T, SUFFIX)                                                                                         \
    extern "C" __global__ void __launch_bounds__(kRowWarps * 32) rms_norm_fwd_##SUFFIX(                               \
        const T* x, const T* h, const T* w, T* sum, T* y, unsigned long long rows, int dim, float eps, int vectors) {  \
        if (vectors) rms_norm_fwd<T, 16 / sizeof(T)>(x, h, w, sum, y, rows, dim, eps);                               \
        else rms_norm_fwd<T, 1>(x, h, w, sum, y, rows, dim, eps);                                                     \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kRowWarps * 32) rms_norm_bwd_dx_##SUFFIX(                            \
        const T* x, const T* w, const T* dy, const T* dres, T* dx, float* rstd, unsigned long long rows, int dim,     \
        float eps, int vectors) {                                                                                     \
        if (vectors) rms_norm_bwd_dx<T, 16 / sizeof(T)>(x, w, dy, dres, dx, rstd, rows, dim, eps);                   \
        else rms_norm_bwd_dx<T, 1>(x, w, dy, dres, dx, rstd, rows, dim, eps);                                         \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kRowWarps * 32) rms_norm_bwd_fused_##SUFFIX(                         \
        const T* x, const T* w, const T* dy, const T* dres, T* dx, float* partial, unsigned long long rows, int dim,  \
        float eps, int rows_per_block, int vectors) {                                                                 \
        if (vectors) rms_norm_bwd_fused<T, 16 / sizeof(T)>(x, w, dy, dres, dx, partial, rows, dim, eps, rows_per_block); \
        else rms_norm_bwd_fused<T, 1>(x, w, dy, dres, dx, partial, rows, dim, eps, rows_per_block);                   \
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
    extern "C" __global__ void rope_##SUFFIX(const T* x, unsigned long long x_stride, const T* cos, const T* sin,   \
                                             T* y, unsigned long long y_stride, int tokens, int heads, int d,        \
                                             int interleaved, float sign, int vectors) {                             \
        if (vectors) rope<T, 16 / sizeof(T)>(x, x_stride, cos, sin, y, y_stride, tokens, heads, d, 0, sign);         \
        else rope<T, 1>(x, x_stride, cos, sin, y, y_stride, tokens, heads, d, interleaved, sign);                     \
    }                                                                                                                 \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T* g, const T* u, T* out, unsigned long long rows, int cols, \
                                                   unsigned long long in_stride, int vectors) {                      \
        if (vectors) swiglu_fwd<T, 16 / sizeof(T)>(g, u, out, rows, cols, in_stride);                                \
        else swiglu_fwd<T, 1>(g, u, out, rows, cols, in_stride);                                                      \
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
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T* g, const T* u, const T* dy, T* dg, T* du,                 \
                                                   unsigned long long rows, int cols, unsigned long long in_stride,  \
                                                   unsigned long long out_stride, int vectors) {                     \
        if (vectors) swiglu_bwd<T, 16 / sizeof(T)>(g, u, dy, dg, du, rows, cols, in_stride, out_stride);             \
        else swiglu_bwd<T, 1>(g, u, dy, dg, du, rows, cols, in_stride, out_stride);                                   \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads)                                                            \
        ce_logsumexp_##SUFFIX(const T* logits, const uint32_t* targets, float* out, int vocab) {                      \
        ce_logsumexp<T>(logits, targets, out, vocab);                                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(kThreads) ce_backward_##SUFFIX(                                      \
        const T* logits, const uint32_t* targets, const float* lse, T* dx, int vocab, float scale) {                  \
        ce_backward<T>(logits, targets, lse, dx, vocab, scale);                                                       \
    }

// ---- The optimizer step on the GPU (train::optim::AdamW::update): three launches for the whole
// model and no wait for the host. Every parameter tensor is cut into chunks of at most
// kOptimChunk elements (one block each, listed in a table the host uploads), then:
//   1. optim_grad_sq_sums: each chunk's sum of squared gradients;
//   2. optim_clip: their total in a fixed order (so a step is deterministic and --resume
//      bit-exact), the global norm, the clip scale, and whether to skip the step (a gradient or
//      the loss not finite: the weights stay as they were and the host reports the divergence);
//   3. optim_adamw: the update of every chunk, reading the scale written by step 2, and where
//      the chunk has one, the new weight's 16-bit copy (the compute dtype's weights that the
//      next step's matmuls read), so that no step casts its weights.

// OptimChunk::flags.
constexpr unsigned int kOptimDecayed = 1;    // a matrix: weight decay applies
constexpr unsigned int kOptimCopyF16 = 2;    // the copy is f16 (else bf16)

// One chunk of one parameter tensor; the host writes the same layout (six u64 words,
// crates/model/src/train_ops/cuda.rs: `optimizer_step`).
struct OptimChunk {
    float* p;
    const float* g;
    float* m;
    float* v;
    void* copy;  // the chunk's 16-bit copy, or null
    unsigned int len;
    unsigned int flags;
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
    const float decay = (c.flags & kOptimDecayed) ? matrix_decay : 1.f;
    for (unsigned int i = threadIdx.x; i < c.len; i += kThreads) {
        const float gi = c.g[i] * grad_scale;
        const float mi = c.m[i] * beta1 + gi * (1.f - beta1);
        const float vi = c.v[i] * beta2 + gi * gi * (1.f - beta2);
        c.m[i] = mi;
        c.v[i] = vi;
        const float update = (mi / correction1) / (sqrtf(vi / correction2) + eps);
        const float p = c.p[i] * decay - update * lr;
        c.p[i] = p;
        // Round to nearest even, as candle's f32 -> 16-bit cast.
        if (c.copy == nullptr) continue;
        if (c.flags & kOptimCopyF16) static_cast<__half*>(c.copy)[i] = __float2half_rn(p);
        else static_cast<__nv_bfloat16*>(c.copy)[i] = __float2bfloat16_rn(p);
    }
}

TRAIN_OPS(__nv_bfloat16, bf16)
TRAIN_OPS(__half, f16)
TRAIN_OPS(float, f32)
