//! FP8 (e4m3) quantization (crates/flash-attn/src/fp8.rs) against values computed here from the
//! definition: amax per group, descale = amax / 448, the e4m3 rounding bound, and the rotation
//! R = blockdiag(H_b / sqrt(b) · diag(signs)) recovered column by column.
//!
//! Round trip bound, per element against its own group's descale `s`: e4m3 keeps 3 mantissa
//! bits, so rounding to nearest moves `x / s` by at most 2^-4 of itself in the normal range and by
//! half the smallest subnormal (2^-10) below it: |dequantize(x) - x| ≤ s · (2^-4 · |x / s| + 2^-10),
//! plus f32 rounding of the division and the product.

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::fp8::{self, Granularity, Quantized, Quantizer, E4M3_MAX, K_BLOCK_ROWS, Q_BLOCK_ROWS};
use flash_attn3_tests::{assert_err, assert_identical, to_f64_vec, TestRng};

const CPU: Device = Device::Cpu;

/// e4m3 data as f32 (exact). Never straight to f64: candle 0.11.1's e4m3 → f64 conversion
/// (`WithDType::to_f64`) calls itself forever, so `to_dtype(F64)` of e4m3 data never returns.
fn widen(data: &Tensor) -> Result<Tensor> {
    data.to_dtype(DType::F32)
}

/// Random normal values of `dims` in `dtype`; with `outliers`, 0.1% of the entries (at least one)
/// multiplied by 10.
fn input(rng: &mut TestRng, dims: &[usize], dtype: DType, outliers: bool) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut values: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    if outliers {
        for _ in 0..(n / 1000).max(1) {
            let i = rng.range(0, n - 1);
            values[i] *= 10.0;
        }
    }
    Tensor::from_vec(values, dims, &CPU)?.to_dtype(dtype)
}

/// (batch, seqlen, heads, head_dim) of a rank-4 or varlen (as batch 1) shape.
fn bshd(dims: &[usize]) -> (usize, usize, usize, usize) {
    match *dims {
        [b, s, h, d] => (b, s, h, d),
        [t, h, d] => (1, t, h, d),
        _ => panic!("bad shape {dims:?}"),
    }
}

/// The descale entry (flat index) that covers (b, s, h), written from the documented shapes.
fn descale_index(dims: &[usize], granularity: Granularity, b: usize, s: usize, h: usize) -> usize {
    let (_, seqlen, heads, _) = bshd(dims);
    match granularity {
        Granularity::Tensor | Granularity::Head => b * heads + h,
        Granularity::Block(rows) => (b * heads + h) * seqlen.div_ceil(rows) + s / rows,
    }
}

/// amax / 448 per descale entry, from the f64 values of x (rotated by the caller if needed).
fn expected_descale(x: &[f64], dims: &[usize], granularity: Granularity) -> Vec<f32> {
    let (batch, seqlen, heads, d) = bshd(dims);
    let entries = match granularity {
        Granularity::Block(rows) => batch * heads * seqlen.div_ceil(rows),
        _ => batch * heads,
    };
    let mut amax = vec![0f64; entries];
    for b in 0..batch {
        for s in 0..seqlen {
            for h in 0..heads {
                let row = &x[((b * seqlen + s) * heads + h) * d..][..d];
                let slot = &mut amax[descale_index(dims, granularity, b, s, h)];
                *slot = row.iter().fold(*slot, |m, v| m.max(v.abs()));
            }
        }
    }
    if granularity == Granularity::Tensor {
        let all = amax.iter().fold(0f64, |m, &v| m.max(v));
        amax.fill(all);
    }
    amax.iter()
        .map(|&m| if m == 0.0 { 1.0 } else { m as f32 / E4M3_MAX })
        .collect()
}

/// Checks dtype and shapes, the descale against amax, every element against the e4m3 bound
/// (against `reference`, the values that were quantized), and that each group's largest value
/// lands on ±448.
fn check_quantized(
    q: &Quantized,
    reference: &[f64],
    dims: &[usize],
    granularity: Granularity,
    what: &str,
) -> Result<()> {
    assert_eq!(q.data.dtype(), DType::F8E4M3, "{what}: data dtype");
    assert_eq!(q.data.dims(), dims, "{what}: data shape");
    assert_eq!(q.descale.dtype(), DType::F32, "{what}: descale dtype");
    assert_eq!(q.granularity, granularity, "{what}: granularity");
    let (batch, seqlen, heads, d) = bshd(dims);
    let want_dims = match (granularity, dims.len()) {
        (_, 3) => vec![1, heads],
        (Granularity::Block(rows), _) => vec![batch, heads, seqlen.div_ceil(rows)],
        _ => vec![batch, heads],
    };
    assert_eq!(q.descale.dims(), want_dims.as_slice(), "{what}: descale shape");

    let want = expected_descale(reference, dims, granularity);
    let got = q.descale.flatten_all()?.to_vec1::<f32>()?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= w * 1e-6,
            "{what}: descale[{i}] = {g}, amax / 448 = {w}"
        );
    }

    let data = to_f64_vec(&widen(&q.data)?)?;
    let deq = to_f64_vec(&fp8::dequantize(q)?)?;
    let mut group_max = vec![0f64; got.len()];
    for b in 0..batch {
        for s in 0..seqlen {
            for h in 0..heads {
                let g = descale_index(dims, granularity, b, s, h);
                let scale = got[g] as f64;
                for j in 0..d {
                    let i = ((b * seqlen + s) * heads + h) * d + j;
                    let x = reference[i];
                    let bound = scale * (x.abs() / scale / 16.0 + 1.0 / 1024.0) * (1.0 + 1e-6) + 1e-30;
                    assert!(
                        (deq[i] - x).abs() <= bound,
                        "{what}: element {:?}: {x} came back as {} (descale {scale}, bound {bound})",
                        (b, s, h, j),
                        deq[i]
                    );
                    assert_eq!(
                        deq[i],
                        (data[i] as f32 * got[g]) as f64,
                        "{what}: dequantize is data · descale"
                    );
                    group_max[g] = group_max[g].max(data[i].abs());
                }
            }
        }
    }
    if granularity == Granularity::Tensor {
        // One group: its entries per (batch, head) are copies.
        let all = group_max.iter().fold(0f64, |m, &v| m.max(v));
        group_max.fill(all);
    }
    for (g, m) in group_max.iter().enumerate() {
        if want[g] != 1.0 || *m != 0.0 {
            assert_eq!(
                *m, E4M3_MAX as f64,
                "{what}: group {g}'s largest value should map to 448"
            );
        }
    }
    Ok(())
}

const GRANULARITIES: [Granularity; 5] = [
    Granularity::Tensor,
    Granularity::Head,
    Granularity::Block(Q_BLOCK_ROWS),
    Granularity::Block(K_BLOCK_ROWS),
    Granularity::Block(7),
];

#[test]
fn round_trip_and_descale_match_amax_per_granularity() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_round_trip");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for outliers in [false, true] {
            for dims in [[2, 130, 3, 64], [1, 257, 2, 96], [3, 5, 1, 1]] {
                let x = input(&mut rng, &dims, dtype, outliers)?;
                let reference = to_f64_vec(&x)?;
                for granularity in GRANULARITIES {
                    let q = fp8::quantize(&x, granularity)?;
                    let what = format!("{dtype:?} {dims:?} outliers {outliers} {granularity:?}");
                    check_quantized(&q, &reference, &dims, granularity, &what)?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn tensor_scale_is_one_value_and_head_scales_differ() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_tensor_vs_head");
    // Head h scaled by 2^h: per-head scales must follow, the per-tensor scale is the largest.
    let x = input(&mut rng, &[2, 40, 4, 32], DType::F32, false)?;
    let x = x.broadcast_mul(&Tensor::new(&[1f32, 2., 4., 8.], &CPU)?.reshape((1, 1, 4, 1))?)?;
    let reference = to_f64_vec(&x)?;
    let tensor = fp8::quantize(&x, Granularity::Tensor)?.descale.to_vec2::<f32>()?;
    let amax = reference.iter().fold(0f64, |m, v| m.max(v.abs())) as f32;
    for row in &tensor {
        for &v in row {
            assert_eq!(v, amax / E4M3_MAX, "every per-tensor entry is the one scale");
        }
    }
    let head = fp8::quantize(&x, Granularity::Head)?.descale.to_vec2::<f32>()?;
    for row in &head {
        assert!(
            row.windows(2).all(|w| w[1] > w[0]),
            "per-head scales follow the heads: {row:?}"
        );
        assert_eq!(*row.iter().last().unwrap(), row.iter().fold(0f32, |m, &v| m.max(v)));
    }
    Ok(())
}

#[test]
fn varlen_scales_are_one_per_head() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_varlen");
    let dims = [77, 3, 64];
    let x = input(&mut rng, &dims, DType::BF16, true)?;
    let reference = to_f64_vec(&x)?;
    for granularity in [Granularity::Tensor, Granularity::Head] {
        let q = fp8::quantize(&x, granularity)?;
        check_quantized(&q, &reference, &dims, granularity, &format!("varlen {granularity:?}"))?;
    }
    Ok(())
}

#[test]
fn partial_last_block_has_its_own_scale() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_partial_block");
    // seqlen 130 in blocks of 64: rows 128 and 129 form the third block. Make them 100x smaller,
    // so a scale that looked at any other row would be far too large.
    let x = input(&mut rng, &[2, 130, 2, 64], DType::F32, false)?;
    let small = Tensor::ones((1, 130, 1, 1), DType::F32, &CPU)?.slice_assign(
        &[0..1, 128..130, 0..1, 0..1],
        &Tensor::full(0.01f32, (1, 2, 1, 1), &CPU)?,
    )?;
    let x = x.broadcast_mul(&small)?;
    let q = fp8::quantize(&x, Granularity::Block(64))?;
    assert_eq!(q.descale.dims(), &[2, 2, 3]);
    let descale = q.descale.to_vec3::<f32>()?;
    let x4 = to_f64_vec(&x)?;
    for b in 0..2 {
        for h in 0..2 {
            let mut amax = 0f64;
            for s in 128..130 {
                for j in 0..64 {
                    amax = amax.max(x4[((b * 130 + s) * 2 + h) * 64 + j].abs());
                }
            }
            let want = amax as f32 / E4M3_MAX;
            assert!(
                (descale[b][h][2] - want).abs() <= want * 1e-6,
                "last block of ({b}, {h})"
            );
            assert!(descale[b][h][1] > 20.0 * descale[b][h][2], "full blocks are large");
        }
    }
    check_quantized(&q, &x4, &[2, 130, 2, 64], Granularity::Block(64), "partial block")
}

#[test]
fn zero_groups_get_descale_one_and_zero_data() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_zero_group");
    // Head 1 all zeros.
    let x = input(&mut rng, &[1, 10, 2, 16], DType::F16, false)?;
    let x = x.broadcast_mul(
        &Tensor::new(&[1f32, 0.], &CPU)?
            .to_dtype(DType::F16)?
            .reshape((1, 1, 2, 1))?,
    )?;
    for granularity in [Granularity::Head, Granularity::Block(4)] {
        let q = fp8::quantize(&x, granularity)?;
        let descale = q.descale.flatten_all()?.to_vec1::<f32>()?;
        let per_head = descale.len() / 2;
        assert!(
            descale[per_head..].iter().all(|&v| v == 1.0),
            "{granularity:?}: {descale:?}"
        );
        assert!(
            descale[..per_head].iter().all(|&v| v != 1.0),
            "{granularity:?}: {descale:?}"
        );
        let head1 = to_f64_vec(&widen(&q.data.narrow(2, 1, 1)?)?)?;
        assert!(head1.iter().all(|&v| v == 0.0));
        check_quantized(&q, &to_f64_vec(&x)?, &[1, 10, 2, 16], granularity, "zero head")?;
    }
    Ok(())
}

#[test]
fn strided_input_quantizes_like_its_contiguous_copy() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_strided");
    // (b, h, s, d) transposed to (b, s, h, d): not contiguous.
    let x = input(&mut rng, &[2, 3, 50, 64], DType::F32, true)?.transpose(1, 2)?;
    assert!(!x.is_contiguous());
    for granularity in GRANULARITIES {
        let got = Quantizer::new(granularity).incoherent(7).quantize(&x)?;
        let want = Quantizer::new(granularity).incoherent(7).quantize(&x.contiguous()?)?;
        assert_identical(&widen(&got.data)?, &widen(&want.data)?, "strided data")?;
        assert_identical(&got.descale, &want.descale, "strided descale")?;
    }
    Ok(())
}

/// The columns of R for head dim `d`: rotating the identity's rows gives R·e_j.
fn rotation_matrix(d: usize, seed: u64) -> Result<Vec<Vec<f64>>> {
    let r = fp8::rotate(&Tensor::eye(d, DType::F32, &CPU)?, seed)?;
    assert_eq!(r.dtype(), DType::F32);
    // row j of the result is column j of R
    let cols = r.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    Ok((0..d).map(|i| (0..d).map(|j| cols[j][i]).collect()).collect())
}

const HEAD_DIMS: [(usize, usize); 8] = [
    (1, 1),
    (2, 2),
    (64, 64),
    (80, 16),
    (96, 32),
    (128, 128),
    (192, 64),
    (256, 256),
];

#[test]
fn rotation_is_signed_blockwise_hadamard() -> Result<()> {
    for (d, b) in HEAD_DIMS {
        for seed in [0u64, 1, 0xDEAD_BEEF] {
            let r = rotation_matrix(d, seed)?;
            let norm = 1.0 / (b as f64).sqrt();
            // The first row of each block gives the signs (H's first row is all +1).
            for (i, row) in r.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    let want = if i / b == j / b {
                        let sign = r[i / b * b][j].signum();
                        let h = if ((i % b) & (j % b)).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        h * sign * norm
                    } else {
                        0.0
                    };
                    assert!(
                        (v - want).abs() <= 1e-6,
                        "d {d} seed {seed}: R[{i}][{j}] = {v}, want {want}"
                    );
                }
            }
            // Orthogonal: R Rᵀ = I.
            for i in 0..d {
                for k in 0..d {
                    let dot: f64 = (0..d).map(|j| r[i][j] * r[k][j]).sum();
                    let want = if i == k { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() <= 1e-5, "d {d}: (R Rᵀ)[{i}][{k}] = {dot}");
                }
            }
        }
        if d >= 16 {
            let s0: Vec<f64> = rotation_matrix(d, 1)?.iter().map(|row| row[0]).collect();
            let s1: Vec<f64> = rotation_matrix(d, 2)?.iter().map(|row| row[0]).collect();
            assert_ne!(s0, s1, "d {d}: another seed draws other signs");
        }
    }
    Ok(())
}

#[test]
fn rotation_preserves_norms_and_dot_products() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_rotation_dots");
    let seed = rng.next_u64();
    for (d, _) in HEAD_DIMS {
        for dtype in [DType::F32, DType::BF16] {
            let q = input(&mut rng, &[2, 33, 3, d], dtype, true)?;
            let k = input(&mut rng, &[2, 33, 3, d], dtype, true)?;
            let (rq, rk) = (fp8::rotate(&q, seed)?, fp8::rotate(&k, seed)?);
            assert_eq!(rq.dims(), q.dims());
            assert_eq!(rq.dtype(), DType::F32);
            let (q, k, rq, rk) = (to_f64_vec(&q)?, to_f64_vec(&k)?, to_f64_vec(&rq)?, to_f64_vec(&rk)?);
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            for row in 0..q.len() / d {
                let at = |v: &[f64]| v[row * d..][..d].to_vec();
                let (q, k, rq, rk) = (at(&q), at(&k), at(&rq), at(&rk));
                let (nq, nrq) = (dot(&q, &q).sqrt(), dot(&rq, &rq).sqrt());
                assert!((nrq - nq).abs() <= 1e-5 * nq, "d {d}: norm {nq} became {nrq}");
                let (s, rs) = (dot(&q, &k), dot(&rq, &rk));
                let scale = nq * dot(&k, &k).sqrt();
                assert!((rs - s).abs() <= 1e-4 * scale, "d {d}: q·k {s} became {rs}");
            }
            if d >= 16 {
                let other = to_f64_vec(&fp8::rotate(
                    &Tensor::from_vec(q.clone(), (q.len() / d, d), &CPU)?.to_dtype(DType::F32)?,
                    seed ^ 1,
                )?)?;
                let diff = other.iter().zip(&rq).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(diff > 1e-2, "d {d}: another seed gives another rotation");
            }
        }
    }
    Ok(())
}

#[test]
fn rotation_spreads_an_outlier() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_outlier_spread");
    for (d, b) in HEAD_DIMS {
        let at = rng.range(0, d - 1);
        let mut v = vec![0f32; d];
        v[at] = -1000.0;
        let r = fp8::rotate(&Tensor::from_vec(v, d, &CPU)?, rng.next_u64())?.to_vec1::<f32>()?;
        let max = r.iter().fold(0f32, |m, x| m.max(x.abs()));
        let want = 1000.0 / (b as f32).sqrt();
        assert!(max <= want * (1.0 + 1e-6), "d {d}: max {max} > {want}");
        let spread = r.iter().filter(|x| x.abs() > want * 0.999).count();
        assert_eq!(spread, b, "d {d}: the outlier covers its whole block");
    }
    // Quantized per tensor, an outlier no longer sets the scale for everything.
    let mut x = input(&mut rng, &[1, 64, 2, 128], DType::F32, false)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    x[1000] = 1000.0;
    let x = Tensor::from_vec(x, (1, 64, 2, 128), &CPU)?;
    let plain = fp8::quantize(&x, Granularity::Tensor)?.descale.to_vec2::<f32>()?[0][0];
    let rotated = Quantizer::new(Granularity::Tensor).incoherent(3).quantize(&x)?;
    let rotated_scale = rotated.descale.to_vec2::<f32>()?[0][0];
    assert!(
        rotated_scale < plain / 4.0,
        "rotated scale {rotated_scale} vs plain {plain}"
    );
    Ok(())
}

#[test]
fn incoherent_quantization_is_quantization_of_the_rotation() -> Result<()> {
    let mut rng = TestRng::fresh("fp8_incoherent");
    let seed = rng.next_u64();
    let dims = [2, 70, 2, 192];
    let q = input(&mut rng, &dims, DType::BF16, true)?;
    let k = input(&mut rng, &dims, DType::BF16, true)?;
    for granularity in GRANULARITIES {
        let quantizer = Quantizer::new(granularity).incoherent(seed);
        let (qq, qk) = (quantizer.quantize(&q)?, quantizer.quantize(&k)?);
        let rq = fp8::rotate(&q, seed)?;
        let want = fp8::quantize(&rq, granularity)?;
        assert_identical(&widen(&qq.data)?, &widen(&want.data)?, "incoherent data")?;
        assert_identical(&qq.descale, &want.descale, "incoherent descale")?;
        check_quantized(
            &qq,
            &to_f64_vec(&rq)?,
            &dims,
            granularity,
            &format!("incoherent {granularity:?}"),
        )?;

        // Scores of the dequantized rotated inputs stay close to the exact q·kᵀ of each head: two
        // factors with e4m3's ~2.7% RMS relative rounding give ~3.7% RMS; 5% leaves room, not bugs.
        let (dq, dk) = (fp8::dequantize(&qq)?, fp8::dequantize(&qk)?);
        let scores = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
            let (a, b) = (
                a.to_dtype(DType::F32)?.transpose(1, 2)?,
                b.to_dtype(DType::F32)?.transpose(1, 2)?,
            );
            a.contiguous()?.matmul(&b.contiguous()?.t()?)
        };
        let (got, want) = (to_f64_vec(&scores(&dq, &dk)?)?, to_f64_vec(&scores(&q, &k)?)?);
        let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt();
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w) * (g - w))
            .sum::<f64>()
            .sqrt();
        assert!(err <= 0.05 * norm, "{granularity:?}: scores error {err} of norm {norm}");
    }
    Ok(())
}

#[test]
fn bad_inputs_are_rejected() -> Result<()> {
    let prefix = "flash-attn3: fp8 quantize: ";
    let ok = Tensor::ones((1, 4, 2, 8), DType::F32, &CPU)?;
    for dtype in [DType::F64, DType::U32, DType::U8] {
        assert_err(
            fp8::quantize(&ok.to_dtype(dtype)?, Granularity::Head),
            &[prefix, "dtype"],
        );
    }
    let already = fp8::quantize(&ok, Granularity::Head)?.data;
    assert_err(fp8::quantize(&already, Granularity::Head), &[prefix, "dtype", "F8E4M3"]);
    for dims in [vec![8], vec![4, 8], vec![1, 1, 4, 2, 8]] {
        let x = Tensor::ones(dims, DType::F32, &CPU)?;
        assert_err(fp8::quantize(&x, Granularity::Tensor), &[prefix, "shape"]);
    }
    for dims in [vec![0, 4, 2, 8], vec![1, 0, 2, 8], vec![1, 4, 2, 0], vec![0, 2, 8]] {
        let x = Tensor::ones(dims, DType::F32, &CPU)?;
        assert_err(fp8::quantize(&x, Granularity::Head), &[prefix, "empty"]);
    }
    assert_err(fp8::quantize(&ok, Granularity::Block(0)), &[prefix, "Block(0)"]);
    let varlen = Tensor::ones((5, 2, 8), DType::F32, &CPU)?;
    assert_err(
        fp8::quantize(&varlen, Granularity::Block(64)),
        &[
            prefix,
            "per-block scales need fixed-length (batch, seqlen, heads, head_dim) input",
        ],
    );
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let x = ok.slice_assign(&[0..1, 2..3, 1..2, 5..6], &Tensor::full(bad, (1, 1, 1, 1), &CPU)?)?;
        let what = "flash-attn3: fp8 quantize: input has non-finite values";
        assert_err(fp8::quantize(&x, Granularity::Tensor), &[what]);
        assert_err(Quantizer::new(Granularity::Head).incoherent(1).quantize(&x), &[what]);
    }
    assert_err(
        fp8::rotate(&ok.to_dtype(DType::F64)?, 0),
        &["flash-attn3: fp8 rotate: ", "dtype"],
    );
    // A descale that does not fit the data.
    let mut q = fp8::quantize(&ok, Granularity::Block(2))?;
    q.granularity = Granularity::Block(4);
    assert_err(
        fp8::dequantize(&q),
        &["flash-attn3: fp8 dequantize: ", "descale has shape"],
    );
    Ok(())
}
