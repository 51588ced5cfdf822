// Matvec micro-benchmark (session 28; docs/kernels/model-fused.md, "Session 28"): the batch-1
// projections of the Llama-3.2-1B shape, y = W x with W (n, k) bf16, as variants of linear_vector
// (kernels/model/fused.cu): KW warps per output, as more blocks (8/KW outputs per block of 256
// threads) or as bigger blocks (8 outputs per block of 256*KW threads), each with the prologue its
// projection runs per block in the model: none (o), SiLU x up (down), add + RMSNorm (q/k/v,
// gate/up, head). Each shape is timed over enough weight copies that L2 never holds them, launched
// back to back from a CUDA graph. On the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/mv matvec-microbench.cu && /tmp/mv
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstdint>
typedef __nv_bfloat16 bf16;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + __expf(-g)) * u; }

__device__ float block_sum(float v) {
    __shared__ float red[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < warps; ++i) s += red[i];
    return s;
}

enum { PLAIN = 0, SILU = 1, NORM = 2 };

template <int U, int KW, int PREP, bool BIG>
__global__ void __launch_bounds__(1024) mv(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y, int n, int k) {
    extern __shared__ uint4 staged[];
    constexpr int kVec = 8;
    constexpr int kOuts = BIG ? 8 : 8 / KW;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int col = blockIdx.x * kOuts + warp / KW, slice = warp % KW;
    const int vecs = k / kVec;
    const int v_begin = slice * (vecs / KW), v_end = (slice + 1) * (vecs / KW);
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)min(col, n - 1) * k);
    uint4 a[U];
    auto load = [&](int v0) {
#pragma unroll
        for (int u = 0; u < U; ++u) { const int v = v0 + u * 32; a[u] = v < v_end ? __ldg(wrow + v) : make_uint4(0, 0, 0, 0); }
    };
    float acc = 0.f;
    auto xvec = [&](int v) -> uint4 { return PREP != PLAIN ? staged[v] : __ldg(reinterpret_cast<const uint4*>(x) + v); };
    int v0 = v_begin + lane;
    load(v0);
    if (PREP == SILU) {
        const uint4* g = reinterpret_cast<const uint4*>(x);
        const uint4* up = reinterpret_cast<const uint4*>(x + k);
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
            const uint4 gv = g[v], uv = up[v];
            const bf16* ge = reinterpret_cast<const bf16*>(&gv);
            const bf16* ue = reinterpret_cast<const bf16*>(&uv);
            uint4 o; bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
            for (int e = 0; e < kVec; ++e) oe[e] = __float2bfloat16(silu_times(__bfloat162float(ge[e]), __bfloat162float(ue[e])));
            staged[v] = o;
        }
        __syncthreads();
    } else if (PREP == NORM) {
        // x and x + k: the two addends, x + 2k: the norm weight.
        const uint4* xa = reinterpret_cast<const uint4*>(x);
        const uint4* xb = reinterpret_cast<const uint4*>(x + k);
        const uint4* nw = reinterpret_cast<const uint4*>(x + 2 * k);
        float sum = 0.f;
        uint4 r[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int v = threadIdx.x + j * blockDim.x;
            if (v < vecs) {
                const uint4 av = xa[v], bv = xb[v];
                const bf16* ae = reinterpret_cast<const bf16*>(&av);
                const bf16* be = reinterpret_cast<const bf16*>(&bv);
                bf16* re = reinterpret_cast<bf16*>(&r[j]);
#pragma unroll
                for (int e = 0; e < kVec; ++e) { re[e] = __float2bfloat16(__bfloat162float(ae[e]) + __bfloat162float(be[e])); const float f = __bfloat162float(re[e]); sum += f * f; }
            }
        }
        const float scale = rsqrtf(block_sum(sum) / k + 1e-5f);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int v = threadIdx.x + j * blockDim.x;
            if (v < vecs) {
                const uint4 wv = nw[v];
                const bf16* we = reinterpret_cast<const bf16*>(&wv);
                bf16* re = reinterpret_cast<bf16*>(&r[j]);
#pragma unroll
                for (int e = 0; e < kVec; ++e) re[e] = __float2bfloat16(__bfloat162float(re[e]) * scale * __bfloat162float(we[e]));
                staged[v] = r[j];
            }
        }
        __syncthreads();
    }
    if (col < n) {
        for (;;) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int v = v0 + u * 32;
                if (v >= v_end) break;
                const uint4 xu = xvec(v);
                const bf16* we = reinterpret_cast<const bf16*>(&a[u]);
                const bf16* xe = reinterpret_cast<const bf16*>(&xu);
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc = fmaf(__bfloat162float(we[e]), __bfloat162float(xe[e]), acc);
            }
            v0 += 32 * U;
            if (v0 >= v_end) break;
            load(v0);
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (KW == 1) {
        if (lane == 0 && col < n) y[col] = __float2bfloat16(acc);
    } else {
        __shared__ float part[32];
        if (lane == 0) part[warp] = acc;
        __syncthreads();
        if (slice == 0 && lane == 0 && col < n) {
            float s = 0.f;
            for (int i = 0; i < KW; ++i) s += part[warp + i];
            y[col] = __float2bfloat16(s);
        }
    }
}

typedef void (*Kern)(const bf16*, const bf16*, bf16*, int, int);
struct Var { const char* name; Kern f; int kw; bool big; };

template <int PREP> std::vector<Var> variants() {
    return {
        {"u4", mv<4, 1, PREP, false>, 1, false},
        {"u4k2", mv<4, 2, PREP, false>, 2, false},
        {"u4k4", mv<4, 4, PREP, false>, 4, false},
        {"u4k2big", mv<4, 2, PREP, true>, 2, true},
        {"u4k4big", mv<4, 4, PREP, true>, 4, true},
        {"u2k4big", mv<2, 4, PREP, true>, 4, true},
        {"u8k2big", mv<8, 2, PREP, true>, 2, true},
    };
}

int main() {
    struct Shape { const char* name; int n, k, per_token, prep; };
    Shape shapes[] = {{"qkv", 3072, 2048, 16, NORM}, {"o", 2048, 2048, 16, PLAIN}, {"gate/up", 16384, 2048, 16, NORM},
                      {"down", 2048, 8192, 16, SILU}, {"downplain", 2048, 8192, 16, PLAIN}, {"head", 128256, 2048, 1, NORM}};
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const size_t kPool = 640ull << 20;
    bf16* pool; CK(cudaMalloc(&pool, kPool));
    CK(cudaMemset(pool, 0x3c, kPool));
    bf16 *x, *y; CK(cudaMalloc(&x, 1 << 20)); CK(cudaMalloc(&y, 1 << 20)); CK(cudaMemset(x, 0x3c, 1 << 20));
    printf("shape,variant,us_per_call,TB_s,per_token_us\n");
    double best_total = 0, base_total = 0;
    for (auto& s : shapes) {
        const size_t bytes = (size_t)s.n * s.k * 2;
        int layers = (int)(kPool / bytes); if (layers > 16) layers = 16; if (layers < 1) layers = 1;
        auto vars = s.prep == SILU ? variants<SILU>() : s.prep == NORM ? variants<NORM>() : variants<PLAIN>();
        double best = 1e30, base = 0;
        for (int round = 0; round < 2; ++round)
        for (auto& v : vars) {
            const int outs = v.big ? 8 : 8 / v.kw, threads = v.big ? 256 * v.kw : 256;
            dim3 grid((s.n + outs - 1) / outs);
            const int smem = s.prep != PLAIN ? s.k * 2 : 0;
            if (smem > 48 * 1024) CK(cudaFuncSetAttribute(v.f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < layers; ++l) v.f<<<grid, threads, smem, st>>>(x, pool + (size_t)l * s.n * s.k, y, s.n, s.k);
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
            const int reps = 20;
            CK(cudaEventRecord(e0, st));
            for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            const double us = ms * 1e3 / (reps * layers);
            if (round == 1) {
                printf("%s,%s,%.2f,%.2f,%.1f\n", s.name, v.name, us, bytes / us / 1e6, us * s.per_token);
                if (v.kw == 1) base = us * s.per_token;
                if (us * s.per_token < best) best = us * s.per_token;
            }
            CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
        }
        if (s.name[0] != 'd' || s.name[4] == 0) { base_total += base; best_total += best; }
    }
    printf("per token (qkv, o, gate/up, down with SiLU, head): base %.1f us, best %.1f us\n", base_total, best_total);
    CK(cudaGetLastError());
    return 0;
}
