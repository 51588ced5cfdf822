//! The statistical check of `sample_rows` on any device: the CPU test (tests/model.rs) and the
//! GPU test (tests/gpu.rs) run the same one.

use candle_core::{Device, Result, Tensor};
use flash_llama::sampling::{sample_rows, RowSampling};
use flash_llama::SamplingParams;

/// The probabilities the host sampler draws from, in f64: weights by temperature, the top k in
/// walk order (larger weight first, then smaller index), then the top-p prefix of those.
pub fn kept_distribution(logits: &[f32], temperature: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let total: f64 = order.iter().map(|&i| w[i]).sum();
    let (mut acc, mut keep) = (0.0, order.len());
    for (n, &i) in order.iter().enumerate() {
        acc += w[i] / total;
        if acc >= top_p {
            keep = n + 1;
            break;
        }
    }
    let kept_total: f64 = order[..keep].iter().map(|&i| w[i]).sum();
    let mut p = vec![0.0; w.len()];
    for &i in &order[..keep] {
        p[i] = w[i] / kept_total;
    }
    p
}

/// Draws on `dev` follow the kept distribution: 40 logits with clear gaps (no boundary within
/// rounding), 6,000 draws per setting (counters 0.., seeds varied); tokens outside the kept set
/// never come, each kept token's frequency is within 5 standard deviations of its probability.
pub fn draws_follow_the_kept_distribution(dev: &Device) -> Result<()> {
    let logits: Vec<f32> = (0..40).map(|i| ((i * 37) % 40) as f32 * 0.15 - 2.0).collect();
    for (t, k, p) in [
        (1.0, 0, 1.0),
        (0.7, 0, 0.8),
        (1.3, 7, 1.0),
        (1.0, 12, 0.6),
        (2.0, 40, 0.95),
    ] {
        let want = kept_distribution(&logits, t, k, p);
        let draws = 6000;
        let rows: Vec<RowSampling> = (0..draws)
            .map(|i| {
                let sp = SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p: p,
                    seed: 1000 + i as u64 % 97,
                    ..SamplingParams::default()
                };
                RowSampling::new(&sp, i as u64).expect("no repeat penalty")
            })
            .collect();
        let block = Tensor::new(logits.clone(), dev)?.unsqueeze(0)?.repeat((draws, 1))?;
        let tokens = sample_rows(&block, &rows)?.to_vec1::<u32>()?;
        let mut counts = vec![0usize; logits.len()];
        for &tok in &tokens {
            counts[tok as usize] += 1;
        }
        for (i, (&c, &p_i)) in counts.iter().zip(&want).enumerate() {
            let f = c as f64 / draws as f64;
            if p_i == 0.0 {
                assert_eq!(
                    c, 0,
                    "(T {t}, k {k}, p {p}): token {i} is outside the kept set, drawn {c} times"
                );
            } else {
                let sd = (p_i * (1.0 - p_i) / draws as f64).sqrt();
                assert!(
                    (f - p_i).abs() <= 5.0 * sd,
                    "(T {t}, k {k}, p {p}): token {i} frequency {f} against probability {p_i}"
                );
            }
        }
    }
    Ok(())
}
