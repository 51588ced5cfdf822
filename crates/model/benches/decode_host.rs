//! Where the host's time goes in a decode step on the GPU: the time to *queue* (not run) one
//! batch-1 decode step of the Llama-3.2-1B shape, and each kind of op such a step is made of, on
//! the step's own shapes. A decode step at batch 1 is host-bound (the GPU waits for the host, see
//! docs/benchmarks.md), so these numbers, not kernel times, set its speed.
//!
//! Needs the `cuda` feature and a Hopper GPU; built by scripts/gpu-pack.sh, run by
//! scripts/gpu-run.sh (or by hand: `decode_host [reps]`). Weights are zeros: the host's work
//! does not depend on their values.
//!
//! Each row: the op is queued `reps` times; "host" is the time until the last one is queued,
//! "device" the time until it has also run (a row whose device time exceeds its host time is
//! bound by the GPU, not the host), both per call.

use std::time::Instant;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};
use flash_attn3::{FlashAttn, SeqOffsets};
use flash_llama::fused::{add_rms_norm, argmax_rows, linear_vector, rope_store, silu_mul};
use flash_llama::{Config, Kernels, Llama};

/// meta-llama/Llama-3.2-1B's config.json (the shape only: no weights are read).
const LLAMA32_1B: &str = include_str!("llama32_1b.json");

/// Host and device time per call, in µs, of `f` queued `reps` times (after a warm-up).
fn time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..10 {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    let host = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    let device = t.elapsed().as_secs_f64();
    Ok((host * 1e6 / reps as f64, device * 1e6 / reps as f64))
}

fn main() -> Result<()> {
    let reps: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let dev = Device::new_cuda(0)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        // As the generate example does (one stream: cudarc's per-allocation events order nothing).
        unsafe { d.disable_event_tracking() };
    }
    let dt = DType::BF16;
    let cfg = Config::from_hf_json(LLAMA32_1B).map_err(candle_core::Error::wrap)?;
    let model = Llama::load(VarBuilder::zeros(dt, &dev), &cfg, Kernels::Fused)?;
    let mut rows: Vec<(String, (f64, f64))> = Vec::new();

    // A whole decode step after a 512-token prompt (the cache grows by one key per call).
    let prompt: Vec<u32> = (0..512).map(|i| (i * 7 + 3) % 1000).collect();
    let mut cache = model.new_cache(1, 512 + reps + 20)?;
    model.step(&[prompt], &mut cache)?;
    rows.push((
        "decode step (Llama::step, batch 1)".into(),
        time(&dev, reps, || model.step(&[vec![5]], &mut cache).map(drop))?,
    ));

    // The ops of one layer, on a decode step's shapes.
    let (h, hk, d, hidden, inter) = (32, 8, 64, 2048, 8192);
    let x = Tensor::zeros((1, hidden), dt, &dev)?;
    let w = Tensor::ones(hidden, dt, &dev)?;
    let qkv = Linear::new(Tensor::zeros(((h + 2 * hk) * d, hidden), dt, &dev)?, None);
    let gate_up = Linear::new(Tensor::zeros((2 * inter, hidden), dt, &dev)?, None);
    rows.push((
        "matmul 1 x 2048 -> 3072 (q/k/v)".into(),
        time(&dev, reps, || qkv.forward(&x).map(drop))?,
    ));
    rows.push((
        "matmul 1 x 2048 -> 16384 (gate/up)".into(),
        time(&dev, reps, || gate_up.forward(&x).map(drop))?,
    ));
    rows.push((
        "linear_vector 1 x 2048 -> 3072 (q/k/v)".into(),
        time(&dev, reps, || linear_vector(&x, qkv.weight(), None).map(drop))?,
    ));
    rows.push((
        "linear_vector 1 x 2048 -> 16384 (gate/up)".into(),
        time(&dev, reps, || linear_vector(&x, gate_up.weight(), None).map(drop))?,
    ));
    let down = Tensor::zeros((hidden, inter), dt, &dev)?;
    let act = Tensor::zeros((1, inter), dt, &dev)?;
    rows.push((
        "matmul 1 x 8192 -> 2048 (down)".into(),
        time(&dev, reps, || act.matmul(&down.t()?).map(drop))?,
    ));
    rows.push((
        "linear_vector 1 x 8192 -> 2048 (down)".into(),
        time(&dev, reps, || linear_vector(&act, &down, None).map(drop))?,
    ));
    let head = Tensor::zeros((cfg.vocab_size, hidden), dt, &dev)?;
    rows.push((
        "matmul 1 x 2048 -> 128256 (head)".into(),
        time(&dev, reps, || x.matmul(&head.t()?).map(drop))?,
    ));
    rows.push((
        "linear_vector 1 x 2048 -> 128256 (head)".into(),
        time(&dev, reps, || linear_vector(&x, &head, None).map(drop))?,
    ));
    rows.push((
        "add + RMSNorm (fused)".into(),
        time(&dev, reps, || add_rms_norm(&x, &x, &w, 1e-5).map(drop))?,
    ));
    let y = Tensor::zeros((1, 2 * inter), dt, &dev)?;
    rows.push(("SiLU x up (fused)".into(), time(&dev, reps, || silu_mul(&y).map(drop))?));
    let q = Tensor::zeros((1, h + 2 * hk, d), dt, &dev)?;
    let cs = Tensor::zeros((1, h + 2 * hk, d / 2), dt, &dev)?;
    rows.push((
        "RoPE (fused, no store)".into(),
        time(&dev, reps, || rope_store(&q, &cs, &cs, false, None))?,
    ));
    // Attention as the model calls it: one query, a cache slot of `slot` keys holding all but
    // the last 40 (the slot's gap), split-KV chosen automatically and off.
    let qh = q.narrow(1, 0, h)?;
    let attn = FlashAttn::new(0.125).causal(true);
    for slot in [640, 1280, 2560, 5120, 10240] {
        let kv = Tensor::zeros((slot, 2 * hk, d), dt, &dev)?;
        let (ck, cv) = (kv.narrow(1, 0, hk)?, kv.narrow(1, hk, hk)?);
        for (how, splits) in [("split-KV auto", 0), ("num_splits 1", 1)] {
            let attn = attn.clone().num_splits(splits);
            let (cu_q, cu_k) = (
                SeqOffsets::from_lengths([1, 0], &dev)?,
                SeqOffsets::from_lengths([slot - 40, 40], &dev)?,
            );
            rows.push((
                format!("attention, decode, {} keys ({how})", slot - 40),
                time(&dev, reps, || {
                    attn.forward_varlen_offsets(&qh, &ck, &cv, &cu_q, &cu_k, 1, slot)
                        .map(drop)
                })?,
            ));
        }
    }
    rows.push((
        "SeqOffsets::from_lengths (2 entries)".into(),
        time(&dev, reps, || SeqOffsets::from_lengths([1, 0], &dev).map(drop))?,
    ));
    rows.push((
        "Tensor::new (1 u32, upload)".into(),
        time(&dev, reps, || Tensor::new(&[5u32], &dev).map(drop))?,
    ));
    let logits = Tensor::zeros((1, cfg.vocab_size), dt, &dev)?;
    rows.push((
        "argmax over 128256 (fused)".into(),
        time(&dev, reps, || argmax_rows(&logits).map(drop))?,
    ));
    rows.push((
        "to_dtype bf16 -> f32, 128256".into(),
        time(&dev, reps, || logits.to_dtype(DType::F32).map(drop))?,
    ));
    let small = Tensor::zeros((1, 16), DType::F32, &dev)?;
    rows.push((
        "candle unary op (cos, 16 elements)".into(),
        time(&dev, reps, || small.cos().map(drop))?,
    ));
    rows.push((
        "candle binary op (mul, 16 elements)".into(),
        time(&dev, reps, || (&small * &small).map(drop))?,
    ));
    rows.push((
        "narrow + reshape (no kernel)".into(),
        time(&dev, reps, || q.narrow(1, 0, h)?.reshape((1, h * d)).map(drop))?,
    ));

    println!("Host cost of queuing decode ops (Llama-3.2-1B shape, bf16, batch 1), {reps} calls each:");
    println!("| op | host µs/call | device µs/call |");
    println!("|---|---|---|");
    for (name, (host, device)) in rows {
        println!("| {name} | {host:.1} | {device:.1} |");
    }
    Ok(())
}
