//! Attention sinks (`FlashAttn::sinks`) on the GPU against the f64 reference: the forward kernel's
//! finalize (two-warpgroup and three-warpgroup tiles, d64 / d128 / d256), rows and whole tiles
//! that see no key (the LSE is then the sink), split-KV (the combine adds the sink once), pack-GQA
//! decode, varlen, a kvcache call, and the gradients of q, k, v and the sinks through
//! `loss.backward()` (the backward kernels read the sink-inclusive LSE).

use candle_core::{DType, Result, Tensor};
use flash_attn3_tests::{
    assert_close, check_sinks, check_sinks_varlen, random_sinks, AttnShape, Opts, SinkTols, TestRng,
};

use super::{gpu, poison, LSE_TOL, OUT_TOL};

const BF16: SinkTols = SinkTols {
    out: OUT_TOL,
    lse: LSE_TOL,
    grad: Some(2e-2),
};
const FORWARD_ONLY: SinkTols = SinkTols { grad: None, ..BF16 };

#[test]
fn sinks_forward_backward_head_dims() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-sinks");
    let dev = gpu()?;
    for (shape, opts) in [
        ((2, 300, 300, 4, 2, 128, 128), Opts::new(0.088).causal()),
        // d64 unmasked runs on 192-row tiles (three warpgroups), causal on 128-row ones.
        ((1, 257, 700, 4, 4, 64, 64), Opts::new(0.125)),
        ((2, 300, 280, 4, 1, 64, 64), Opts::new(0.125).causal()),
        (
            (1, 200, 333, 2, 2, 256, 256),
            Opts::new(0.06).window(Some(50), Some(10)).softcap(10.0),
        ),
        // More queries than keys, causal: whole tiles with no key (the LSE is the sink).
        ((1, 400, 90, 4, 2, 128, 128), Opts::new(0.088).causal()),
    ] {
        poison(&dev, 1 << 24)?;
        let tols = if shape.1 > 1000 { FORWARD_ONLY } else { BF16 };
        check_sinks(
            &mut rng,
            &dev,
            DType::BF16,
            AttnShape::new(shape),
            opts,
            0,
            tols,
            "gpu sinks",
        )?;
    }
    Ok(())
}

/// Split-KV (the combine adds the sink) and pack-GQA decode shapes.
#[test]
fn sinks_split_kv_and_decode() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-sinks-splits");
    let dev = gpu()?;
    for splits in [1, 3, 0] {
        for (shape, opts) in [
            ((2, 1, 4000, 16, 2, 128, 128), Opts::new(0.088)),
            ((1, 4, 3000, 8, 8, 64, 64), Opts::new(0.125).causal()),
        ] {
            check_sinks(
                &mut rng,
                &dev,
                DType::BF16,
                AttnShape::new(shape),
                opts,
                splits,
                FORWARD_ONLY,
                "gpu sinks split",
            )?;
        }
    }
    Ok(())
}

#[test]
fn sinks_varlen_and_kvcache() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-sinks-varlen");
    let dev = gpu()?;
    let (h, hk, d) = (4, 2, 128);
    check_sinks_varlen(
        &mut rng,
        &dev,
        DType::BF16,
        &[50, 0, 170],
        &[90, 40, 300],
        (h, hk, d),
        0.088,
        FORWARD_ONLY,
    )?;
    // A paged kvcache decode call with sinks, against the same call on the CPU.
    let (b, ps, pages) = (2, 16, 40);
    let q = rng.randn((b, 1, 8, d), DType::BF16, &dev)?;
    let k_cache = rng.randn((pages, ps, hk, d), DType::BF16, &dev)?;
    let v_cache = rng.randn((pages, ps, hk, d), DType::BF16, &dev)?;
    let lens = Tensor::new(&[300u32, 45], &dev)?;
    let table: Vec<u32> = (0..pages as u32).rev().collect();
    let table = Tensor::from_vec(table, (b, pages / 2), &dev)?;
    let vals = random_sinks(&mut rng, 8);
    let sinks = Tensor::new(vals.as_slice(), &dev)?;
    let attn = Opts::new(0.088).causal().builder().sinks(&sinks);
    let cpu = candle_core::Device::Cpu;
    let host = |t: &Tensor| t.to_device(&cpu);
    let (out, lse) = attn
        .kv_cache(&k_cache, &v_cache, &lens)
        .page_table(&table)
        .forward_with_lse(&q)?;
    let (want, want_lse) = attn
        .clone()
        .sinks(&host(&sinks)?)
        .kv_cache(&host(&k_cache)?, &host(&v_cache)?, &host(&lens)?)
        .page_table(&host(&table)?)
        .forward_with_lse(&host(&q)?)?;
    let what = format!("kvcache with sinks, seed {}", rng.seed());
    assert_close(&out, &want, OUT_TOL, &what)?;
    assert_close(&lse, &want_lse, LSE_TOL, &what)?;
    Ok(())
}

/// Small, for compute-sanitizer (memcheck, racecheck): one causal call with sinks, split in
/// three (the combine's sink), backward included.
#[test]
fn sinks_small_for_sanitizer() -> Result<()> {
    let mut rng = TestRng::fresh("gpu-sinks-sanitizer");
    let dev = gpu()?;
    let shape = AttnShape::new((1, 70, 200, 4, 2, 128, 128));
    let opts = Opts::new(0.088).causal();
    check_sinks(
        &mut rng,
        &dev,
        DType::BF16,
        shape,
        opts,
        3,
        FORWARD_ONLY,
        "sanitizer, split",
    )?;
    check_sinks(&mut rng, &dev, DType::BF16, shape, opts, 1, BF16, "sanitizer, backward")
}
