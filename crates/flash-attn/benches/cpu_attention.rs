//! CPU attention benchmark: flash-attn3's CPU path against the naive candle composite
//! (matmul, softmax, matmul) and candle-nn's CPU flash attention, plus the peak extra memory
//! of a long-sequence forward.
//!
//!     cargo bench -p flash-attn3 --bench cpu_attention            # full table
//!     cargo bench -p flash-attn3 --bench cpu_attention -- --quick # smaller, fewer repeats
//!
//! Timings are medians over repeated runs after one warm-up run.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::attention::AttnMask;

/// The naive composite on (batch, seq, heads, dim) inputs: what a candle model does today.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let q = q.transpose(1, 2)?.contiguous()?;
    let k = k.transpose(1, 2)?.contiguous()?;
    let v = v.transpose(1, 2)?.contiguous()?;
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if causal {
        let (sq, sk) = (scores.dim(2)?, scores.dim(3)?);
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| if j + sq > i + sk { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(mask, (sq, sk), scores.device())?)?;
    }
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    Ok(probs.matmul(&v)?.transpose(1, 2)?)
}

fn median_ms(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(times[times.len() / 2])
}

/// Peak resident memory (VmHWM) in bytes; `reset_peak` starts a new measurement.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A long causal forward must need memory linear in the sequence length. Runs first, on a
/// fresh heap, so freed blocks of other runs cannot hide its allocations.
fn long_sequence_memory(dev: &Device) -> Result<()> {
    let (s, heads, dim) = (32 * 1024, 2, 64);
    let q = Tensor::randn(0f32, 1., (1, s, heads, dim), dev)?;
    let k = Tensor::randn(0f32, 1., (1, s, heads, dim), dev)?;
    let v = Tensor::randn(0f32, 1., (1, s, heads, dim), dev)?;
    let output_bytes = (s * heads * dim * DType::F32.size_in_bytes()) as f64;
    // After the reset the peak equals the current resident size: the baseline.
    let measured = reset_peak();
    let before = peak_rss();
    let start = Instant::now();
    let out = flash_attn3::flash_attn(&q, &k, &v, 1.0 / (dim as f32).sqrt(), true)?;
    let elapsed = start.elapsed().as_secs_f64();
    match (measured, before, peak_rss()) {
        (true, Some(before), Some(after)) => {
            let extra = after as f64 - before as f64 - output_bytes;
            println!(
                "seqlen {s}, {heads} heads, head dim {dim}, causal forward: {elapsed:.1} s, peak memory beyond inputs and output {:.1} MB (the score matrix alone would be {:.0} MB)\n",
                extra / 1e6,
                (s * s * heads * 4) as f64 / 1e6
            );
        }
        _ => println!("seqlen {s}: {elapsed:.1} s (peak memory not measurable here: no /proc/self/clear_refs)\n"),
    }
    assert_eq!(out.dims(), &[1, s, heads, dim]);
    Ok(())
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let dev = Device::Cpu;
    long_sequence_memory(&dev)?;
    let (heads, dim) = (8, 128);
    let repeats = if quick { 3 } else { 5 };
    let seqlens: &[usize] = if quick { &[512, 2048] } else { &[512, 1024, 2048, 4096] };
    println!(
        "CPU attention, f32, batch 1, {heads} heads, head dim {dim}, {} threads; median ms of {repeats}",
        rayon::current_num_threads()
    );
    println!("| seqlen | causal | pass | flash-attn3 | naive composite | candle-nn flash | vs naive | vs candle-nn |");
    println!("|---|---|---|---|---|---|---|---|");
    for &s in seqlens {
        let q = Tensor::randn(0f32, 1., (1, s, heads, dim), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, s, heads, dim), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, s, heads, dim), &dev)?;
        let scale = 1.0 / (dim as f64).sqrt();
        for causal in [false, true] {
            let ours = median_ms(repeats, || {
                flash_attn3::flash_attn(&q, &k, &v, scale as f32, causal)?;
                Ok(())
            })?;
            let composite = median_ms(repeats, || {
                naive(&q, &k, &v, scale, causal)?;
                Ok(())
            })?;
            let mask = if causal { AttnMask::causal() } else { AttnMask::None };
            let candle_nn_flash = median_ms(repeats, || {
                candle_nn::attention::flash_attn::<f32>(&q, &k, &v, scale as f32, mask.clone(), None, None)?;
                Ok(())
            })?;
            println!(
                "| {s} | {causal} | fwd | {ours:.1} | {composite:.1} | {candle_nn_flash:.1} | {:.2}x | {:.2}x |",
                composite / ours,
                candle_nn_flash / ours
            );

            // Forward + backward through candle's autograd (candle-nn's flash attention has no backward).
            let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
            let ours_bwd = median_ms(repeats, || {
                let out = flash_attn3::flash_attn(&qv, &kv, &vv, scale as f32, causal)?;
                out.sum_all()?.backward()?;
                Ok(())
            })?;
            let composite_bwd = median_ms(repeats, || {
                naive(&qv, &kv, &vv, scale, causal)?.sum_all()?.backward()?;
                Ok(())
            })?;
            println!(
                "| {s} | {causal} | fwd+bwd | {ours_bwd:.1} | {composite_bwd:.1} | - | {:.2}x | - |",
                composite_bwd / ours_bwd
            );
        }
    }
    Ok(())
}
