//! The projections of a batched decode step: flash-llama's `linear_rows` (tensor cores, one read
//! of the weight, kernels/model/linear_rows.cu) against candle's matmul (cuBLAS), which
//! `Linear::forward` runs, on the Llama-3.2-1B shapes at 2-64 tokens.
//!
//! Needs the `cuda` feature and a Hopper GPU; built by scripts/gpu-pack.sh, run by
//! scripts/gpu-run.sh (or by hand: `gpu_linear`; `BENCH_LINEAR_TOKENS=8,32` picks the token
//! counts, `BENCH_LINEAR_SHAPES=o,head` the projections). Each row: several products one after the other captured into a CUDA graph (as in a
//! replayed decode step), each on its own copy of the weight, the copies together larger than
//! the L2 cache, so every call reads its weight from HBM; the graph replayed back to back; time
//! per product, and the weight's bytes over it.

use std::time::Instant;

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{DType, Device, Result, Tensor};
use flash_llama::fused::{linear_rows, linear_rows_fits};

/// (name, outputs, k) of the 1B shape's projections.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q/k/v", 3072, 2048),
    ("o", 2048, 2048),
    ("gate/up", 16384, 2048),
    ("down", 2048, 8192),
    ("head", 128_256, 2048),
];

/// Bytes of weight copies each row cycles through: over twice an H100's or H200's L2.
const WEIGHT_BYTES: usize = 160 << 20;

/// Seconds per call of `f` (which makes `calls` calls): captured once into a CUDA graph on
/// candle's stream, replayed back to back.
fn graph_time(dev: &Device, calls: usize, f: impl Fn() -> Result<Vec<Tensor>>) -> Result<f64> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    drop(f()?); // kernels loaded, allocator warm
    dev.synchronize()?;
    let err = |e| candle_core::Error::Msg(format!("{e:?}"));
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(err)?;
    let out = f();
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .map_err(err)?
        .ok_or_else(|| candle_core::Error::Msg("empty graph".into()))?;
    // The outputs live in the graph's memory, which the graph frees at its next launch.
    std::mem::forget(out?);
    for _ in 0..3 {
        graph.launch().map_err(err)?;
    }
    dev.synchronize()?;
    let reps = 20;
    let start = Instant::now();
    for _ in 0..reps {
        graph.launch().map_err(err)?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / (reps * calls) as f64)
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let tokens: Vec<usize> = std::env::var("BENCH_LINEAR_TOKENS")
        .unwrap_or_else(|_| "2,8,16,32,64".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let picked = std::env::var("BENCH_LINEAR_SHAPES").ok();
    let dtype = DType::BF16;
    println!("| projection | n x k | tokens | linear_rows us | cuBLAS us | cuBLAS / ours | ours GB/s | cuBLAS GB/s |");
    println!("|---|---|---|---|---|---|---|---|");
    for (name, n, k) in SHAPES {
        if picked.as_ref().is_some_and(|p| !p.split(',').any(|s| s == name)) {
            continue;
        }
        let bytes = n * k * dtype.size_in_bytes();
        let copies = WEIGHT_BYTES.div_ceil(bytes).clamp(1, 32);
        let weights: Vec<Tensor> = (0..copies)
            .map(|_| Tensor::randn(0f32, 0.05, (n, k), &dev)?.to_dtype(dtype))
            .collect::<Result<_>>()?;
        for &m in &tokens {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
            if !linear_rows_fits(&x, &weights[0]) {
                println!("| {name} | {n} x {k} | {m} | (not taken) | | | | |");
                continue;
            }
            // The two agree before they are timed.
            let (ours, theirs) = (linear_rows(&x, &weights[0], None)?, x.matmul(&weights[0].t()?)?);
            let diff = (ours.to_dtype(DType::F32)? - theirs.to_dtype(DType::F32)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            let scale = theirs
                .to_dtype(DType::F32)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff <= 0.02 * scale.max(1e-3), "{name} m {m}: {diff} of {scale}");
            let ours = graph_time(&dev, copies, || {
                weights.iter().map(|w| linear_rows(&x, w, None)).collect()
            })?;
            let cublas = graph_time(&dev, copies, || weights.iter().map(|w| x.matmul(&w.t()?)).collect())?;
            println!(
                "| {name} | {n} x {k} | {m} | {:.2} | {:.2} | {:.3} | {:.0} | {:.0} |",
                ours * 1e6,
                cublas * 1e6,
                cublas / ours,
                bytes as f64 / ours / 1e9,
                bytes as f64 / cublas / 1e9
            );
        }
    }
    Ok(())
}
