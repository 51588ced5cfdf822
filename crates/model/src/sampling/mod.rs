//! Choosing the next token from a row of logits: repeat penalty, then greedy or
//! temperature / top-k / top-p sampling with a seeded generator (runs are reproducible).

use candle_core::{Result, Tensor};

mod device;
pub use device::{sample_rows, RowSampling};

/// How to pick tokens. `temperature <= 0` is greedy (argmax); `top_k = 0` and `top_p >= 1`
/// disable those filters; `repeat_penalty = 1` disables the penalty.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub repeat_penalty: f32,
    /// How many of the latest tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 299792458,
        }
    }
}

impl SamplingParams {
    /// Plain greedy decoding: the largest logit, nothing that depends on the history.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.repeat_penalty == 1.0
    }
}

/// A sampler with its own random state; use one per sequence so that a sequence's tokens do not
/// depend on what else is in the batch.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let state = params.seed;
        Self { params, state }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// SplitMix64: tiny, fast and good enough to draw one uniform number per token.
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token from `logits` (vocab,) given the tokens so far (`history`).
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<u32> {
        let mut logits: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        if logits.is_empty() {
            candle_core::bail!("cannot sample from empty logits")
        }
        let p = &self.params;
        if p.repeat_penalty != 1.0 {
            // CTRL-style penalty (as HF): make every recently seen token less likely, once.
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &history[start..] {
                if let Some(l) = logits.get_mut(t as usize) {
                    if seen.insert(t) {
                        *l = if *l >= 0.0 {
                            *l / p.repeat_penalty
                        } else {
                            *l * p.repeat_penalty
                        };
                    }
                }
            }
        }
        if p.temperature <= 0.0 {
            return Ok(argmax(&logits));
        }
        // Softmax weights of the temperature-scaled logits, in vocabulary order.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, (((l - max) as f64) / p.temperature).exp()))
            .collect();
        // The filters and the draw walk the tokens most likely first, but only as far as they
        // stop: the top k, the top-p prefix, the token the draw lands on (typically a few
        // hundred of a 128k vocabulary). Sorting the whole vocabulary took milliseconds per
        // token, so the walk orders a growing head of it instead (`Walk`).
        if p.top_k > 0 && p.top_k < probs.len() {
            probs.select_nth_unstable_by(p.top_k - 1, walk_order);
            probs.truncate(p.top_k);
        }
        let mut walk = Walk { probs, ordered: 0 };
        let total: f64 = walk.probs.iter().map(|x| x.1).sum();
        let (keep, kept_total) = if p.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (at least one token).
            let mut acc = 0.0;
            let mut keep = walk.probs.len();
            for i in 0..walk.probs.len() {
                acc += walk.get(i).1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            let kept_total = (0..keep).map(|i| walk.get(i).1).sum();
            (keep, kept_total)
        } else {
            (walk.probs.len(), total)
        };
        let mut r = self.next_f64() * kept_total;
        for i in 0..keep {
            let (token, weight) = walk.get(i);
            if r < weight {
                return Ok(token);
            }
            r -= weight;
        }
        Ok(walk.get(keep - 1).0)
    }
}

/// The order in which the sampler walks its candidates: most likely first, ties by the lower
/// token id (what a stable sort of the vocabulary by probability gives).
fn walk_order(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Candidates whose first `ordered` entries are the most likely ones in walk order (the rest
/// after them, in any order), ordered further on demand: each time the walk reaches the end of
/// the ordered head, the head doubles (at least 64) by a selection over the rest and a sort of
/// the selected, linear in the vocabulary instead of a full sort.
struct Walk {
    probs: Vec<(u32, f64)>,
    ordered: usize,
}

impl Walk {
    /// The `i`-th candidate in walk order.
    fn get(&mut self, i: usize) -> (u32, f64) {
        while i >= self.ordered {
            let len = self.probs.len();
            let grown = (2 * self.ordered).max(64).min(len);
            let rest = &mut self.probs[self.ordered..];
            let take = grown - self.ordered;
            if take < rest.len() {
                rest.select_nth_unstable_by(take - 1, walk_order);
            }
            rest[..take].sort_unstable_by(walk_order);
            self.ordered = grown;
        }
        self.probs[i]
    }
}

/// The index of the largest value, the first one on ties; NaNs are never chosen (all NaN: 0).
/// The GPU's greedy choice (`fused::argmax_rows`) follows the same rules.
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in xs.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}
