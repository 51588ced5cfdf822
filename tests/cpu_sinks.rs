//! Attention sinks (`FlashAttn::sinks`, gpt-oss) on the CPU against the f64 reference: fixed
//! length with GQA, causal / window / softcap, rows that see no key (output 0, LSE = the sink),
//! a dominant sink; varlen; a kvcache call; the gradients of q, k, v and the sinks through
//! `loss.backward()`; and the errors.

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::FlashAttn;
use flash_attn3_tests::{
    assert_close, assert_err, attention_ref, check_sinks, check_sinks_varlen, random_sinks, AttnShape, Opts, SinkTols,
    TestRng,
};

const F32: SinkTols = SinkTols {
    out: 1e-5,
    lse: 1e-5,
    grad: Some(1e-4),
};

#[test]
fn sinks_fixed_length_forward_and_backward() -> Result<()> {
    let mut rng = TestRng::fresh("cpu-sinks-fixed");
    let dev = Device::Cpu;
    for (shape, opts) in [
        ((2, 37, 53, 4, 2, 32, 32), Opts::new(0.125)),
        ((1, 40, 40, 6, 3, 64, 48), Opts::new(0.125).causal()),
        // More queries than keys, causal: the first rows see no key.
        ((2, 30, 11, 2, 1, 32, 32), Opts::new(0.2).causal()),
        (
            (1, 25, 60, 4, 4, 40, 40),
            Opts::new(0.1).window(Some(7), Some(3)).softcap(5.0),
        ),
    ] {
        check_sinks(
            &mut rng,
            &dev,
            DType::F32,
            AttnShape::new(shape),
            opts,
            0,
            F32,
            "cpu sinks",
        )?;
    }
    Ok(())
}

/// A row with no visible key: output 0 and LSE equal to its head's sink.
#[test]
fn sinks_row_without_keys() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::ones((1, 3, 2, 8), DType::F32, &dev)?;
    let k = Tensor::ones((1, 1, 2, 8), DType::F32, &dev)?;
    let sinks = Tensor::new(&[0.5f32, -1.5], &dev)?;
    let (out, lse) = FlashAttn::new(0.3)
        .causal(true)
        .sinks(&sinks)
        .forward_with_lse(&q, &k, &k)?;
    // Queries 0 and 1 see no key (bottom-right causal: 3 queries over 1 key).
    let out = out.flatten_all()?.to_vec1::<f32>()?;
    assert!(out[..2 * 2 * 8].iter().all(|&x| x == 0.0), "rows without keys give 0");
    assert!(out[2 * 2 * 8..].iter().all(|&x| x != 0.0), "the last row sees the key");
    let lse = lse.to_vec3::<f32>()?;
    assert_eq!(lse[0][0][0], 0.5);
    assert_eq!(lse[0][1][1], -1.5);
    // Query 2 sees the key: its LSE is log(e^{0.3·8} + e^{sink}).
    let want = ((0.3f64 * 8.0).exp() + 0.5f64.exp()).ln();
    assert!((lse[0][0][2] as f64 - want).abs() < 1e-5, "{} vs {want}", lse[0][0][2]);
    Ok(())
}

#[test]
fn sinks_varlen() -> Result<()> {
    let mut rng = TestRng::fresh("cpu-sinks-varlen");
    check_sinks_varlen(
        &mut rng,
        &Device::Cpu,
        DType::F32,
        &[5, 0, 17],
        &[9, 4, 30],
        (4, 2, 32),
        0.17,
        F32,
    )
}

/// A kvcache call with sinks: the attention over the cache's first cache_seqlens keys, as the
/// reference computes it on those keys.
#[test]
fn sinks_kvcache() -> Result<()> {
    let mut rng = TestRng::fresh("cpu-sinks-kvcache");
    let dev = Device::Cpu;
    let (b, h, hk, d, cap) = (2, 4, 2, 32, 48);
    let q = rng.randn((b, 2, h, d), DType::F32, &dev)?;
    let k_cache = rng.randn((b, cap, hk, d), DType::F32, &dev)?;
    let v_cache = rng.randn((b, cap, hk, d), DType::F32, &dev)?;
    let lens = [31usize, 7];
    let lens_t = Tensor::new(&[31u32, 7], &dev)?;
    let vals = random_sinks(&mut rng, h);
    let sinks = Tensor::new(vals.as_slice(), &dev)?;
    let opts = Opts::new(0.2).causal();
    let (out, _) = opts
        .builder()
        .sinks(&sinks)
        .kv_cache(&k_cache, &v_cache, &lens_t)
        .forward_with_lse(&q)?;
    for (bi, &n) in lens.iter().enumerate() {
        let narrow = |t: &Tensor| t.narrow(0, bi, 1)?.narrow(1, 0, n);
        let (want, _) = attention_ref(
            &q.narrow(0, bi, 1)?,
            &narrow(&k_cache)?,
            &narrow(&v_cache)?,
            &opts.reference().sinks(&vals),
        )?;
        assert_close(
            &out.narrow(0, bi, 1)?,
            &want,
            1e-5,
            &format!("kvcache sequence {bi}, seed {}", rng.seed()),
        )?;
    }
    Ok(())
}

#[test]
fn sinks_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 4, 4, 8), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 4, 2, 8), DType::F32, &dev)?;
    let wrong_len = Tensor::zeros(3, DType::F32, &dev)?;
    assert_err(
        FlashAttn::new(0.1).sinks(&wrong_len).forward(&q, &k, &k),
        &["sinks", "[4]"],
    );
    let integers = Tensor::zeros(4, DType::U32, &dev)?;
    assert_err(
        FlashAttn::new(0.1).sinks(&integers).forward(&q, &k, &k),
        &["sinks", "U32"],
    );
    let matrix = Tensor::zeros((4, 1), DType::F32, &dev)?;
    assert_err(
        FlashAttn::new(0.1).sinks(&matrix).forward(&q, &k, &k),
        &["sinks", "[4, 1]"],
    );
    Ok(())
}
