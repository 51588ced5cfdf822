//! The CPU forward against the f64 reference (tests/reference.rs): every option, odd shapes,
//! GQA, varlen with empty sequences, half precision, non-contiguous inputs, the drop-in
//! functions and the builder's equivalences.
//!
//! Tolerances (relative to the largest reference value, see `assert_close`): f32 1e-5;
//! f16/bf16 outputs 1e-2 against the reference of the same rounded inputs, their f32 LSE 1e-4.

use candle_core::{DType, Device, Result, Tensor};
use flash_attn3::{flash_attn, flash_attn_varlen, flash_attn_varlen_windowed, flash_attn_windowed, FlashAttn};
use flash_attn3_tests::{
    assert_close, assert_identical, attention_ref, attention_ref_varlen, cumulative, max_len, naive_attention,
    seqlens_tensor, to_f64_vec, AttnShape, Opts, RefOptions, TestRng,
};

const CPU: Device = Device::Cpu;
const F32_TOL: f64 = 1e-5;
const HALF_TOL: f64 = 1e-2;
const HALF_LSE_TOL: f64 = 1e-4;

fn tolerances(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (F32_TOL, F32_TOL),
        _ => (HALF_TOL, HALF_LSE_TOL),
    }
}

/// Runs the builder's forward_with_lse on (q, k, v) and compares out and LSE with the reference.
fn check_qkv(q: &Tensor, k: &Tensor, v: &Tensor, opts: Opts, what: &str) -> Result<(Tensor, Tensor)> {
    let (out, lse) = opts.builder().forward_with_lse(q, k, v)?;
    let (b, sq, h, _) = q.dims4()?;
    assert_eq!(out.dims(), &[b, sq, h, v.dim(3)?], "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    assert_eq!(lse.dims(), &[b, h, sq], "{what}: LSE shape");
    assert_eq!(lse.dtype(), DType::F32, "{what}: LSE dtype");
    let (want_out, want_lse) = attention_ref(q, k, v, &opts.reference())?;
    let (tol, lse_tol) = tolerances(q.dtype());
    assert_close(&out, &want_out, tol, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, lse_tol, &format!("{what}: lse"))?;
    Ok((out, lse))
}

/// Random q, k, v of `shape` in `dtype`, checked against the reference.
fn check(rng: &mut TestRng, shape: AttnShape, dtype: DType, opts: Opts, what: &str) -> Result<()> {
    let (q, k, v) = shape.random_qkv(rng, dtype, &CPU)?;
    check_qkv(&q, &k, &v, opts, &format!("{what} {shape:?} {dtype:?} {opts:?}")).map(|_| ())
}

/// Shapes covering head dims 32..256 (head_dim_v != head_dim in some), GQA 1/2/4/8, batch > 1,
/// sq > sk and sq < sk, and seqlens over 256 (several 64-row query blocks and 256-key blocks).
/// Seqlens are drawn odd (not multiples of 64) from the given ranges.
fn structural_shapes(rng: &mut TestRng) -> Vec<AttnShape> {
    let mut len = |lo, hi| rng.odd_len(lo, hi);
    vec![
        AttnShape::new((2, len(257, 450), len(257, 450), 2, 2, 32, 32)),
        AttnShape::new((1, len(300, 700), len(20, 200), 4, 2, 64, 64)),
        AttnShape::new((3, len(1, 63), len(300, 700), 2, 1, 80, 80)),
        AttnShape::new((1, len(65, 200), len(65, 300), 8, 1, 96, 64)),
        AttnShape::new((2, len(129, 255), len(257, 400), 4, 1, 128, 128)),
        AttnShape::new((1, len(257, 400), len(257, 400), 2, 1, 192, 128)),
        AttnShape::new((1, len(257, 350), len(257, 350), 2, 2, 256, 256)),
        AttnShape::new((2, len(1, 100), len(1, 100), 4, 4, 64, 256)),
        AttnShape::new((1, len(100, 300), len(100, 300), 6, 3, 128, 32)),
    ]
}

#[test]
fn f32_plain_matches_reference_on_odd_shapes() -> Result<()> {
    let mut rng = TestRng::fresh("f32_plain");
    for shape in structural_shapes(&mut rng) {
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()), "plain")?;
    }
    Ok(())
}

/// Random options: none, causal, a two-sided window, a left or a right window; a softcap half
/// of the time.
fn random_opts(rng: &mut TestRng, scale: f64) -> Opts {
    let mut opts = Opts::new(scale);
    match rng.range(0, 4) {
        0 => {}
        1 => opts = opts.causal(),
        2 => opts = opts.window(Some(rng.range(0, 300)), Some(rng.range(0, 300))),
        3 => opts = opts.window(Some(rng.range(0, 300)), None),
        _ => opts = opts.window(None, Some(rng.range(0, 300))),
    }
    if rng.coin() {
        opts = opts.softcap(rng.pick(&[1.0, 5.0, 30.0]));
    }
    opts
}

/// Random shapes (odd seqlens up to 700, head dims 32..256, GQA 1/2/4/8, batch 1..3) with
/// random options, `cases` of them whose reference costs at most `budget` multiply-adds.
fn random_cases(rng: &mut TestRng, dtype: DType, cases: usize, budget: usize) -> Result<()> {
    let mut done = 0;
    while done < cases {
        let shape = AttnShape::random(rng, (1, 700), &[32, 64, 80, 96, 128, 192, 256], &[1, 2, 4, 8]);
        if shape.cost() > budget {
            continue;
        }
        let opts = random_opts(rng, shape.scale());
        check(rng, shape, dtype, opts, "random")?;
        done += 1;
    }
    Ok(())
}

#[test]
fn f32_random_shapes_and_options_match_reference() -> Result<()> {
    random_cases(&mut TestRng::fresh("f32_random"), DType::F32, 30, 150_000_000)
}

#[test]
fn half_random_shapes_and_options_match_reference() -> Result<()> {
    let mut rng = TestRng::fresh("half_random");
    random_cases(&mut rng, DType::F16, 8, 100_000_000)?;
    random_cases(&mut rng, DType::BF16, 8, 100_000_000)
}

#[test]
fn f32_causal_matches_reference() -> Result<()> {
    let mut rng = TestRng::fresh("f32_causal");
    for shape in structural_shapes(&mut rng) {
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()).causal(), "causal")?;
    }
    // Equal lengths, and one query against many keys (decoding).
    let sq = rng.odd_len(257, 500);
    check(
        &mut rng,
        AttnShape::new((2, sq, sq, 2, 1, 64, 64)),
        DType::F32,
        Opts::new(0.125).causal(),
        "causal sq=sk",
    )?;
    let sk = rng.odd_len(600, 1100);
    check(
        &mut rng,
        AttnShape::new((3, 1, sk, 4, 2, 128, 128)),
        DType::F32,
        Opts::new(0.09).causal(),
        "decode",
    )?;
    check(
        &mut rng,
        AttnShape::new((2, 77, 1, 2, 1, 64, 64)),
        DType::F32,
        Opts::new(0.1).causal(),
        "sk=1",
    )?;
    Ok(())
}

/// Causal with sq > sk: the first sq - sk rows see no key, so their output is exactly 0 and
/// their LSE exactly -inf; the other rows are finite.
#[test]
fn rows_that_see_no_key_give_zero_and_neg_inf_lse() -> Result<()> {
    let mut rng = TestRng::fresh("empty_rows");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (sq, sk) = (rng.odd_len(200, 400), rng.odd_len(20, 150));
        let shape = AttnShape::new((2, sq, sk, 4, 2, 64, 32));
        for (opts, empty) in [
            (Opts::new(0.125).causal(), sq - sk),
            // A right window of 5: query i sees up to key i + sk - sq + 5.
            (Opts::new(0.125).window(None, Some(5)), sq - sk - 5),
            (Opts::new(0.125).window(Some(3), Some(5)).softcap(2.0), sq - sk - 5),
        ] {
            let (q, k, v) = shape.random_qkv(&mut rng, dtype, &CPU)?;
            let (out, lse) = check_qkv(&q, &k, &v, opts, &format!("empty rows {dtype:?} {opts:?}"))?;
            let out = to_f64_vec(&out.narrow(1, 0, empty)?)?;
            assert!(
                out.iter().all(|&x| x == 0.0),
                "{dtype:?} {opts:?}: rows that see no key must be 0"
            );
            let lse_empty = to_f64_vec(&lse.narrow(2, 0, empty)?)?;
            assert!(
                lse_empty.iter().all(|&x| x == f64::NEG_INFINITY),
                "{dtype:?} {opts:?}: their LSE must be -inf"
            );
            let lse_rest = to_f64_vec(&lse.narrow(2, empty, sq - empty)?)?;
            assert!(
                lse_rest.iter().all(|x| x.is_finite()),
                "{dtype:?} {opts:?}: the other rows must be finite"
            );
        }
    }
    Ok(())
}

#[test]
fn f32_windows_match_reference() -> Result<()> {
    let mut rng = TestRng::fresh("f32_windows");
    let shapes = [
        AttnShape::new((2, rng.odd_len(257, 450), rng.odd_len(257, 450), 2, 1, 64, 64)),
        AttnShape::new((1, rng.odd_len(300, 600), rng.odd_len(30, 250), 2, 2, 96, 64)),
        AttnShape::new((1, rng.odd_len(30, 250), rng.odd_len(300, 700), 4, 2, 32, 80)),
    ];
    for shape in shapes {
        let (l, r) = (rng.range(0, 200), rng.range(0, 200));
        let big = 100_000;
        for opts in [
            Opts::new(shape.scale()).window(Some(l), None),
            Opts::new(shape.scale()).window(None, Some(r)),
            Opts::new(shape.scale()).window(Some(l), Some(r)),
            Opts::new(shape.scale()).window(Some(0), Some(0)),
            Opts::new(shape.scale()).window(Some(l), Some(0)),
            Opts::new(shape.scale()).window(Some(big), Some(big)),
            Opts::new(shape.scale()).window(None, None),
        ] {
            check(&mut rng, shape, DType::F32, opts, "window")?;
        }
        // Causal combined with a window through the builder caps the right side at 0.
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
        let scale = shape.scale() as f32;
        let want = attention_ref(&q, &k, &v, &RefOptions::new(scale as f64).window(Some(l), Some(0)))?;
        for (name, fa) in [
            (
                "causal then window",
                FlashAttn::new(scale).causal(true).window(Some(l), Some(r + 1)),
            ),
            (
                "window then causal",
                FlashAttn::new(scale).window(Some(l), Some(r + 1)).causal(true),
            ),
            (
                "causal then left window",
                FlashAttn::new(scale).causal(true).window(Some(l), None),
            ),
        ] {
            let (out, lse) = fa.forward_with_lse(&q, &k, &v)?;
            assert_close(&out, &want.0, F32_TOL, &format!("{name} {shape:?} l={l}: out"))?;
            assert_close(&lse, &want.1, F32_TOL, &format!("{name} {shape:?} l={l}: lse"))?;
        }
    }
    Ok(())
}

#[test]
fn f32_softcap_matches_reference() -> Result<()> {
    let mut rng = TestRng::fresh("f32_softcap");
    let shapes = [
        AttnShape::new((2, rng.odd_len(100, 300), rng.odd_len(257, 500), 4, 2, 64, 64)),
        AttnShape::new((1, rng.odd_len(257, 400), rng.odd_len(20, 200), 8, 2, 128, 96)),
    ];
    for shape in shapes {
        // A scale of 3/sqrt(d) gives scores of a few units, so the cap bends them.
        let base = Opts::new(3.0 * shape.scale());
        for opts in [
            base.softcap(1.0),
            base.softcap(5.0),
            base.softcap(50.0),
            base.softcap(0.3).causal(),
            base.softcap(2.0)
                .window(Some(rng.range(0, 150)), Some(rng.range(0, 150))),
            base.softcap(2.0).window(Some(rng.range(0, 150)), Some(0)),
        ] {
            check(&mut rng, shape, DType::F32, opts, "softcap")?;
        }
    }
    Ok(())
}

/// Scores of tens of units: the softmax must subtract the row maximum. The error of an f32
/// score grows with its magnitude, hence the looser tolerance.
#[test]
fn f32_large_scores_are_stable() -> Result<()> {
    let mut rng = TestRng::fresh("f32_large_scores");
    let shape = AttnShape::new((1, rng.odd_len(100, 300), rng.odd_len(257, 400), 2, 1, 64, 64));
    let q = rng.randn_scaled(shape.q_shape(), 4.0, DType::F32, &CPU)?;
    let k = rng.randn_scaled(shape.k_shape(), 4.0, DType::F32, &CPU)?;
    let v = rng.randn(shape.v_shape(), DType::F32, &CPU)?;
    for opts in [Opts::new(0.5), Opts::new(0.5).causal(), Opts::new(0.5).softcap(20.0)] {
        let (out, lse) = opts.builder().forward_with_lse(&q, &k, &v)?;
        let (want_out, want_lse) = attention_ref(&q, &k, &v, &opts.reference())?;
        assert_close(&out, &want_out, 1e-4, &format!("large scores {opts:?}: out"))?;
        assert_close(&lse, &want_lse, F32_TOL, &format!("large scores {opts:?}: lse"))?;
    }
    Ok(())
}

/// A zero scale (uniform attention over the visible keys) and a negative one are valid.
#[test]
fn f32_zero_and_negative_scales() -> Result<()> {
    let mut rng = TestRng::fresh("f32_scales");
    let shape = AttnShape::new((2, rng.odd_len(30, 200), rng.odd_len(257, 400), 4, 2, 64, 64));
    for opts in [
        Opts::new(0.0),
        Opts::new(0.0).causal(),
        Opts::new(-0.2),
        Opts::new(-0.6).softcap(2.0).window(Some(30), Some(30)),
    ] {
        check(&mut rng, shape, DType::F32, opts, "scale")?;
    }
    Ok(())
}

/// Head dims outside the usual list (1..=256 is supported): tiny and odd sizes.
#[test]
fn f32_small_and_odd_head_dims() -> Result<()> {
    let mut rng = TestRng::fresh("f32_odd_head_dims");
    for (d, dv) in [
        (1, 1),
        (2, 7),
        (3, 3),
        (8, 1),
        (17, 33),
        (33, 17),
        (255, 100),
        (100, 255),
    ] {
        let shape = AttnShape::new((2, rng.odd_len(1, 150), rng.odd_len(1, 300), 2, 1, d, dv));
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()), "odd head dim")?;
        check(
            &mut rng,
            shape,
            DType::F32,
            Opts::new(shape.scale()).causal().softcap(3.0),
            "odd head dim",
        )?;
    }
    Ok(())
}

#[test]
fn half_precision_matches_reference_of_the_rounded_inputs() -> Result<()> {
    let mut rng = TestRng::fresh("half");
    for dtype in [DType::F16, DType::BF16] {
        let shapes = [
            AttnShape::new((2, rng.odd_len(257, 400), rng.odd_len(257, 400), 4, 1, 64, 64)),
            AttnShape::new((1, rng.odd_len(300, 500), rng.odd_len(20, 200), 2, 2, 128, 80)),
            AttnShape::new((2, rng.odd_len(1, 120), rng.odd_len(257, 600), 8, 2, 256, 192)),
        ];
        for shape in shapes {
            let base = Opts::new(shape.scale());
            for opts in [
                base,
                base.causal(),
                base.window(Some(rng.range(0, 100)), Some(rng.range(0, 100))),
                Opts::new(3.0 * shape.scale()).softcap(2.0).causal(),
            ] {
                check(&mut rng, shape, dtype, opts, "half")?;
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Varlen
// ------------------------------------------------------------------------------------------

/// Random packed q, k, v for the given sequence lengths.
fn random_varlen(
    rng: &mut TestRng,
    lens_q: &[usize],
    lens_k: &[usize],
    (heads, kv_heads, d, dv): (usize, usize, usize, usize),
    dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    Ok((
        rng.randn((tq, heads, d), dtype, &CPU)?,
        rng.randn((tk, kv_heads, d), dtype, &CPU)?,
        rng.randn((tk, kv_heads, dv), dtype, &CPU)?,
    ))
}

/// Runs the varlen builder (with the exact maxima and with larger declared ones) and
/// compares with the reference; returns (out, lse).
#[allow(clippy::too_many_arguments)]
fn check_varlen_qkv(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    opts: Opts,
    what: &str,
) -> Result<(Tensor, Tensor)> {
    let (sq, sk) = (seqlens_tensor(cu_q, &CPU)?, seqlens_tensor(cu_k, &CPU)?);
    let (mq, mk) = (max_len(cu_q), max_len(cu_k));
    let (out, lse) = opts.builder().forward_varlen_with_lse(q, k, v, &sq, &sk, mq, mk)?;
    let (tq, h, _) = q.dims3()?;
    assert_eq!(out.dims(), &[tq, h, v.dim(2)?], "{what}: output shape");
    assert_eq!(out.dtype(), q.dtype(), "{what}: output dtype");
    assert_eq!(lse.dims(), &[h, tq], "{what}: LSE shape");
    assert_eq!(lse.dtype(), DType::F32, "{what}: LSE dtype");
    let (want_out, want_lse) = attention_ref_varlen(q, k, v, cu_q, cu_k, &opts.reference())?;
    let (tol, lse_tol) = tolerances(q.dtype());
    assert_close(&out, &want_out, tol, &format!("{what}: out"))?;
    assert_close(&lse, &want_lse, lse_tol, &format!("{what}: lse"))?;
    // Larger declared maxima change nothing.
    let (out2, lse2) = opts
        .builder()
        .forward_varlen_with_lse(q, k, v, &sq, &sk, mq + 13, mk + 100)?;
    assert_identical(&out2, &out, &format!("{what}: out with larger max_seqlen"))?;
    assert_identical(&lse2, &lse, &format!("{what}: lse with larger max_seqlen"))?;
    Ok((out, lse))
}

/// Sequence lengths with an empty q side, an empty k side, both empty, sq > sk (causal rows that
/// see nothing), sq < sk and lengths over 256.
fn varlen_lengths(rng: &mut TestRng) -> (Vec<usize>, Vec<usize>) {
    let lens_q = vec![
        rng.odd_len(1, 60),
        0,
        rng.odd_len(257, 400),
        0,
        rng.odd_len(100, 200),
        rng.odd_len(1, 40),
        0,
    ];
    let lens_k = vec![
        0,
        rng.odd_len(1, 60),
        rng.odd_len(257, 500),
        0,
        rng.odd_len(20, 90),
        rng.odd_len(257, 300),
        0,
    ];
    (lens_q, lens_k)
}

#[test]
fn varlen_with_empty_sequences_matches_reference() -> Result<()> {
    let mut rng = TestRng::fresh("varlen");
    for (heads, kv_heads, d, dv) in [(2, 2, 64, 64), (4, 2, 128, 96), (8, 1, 32, 32)] {
        let (lens_q, lens_k) = varlen_lengths(&mut rng);
        let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
        let scale = 1.0 / (d as f64).sqrt();
        for opts in [
            Opts::new(scale),
            Opts::new(scale).causal(),
            Opts::new(scale).window(Some(rng.range(0, 100)), Some(rng.range(0, 100))),
            Opts::new(scale).window(None, Some(rng.range(0, 30))),
            Opts::new(3.0 * scale).softcap(2.0).causal(),
        ] {
            let (q, k, v) = random_varlen(&mut rng, &lens_q, &lens_k, (heads, kv_heads, d, dv), DType::F32)?;
            let what = format!("varlen q {lens_q:?} k {lens_k:?} h {heads}/{kv_heads} d {d}/{dv} {opts:?}");
            let (out, lse) = check_varlen_qkv(&q, &k, &v, &cu_q, &cu_k, opts, &what)?;
            // Sequence 0 has queries but no keys: zero output, -inf LSE.
            let rows = lens_q[0];
            assert!(
                to_f64_vec(&out.narrow(0, 0, rows)?)?.iter().all(|&x| x == 0.0),
                "{what}: keyless rows must be 0"
            );
            assert!(
                to_f64_vec(&lse.narrow(1, 0, rows)?)?
                    .iter()
                    .all(|&x| x == f64::NEG_INFINITY),
                "{what}: keyless rows must have LSE -inf"
            );
        }
    }
    Ok(())
}

#[test]
fn varlen_half_precision_matches_reference() -> Result<()> {
    let mut rng = TestRng::fresh("varlen_half");
    for dtype in [DType::F16, DType::BF16] {
        let (lens_q, lens_k) = varlen_lengths(&mut rng);
        let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
        for opts in [
            Opts::new(0.125).causal(),
            Opts::new(0.3).softcap(1.5).window(Some(40), Some(7)),
        ] {
            let (q, k, v) = random_varlen(&mut rng, &lens_q, &lens_k, (4, 2, 64, 64), dtype)?;
            check_varlen_qkv(&q, &k, &v, &cu_q, &cu_k, opts, &format!("varlen {dtype:?} {opts:?}"))?;
        }
    }
    Ok(())
}

/// Each sequence of a varlen call equals a fixed-length call on that sequence alone.
#[test]
fn varlen_equals_per_sequence_fixed_calls() -> Result<()> {
    let mut rng = TestRng::fresh("varlen_vs_fixed");
    let lens_q = [rng.odd_len(1, 100), rng.odd_len(257, 350), rng.odd_len(30, 90), 1];
    let lens_k = [
        rng.odd_len(100, 300),
        rng.odd_len(257, 350),
        rng.odd_len(5, 40),
        rng.odd_len(1, 50),
    ];
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (q, k, v) = random_varlen(&mut rng, &lens_q, &lens_k, (4, 1, 64, 32), DType::F32)?;
    for fa in [
        FlashAttn::new(0.125),
        FlashAttn::new(0.125).causal(true),
        FlashAttn::new(0.2).window(Some(20), Some(3)).softcap(4.0),
    ] {
        let (sq, sk) = (seqlens_tensor(&cu_q, &CPU)?, seqlens_tensor(&cu_k, &CPU)?);
        let (out, lse) = fa.forward_varlen_with_lse(&q, &k, &v, &sq, &sk, max_len(&cu_q), max_len(&cu_k))?;
        for b in 0..lens_q.len() {
            let qs = q.narrow(0, cu_q[b], lens_q[b])?.unsqueeze(0)?;
            let ks = k.narrow(0, cu_k[b], lens_k[b])?.unsqueeze(0)?;
            let vs = v.narrow(0, cu_k[b], lens_k[b])?.unsqueeze(0)?;
            let (o1, l1) = fa.forward_with_lse(&qs, &ks, &vs)?;
            let what = format!("{fa:?} sequence {b}");
            assert_close(
                &out.narrow(0, cu_q[b], lens_q[b])?,
                &o1.squeeze(0)?,
                1e-6,
                &format!("{what}: out"),
            )?;
            assert_close(
                &lse.narrow(1, cu_q[b], lens_q[b])?,
                &l1.squeeze(0)?,
                1e-6,
                &format!("{what}: lse"),
            )?;
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Layouts
// ------------------------------------------------------------------------------------------

/// q from a transposed (b, h, s, d) tensor, k narrowed out of a longer sequence, v narrowed on its
/// last dimension (strided rows), a kv head broadcast with stride 0: same result as contiguous
/// copies, and as the reference.
#[test]
fn non_contiguous_inputs_give_the_same_result() -> Result<()> {
    let mut rng = TestRng::fresh("non_contiguous");
    for dtype in [DType::F32, DType::BF16] {
        let (b, sq, sk, h, hk, d, dv) = (2, rng.odd_len(65, 300), rng.odd_len(257, 400), 4, 2, 64, 48);
        let q = rng.randn((b, h, sq, d), dtype, &CPU)?.transpose(1, 2)?;
        let k = rng.randn((b, sk + 20, hk, d), dtype, &CPU)?.narrow(1, 7, sk)?;
        let v = rng.randn((b, sk, hk, dv + 9), dtype, &CPU)?.narrow(3, 5, dv)?;
        assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
        let (qc, kc, vc) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let shape = format!("{dtype:?} b{b} sq{sq} sk{sk} h{h}/{hk} d{d}/{dv}");
        for opts in [
            Opts::new(0.125),
            Opts::new(0.125).causal(),
            Opts::new(0.3).softcap(2.0).window(Some(50), Some(10)),
        ] {
            let (out, lse) = check_qkv(&q, &k, &v, opts, &format!("non-contiguous {shape} {opts:?}"))?;
            let (out_c, lse_c) = opts.builder().forward_with_lse(&qc, &kc, &vc)?;
            assert_close(
                &out,
                &out_c,
                1e-6,
                &format!("non-contiguous vs contiguous {shape} {opts:?}: out"),
            )?;
            assert_close(
                &lse,
                &lse_c,
                1e-6,
                &format!("non-contiguous vs contiguous {shape} {opts:?}: lse"),
            )?;
        }
        // One kv head broadcast to two (head stride 0) and a batch broadcast (batch stride 0).
        let k1 = rng.randn((1, sk, 1, d), dtype, &CPU)?;
        let v1 = rng.randn((1, sk, 1, dv), dtype, &CPU)?;
        let (kb, vb) = (k1.broadcast_as((b, sk, hk, d))?, v1.broadcast_as((b, sk, hk, dv))?);
        let opts = Opts::new(0.125).causal();
        let (out, _) = check_qkv(&qc, &kb, &vb, opts, &format!("broadcast k/v {shape}"))?;
        let (out_c, _) = opts
            .builder()
            .forward_with_lse(&qc, &kb.contiguous()?, &vb.contiguous()?)?;
        assert_close(&out, &out_c, 1e-6, &format!("broadcast vs contiguous {shape}"))?;
    }
    Ok(())
}

#[test]
fn non_contiguous_varlen_inputs_give_the_same_result() -> Result<()> {
    let mut rng = TestRng::fresh("non_contiguous_varlen");
    let (lens_q, lens_k) = varlen_lengths(&mut rng);
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (tq, tk, h, hk, d) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1], 4, 2, 32);
    let q = rng.randn((tq + 11, h, d), DType::F32, &CPU)?.narrow(0, 3, tq)?;
    let k = rng.randn((hk, tk, d), DType::F32, &CPU)?.transpose(0, 1)?;
    let v = rng.randn((tk, hk, d + 3), DType::F32, &CPU)?.narrow(2, 1, d)?;
    let opts = Opts::new(0.2).causal();
    let (out, lse) = check_varlen_qkv(&q, &k, &v, &cu_q, &cu_k, opts, "non-contiguous varlen")?;
    let (sq, sk) = (seqlens_tensor(&cu_q, &CPU)?, seqlens_tensor(&cu_k, &CPU)?);
    let (out_c, lse_c) = opts.builder().forward_varlen_with_lse(
        &q.contiguous()?,
        &k.contiguous()?,
        &v.contiguous()?,
        &sq,
        &sk,
        max_len(&cu_q),
        max_len(&cu_k),
    )?;
    assert_close(&out, &out_c, 1e-6, "non-contiguous vs contiguous varlen: out")?;
    assert_close(&lse, &lse_c, 1e-6, "non-contiguous vs contiguous varlen: lse")
}

// ------------------------------------------------------------------------------------------
// The API surface
// ------------------------------------------------------------------------------------------

#[test]
fn drop_in_functions_equal_the_builder() -> Result<()> {
    let mut rng = TestRng::fresh("drop_in");
    let shape = AttnShape::new((2, rng.odd_len(65, 300), rng.odd_len(65, 300), 4, 2, 64, 64));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let s = shape.scale() as f32;
    for causal in [false, true] {
        let out = flash_attn(&q, &k, &v, s, causal)?;
        assert_identical(
            &out,
            &FlashAttn::new(s).causal(causal).forward(&q, &k, &v)?,
            "flash_attn",
        )?;
        let want = attention_ref(&q, &k, &v, &RefOptions::new(s as f64).causal(causal))?.0;
        assert_close(
            &out,
            &want,
            F32_TOL,
            &format!("flash_attn causal={causal} vs reference"),
        )?;
    }
    for (l, r) in [(None, None), (Some(13), None), (None, Some(9)), (Some(40), Some(2))] {
        let out = flash_attn_windowed(&q, &k, &v, s, l, r)?;
        assert_identical(
            &out,
            &FlashAttn::new(s).window(l, r).forward(&q, &k, &v)?,
            "flash_attn_windowed",
        )?;
        let want = attention_ref(&q, &k, &v, &RefOptions::new(s as f64).window(l, r))?.0;
        assert_close(
            &out,
            &want,
            F32_TOL,
            &format!("flash_attn_windowed {l:?} {r:?} vs reference"),
        )?;
    }
    // forward is forward_with_lse's output.
    let fa = FlashAttn::new(s).causal(true).softcap(7.0);
    assert_identical(
        &fa.forward(&q, &k, &v)?,
        &fa.forward_with_lse(&q, &k, &v)?.0,
        "forward vs forward_with_lse",
    )?;

    let (lens_q, lens_k) = varlen_lengths(&mut rng);
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (q, k, v) = random_varlen(&mut rng, &lens_q, &lens_k, (4, 2, 64, 64), DType::F32)?;
    let (sq, sk, mq, mk) = (
        seqlens_tensor(&cu_q, &CPU)?,
        seqlens_tensor(&cu_k, &CPU)?,
        max_len(&cu_q),
        max_len(&cu_k),
    );
    for causal in [false, true] {
        let out = flash_attn_varlen(&q, &k, &v, &sq, &sk, mq, mk, s, causal)?;
        let builder = FlashAttn::new(s).causal(causal);
        assert_identical(
            &out,
            &builder.forward_varlen(&q, &k, &v, &sq, &sk, mq, mk)?,
            "flash_attn_varlen",
        )?;
        assert_identical(
            &out,
            &builder.forward_varlen_with_lse(&q, &k, &v, &sq, &sk, mq, mk)?.0,
            "flash_attn_varlen vs forward_varlen_with_lse",
        )?;
        let want = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &RefOptions::new(s as f64).causal(causal))?.0;
        assert_close(
            &out,
            &want,
            F32_TOL,
            &format!("flash_attn_varlen causal={causal} vs reference"),
        )?;
    }
    for (l, r) in [(None, None), (Some(13), None), (None, Some(9)), (Some(40), Some(2))] {
        let out = flash_attn_varlen_windowed(&q, &k, &v, &sq, &sk, mq, mk, s, l, r)?;
        let builder = FlashAttn::new(s).window(l, r);
        assert_identical(
            &out,
            &builder.forward_varlen(&q, &k, &v, &sq, &sk, mq, mk)?,
            "flash_attn_varlen_windowed",
        )?;
        let want = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &RefOptions::new(s as f64).window(l, r))?.0;
        assert_close(
            &out,
            &want,
            F32_TOL,
            &format!("flash_attn_varlen_windowed {l:?} {r:?} vs reference"),
        )?;
    }
    Ok(())
}

#[test]
fn builder_equivalences() -> Result<()> {
    let mut rng = TestRng::fresh("builder_equivalences");
    let shape = AttnShape::new((2, rng.odd_len(65, 300), rng.odd_len(65, 300), 4, 4, 32, 32));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let s = 0.17f32;
    let l = rng.range(0, 60);
    // As values.
    assert_eq!(FlashAttn::new(s).causal(true), FlashAttn::new(s).window(None, Some(0)));
    assert_eq!(FlashAttn::new(s).causal(false), FlashAttn::new(s));
    // Each setter replaces only its own value.
    assert_eq!(FlashAttn::new(s).causal(true).causal(false), FlashAttn::new(s));
    assert_eq!(
        FlashAttn::new(s).window(None, Some(0)).window(None, Some(3)),
        FlashAttn::new(s).window(None, Some(3))
    );
    assert_ne!(FlashAttn::new(s).window(None, Some(3)), FlashAttn::new(s).causal(true));
    assert_eq!(FlashAttn::new(s).window(None, None), FlashAttn::new(s));
    assert_eq!(
        FlashAttn::new(s).causal(true).window(Some(l), Some(9)),
        FlashAttn::new(s).window(Some(l), Some(0))
    );
    assert_eq!(
        FlashAttn::new(s).window(Some(l), Some(9)).causal(true),
        FlashAttn::new(s).window(Some(l), Some(0))
    );
    // As results.
    let run = |fa: FlashAttn| fa.forward_with_lse(&q, &k, &v);
    let causal = run(FlashAttn::new(s).causal(true))?;
    for (name, other) in [
        ("window (None, Some(0))", run(FlashAttn::new(s).window(None, Some(0)))?),
        (
            "flash_attn causal",
            (flash_attn(&q, &k, &v, s, true)?, causal.1.clone()),
        ),
        (
            "flash_attn_windowed (None, Some(0))",
            (flash_attn_windowed(&q, &k, &v, s, None, Some(0))?, causal.1.clone()),
        ),
    ] {
        assert_identical(&other.0, &causal.0, &format!("causal == {name}: out"))?;
        assert_identical(&other.1, &causal.1, &format!("causal == {name}: lse"))?;
    }
    let plain = run(FlashAttn::new(s))?;
    for (name, other) in [
        ("causal(false)", run(FlashAttn::new(s).causal(false))?),
        ("window(None, None)", run(FlashAttn::new(s).window(None, None))?),
        // A GPU performance knob: the CPU path computes the same thing bit for bit.
        ("num_splits(7)", run(FlashAttn::new(s).num_splits(7))?),
        (
            "a window wider than both sequences",
            run(FlashAttn::new(s).window(Some(100_000), Some(100_000)))?,
        ),
    ] {
        assert_identical(&other.0, &plain.0, &format!("plain == {name}: out"))?;
        assert_identical(&other.1, &plain.1, &format!("plain == {name}: lse"))?;
    }
    let left_causal = run(FlashAttn::new(s).window(Some(l), Some(0)))?;
    for (name, other) in [
        (
            "causal then window",
            run(FlashAttn::new(s).causal(true).window(Some(l), Some(9)))?,
        ),
        (
            "window then causal",
            run(FlashAttn::new(s).window(Some(l), Some(9)).causal(true))?,
        ),
    ] {
        assert_identical(&other.0, &left_causal.0, &format!("window (l, 0) == {name}: out"))?;
    }
    // Varlen: causal == window (None, Some(0)).
    let (lens_q, lens_k) = varlen_lengths(&mut rng);
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (q, k, v) = random_varlen(&mut rng, &lens_q, &lens_k, (2, 1, 32, 32), DType::F32)?;
    let (sq, sk, mq, mk) = (
        seqlens_tensor(&cu_q, &CPU)?,
        seqlens_tensor(&cu_k, &CPU)?,
        max_len(&cu_q),
        max_len(&cu_k),
    );
    let a = flash_attn_varlen(&q, &k, &v, &sq, &sk, mq, mk, s, true)?;
    let b = flash_attn_varlen_windowed(&q, &k, &v, &sq, &sk, mq, mk, s, None, Some(0))?;
    assert_identical(&a, &b, "varlen causal == window (None, Some(0))")
}

/// Output dtype = input dtype, LSE f32, for every supported dtype.
#[test]
fn output_dtypes_and_shapes() -> Result<()> {
    let mut rng = TestRng::fresh("dtypes");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (q, k, v) = AttnShape::new((3, 5, 9, 4, 2, 16, 24)).random_qkv(&mut rng, dtype, &CPU)?;
        let (out, lse) = FlashAttn::new(0.25).forward_with_lse(&q, &k, &v)?;
        assert_eq!((out.dtype(), out.dims()), (dtype, &[3, 5, 4, 24][..]));
        assert_eq!((lse.dtype(), lse.dims()), (DType::F32, &[3, 4, 5][..]));
        let out = flash_attn(&q, &k, &v, 0.25, true)?;
        assert_eq!((out.dtype(), out.dims()), (dtype, &[3, 5, 4, 24][..]));
    }
    Ok(())
}

/// Two runs of one call give the same bits (every output row is written by one task).
#[test]
fn forward_is_deterministic() -> Result<()> {
    let mut rng = TestRng::fresh("deterministic");
    let shape = AttnShape::new((2, rng.odd_len(257, 500), rng.odd_len(257, 500), 4, 2, 64, 64));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let fa = FlashAttn::new(0.125).causal(true).softcap(5.0);
    let (a, la) = fa.forward_with_lse(&q, &k, &v)?;
    let (b, lb) = fa.forward_with_lse(&q, &k, &v)?;
    assert_identical(&a, &b, "out")?;
    assert_identical(&la, &lb, "lse")
}

/// The naive candle composite (matmul, softmax_last_dim, matmul) agrees with the op and with
/// the reference.
#[test]
fn matches_naive_candle_composite() -> Result<()> {
    let mut rng = TestRng::fresh("composite");
    let shape = AttnShape::new((2, rng.odd_len(60, 250), rng.odd_len(250, 400), 4, 2, 64, 48));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let scale = shape.scale();
    for causal in [false, true] {
        let naive = naive_attention(&q, &k, &v, scale, causal)?;
        let out = flash_attn(&q, &k, &v, scale as f32, causal)?;
        assert_close(&out, &naive, F32_TOL, &format!("op vs composite causal={causal}"))?;
        let want = attention_ref(&q, &k, &v, &RefOptions::new(scale as f32 as f64).causal(causal))?.0;
        assert_close(
            &naive,
            &want,
            F32_TOL,
            &format!("composite vs reference causal={causal}"),
        )?;
    }
    Ok(())
}

/// The GPU memory pool's calls are no-ops on the CPU, so a program can make them on any device.
#[test]
fn device_memory_pool_calls_do_nothing_on_the_cpu() -> Result<()> {
    flash_attn3::retain_freed_device_memory(&Device::Cpu)?;
    assert_eq!(flash_attn3::device_memory_release_threshold(&Device::Cpu)?, None);
    Ok(())
}
