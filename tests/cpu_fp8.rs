//! FP8 (e4m3) inputs on the CPU: the same API as on the GPU, computed exactly in f32 from the
//! dequantised inputs (x = e4m3 · descale), so every GPU fp8 case has a reference. Checked here
//! against the f64 reference of the dequantised inputs, with every descale form, and the errors.

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::fp8::{self, Granularity, Quantizer};
use flash_attn3::FlashAttn;
use flash_attn3_tests::{
    assert_close, attention_ref, attention_ref_varlen, cumulative, max_len, seqlens_tensor, AttnShape, Opts, TestRng,
};

/// The output is rounded to bf16 once; the f32 attention under it is exact to ~1e-6.
const OUT_TOL: f64 = 1e-2;
const LSE_TOL: f64 = 1e-5;

#[test]
fn fp8_cpu_matches_f32_of_dequantised_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-fp8");
    for (gq, gk, gv, rotate) in [
        (Granularity::Tensor, Granularity::Tensor, Granularity::Tensor, false),
        (Granularity::Head, Granularity::Head, Granularity::Head, false),
        (
            Granularity::Block(fp8::Q_BLOCK_ROWS),
            Granularity::Block(fp8::K_BLOCK_ROWS),
            Granularity::Head,
            false,
        ),
        (
            Granularity::Block(fp8::Q_BLOCK_ROWS),
            Granularity::Block(fp8::K_BLOCK_ROWS),
            Granularity::Head,
            true,
        ),
    ] {
        let shape = AttnShape::new((2, rng.odd_len(1, 150), rng.odd_len(100, 300), 4, 2, 64, 64));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let quant = |g: Granularity, rot: bool| {
            if rot {
                Quantizer::new(g).incoherent(7)
            } else {
                Quantizer::new(g)
            }
        };
        let (q8, k8, v8) = (
            quant(gq, rotate).quantize(&q)?,
            quant(gk, rotate).quantize(&k)?,
            quant(gv, false).quantize(&v)?,
        );
        let o = Opts::new(shape.scale()).causal();
        let (want, want_lse) = attention_ref(
            &fp8::dequantize(&q8)?,
            &fp8::dequantize(&k8)?,
            &fp8::dequantize(&v8)?,
            &o.reference(),
        )?;
        for out_dtype in [DType::BF16, DType::F16] {
            let (out, lse) = o
                .builder()
                .descale(Some(&q8.descale), Some(&k8.descale), Some(&v8.descale))
                .out_dtype(out_dtype)
                .forward_with_lse(&q8.data, &k8.data, &v8.data)?;
            assert_eq!(out.dtype(), out_dtype);
            let what = format!("cpu fp8 {gq:?}/{gk:?} rotate {rotate} {shape:?} seed {}", rng.seed());
            assert_close(&out, &want, OUT_TOL, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
        }
    }
    Ok(())
}

/// FA3's descale form (batch, kv_heads) for q, and batch 1 shared by every sequence (varlen).
#[test]
fn fp8_cpu_kv_head_descales_and_varlen() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-fp8-varlen");
    let cu = cumulative(&[rng.odd_len(1, 90), 0, rng.odd_len(50, 150)]);
    let (hq, hk, d) = (4, 2, 32);
    let q = rng.randn((cu[3], hq, d), DType::F32, &dev)?.to_dtype(DType::F8E4M3)?;
    let k = rng.randn((cu[3], hk, d), DType::F32, &dev)?.to_dtype(DType::F8E4M3)?;
    let v = rng.randn((cu[3], hk, d), DType::F32, &dev)?.to_dtype(DType::F8E4M3)?;
    let qd = Tensor::new(&[[0.5f32, 2.0]], &dev)?; // (1, kv_heads): heads 0-1 and 2-3
    let kd = Tensor::new(&[[0.25f32, 1.5]], &dev)?;
    let vd = Tensor::new(&[[3.0f32, 0.125]], &dev)?;
    let per_head = |t: &Tensor, group: usize| -> Result<Tensor> {
        let h = t.dim(1)?;
        t.reshape((1, h, 1))?
            .broadcast_as((1, h, group))?
            .reshape((1, 1, h * group, 1))?
            .squeeze(0)
    };
    let deq = |x: &Tensor, s: &Tensor, group: usize| -> Result<Tensor> {
        x.to_dtype(DType::F32)?.broadcast_mul(&per_head(s, group)?)
    };
    let o = Opts::new(0.2).causal();
    let (want, want_lse) = attention_ref_varlen(
        &deq(&q, &qd, 2)?,
        &deq(&k, &kd, 1)?,
        &deq(&v, &vd, 1)?,
        &cu,
        &cu,
        &o.reference(),
    )?;
    let seqlens = seqlens_tensor(&cu, &dev)?;
    let (out, lse) = o
        .builder()
        .descale(Some(&qd), Some(&kd), Some(&vd))
        .forward_varlen_with_lse(&q, &k, &v, &seqlens, &seqlens, max_len(&cu), max_len(&cu))?;
    assert_close(&out, &want, OUT_TOL, "varlen fp8 out")?;
    assert_close(&lse, &want_lse, LSE_TOL, "varlen fp8 lse")?;
    Ok(())
}

#[test]
fn fp8_errors() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = TestRng::fresh("cpu-fp8-errors");
    let x = rng.randn((2, 70, 4, 64), DType::F32, &dev)?;
    let q = fp8::quantize(&x, Granularity::Head)?;
    let msg = |r: Result<Tensor>| r.expect_err("must fail").to_string();
    let ones = |shape: &[usize]| Tensor::ones(shape, DType::F32, &dev);
    let run = |fa: FlashAttn| fa.forward(&q.data, &q.data, &q.data);
    // Shapes: wrong batch, wrong heads, a block count that is not ceil(seqlen / block), rank 1.
    for (what, fa, needle) in [
        (
            "q batch",
            FlashAttn::new(0.1).descale(Some(&ones(&[3, 4])?), None, None),
            "batch",
        ),
        (
            "k heads",
            FlashAttn::new(0.1).descale(None, Some(&ones(&[2, 3])?), None),
            "k_descale",
        ),
        (
            "q blocks",
            FlashAttn::new(0.1).descale(Some(&ones(&[2, 4, 1])?), None, None),
            "q_descale",
        ),
        (
            "k blocks",
            FlashAttn::new(0.1).descale(None, Some(&ones(&[2, 4, 2])?), None),
            "k_descale",
        ),
        (
            "v blocks",
            FlashAttn::new(0.1).descale(None, None, Some(&ones(&[2, 4, 1])?)),
            "v_descale",
        ),
        (
            "rank 1",
            FlashAttn::new(0.1).descale(Some(&ones(&[4])?), None, None),
            "rank",
        ),
        (
            "f16 descale",
            FlashAttn::new(0.1).descale(Some(&ones(&[2, 4])?.to_dtype(DType::F16)?), None, None),
            "f32",
        ),
        ("out f32", FlashAttn::new(0.1).out_dtype(DType::F32), "bf16 or f16"),
    ] {
        let e = msg(run(fa));
        assert!(e.contains(needle), "{what}: {e}");
    }
    // Descales or another output dtype on 16-bit inputs.
    let xb = x.to_dtype(DType::BF16)?;
    let e = msg(FlashAttn::new(0.1)
        .descale(Some(&q.descale), None, None)
        .forward(&xb, &xb, &xb));
    assert!(e.contains("F8E4M3 inputs only"), "{e}");
    let e = msg(FlashAttn::new(0.1).out_dtype(DType::F16).forward(&xb, &xb, &xb));
    assert!(e.contains("out_dtype"), "{e}");
    // Mixed dtypes, a head dim that is no multiple of 16, per-block descales on varlen inputs.
    let e = msg(flash_attn3::flash_attn(&q.data, &xb, &xb, 0.1, false));
    assert!(e.contains("share one dtype"), "{e}");
    let x40 = rng.randn((1, 8, 1, 40), DType::F32, &dev)?.to_dtype(DType::F8E4M3)?;
    let e = msg(flash_attn3::flash_attn(&x40, &x40, &x40, 0.1, false));
    assert!(e.contains("multiples of 16"), "{e}");
    let packed = q.data.reshape((140, 4, 64))?;
    let cu = seqlens_tensor(&[0, 70, 140], &dev)?;
    let e = msg(FlashAttn::new(0.1)
        .descale(Some(&ones(&[2, 4, 2])?), None, None)
        .forward_varlen(&packed, &packed, &packed, &cu, &cu, 70, 70));
    assert!(e.contains("fixed-length"), "{e}");
    // No backward.
    let out = flash_attn3::flash_attn(&q.data, &q.data, &q.data, 0.1, false)?;
    let lse = Tensor::zeros((2, 4, 70), DType::F32, &dev)?;
    let e = FlashAttn::new(0.1)
        .backward(&q.data, &q.data, &q.data, &out, &lse, &out)
        .map(|_| ())
        .expect_err("fp8 backward")
        .to_string();
    assert!(e.contains("no backward"), "{e}");
    Ok(())
}
