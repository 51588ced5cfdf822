// Online softmax over the S accumulators of one consumer warpgroup, in registers.
//
// wgmma's m64nN f32 accumulator layout: thread (warp w, lane l) of the warpgroup holds rows
// r = 16w + l/4 and r + 8; accumulator 4j + 2h + e is row (h ? r + 8 : r), column 8j + 2(l%4) + e.
// A row is therefore spread over the 4 lanes of a quad: row reductions are 2 xor-shuffles.
//
// Scores stay in raw units (q·k, or tanh(.) under softcap); scale·log2(e) is folded into one FFMA
// per element: p = exp2(s·scale_log2 - ref), where ref, the row's reference max, is kept in those
// exp2 units (max·scale_log2, less kPScaleLog2 below), so that a block's check, its exponentials
// and the LSE use it as it is, without a multiply and a -inf test per row and block. A row that has
// seen no finite score yet has ref = kNoMax, a finite stand-in for -inf: s·scale_log2 - kNoMax is
// -inf for a masked score (p = 0) and huge for any finite one (the reference max moves).
//
// kLazyMax: the running max a row's probabilities are taken against moves only when a block's max
// exceeds it by more than kMaxSlack (log2 units): until then p may reach 2^kMaxSlack = 256
// (harmless for the fp32 sums and the 16-bit P), and the correction factor is exactly 1, so O
// needs no rescale (the consumer skips it when every row of a warp kept its max; FA4's trick).
// The result is the same softmax: O, the row sum and the LSE all use the same reference max.
// Without it (FwdTraits::kLazyMax false: the 16-bit d64 kernel on three warpgroups) the max follows
// every block.
//
// kPScaleLog2 (fp8 kernels: 8): p is computed times 2^kPScaleLog2, as FA3 does, so that P's e4m3
// rounding keeps 3 mantissa bits down to 2^-14 of the row max instead of 2^-6 (below e4m3's
// normal range a value keeps only an absolute 2^-10); O and the row sum carry the same factor,
// which the LSE takes back out. The largest p is then 2^(kPScaleLog2 + slack), which must stay
// under e4m3's 448 = 2^8.8: the lazy max's slack shrinks to 0.75.
//
// kExp2FmaEvery (0: off): every kExp2FmaEvery-th exponential of a row is computed on the FMA pipe
// (exp2_fma, primitives/warp.cuh) instead of the SFU. Measured per kernel (FwdTraits); it pays
// only where the SFU is the softmax's limit and the FMA pipe has room: fp8 d128 on 128-key
// blocks (docs/kernels/forward-fp8.md, version 4).
//
// kSeedSums: each row sum's four chains start from their first p instead of from 0.f + p (ptxas
// keeps that FADD: 0 + -0 is +0). Measured per kernel (FwdTraits::kSeedRowSums).
//
// kSeedMax: the same for the row max's four chains (thread_max): each starts from its first pair of
// scores instead of -inf (ptxas keeps fmaxf(-inf, x): a NaN x would come out as -inf). Measured per
// kernel (FwdTraits::kSeedRowMax).
#pragma once
#include <cmath>

#include "../primitives/warp.cuh"

namespace fa3 {

constexpr float kMaxSlack = 8.f;
constexpr float kNoMax = -3.40282347e38f;  // -FLT_MAX: a row's ref before its first finite score

template <int kSRegs, bool kLazyMax, int kPScaleLog2 = 0, int kExp2FmaEvery = 0, bool kSeedSums = false,
          bool kSeedMax = false>
struct OnlineSoftmax {
    static constexpr float kSlack = kPScaleLog2 == 0 ? kMaxSlack : 8.75f - kPScaleLog2;
    static_assert(kPScaleLog2 >= 0 && kPScaleLog2 <= 8, "p <= 2^8.75 < 448 with the slack above");
    // The rows' reference maxes in exp2 units: max·scale_log2 - kPScaleLog2 (kNoMax: none yet).
    float ref[2];
    float row_sum[2];  // this thread's partial sums; reduced over the quad at the end
    // Whether the last step may have moved a reference max of some row of the warp, so that O
    // needs its correction factors (the same in every lane; always true without the lazy max).
    bool moved;

    __device__ __forceinline__ void init() {
        ref[0] = ref[1] = kNoMax;
        row_sum[0] = row_sum[1] = 0.f;
        moved = false;
    }

    // Turns s into unnormalised probabilities; returns the factors by which O must be rescaled
    // (exactly 1 for a row whose reference max did not move). `live`, the same in every lane of
    // the warp: bit h clear when row h of every lane (rows 16w..16w+7, or +8..+15) lies past the
    // tile's last query, so that its p are only set to 0 (the decode kernels skip padding rows:
    // FwdTraits::kSkipPaddingRows); 3 elsewhere, which the compiler folds away.
    __device__ __forceinline__ void step(float (&s)[kSRegs], float scale_log2, float (&corr)[2], unsigned live = 3u) {
        static_assert(kSRegs % 4 == 0 && kSRegs >= 16, "at least 4 column groups per row");
        if constexpr (kLazyMax) {
            update_max(s, scale_log2, corr, live);
            exponentiate(s, scale_log2, corr, live);
        } else {
            moved = true;
            // Each row's max, correction and exponentials in turn.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (!(live >> h & 1u)) {
                    corr[h] = 1.f;
                    zero_row(s, h);
                    continue;
                }
                // This block's max (-inf: every score masked) joins the reference max.
                const float m = fmaxf(ref[h], fmaf(quad_max(thread_max(s, h)), scale_log2, -kPScaleLog2));
                corr[h] = fast_exp2(ref[h] - m);
                ref[h] = m;
                exponentiate_row(s, h, m, scale_log2, corr[h]);
            }
        }
    }

    // The lazy step's first half (apart, so that a caller can run other work between the halves:
    // mainloop.cuh consumer_serial): the rows' reference maxes after this block, and O's
    // correction factors.
    __device__ __forceinline__ void update_max(const float (&s)[kSRegs], float scale_log2, float (&corr)[2],
                                               unsigned live = 3u) {
        static_assert(kLazyMax, "the exact max updates inside step");
        float mx[2];
        // A dead row's max stays -inf, so it never moves its reference max.
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = (live >> h & 1u) ? thread_max(s, h) : -INFINITY;
        move_max(mx, scale_log2, corr);
    }

    // update_max for a caller with no spare registers (mainloop.cuh consumer_serial, every row
    // live): max_begin, max_cols over the scores, update_max_from. Two chains a row, each FMNMX on
    // its chain's last value: thread_max's pairs-then-folds need a free register per pair, and with
    // one ptxas waited on it (3 cycles per FMNMX instead of 2; +1..1.5%, forward-fp8.md version 10).
    __device__ __forceinline__ void max_begin(float (&m)[2][2]) const {
#pragma unroll
        for (int h = 0; h < 2; ++h) m[h][0] = m[h][1] = -INFINITY;
    }
    template <int kJ0, int kJ1> __device__ __forceinline__ void max_cols(const float (&s)[kSRegs], float (&m)[2][2]) const {
#pragma unroll
        for (int j = kJ0; j < kJ1; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
                for (int h = 0; h < 2; ++h) m[h][e] = fmaxf(m[h][e], s[4 * j + 2 * h + e]);
    }
    __device__ __forceinline__ void update_max_from(const float (&m)[2][2], float scale_log2, float (&corr)[2]) {
        static_assert(kLazyMax, "the exact max updates inside step");
        float mx[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = fmaxf(m[h][0], m[h][1]);
        move_max(mx, scale_log2, corr);
    }

    // The lazy max's update from each row's max over this thread's scores (-inf: none visible).
    __device__ __forceinline__ void move_max(const float (&mx)[2], float scale_log2, float (&corr)[2]) {
        // The reference max moves only past the slack (the first visible key always moves it
        // off kNoMax). A row's 4 lanes agree through the quad's max, which is needed only when
        // some lane of the warp saw a score past the slack: otherwise no row moves, and the
        // exponentials start without the two shuffles' latency (version 31). One FFMA and one
        // compare a row: mx·scale_log2 - ref is the block's largest exponent, before the slack.
        bool may_move = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) may_move |= fmaf(mx[h], scale_log2, -ref[h]) > kSlack + kPScaleLog2;
        corr[0] = corr[1] = 1.f;
        moved = __any_sync(0xffffffffu, may_move);
        if (moved) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m = fmaf(quad_max(mx[h]), scale_log2, -kPScaleLog2);
                if (m - ref[h] > kSlack) {
                    corr[h] = fast_exp2(ref[h] - m);
                    ref[h] = m;
                }
            }
        }
    }

    // The lazy step's second half: s to p against the reference maxes (a dead row's p set to 0).
    __device__ __forceinline__ void exponentiate(float (&s)[kSRegs], float scale_log2, const float (&corr)[2],
                                                 unsigned live = 3u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (live >> h & 1u) {
                exponentiate_row(s, h, ref[h], scale_log2, corr[h]);
            } else {
                zero_row(s, h);
            }
        }
    }

    // exponentiate over the column groups [kJ0, kJ1) only (8 keys each); O's correction enters the
    // row sums with the first part (kJ0 == 0).
    template <int kJ0, int kJ1>
    __device__ __forceinline__ void exponentiate_part(float (&s)[kSRegs], float scale_log2, const float (&corr)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            exponentiate_row<kJ0, kJ1>(s, h, ref[h], scale_log2, kJ0 == 0 ? corr[h] : 1.f);
    }

    // Row h's max over this thread's scores (raw units). Row max and row sum each run as 4
    // independent chains (then combined): one chain through all 32 elements of a row would
    // serialise on the FMNMX / FADD latency.
    __device__ __forceinline__ float thread_max(const float (&s)[kSRegs], int h) const {
        static_assert(kSRegs >= 16, "four chains of at least one pair");
        float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
            const float pair = fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
            // (fmaxf(-inf, x) is not x for a NaN x, so ptxas keeps the FMNMX with -inf.)
            m4[j % 4] = kSeedMax && j < 4 ? pair : fmaxf(m4[j % 4], pair);
        }
        return fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
    }

    // The max over the 4 lanes of a quad (one row).
    __device__ __forceinline__ static float quad_max(float m) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
        return fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
    }

    // p = exp2(s·scale_log2 - m_ref) in place for row h; the row sum rescaled and extended.
    template <int kJ0 = 0, int kJ1 = kSRegs / 4>
    __device__ __forceinline__ void exponentiate_row(float (&s)[kSRegs], int h, float m_ref, float scale_log2,
                                                     float corr) {
        float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = kJ0; j < kJ1; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = fmaf(s[4 * j + 2 * h + e], scale_log2, -m_ref);
                constexpr int kEvery = kExp2FmaEvery > 0 ? kExp2FmaEvery : 1;  // (no % 0 in the dead branch)
                const bool on_fma = kExp2FmaEvery > 0 && (2 * j + e) % kEvery == kEvery - 1;
                const float pv = on_fma ? exp2_fma(x) : fast_exp2(x);
                s[4 * j + 2 * h + e] = pv;
                if (kSeedSums && 2 * (j - kJ0) + e < 4) s4[(2 * j + e) % 4] = pv;  // no FADD with 0
                else s4[(2 * j + e) % 4] += pv;
            }
        }
        row_sum[h] = row_sum[h] * corr + ((s4[0] + s4[1]) + (s4[2] + s4[3]));
    }

    // Row h's p, all 0: a row past the tile's last query (`live` above).
    __device__ __forceinline__ static void zero_row(float (&s)[kSRegs], int h) {
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) s[4 * j + 2 * h] = s[4 * j + 2 * h + 1] = 0.f;
    }

    // The final row sums (over the quad) and natural-log LSE; a row with no visible key gets
    // inv_sum 0 (a zero output row) and LSE -inf. `sink_log2`: each row's attention-sink logit in
    // log2 units, one more term of its denominator (-inf: none); the LSE then includes it, and a
    // row with no visible key gets the sink's logit as its LSE.
    __device__ __forceinline__ void finalize(float (&inv_sum)[2], float (&lse)[2], const float (&sink_log2)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = row_sum[h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            const bool empty = !(sum > 0.f) || ref[h] == kNoMax;
            // The sum's unit: p = 2^(s·scale_log2 - ref) (kPScaleLog2 included).
            const float keys_lse2 = empty ? -INFINITY : ref[h] + log2f(sum);
            const float z = sink_log2[h];
            if (z == -INFINITY) {
                inv_sum[h] = empty ? 0.f : 1.f / sum;
                lse[h] = keys_lse2 * 0.69314718055994531f;
            } else {
                // log2 of keys + sink without overflow for a sink far above the keys.
                const float lse2 = empty ? z : fmaxf(keys_lse2, z) + log2f(1.f + exp2f(-fabsf(keys_lse2 - z)));
                inv_sum[h] = empty ? 0.f : exp2f(ref[h] - lse2);
                lse[h] = lse2 * 0.69314718055994531f;
            }
        }
    }
};

}  // namespace fa3
