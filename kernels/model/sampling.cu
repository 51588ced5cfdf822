// Token sampling on the device (flash_llama::device_sampling): one block per row of logits picks
// that row's token by greedy choice or by temperature / top-k / top-p sampling, so a decode step
// copies one u32 per sequence to the host instead of a whole row of logits. Compiled by
// crates/model/build.rs into an sm_90a cubin; launched by crates/model/src/device_sampling.rs,
// whose CPU path runs the same algorithm (the same draws, up to the rounding of the sums).
//
// The distribution is the host sampler's (crates/model/src/sampling.rs): weights
// w_i = exp((l_i - max) / T); the tokens in walk order (w descending, then id ascending); keep the
// first top_k, then the shortest prefix of those whose mass reaches top_p of theirs; draw in
// proportion to w among the kept. Instead of sorting the vocabulary, the kernel draws by
// rejection: draw j in proportion to w among the candidates (at first every token), then count
// the tokens ahead of j in walk order and their mass; j is kept if fewer than top_k are ahead
// and their mass is under top_p of the top-k mass; otherwise every token from j on is out too,
// and the next draw is among the tokens ahead of j. The kept set lies inside every candidate
// set, so the accepted token has exactly the kept set's distribution; a draw usually lands in
// it within a few rounds. Every sum runs in f64 in a fixed order (per thread, then a fixed
// tree or in thread order), so a (seed, counter) pair always gives the same token.
#include <stdint.h>

#include "argmax.cuh"
#include "dtype.cuh"

namespace {

constexpr int kSampleThreads = 512;
constexpr int kSampleWarps = kSampleThreads / 32;
// Rounds of rejection before falling back to the first token in walk order (always kept).
constexpr int kMaxRounds = 48;

// One row's sampling parameters; the host writes the same layout (device_sampling.rs, 32 bytes).
struct RowSampling {
    float temperature;  // <= 0: greedy
    uint32_t top_k;     // 0: no limit
    float top_p;        // >= 1: no limit
    uint32_t pad;
    uint64_t seed;
    uint64_t counter;  // the sequence's token index: each token gets its own draws
};

// A uniform double in [0, 1) from (seed, counter, round): SplitMix64's output function on a
// counter, so any token's draw can be made without the ones before it.
__device__ __forceinline__ double uniform01(uint64_t seed, uint64_t counter, uint32_t round) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (counter * 64 + round + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// i before j in walk order.
__device__ __forceinline__ bool ahead(float wi, uint32_t i, float wj, uint32_t j) {
    return wi > wj || (wi == wj && i < j);
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ uint32_t warp_sum_u(uint32_t v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The block's sum (every thread gets it), in a fixed tree.
__device__ double block_sum(double v, double* scratch) {
    v = warp_sum(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < kSampleWarps ? scratch[threadIdx.x % 32] : 0.0;
    return warp_sum(v);
}

__device__ uint32_t block_sum_u(uint32_t v, uint32_t* scratch) {
    v = warp_sum_u(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < kSampleWarps ? scratch[threadIdx.x % 32] : 0u;
    return warp_sum_u(v);
}

template <typename T>
__device__ void sample_rows(const T* __restrict__ logits, const RowSampling* __restrict__ params,
                            uint32_t* __restrict__ out, int vocab) {
    const T* x = logits + (size_t)blockIdx.x * vocab;
    const RowSampling ps = params[blockIdx.x];
    __shared__ double fscratch[kSampleWarps];
    __shared__ uint32_t uscratch[kSampleWarps];
    __shared__ double thread_sums[kSampleThreads];
    __shared__ uint32_t hist[256];
    __shared__ uint32_t picked;
    // Thread t owns the tokens t, t + kSampleThreads, ... (coalesced loads). The draw walks the
    // tokens in "draw order": thread 0's in ascending order, then thread 1's, ...; any fixed order
    // gives the same distribution, and the CPU copy walks the same one.
#define FOR_OWN(i) for (int i = threadIdx.x; i < vocab; i += kSampleThreads)

    // The largest logit and its first index (NaNs never chosen): argmax_rows' choice.
    float best = -INFINITY;
    uint32_t at = kNoIndex;
    FOR_OWN(i) {
        const float v = to_f(x[i]);
        if (!isnan(v) && (at == kNoIndex || v > best)) {
            best = v;
            at = i;
        }
    }
    block_argmax<kSampleThreads>(best, at);
    const uint32_t first = at == kNoIndex ? 0u : at;  // the first token in walk order
    if (!(ps.temperature > 0.f) || ps.top_k == 1 || at == kNoIndex) {
        if (threadIdx.x == 0) out[blockIdx.x] = first;
        return;
    }
    const float max_logit = best, inv_temperature = 1.f / ps.temperature;
    auto weight = [&](int i) -> float {
        const float v = to_f(x[i]);
        return isnan(v) ? 0.f : expf((v - max_logit) * inv_temperature);
    };

    // The top-k mass: the k-th weight in walk order by a radix select over the weights' bits
    // (non-negative floats order as their bit patterns), 8 bits a pass.
    const uint32_t k = ps.top_k;
    // Each thread's sum is also its candidates' mass in the first round (every token).
    double own = 0.0;
    FOR_OWN(i) own += weight(i);
    thread_sums[threadIdx.x] = own;
    const double total = block_sum(own, fscratch);
    double kept_total = total;
    if (k > 0 && k < (uint32_t)vocab && ps.top_p < 1.f) {
        uint32_t prefix = 0, remaining = k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            const uint32_t high_mask = shift == 24 ? 0u : ~0u << (shift + 8);
            for (int b = threadIdx.x; b < 256; b += kSampleThreads) hist[b] = 0;
            __syncthreads();
            FOR_OWN(i) {
                const uint32_t bits = __float_as_uint(weight(i));
                if ((bits & high_mask) == prefix) atomicAdd(&hist[(bits >> shift) & 255u], 1u);
            }
            __syncthreads();
            // The digit of the k-th: walk the bins from the top (one thread; 256 bins).
            if (threadIdx.x == 0) {
                uint32_t above = 0;
                int b = 255;
                for (; b > 0; --b) {
                    if (above + hist[b] >= remaining) break;
                    above += hist[b];
                }
                uscratch[0] = (uint32_t)b;
                uscratch[1] = remaining - above;
            }
            __syncthreads();
            prefix |= uscratch[0] << shift;
            remaining = uscratch[1];
            __syncthreads();
        }
        // prefix: the k-th weight; `remaining` tokens of that weight are among the top k.
        const float wk = __uint_as_float(prefix);
        double above = 0.0;
        FOR_OWN(i) {
            const float w = weight(i);
            if (w > wk) above += w;
        }
        kept_total = block_sum(above, fscratch) + (double)remaining * wk;
    }
    const double mass_limit = ps.top_p < 1.f ? (double)ps.top_p * kept_total : INFINITY;

    // Rejection rounds; the candidates are the tokens ahead of (pivot_w, pivot_i).
    bool pivoted = false;
    float pivot_w = 0.f;
    uint32_t pivot_i = 0;
    auto candidate = [&](float w, int i) { return w > 0.f && (!pivoted || ahead(w, i, pivot_w, pivot_i)); };
    for (int round = 0; round < kMaxRounds; ++round) {
        // The draw: a target in the candidates' mass, found by the threads' sums of their
        // candidates in draw order (written by the pass before).
        __syncthreads();
        if (threadIdx.x == 0) {
            // One thread walks the sums in order: 512 adds, the same order every time.
            double mass = 0.0;
            for (int t = 0; t < kSampleThreads; ++t) mass += thread_sums[t];
            const double target = uniform01(ps.seed, ps.counter, round) * mass;
            double acc = 0.0;
            int t = 0, last = -1;
            for (; t < kSampleThreads; ++t) {
                if (thread_sums[t] > 0.0) last = t;
                if (thread_sums[t] > 0.0 && target < acc + thread_sums[t]) break;
                acc += thread_sums[t];
            }
            if (t == kSampleThreads) t = last;  // rounding put the target past the end
            uscratch[0] = (uint32_t)t;
            fscratch[0] = target - acc;
        }
        __syncthreads();
        const uint32_t owner = uscratch[0];
        if (threadIdx.x == owner) {
            double r = fscratch[0];
            int chosen = -1;
            FOR_OWN(i) {
                const float w = weight(i);
                if (!candidate(w, i)) continue;
                chosen = i;
                if (r < w) break;
                r -= w;
            }
            picked = (uint32_t)chosen;
        }
        __syncthreads();
        if (owner == 0xffffffffu || picked == 0xffffffffu) break;  // no candidate left
        const uint32_t j = picked;
        const float wj = weight(j);
        // The tokens ahead of j: how many, and their mass; each thread's share of that mass is
        // its candidates' mass in the next round, if there is one.
        uint32_t count = 0;
        double mass = 0.0;
        FOR_OWN(i) {
            const float w = weight(i);
            if (ahead(w, i, wj, j)) {
                ++count;
                mass += w;
            }
        }
        thread_sums[threadIdx.x] = mass;
        count = block_sum_u(count, uscratch);
        mass = block_sum(mass, fscratch);
        if ((k == 0 || count < k) && mass < mass_limit) {
            if (threadIdx.x == 0) out[blockIdx.x] = j;
            return;
        }
        pivoted = true;
        pivot_w = wj;
        pivot_i = j;
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = first;
#undef FOR_OWN
}

}  // namespace

#define SAMPLE_ROWS(T, SUFFIX)                                                                                        \
    extern "C" __global__ void __launch_bounds__(kSampleThreads)                                                      \
        sample_rows_##SUFFIX(const T* logits, const RowSampling* params, uint32_t* out, int vocab) {                 \
        sample_rows<T>(logits, params, out, vocab);                                                                   \
    }

SAMPLE_ROWS(float, f32)
SAMPLE_ROWS(__nv_bfloat16, bf16)
SAMPLE_ROWS(__half, f16)
