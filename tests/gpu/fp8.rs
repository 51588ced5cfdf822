//! FP8 (e4m3) forward tests: the kernels against the f64 reference of the dequantised inputs
//! (x = e4m3 · descale, exactly what the kernel multiplies), with fresh random inputs per check.
//!
//! The bound. P is rounded to e4m3 before P·V (as in FA3): a relative error of at most 2^-4 per
//! probability (3 mantissa bits), so |O - O_ref| <= 2^-4 · max|v| per element from P, plus the
//! 16-bit rounding of O (2^-8 relative in bf16). Probabilities below e4m3's normal range (2^-6,
//! relative to the row's reference max) round with an absolute error of 2^-10 instead; at these
//! sizes their total weight stays far below the bound. The scores S = Q·Kᵀ are not exact fp32
//! sums: Hopper's fp8 wgmma adds a dot product's terms keeping only about 14 bits (DeepSeek-V3
//! technical report, "increasing accumulation precision"), so a score may be off by up to 2^-13 · Σ_d |q_d k_d| <=
//! 2^-13 · |q| |k| (Cauchy–Schwarz), times |softmax scale|: δ in logits, which moves each
//! softmax weight by a factor within e^{±2δ} and the output by at most (e^{2δ} - 1) · max|v|.
//! With O(1) inputs that term is ~1e-4; with logits in the hundreds it dominates (a near-tie of
//! two keys then splits differently). `assert_fp8_close` asserts max |O - O_ref| <=
//! (2^-4 + 2^-8 + e^{2δ} - 1) · max|v|, an RMS error under 1e-2 · max|v| (P's rounding errors are
//! unbiased, so the RMS sits far below the worst case), and the callers check the LSE (fp32, from
//! the unrounded probabilities) to 1e-3 as for 16-bit inputs.

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::fp8::{self, Granularity, Quantized, Quantizer};
use flash_attn3_tests::{
    assert_close, assert_err, attention_ref, attention_ref_varlen, cumulative, max_len, seqlens_tensor, to_f64_vec,
    AttnShape, Opts, TestRng,
};

use super::{gpu, poison, variants, LSE_TOL};

/// P's e4m3 rounding plus the output's bf16 rounding, relative to max|v| (module docs).
const MAX_ERR: f64 = 1.0 / 16.0 + 1.0 / 256.0;
const RMS_ERR: f64 = 1e-2;

/// max |got - want| and the RMS of the difference, both over max|v|; NaN or a non-finite
/// mismatch fails.
fn errors(got: &Tensor, want: &Tensor, v_max: f64, what: &str) -> Result<(f64, f64)> {
    let (g, w) = (to_f64_vec(got)?, to_f64_vec(want)?);
    assert_eq!(g.len(), w.len(), "{what}: sizes");
    let (mut max, mut sq) = (0f64, 0f64);
    for (i, (&g, &w)) in g.iter().zip(&w).enumerate() {
        assert!(g.is_finite() && w.is_finite(), "{what}: element {i} got {g}, want {w}");
        max = max.max((g - w).abs());
        sq += (g - w) * (g - w);
    }
    Ok((max / v_max, (sq / g.len().max(1) as f64).sqrt() / v_max))
}

/// `got` against `want` for the dequantised inputs `qkv` and the call's softmax `scale`, to the
/// module's bound.
pub(super) fn assert_fp8_close(
    got: &Tensor,
    want: &Tensor,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    scale: f32,
    what: &str,
) -> Result<()> {
    let v_max = flash_attn3_tests::max_abs(v)?.max(1e-30);
    let (max, rms) = errors(got, want, v_max, what)?;
    // δ from the largest row norms of q and k (any heads: an upper bound).
    let max_norm = |x: &Tensor| -> Result<f64> {
        let rank = x.rank();
        Ok((x
            .to_dtype(DType::F64)?
            .sqr()?
            .sum(rank - 1)?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?)
        .sqrt())
    };
    let delta = (scale as f64).abs() * 2f64.powi(-13) * max_norm(q)? * max_norm(k)?;
    let bound = MAX_ERR + ((2.0 * delta).exp() - 1.0);
    assert!(
        max <= bound && rms <= RMS_ERR,
        "{what}: max error {max:.3e} (bound {bound:.3e}, of which {:.3e} from S's fp8 accumulation), rms {rms:.3e} (bound {RMS_ERR:.1e}), relative to max|v| {v_max:.3}",
        bound - MAX_ERR
    );
    Ok(())
}

/// q, k and v quantized with the given granularity (q and k per block of the kernels' block
/// sizes when `Block`), optionally with the incoherent rotation of q and k.
fn quantize_qkv(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    granularity: Granularity,
    rotate: Option<u64>,
) -> Result<(Quantized, Quantized, Quantized)> {
    let (gq, gk, gv) = match granularity {
        Granularity::Block(_) => (
            Granularity::Block(fp8::Q_BLOCK_ROWS),
            Granularity::Block(fp8::K_BLOCK_ROWS),
            Granularity::Head,
        ),
        g => (g, g, g),
    };
    let quant = |g: Granularity, rot: bool| match (rot, rotate) {
        (true, Some(seed)) => Quantizer::new(g).incoherent(seed),
        _ => Quantizer::new(g),
    };
    Ok((
        quant(gq, true).quantize(q)?,
        quant(gk, true).quantize(k)?,
        quant(gv, false).quantize(v)?,
    ))
}

fn fp8_builder(o: Opts, q: &Quantized, k: &Quantized, v: &Quantized) -> flash_attn3::FlashAttn {
    o.builder()
        .descale(Some(&q.descale), Some(&k.descale), Some(&v.descale))
}

/// A varlen fp8 call through `builder` (the descales of q8, k8, v8 attached) over the sequences
/// `cu_q` / `cu_k`: its output and LSE.
fn fp8_varlen_call(
    builder: flash_attn3::FlashAttn,
    (q8, k8, v8): (&Quantized, &Quantized, &Quantized),
    (cu_q, cu_k): (&[usize], &[usize]),
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    builder.forward_varlen_with_lse(
        &q8.data,
        &k8.data,
        &v8.data,
        &seqlens_tensor(cu_q, dev)?,
        &seqlens_tensor(cu_k, dev)?,
        max_len(cu_q),
        max_len(cu_k),
    )
}

/// One fixed-length fp8 call against the f64 reference of its dequantised inputs, with the
/// split count chosen per call and with num_splits(1); `out_dtype` bf16 or f16.
fn check_fp8(
    qkv: (&Tensor, &Tensor, &Tensor),
    granularity: Granularity,
    o: Opts,
    out_dtype: DType,
    what: &str,
) -> Result<()> {
    let (q8, k8, v8) = quantize_qkv(qkv, granularity, None)?;
    let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
    let (want, want_lse) = attention_ref(&qd, &kd, &vd, &o.reference())?;
    for splits in [0, 1] {
        poison(qkv.0.device(), want.elem_count() * 2)?;
        let (out, lse) = fp8_builder(o, &q8, &k8, &v8)
            .out_dtype(out_dtype)
            .num_splits(splits)
            .forward_with_lse(&q8.data, &k8.data, &v8.data)?;
        assert_eq!(out.dtype(), out_dtype, "{what}: out dtype");
        let what = format!("{what} {granularity:?} num_splits({splits})");
        assert_fp8_close(&out, &want, (&qd, &kd, &vd), o.scale, &format!("{what}: out"))?;
        assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
    }
    Ok(())
}

#[test]
fn fp8_every_option_head_dims_and_granularities() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-options");
    let mut n = 0;
    for d in [64, 96, 128, 192, 256] {
        for (name, o) in variants(d, &mut rng) {
            let ratio = rng.pick(&[1, 2, 4, 8]);
            let kv_heads = rng.range(1, 2);
            let (sq, sk) = if rng.coin() {
                (rng.odd_len(1, 200), rng.odd_len(130, 400))
            } else {
                (rng.odd_len(130, 330), rng.odd_len(1, 200))
            };
            let shape = AttnShape::new((rng.range(1, 2), sq, sk, kv_heads * ratio, kv_heads, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
            let granularity = rng.pick(&[Granularity::Tensor, Granularity::Head, Granularity::Block(0)]);
            let out_dtype = if rng.coin() { DType::BF16 } else { DType::F16 };
            let what = format!("fp8 d{d} {name} {shape:?} {out_dtype:?} seed {}", rng.seed());
            check_fp8((&q, &k, &v), granularity, o, out_dtype, &what)?;
            n += 1;
        }
    }
    eprintln!("{n} fp8 cases");
    Ok(())
}

/// The d128 kernel on 256-key blocks (the consumer without intra-warpgroup overlap, mainloop.cuh
/// consumer_serial), which the default choice keeps for calls of 1k keys or more (8k masked),
/// forced on small odd shapes: every option, per-head and per-block descales (a 256-key block spans
/// two or three 128-key K descale blocks), both split choices.
#[test]
fn fp8_d128_256_key_blocks() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-256");
    let tuning = flash_attn3::Tuning {
        fp8_d128_block_n: Some(256),
        ..Default::default()
    };
    let mut n = 0;
    for d in [96, 128] {
        for (name, o) in variants(d, &mut rng) {
            let ratio = rng.pick(&[1, 2, 4]);
            let kv_heads = rng.range(1, 2);
            let (sq, sk) = (rng.odd_len(1, 330), rng.odd_len(200, 700));
            let shape = AttnShape::new((rng.range(1, 2), sq, sk, kv_heads * ratio, kv_heads, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
            // K's magnitude steps by 128-key block (x1, x2, x3, ...), so that a block's scores
            // taken with a neighbour's descale would be off by half or more.
            let ramp: Vec<f32> = (0..sk).map(|i| 1.0 + (i / fp8::K_BLOCK_ROWS % 3) as f32).collect();
            let k = k.broadcast_mul(&Tensor::from_vec(ramp, (1, sk, 1, 1), &dev)?)?;
            for granularity in [Granularity::Head, Granularity::Block(0)] {
                let what = format!("fp8 256 keys d{d} {name} {shape:?} seed {}", rng.seed());
                check_fp8((&q, &k, &v), granularity, o.tuned(tuning), DType::BF16, &what)?;
                n += 1;
            }
        }
    }
    eprintln!("{n} fp8 cases on 256-key blocks");
    Ok(())
}

/// A NaN in k or q comes out as NaN in every output it feeds, and only there: through the
/// SFU's exponentials and through the FMA pipe's (`exp2_fma`: every 4th exponential of a row in
/// the 128-key d128 kernel: key 9 of a block is one of those in every row, key 0 goes to the
/// SFU), and on 256-key blocks.
#[test]
fn fp8_nan_inputs_reach_the_outputs_they_feed() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-nan");
    let (sq, sk, heads, d) = (70, 300, 2, 128);
    // e4m3 made on the host (candle's CUDA backend has no f32 -> e4m3 cast); a NaN stays NaN.
    let e4m3 = |mut x: Vec<f32>, n: usize, nan_at: Option<usize>| -> Result<Tensor> {
        if let Some(i) = nan_at {
            x[i] = f32::NAN;
        }
        Tensor::from_vec(x, (1, n, heads, d), &Device::Cpu)?
            .to_dtype(DType::F8E4M3)?
            .to_device(&dev)
    };
    let values = |rng: &mut TestRng, n: usize| -> Result<Vec<f32>> {
        rng.randn((n * heads * d,), DType::F32, &Device::Cpu)?.to_vec1::<f32>()
    };
    for keys_per_block in [128, 256] {
        let attn = flash_attn3::FlashAttn::new(1.0 / (d as f32).sqrt()).tuning(flash_attn3::Tuning {
            fp8_d128_block_n: Some(keys_per_block),
            ..Default::default()
        });
        let (qv, kv, vv) = (values(&mut rng, sq)?, values(&mut rng, sk)?, values(&mut rng, sk)?);
        for nan_key in [0, 9, 137] {
            // k of key nan_key, head 1: every output row of head 1 sees it.
            let (q, v) = (e4m3(qv.clone(), sq, None)?, e4m3(vv.clone(), sk, None)?);
            let k = e4m3(kv.clone(), sk, Some((nan_key * heads + 1) * d + 5))?;
            poison(&dev, sq * heads * d * 2)?;
            let out = attn
                .forward(&q, &k, &v)?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?;
            let out = out.reshape((sq, heads, d))?;
            let nan_head = out.narrow(1, 1, 1)?.flatten_all()?.to_vec1::<f32>()?;
            let other = out.narrow(1, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
            let what = format!("{keys_per_block}-key blocks, NaN at key {nan_key}");
            assert!(
                nan_head.iter().all(|x| x.is_nan()),
                "{what}: a head-1 output is not NaN"
            );
            assert!(
                other.iter().all(|x| x.is_finite()),
                "{what}: a head-0 output is not finite"
            );
        }
        // q of query 33, head 0: that row alone.
        let q = e4m3(qv.clone(), sq, Some((33 * heads) * d + 7))?;
        let (k, v) = (e4m3(kv.clone(), sk, None)?, e4m3(vv.clone(), sk, None)?);
        let out = attn
            .forward(&q, &k, &v)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?;
        let flat = out.flatten_all()?.to_vec1::<f32>()?;
        for (i, x) in flat.iter().enumerate() {
            let (query, head) = (i / (heads * d), i / d % heads);
            let want_nan = query == 33 && head == 0;
            assert_eq!(x.is_nan(), want_nan, "{keys_per_block}-key blocks: output {i} = {x}");
            assert!(
                want_nan || x.is_finite(),
                "{keys_per_block}-key blocks: output {i} = {x}"
            );
        }
    }
    Ok(())
}

#[test]
fn fp8_every_granularity_long_keys_and_gqa() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-granularity");
    for granularity in [Granularity::Tensor, Granularity::Head, Granularity::Block(0)] {
        for causal in [false, true] {
            let d = rng.pick(&[64, 128, 256]);
            let shape = AttnShape::new((2, rng.odd_len(300, 700), rng.odd_len(700, 1500), 8, 2, d, d));
            let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
            let o = Opts::new(shape.scale()).causal_if(causal);
            let what = format!("fp8 {shape:?} causal {causal} seed {}", rng.seed());
            check_fp8((&q, &k, &v), granularity, o, DType::BF16, &what)?;
        }
    }
    Ok(())
}

/// Grids of two to four tiles per CTA (the other tests' grids fit one wave, but for the bit
/// comparisons of fp8_v_transpose_in_kernel_matches_the_pre_pass), against the reference: each
/// CTA's tile boundaries (the K/V ring and the turns running across tiles, O's stores issued
/// under the next tile's first S, fp8 d256's two staging passes), with query lengths whose last
/// tile leaves the second consumer warpgroup idle (d256: 1,050 = 8 · 128 + 26) or not, and causal
/// tiles that see no key (sq > sk).
#[test]
fn fp8_several_tiles_per_cta() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-tiles");
    for (d, causal, sq) in [
        (256, false, 1050),
        (256, true, 1000),
        (128, false, 1100),
        (64, true, 1500),
    ] {
        let shape = AttnShape::new((1, sq, rng.odd_len(260, 400), 48, 8, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let o = Opts::new(shape.scale()).causal_if(causal);
        let what = format!("fp8 several tiles a CTA {shape:?} causal {causal} seed {}", rng.seed());
        check_fp8((&q, &k, &v), Granularity::Head, o, DType::BF16, &what)?;
    }
    Ok(())
}

/// Scales that are not 1: inputs of very different magnitudes per head, and a softmax scale
/// that is negative or zero (the descales fold into it).
#[test]
fn fp8_scales_magnitudes_negative_zero() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-scales");
    let shape = AttnShape::new((2, 77, 301, 4, 2, 128, 128));
    for scale in [0.09, -0.09, 0.0, 1.5] {
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        // Per-head magnitudes from 1e-3 to 30 (descales 3e4 apart), with q's chosen against its
        // kv head's so that the logits stay O(10): logits in the hundreds would only test S's
        // fp8 accumulation (module docs).
        let kv_mag = Tensor::new(&[1e-3f32, 30.0], &dev)?.reshape((1, 1, 2, 1))?;
        let q_mag = Tensor::new(&[30.0f32, 1e-3, 1e-3, 1.0 / 30.0], &dev)?.reshape((1, 1, 4, 1))?;
        let (q, k, v) = (
            q.broadcast_mul(&q_mag)?,
            k.broadcast_mul(&kv_mag)?,
            v.broadcast_mul(&kv_mag)?,
        );
        let what = format!("fp8 scale {scale} seed {}", rng.seed());
        check_fp8((&q, &k, &v), Granularity::Head, Opts::new(scale), DType::BF16, &what)?;
    }
    Ok(())
}

/// The incoherent rotation: the kernel sees rotated q and k (e4m3 · descale), whose product is
/// the unrotated one's; compare against the reference of the rotated, dequantised inputs and,
/// loosely, against the unrotated f32 inputs.
#[test]
fn fp8_incoherent_block_quantization() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-incoherent");
    let shape = AttnShape::new((1, 333, 517, 4, 4, 128, 128));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
    let (q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Block(0), Some(rng.seed()))?;
    let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
    let o = Opts::new(shape.scale());
    let (want, _) = attention_ref(&qd, &kd, &vd, &o.reference())?;
    let out = fp8_builder(o, &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
    assert_fp8_close(
        &out,
        &want,
        (&qd, &kd, &vd),
        o.scale,
        "incoherent vs its dequantised inputs",
    )?;
    let (exact, _) = attention_ref(&q, &k, &v, &o.reference())?;
    let v_max = flash_attn3_tests::max_abs(&v)?;
    let (_, rms) = errors(&out, &exact, v_max, "incoherent vs f32 inputs")?;
    assert!(rms < 2e-2, "incoherent vs the unquantised inputs: rms {rms:.3e}");
    Ok(())
}

#[test]
fn fp8_varlen_with_empty_sequences() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-varlen");
    for d in [64, 128, 256] {
        let lens_q = [rng.odd_len(1, 150), 0, rng.odd_len(100, 300), 1];
        let lens_k = [rng.odd_len(100, 300), rng.odd_len(1, 50), 0, rng.odd_len(1, 200)];
        let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
        let (hq, hk) = (4, 2);
        let q = rng.randn((cu_q[4], hq, d), DType::F32, &dev)?;
        let k = rng.randn((cu_k[4], hk, d), DType::F32, &dev)?;
        let v = rng.randn((cu_k[4], hk, d), DType::F32, &dev)?;
        let granularity = rng.pick(&[Granularity::Tensor, Granularity::Head]);
        let (q8, k8, v8) = quantize_qkv((&q, &k, &v), granularity, None)?;
        let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
        for causal in [false, true] {
            let o = Opts::new(0.1).causal_if(causal);
            let (want, want_lse) = attention_ref_varlen(&qd, &kd, &vd, &cu_q, &cu_k, &o.reference())?;
            poison(&dev, want.elem_count() * 2)?;
            let (out, lse) = fp8_varlen_call(fp8_builder(o, &q8, &k8, &v8), (&q8, &k8, &v8), (&cu_q, &cu_k), &dev)?;
            let what = format!("fp8 varlen d{d} causal {causal} {granularity:?} seed {}", rng.seed());
            assert_fp8_close(&out, &want, (&qd, &kd, &vd), o.scale, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
        }
    }
    Ok(())
}

/// Decode-like GQA calls: FA3's (batch, kv_heads) q descale lets a tile hold the whole group
/// (pack-GQA); a (batch, heads) one does not, and the call must not pack.
#[test]
fn fp8_decode_pack_gqa_and_split_kv() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-decode");
    for (sk, per_kv_head) in [(4097, true), (3000, false), (70, true)] {
        let shape = AttnShape::new((3, 1, sk, 16, 2, 128, 128));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let (mut q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Head, None)?;
        if per_kv_head {
            // One q descale per (batch, kv head): the group's largest, applied to all its heads.
            let amax = q
                .abs()?
                .max_keepdim(3)?
                .max_keepdim(1)?
                .reshape((3, 2, 8))?
                .max_keepdim(2)?
                .squeeze(2)?;
            let descale = (amax / fp8::E4M3_MAX as f64)?;
            let per_head = descale.unsqueeze(2)?.broadcast_as((3, 2, 8))?.reshape((3, 16))?;
            // candle 0.11's CUDA backend has no f32 -> e4m3 cast: convert on the host.
            let data = q.broadcast_div(&per_head.unsqueeze(1)?.unsqueeze(3)?)?;
            let data = data.to_device(&Device::Cpu)?.to_dtype(DType::F8E4M3)?.to_device(&dev)?;
            q8 = Quantized {
                data,
                descale,
                granularity: Granularity::Head,
            };
        }
        let q_deq = if per_kv_head {
            let per_head = q8.descale.unsqueeze(2)?.broadcast_as((3, 2, 8))?.reshape((3, 16))?;
            // candle 0.11's CUDA backend has no e4m3 casts either way: dequantise on the host.
            let cpu = Device::Cpu;
            let data = q8.data.to_device(&cpu)?.to_dtype(DType::F32)?;
            data.broadcast_mul(&per_head.to_device(&cpu)?.unsqueeze(1)?.unsqueeze(3)?)?
        } else {
            fp8::dequantize(&q8)?
        };
        let (kd, vd) = (fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
        let o = Opts::new(shape.scale());
        let (want, want_lse) = attention_ref(&q_deq, &kd, &vd, &o.reference())?;
        for splits in [0, 1, 3] {
            poison(&dev, want.elem_count() * 2)?;
            let (out, lse) = fp8_builder(o, &q8, &k8, &v8)
                .num_splits(splits)
                .forward_with_lse(&q8.data, &k8.data, &v8.data)?;
            let what = format!(
                "fp8 decode sk {sk} per kv head {per_kv_head} splits {splits} seed {}",
                rng.seed()
            );
            assert_fp8_close(&out, &want, (&q_deq, &kd, &vd), o.scale, &format!("{what}: out"))?;
            assert_close(&lse, &want_lse, LSE_TOL, &format!("{what}: lse"))?;
        }
    }
    Ok(())
}

/// The same call on the CPU (exact f32 of the dequantised inputs) and on the GPU agree to the
/// kernel's bound: the API is the same on every device.
#[test]
fn fp8_cpu_and_gpu_agree() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-cpu");
    let shape = AttnShape::new((2, 100, 260, 4, 2, 64, 64));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &Device::Cpu)?;
    let (q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Block(0), None)?;
    let o = Opts::new(shape.scale()).causal();
    let cpu = fp8_builder(o, &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
    let to_gpu = |x: &Quantized| -> Result<Quantized> {
        Ok(Quantized {
            data: x.data.to_device(&dev)?,
            descale: x.descale.to_device(&dev)?,
            granularity: x.granularity,
        })
    };
    let (qg, kg, vg) = (to_gpu(&q8)?, to_gpu(&k8)?, to_gpu(&v8)?);
    let gpu_out = fp8_builder(o, &qg, &kg, &vg).forward(&qg.data, &kg.data, &vg.data)?;
    assert_eq!(cpu.dtype(), DType::BF16);
    let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
    assert_fp8_close(
        &gpu_out.to_device(&Device::Cpu)?,
        &cpu,
        (&qd, &kd, &vd),
        o.scale,
        "gpu vs cpu",
    )?;
    Ok(())
}

/// One small case per fp8 kernel (d64 on 128- and 192-row tiles, d128, d256) for
/// compute-sanitizer, with the GPU quantizer in both of its modes (per block: one launch; per
/// head: amax, then quantize) and the rotation.
#[test]
fn fp8_small_for_sanitizer() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-small");
    // (head dim, granularity, causal, d128's key block: 128 or 256)
    for (d, granularity, causal, keys) in [
        (64, Granularity::Head, true, 128),
        (64, Granularity::Block(0), false, 128),
        (128, Granularity::Block(0), true, 128),
        (128, Granularity::Block(0), false, 256),
        (256, Granularity::Tensor, true, 128),
    ] {
        let shape = AttnShape::new((1, 130, 260, 2, 1, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let o = Opts::new(shape.scale()).causal_if(causal);
        let o = o.tuned(flash_attn3::Tuning {
            fp8_d128_block_n: Some(keys),
            ..Default::default()
        });
        let what = format!("fp8 small d{d} {granularity:?} causal {causal} {keys}-key blocks");
        check_fp8((&q, &k, &v), granularity, o, DType::BF16, &what)?;
    }
    let x = rng.randn((1, 70, 2, 128), DType::BF16, &dev)?;
    let rotated = Quantizer::new(Granularity::Block(fp8::Q_BLOCK_ROWS))
        .incoherent(3)
        .quantize(&x)?;
    assert_eq!(rotated.descale.dims(), &[1, 2, 2]);
    Ok(())
}

/// The in-kernel V^T writer's counts (one buffer per device and thread, which each launch leaves
/// zeroed: crates/flash-attn/src/cuda/mod.rs `vt_fill_counts`) across calls on one thread: few
/// (sequence, kv head) pairs, more pairs than the buffer holds (it grows), few again, each call
/// against the reference. A launch that left a count behind would let the next one read V^T
/// before it is written, or skip units.
#[test]
fn fp8_writer_counts_reused() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-writer-counts");
    // (batch, heads, kv heads, head dim): 2, 90 and 3 pairs. 90 pairs need 92 counts, past a
    // fresh buffer's 64: the buffer grows here unless an earlier call on this thread grew it.
    for (round, (batch, heads, kv_heads, d)) in [(1, 4, 2, 128), (9, 20, 10, 64), (3, 1, 1, 256), (1, 4, 2, 128)]
        .into_iter()
        .enumerate()
    {
        let shape = AttnShape::new((batch, 70, 200, heads, kv_heads, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let o = Opts::new(shape.scale()).causal_if(round % 2 == 1);
        let what = format!("fp8 writer counts, call {round}: {batch} x {kv_heads} pairs, d{d}");
        check_fp8((&q, &k, &v), Granularity::Head, o, DType::BF16, &what)?;
    }
    Ok(())
}

#[test]
fn fp8_errors() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-errors");
    let x = rng.randn((1, 64, 2, 128), DType::F32, &dev)?;
    let q = fp8::quantize(&x, Granularity::Head)?;
    // Wrong descale shape, descale on bf16 inputs, out dtype f32.
    let bad = Tensor::ones((1, 3), DType::F32, &dev)?;
    assert_err(
        flash_attn3::FlashAttn::new(0.1)
            .descale(Some(&bad), None, None)
            .forward(&q.data, &q.data, &q.data),
        &["q_descale"],
    );
    let xb = x.to_dtype(DType::BF16)?;
    assert_err(
        flash_attn3::FlashAttn::new(0.1)
            .descale(None, None, Some(&q.descale))
            .forward(&xb, &xb, &xb),
        &["F8E4M3 inputs only"],
    );
    assert_err(
        flash_attn3::FlashAttn::new(0.1)
            .out_dtype(DType::F32)
            .forward(&q.data, &q.data, &q.data),
        &["bf16 or f16"],
    );
    // Head dim 72 is no multiple of 16.
    let x72 = rng
        .randn((1, 8, 1, 72), DType::F32, &Device::Cpu)?
        .to_dtype(DType::F8E4M3)?
        .to_device(&dev)?;
    assert_err(
        flash_attn3::flash_attn(&x72, &x72, &x72, 0.1, false),
        &["multiples of 16"],
    );
    // No backward.
    let out = flash_attn3::flash_attn(&q.data, &q.data, &q.data, 0.1, false)?;
    let e = flash_attn3::FlashAttn::new(0.1)
        .backward(&q.data, &q.data, &q.data, &out, &out, &out)
        .map(|_| ())
        .expect_err("fp8 backward must fail")
        .to_string();
    assert!(e.contains("no backward"), "{e}");
    Ok(())
}

/// The bits of an e4m3 or f32 tensor, on the host: equal bits, not just equal values (-0 vs 0).
fn bits(x: &Tensor) -> Result<Vec<u32>> {
    let host = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?;
    Ok(host.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The GPU quantizer (kernels/fp8/quantize.cu) gives the host's bits: data and descales, every
/// dtype, granularity, rotation and head dim it takes (and odd ones, which go through the host),
/// odd sequence lengths, varlen, outliers; non-finite input gives NaN descales instead of the
/// host's error.
#[test]
fn fp8_quantize_gpu_matches_host() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-quantize");
    let mut n = 0u64;
    for d in [64, 96, 128, 256, 40, 12, 264] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let varlen = rng.pick(&[false, false, true]);
            let seqlen = rng.odd_len(1, 700);
            let dims: Vec<usize> = if varlen {
                vec![seqlen, 3, d]
            } else {
                vec![2, seqlen, 3, d]
            };
            // N(0, 1) with a few N(0, 10) outliers, as in the accuracy protocol.
            let base = rng.randn(dims.as_slice(), DType::F32, &dev)?;
            let mask = rng.randn(dims.as_slice(), DType::F32, &dev)?.abs()?.ge(3.0)?;
            let x = mask.where_cond(&(&base * 10.0)?, &base)?.to_dtype(dtype)?;
            let mut granularities = vec![Granularity::Tensor, Granularity::Head];
            if !varlen {
                granularities.extend([
                    Granularity::Block(fp8::Q_BLOCK_ROWS),
                    Granularity::Block(fp8::K_BLOCK_ROWS),
                    Granularity::Block(rng.odd_len(1, 90)),
                ]);
            }
            for granularity in granularities {
                for seed in [None, Some(rng.seed() ^ n)] {
                    let quantizer = match seed {
                        Some(s) => Quantizer::new(granularity).incoherent(s),
                        None => Quantizer::new(granularity),
                    };
                    let on_gpu = quantizer.quantize(&x)?;
                    let on_host = quantizer.quantize(&x.to_device(&Device::Cpu)?)?;
                    let what = format!(
                        "d{d} {dtype:?} {dims:?} {granularity:?} rotation {seed:?}, seed {}",
                        rng.seed()
                    );
                    assert!(
                        on_gpu.data.device().is_cuda() && on_gpu.descale.device().is_cuda(),
                        "{what}"
                    );
                    assert_eq!(on_gpu.data.dtype(), DType::F8E4M3, "{what}");
                    assert_eq!(on_gpu.descale.dims(), on_host.descale.dims(), "{what}: descale shape");
                    assert_eq!(bits(&on_gpu.descale)?, bits(&on_host.descale)?, "{what}: descale");
                    let (g, h) = (bits(&on_gpu.data)?, bits(&on_host.data)?);
                    let diff = g.iter().zip(&h).filter(|(a, b)| a != b).count();
                    assert_eq!(diff, 0, "{what}: {diff} of {} e4m3 values differ", g.len());
                    n += 1;
                }
            }
        }
    }
    // Per head with the whole sequence in one CTA (seqlen <= 64: one launch, no amax buffer;
    // a decode step's q), rotated or not.
    for d in [64, 128, 256] {
        for seqlen in [1, 4, 37, 64, 65] {
            let x = rng.randn((3, seqlen, 2, d), DType::F32, &dev)?.to_dtype(DType::BF16)?;
            for seed in [None, Some(rng.seed() ^ n)] {
                let quantizer = match seed {
                    Some(s) => Quantizer::new(Granularity::Head).incoherent(s),
                    None => Quantizer::new(Granularity::Head),
                };
                let on_gpu = quantizer.quantize(&x)?;
                let on_host = quantizer.quantize(&x.to_device(&Device::Cpu)?)?;
                let what = format!("per head, d{d} seqlen {seqlen} rotation {seed:?}, seed {}", rng.seed());
                assert_eq!(on_gpu.descale.dims(), on_host.descale.dims(), "{what}: descale shape");
                assert_eq!(bits(&on_gpu.descale)?, bits(&on_host.descale)?, "{what}: descale");
                assert_eq!(bits(&on_gpu.data)?, bits(&on_host.data)?, "{what}: data");
                n += 1;
            }
        }
    }
    eprintln!("{n} quantizations bit-identical to the host");

    // A NaN or an infinity: its group's descale is NaN, the other groups' are finite.
    let mut flat = rng
        .randn((1, 200, 2, 128), DType::F32, &Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    flat[(130 * 2 + 1) * 128 + 5] = f32::NAN; // position 130, head 1
    flat[(10 * 2) * 128 + 7] = f32::INFINITY; // position 10, head 0
    let x = Tensor::from_vec(flat, (1, 200, 2, 128), &dev)?;
    assert!(
        fp8::quantize(&x.to_device(&Device::Cpu)?, Granularity::Head).is_err(),
        "host must refuse NaN"
    );
    let q = fp8::quantize(&x, Granularity::Block(fp8::Q_BLOCK_ROWS))?;
    let descale = q.descale.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    // (batch 1, heads 2, 4 blocks of 64): head 0 block 0 has the infinity, head 1 block 2 the NaN.
    for (i, d) in descale.iter().enumerate() {
        assert_eq!(d.is_nan(), i == 0 || i == 4 + 2, "descale {i} = {d}");
    }
    Ok(())
}

/// V^T written by the forward kernel itself (two producer warps, kernels/flash_fwd/fp8_vt_fill.cuh)
/// and by the pre-pass (fp8_prepass.cuh) are the same bytes, so the two calls agree bit for bit,
/// and both match the reference: head dims under the kernel's (d32, d96 and d192 on the d64, d128
/// and d256 kernels), d128 on 128- and 256-key blocks, d256 (two units of head-dim rows per 128
/// keys, O staged in two passes), odd key counts (a unit of 128 keys past the sequence's end),
/// GQA, causal, and varlen calls (each sequence's keys from its own offset) at d64 and d256.
#[test]
fn fp8_v_transpose_in_kernel_matches_the_pre_pass() -> Result<()> {
    let dev = gpu()?;
    let mut rng = TestRng::fresh("gpu-fp8-vt-writers");
    let writers = |o: Opts, in_kernel: bool, block_n: usize| {
        o.tuned(flash_attn3::Tuning {
            fp8_vt_in_kernel: Some(in_kernel),
            fp8_d128_block_n: Some(block_n),
            ..Default::default()
        })
    };
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    for (d, causal, block_n) in [
        (32, false, 128),
        (64, true, 128),
        (96, false, 256),
        (128, true, 128),
        (128, false, 256),
        (128, true, 256),
        (256, false, 128),
        (192, true, 128),
    ] {
        let (sq, sk) = (rng.odd_len(60, 300), rng.odd_len(130, 700));
        let shape = AttnShape::new((2, sq, sk, 4, 2, d, d));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &dev)?;
        let (q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Head, None)?;
        let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
        let o = Opts::new(shape.scale()).causal_if(causal);
        let (want, _) = attention_ref(&qd, &kd, &vd, &o.reference())?;
        let what = format!(
            "fp8 V^T writers d{d} causal {causal} {block_n}-key blocks {sq}x{sk} seed {}",
            rng.seed()
        );
        poison(&dev, want.elem_count() * 2)?;
        let in_kernel = fp8_builder(writers(o, true, block_n), &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
        poison(&dev, want.elem_count() * 2)?;
        let pre_pass = fp8_builder(writers(o, false, block_n), &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
        assert_fp8_close(
            &in_kernel,
            &want,
            (&qd, &kd, &vd),
            o.scale,
            &format!("{what}: in kernel"),
        )?;
        assert_eq!(
            bits(&in_kernel)?,
            bits(&pre_pass)?,
            "{what}: in kernel and pre-pass differ"
        );
    }
    // Two grid cells at 2k keys, each run two ways that must give the same bits (and no
    // non-finite output): fresh inputs quantized per head, the output poisoned before each call.
    let same_bits = |rng: &mut TestRng, shape: AttnShape, a: Opts, b: Opts, what: &str| -> Result<()> {
        let (q, k, v) = shape.random_qkv(rng, DType::F32, &dev)?;
        let (q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Head, None)?;
        let out_elems = shape.batch * shape.seqlen_q * shape.heads * shape.head_dim_v;
        poison(&dev, out_elems * 2)?;
        let first = fp8_builder(a, &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
        poison(&dev, out_elems * 2)?;
        let second = fp8_builder(b, &q8, &k8, &v8).forward(&q8.data, &k8.data, &v8.data)?;
        let first_bits = bits(&first)?;
        assert!(
            first_bits.iter().all(|b| f32::from_bits(*b).is_finite()),
            "{what}: a non-finite output"
        );
        assert_eq!(first_bits, bits(&second)?, "{what}: the two differ");
        Ok(())
    };
    // d256: 2,048 units written by 132 CTAs' writers while their consumers compute and their first
    // tiles end; still the pre-pass's bits.
    let shape = AttnShape::new((8, 2048, 2048, 8, 8, 256, 256));
    let o = Opts::new(shape.scale());
    same_bits(
        &mut rng,
        shape,
        writers(o, true, 128),
        writers(o, false, 128),
        "fp8 V^T writers d256 2k (in kernel, pre-pass)",
    )?;
    // d64: its last 192-row tile per (sequence, head) leaves a warpgroup idle, so the default
    // claims tiles through the atomic counter (Tuning::dynamic_tiles) beside the kernel's V^T
    // writer; the pre-pass with static strides gives the same bits.
    let shape = AttnShape::new((8, 2048, 2048, 32, 32, 64, 64));
    let o = Opts::new(shape.scale());
    let strided = o.tuned(flash_attn3::Tuning {
        fp8_vt_in_kernel: Some(false),
        dynamic_tiles: Some(false),
        ..Default::default()
    });
    same_bits(
        &mut rng,
        shape,
        o,
        strided,
        "fp8 d64 2k (the counter's claims with the kernel's V^T, strided claims with the pre-pass)",
    )?;
    for d in [64, 256] {
        let lens_k = [rng.odd_len(1, 90), 0, rng.odd_len(200, 400), rng.odd_len(60, 140)];
        let lens_q = [rng.odd_len(1, 100), 3, rng.odd_len(100, 200), 1];
        let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
        let q = rng.randn((cu_q[4], 4, d), DType::F32, &dev)?;
        let k = rng.randn((cu_k[4], 2, d), DType::F32, &dev)?;
        let v = rng.randn((cu_k[4], 2, d), DType::F32, &dev)?;
        let (q8, k8, v8) = quantize_qkv((&q, &k, &v), Granularity::Tensor, None)?;
        let (qd, kd, vd) = (fp8::dequantize(&q8)?, fp8::dequantize(&k8)?, fp8::dequantize(&v8)?);
        let o = Opts::new(1.0 / (d as f64).sqrt()).causal();
        let (want, _) = attention_ref_varlen(&qd, &kd, &vd, &cu_q, &cu_k, &o.reference())?;
        let mut outs = Vec::new();
        for in_kernel in [true, false] {
            poison(&dev, want.elem_count() * 2)?;
            let builder = fp8_builder(writers(o, in_kernel, 128), &q8, &k8, &v8);
            outs.push(fp8_varlen_call(builder, (&q8, &k8, &v8), (&cu_q, &cu_k), &dev)?.0);
        }
        let what = format!("fp8 V^T writers varlen d{d} seed {}", rng.seed());
        assert_fp8_close(&outs[0], &want, (&qd, &kd, &vd), o.scale, &format!("{what}: in kernel"))?;
        assert_eq!(
            bits(&outs[0])?,
            bits(&outs[1])?,
            "{what}: in kernel and pre-pass differ"
        );
    }
    Ok(())
}
