//! Attention through flash-attn3 next to the naive candle composite (matmul, softmax, matmul):
//! how closely they agree and how long each takes, for a few shapes and dtypes.
//!
//!     cargo run --release --example attention
//!
//! Runs on the CPU. Built with `--features cuda` on a Hopper machine, add `--gpu`.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

/// The naive composite on (batch, seq, heads, dim) inputs, with k/v heads repeated for GQA.
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let group = q.dim(2)? / k.dim(2)?;
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let (b, s, h, d) = t.dims4()?;
        Ok(t.unsqueeze(3)?
            .repeat((1, 1, 1, group, 1))?
            .reshape((b, s, h * group, d))?)
    };
    let (q, k, v) = (
        q.transpose(1, 2)?,
        repeat(k)?.transpose(1, 2)?,
        repeat(v)?.transpose(1, 2)?,
    );
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if causal {
        let (sq, sk) = (scores.dim(2)?, scores.dim(3)?);
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| if j + sq > i + sk { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (sq, sk), scores.device())?.to_dtype(scores.dtype())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let probs = candle_nn::ops::softmax(&scores.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(&v)?.transpose(1, 2)?)
}

fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let start = Instant::now();
    let value = f()?;
    Ok((value, start.elapsed().as_secs_f64() * 1e3))
}

fn main() -> Result<()> {
    let device = if std::env::args().any(|a| a == "--gpu") {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    };
    println!("flash-attn3 vs the naive candle composite on {:?}\n", device.location());
    println!(
        "| dtype | batch | seqlen q/k | heads q/kv | head dim | causal | max abs diff | flash-attn3 ms | naive ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let cases = [
        (DType::F32, 2, 512, 512, 8, 8, 64, false),
        (DType::F32, 2, 512, 512, 8, 8, 64, true),
        (DType::F32, 1, 1000, 1000, 16, 4, 128, true),
        (DType::F32, 4, 1, 777, 8, 2, 128, true),
        (DType::BF16, 1, 1024, 1024, 8, 1, 128, true),
        (DType::F16, 1, 300, 700, 4, 2, 256, false),
    ];
    for (dtype, b, sq, sk, h, hk, d, causal) in cases {
        let q = Tensor::randn(0f32, 1., (b, sq, h, d), &device)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 1., (b, sk, hk, d), &device)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1., (b, sk, hk, d), &device)?.to_dtype(dtype)?;
        let scale = 1.0 / (d as f64).sqrt();
        let (ours, ours_ms) = timed(|| Ok(flash_attn3::flash_attn(&q, &k, &v, scale as f32, causal)?))?;
        let (want, naive_ms) = timed(|| naive(&q, &k, &v, scale, causal))?;
        let diff = (ours.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        println!(
            "| {dtype:?} | {b} | {sq}/{sk} | {h}/{hk} | {d} | {causal} | {diff:.2e} | {ours_ms:.1} | {naive_ms:.1} |"
        );
    }
    println!("\nf32 agrees to ~1e-6; f16/bf16 to the rounding of the half-precision output and of the naive path's probabilities.");
    Ok(())
}
