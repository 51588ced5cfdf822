//! The element-wise work of a score block: scale, softcap, mask, the online-softmax update
//! and, for the backward, probabilities and score gradients.
//!
//! Scores are kept in log2 units (`s · scale · log2 e`) so the softmax needs only `exp2`,
//! which [`exp2`] evaluates with a branch-free polynomial that the compiler vectorises.
//! Each block function is compiled three times (AVX-512, AVX2+FMA, baseline) and picked at
//! run time, as the `gemm` crate does for the matrix products.

use std::f32::consts::LOG2_E;

/// How raw q·k products become the scores the softmax sees.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScoreMap {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl ScoreMap {
    /// The score in log2 units.
    #[inline(always)]
    fn log2_score(self, x: f32) -> f32 {
        match self.softcap {
            Some(cap) => cap * (x * self.scale / cap).tanh() * LOG2_E,
            None => x * (self.scale * LOG2_E),
        }
    }
}

/// 2^x for x <= 0 with a relative error below 2e-7; exactly 0 below -127.
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    // A comparison rather than f32::max, so NaN propagates instead of becoming 2^-127.
    let x = if x < -127.0 { -127.0 } else { x };
    let n = x.round_ties_even();
    let f = x - n; // in [-0.5, 0.5]
                   // Taylor series of 2^f = e^(f ln 2) to degree 6; truncation error < 1.2e-7 on [-0.5, 0.5].
    const C: [f32; 7] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
    ];
    let p = C[6];
    let p = p * f + C[5];
    let p = p * f + C[4];
    let p = p * f + C[3];
    let p = p * f + C[2];
    let p = p * f + C[1];
    let p = p * f + C[0];
    // n in [-127, 0]: the biased exponent n + 127 is in [0, 127]; 0 encodes +0.0.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

const LANES: usize = 16;

#[inline(always)]
fn max_of(values: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..LANES {
            acc[i] = if chunk[i] > acc[i] { chunk[i] } else { acc[i] };
        }
    }
    let mut m = tail.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for a in acc {
        m = m.max(a);
    }
    m
}

/// Replaces each value by `exp2(value - shift)` and returns their sum.
#[inline(always)]
fn exp2_shifted_sum(values: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = values.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for i in 0..LANES {
            chunk[i] = exp2(chunk[i] - shift);
            acc[i] += chunk[i];
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp2(*x - shift);
        sum += *x;
    }
    sum + acc.iter().sum::<f32>()
}

/// The columns `[lo, hi)` of a block starting at key `col0` with `cols` keys that fall in the
/// key range `range` of a row.
#[inline(always)]
fn visible(range: (usize, usize), col0: usize, cols: usize) -> (usize, usize) {
    let lo = range.0.clamp(col0, col0 + cols) - col0;
    let hi = range.1.clamp(col0, col0 + cols) - col0;
    (lo, hi.max(lo))
}

/// One block of the online softmax for `rows` query rows.
pub(crate) struct SoftmaxBlock<'a> {
    /// Raw q·k products, `rows × cols`, row stride `ld`; replaced by unnormalised probabilities.
    pub scores: &'a mut [f32],
    pub ld: usize,
    pub cols: usize,
    /// The key index of column 0.
    pub col0: usize,
    /// Each row's visible key range.
    pub ranges: &'a [(usize, usize)],
    /// Running row maxima (log2 units) and sums.
    pub row_max: &'a mut [f32],
    pub row_sum: &'a mut [f32],
    /// The output accumulator, `rows × dv`, rescaled when a row maximum grows.
    pub acc: &'a mut [f32],
    pub dv: usize,
    pub map: ScoreMap,
}

#[inline(always)]
fn online_softmax_impl(b: SoftmaxBlock<'_>) {
    for (r, &range) in b.ranges.iter().enumerate() {
        let row = &mut b.scores[r * b.ld..r * b.ld + b.cols];
        let (lo, hi) = visible(range, b.col0, b.cols);
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        if lo == hi {
            continue;
        }
        let live = &mut row[lo..hi];
        for x in live.iter_mut() {
            *x = b.map.log2_score(*x);
        }
        let new_max = b.row_max[r].max(max_of(live));
        let correction = exp2(b.row_max[r] - new_max);
        let sum = exp2_shifted_sum(live, new_max);
        b.row_sum[r] = b.row_sum[r] * correction + sum;
        b.row_max[r] = new_max;
        if correction != 1.0 {
            for o in &mut b.acc[r * b.dv..(r + 1) * b.dv] {
                *o *= correction;
            }
        }
    }
}

/// Probabilities of one block for the backward: `scores` (raw q·k) become
/// `exp2(log2_score - lse_log2)`, 0 where masked. With a softcap, `tanh_out` receives
/// tanh(s·scale/cap) per element for the chain rule.
pub(crate) struct ProbBlock<'a> {
    pub scores: &'a mut [f32],
    pub ld: usize,
    pub cols: usize,
    pub col0: usize,
    pub ranges: &'a [(usize, usize)],
    /// Each row's log-sum-exp in log2 units (`-inf` for rows that see no key).
    pub lse_log2: &'a [f32],
    pub map: ScoreMap,
    pub tanh_out: &'a mut [f32],
}

#[inline(always)]
fn probabilities_impl(b: ProbBlock<'_>) {
    for (r, &range) in b.ranges.iter().enumerate() {
        let row = &mut b.scores[r * b.ld..r * b.ld + b.cols];
        let (lo, hi) = visible(range, b.col0, b.cols);
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        let lse = b.lse_log2[r];
        if lo == hi || lse == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        match b.map.softcap {
            Some(cap) => {
                let tanh_row = &mut b.tanh_out[r * b.ld..r * b.ld + b.cols];
                for (x, t) in row[lo..hi].iter_mut().zip(&mut tanh_row[lo..hi]) {
                    *t = (*x * b.map.scale / cap).tanh();
                    *x = exp2(cap * *t * LOG2_E - lse);
                }
            }
            None => {
                let k = b.map.scale * LOG2_E;
                for x in &mut row[lo..hi] {
                    *x = exp2(*x * k - lse);
                }
            }
        }
    }
}

/// Score gradients of one block: `dp` (dO·vᵀ) becomes `p · (dp - D)`, times `1 - tanh²`
/// under a softcap. The softmax scale is applied by the caller's matrix product.
pub(crate) struct GradBlock<'a> {
    pub probs: &'a [f32],
    pub dp: &'a mut [f32],
    pub ld: usize,
    pub rows: usize,
    pub cols: usize,
    /// rowsum(dO ∘ O) per row.
    pub delta: &'a [f32],
    pub tanh: Option<&'a [f32]>,
}

#[inline(always)]
fn score_grads_impl(b: GradBlock<'_>) {
    for r in 0..b.rows {
        let span = r * b.ld..r * b.ld + b.cols;
        let (p, dp, d) = (&b.probs[span.clone()], &mut b.dp[span.clone()], b.delta[r]);
        for (g, &p) in dp.iter_mut().zip(p) {
            *g = p * (*g - d);
        }
        if let Some(tanh) = b.tanh {
            for (g, &t) in dp.iter_mut().zip(&tanh[span]) {
                *g *= 1.0 - t * t;
            }
        }
    }
}

/// Defines `$name(args)` that runs `$body` compiled for the best instruction set present.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $block:ident, $impl_fn:ident) => {
        $(#[$doc])*
        pub(crate) fn $name(block: $block<'_>) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512(block: $block<'_>) {
                    $impl_fn(block)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2(block: $block<'_>) {
                    $impl_fn(block)
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the instructions the function was compiled for.
                    return unsafe { avx512(block) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { avx2(block) };
                }
            }
            $impl_fn(block)
        }
    };
}

dispatch!(
    /// Applies the online-softmax update of one score block.
    online_softmax,
    SoftmaxBlock,
    online_softmax_impl
);
dispatch!(
    /// Recomputes the probabilities of one score block from the saved LSE.
    probabilities,
    ProbBlock,
    probabilities_impl
);
dispatch!(
    /// Turns dO·vᵀ into the score gradients of one block.
    score_grads,
    GradBlock,
    score_grads_impl
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_is_accurate_and_exact_at_the_ends() {
        let mut x = -126.0f32;
        while x <= 0.0 {
            let (got, want) = (exp2(x) as f64, (x as f64).exp2());
            assert!(((got - want) / want).abs() < 3e-7, "exp2({x}) = {got}, want {want}");
            x += 0.0137;
        }
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(-200.0), 0.0);
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn max_of_handles_tails() {
        let v: Vec<f32> = (0..37).map(|i| ((i * 7919) % 37) as f32).collect();
        assert_eq!(max_of(&v), 36.0);
        assert_eq!(max_of(&v[..5]), v[..5].iter().cloned().fold(f32::MIN, f32::max));
    }
}
