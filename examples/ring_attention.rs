//! Context-parallel (ring) attention across GPUs, checked against one GPU's call over the
//! whole sequence and timed next to it.
//!
//! ```text
//! cargo build --release --features nccl --example ring_attention
//! target/release/examples/ring_attention --gpus 2 --seq 32768     # one process per GPU
//! ```
//!
//! Every rank builds the same random q, k, v and output gradient (batch 1, 32 heads of 128,
//! GQA 4, bf16) for the whole sequence, keeps its chunk, runs `RingAttention` forward and
//! backward with the other ranks through NCCL, then runs flash-attn3 over the whole sequence on
//! its own GPU and compares its rows of the output and of dq, dk, dv. Rank 0 prints the errors
//! and both times (the median of --reps runs each).

use anyhow::{bail, Result};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// GPUs (ranks), one process each.
    #[arg(long, default_value_t = 2)]
    gpus: usize,
    /// Whole sequence length (a multiple of --gpus).
    #[arg(long, default_value_t = 16384)]
    seq: usize,
    /// Causal mask (the default) or none.
    #[arg(long)]
    no_causal: bool,
    /// Timed runs of each (after one warm-up).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(not(feature = "nccl"))]
fn run(_: Args) -> Result<()> {
    bail!("ring_attention runs on several GPUs through NCCL: build with `--features nccl`")
}

#[cfg(feature = "nccl")]
fn run(args: Args) -> Result<()> {
    use candle_core::{DType, Device, Tensor};
    use flash_llama::parallel::context::RingAttention;
    use flash_llama::parallel::launch;
    use std::time::Instant;

    if args.gpus < 2 || args.seq % args.gpus != 0 {
        bail!("--gpus must be at least 2 and divide --seq")
    }
    if launch::rank_from_env()?.is_none() {
        return launch::launch_gpu_ranks(args.gpus);
    }
    let (rank, dev, comm) = launch::join_gpu_group(args.gpus)?;
    let (b, h, hk, d, s) = (1, 32, 8, 128, args.seq);
    let chunk = s / args.gpus;
    let causal = !args.no_causal;
    // The same values on every rank: a seeded host generator, not the device's.
    let make = |heads: usize, seed: u64| -> Result<Tensor> {
        let n = b * s * heads * d;
        let values = flash_llama::train::Rng(seed).normals(n, 1.0);
        Ok(Tensor::from_vec(values, (b, s, heads, d), &Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_device(&dev)?)
    };
    let (q, k, v, dout) = (make(h, 1)?, make(hk, 2)?, make(hk, 3)?, make(h, 4)?);
    let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(1, rank * chunk, chunk)?.contiguous()?) };
    let (qr, kr, vr, dr) = (rows(&q)?, rows(&k)?, rows(&v)?, rows(&dout)?);
    let scale = 1.0 / (d as f32).sqrt();
    let ring = RingAttention::new(scale).causal(causal);
    let whole = flash_attn3::FlashAttn::new(scale).causal(causal);
    let sync = || dev.synchronize();
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };

    let mut ring_times = Vec::new();
    let mut ring_result = None;
    for i in 0..=args.reps {
        sync()?;
        let t = Instant::now();
        let (o, l) = ring.forward_with_lse(&comm, &qr, &kr, &vr)?;
        let grads = ring.backward(&comm, &qr, &kr, &vr, &o, &l, &dr)?;
        sync()?;
        if i > 0 {
            ring_times.push(t.elapsed().as_secs_f64());
        }
        ring_result = Some((o, grads));
    }
    let mut whole_times = Vec::new();
    let mut whole_result = None;
    for i in 0..=args.reps {
        sync()?;
        let t = Instant::now();
        let (o, l) = whole.forward_with_lse(&q, &k, &v)?;
        let grads = whole.backward(&q, &k, &v, &o, &l, &dout)?;
        sync()?;
        if i > 0 {
            whole_times.push(t.elapsed().as_secs_f64());
        }
        whole_result = Some((o, grads));
    }
    let (o, (dq, dk, dv)) = ring_result.expect("reps + 1 runs");
    let (wo, (wdq, wdk, wdv)) = whole_result.expect("reps + 1 runs");
    let mut worst = 0f32;
    let mut report = Vec::new();
    for (name, got, want) in [("out", o, wo), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)] {
        let (got, want) = (got.to_dtype(DType::F32)?, rows(&want)?.to_dtype(DType::F32)?);
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
        let err = ((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?) / scale;
        // NaN never passes.
        worst = if err.is_nan() { f32::INFINITY } else { worst.max(err) };
        report.push(format!("{name} {err:.1e}"));
    }
    if launch::is_main_process() {
        println!(
            "ring attention, {} GPUs, seq {s} ({chunk} per GPU), causal {causal}, bf16, 32 heads / 8 kv heads of 128: \
             rank 0 max rel error vs one GPU: {}; fwd+bwd median {:.2} ms ring, {:.2} ms one GPU over the whole sequence",
            args.gpus,
            report.join(", "),
            1e3 * median(ring_times),
            1e3 * median(whole_times),
        );
    }
    if worst > 3e-2 {
        bail!("rank {rank}: ring attention differs from the whole-sequence call by {worst:.2e} (bound 3e-2)")
    }
    Ok(())
}
