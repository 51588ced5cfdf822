//! Gradients of the CPU op through candle's autograd (`Var`s, `loss.backward()`), against the
//! analytic f64 gradients of the reference, against central finite differences, and against
//! candle's autograd of the naive composite.
//!
//! The loss is `sum(out ∘ w)` with random weights `w`, so dL/dout = w. Tolerances (relative to
//! the largest reference value of the gradient, floored at the largest of dq, dk, dv: see
//! `check_grads`): f32 1e-5, f16/bf16 2e-2 against the reference of the same rounded inputs,
//! finite differences of the f32 op 2e-3.

use candle_core::{DType, Device, Result, Tensor, Var};
use flash_attn3::FlashAttn;
use flash_attn3_tests::{
    assert_close, assert_identical, attention_grads_ref, attention_grads_ref_varlen, attention_ref,
    attention_ref_varlen, cumulative, max_len, naive_attention, seqlens_tensor, to_f64_vec, AttnShape, Grads, Opts,
    RefOptions, TestRng,
};

const CPU: Device = Device::Cpu;
const F32_TOL: f64 = 1e-5;
const HALF_TOL: f64 = 2e-2;

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => F32_TOL,
        _ => HALF_TOL,
    }
}

/// dq, dk, dv of `sum(f(q, k, v) ∘ w)` through candle's autograd.
fn autograd(
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
) -> Result<Grads> {
    flash_attn3_tests::autograd(f, (q, k, v), w, || Ok(()))
}

/// The shared gradient check with a tolerance, for tests that only need pass / fail.
fn check_grads(got: Grads, want: Grads, tol: f64, what: &str) -> Result<()> {
    flash_attn3_tests::check_grads(&got, &want, tol, what).map(|_| ())
}

/// Random inputs of `shape`, the op's gradients against the reference's.
fn check(rng: &mut TestRng, shape: AttnShape, dtype: DType, opts: Opts, what: &str) -> Result<()> {
    let (q, k, v) = shape.random_qkv(rng, dtype, &CPU)?;
    let w = rng.randn(shape.out_shape(), dtype, &CPU)?;
    let got = autograd(|q, k, v| opts.builder().forward(q, k, v), &q, &k, &v, &w)?;
    for (g, x) in [(&got.0, &q), (&got.1, &k), (&got.2, &v)] {
        assert_eq!(
            (g.dims(), g.dtype()),
            (x.dims(), x.dtype()),
            "{what}: gradient shape/dtype"
        );
    }
    let want = attention_grads_ref(&q, &k, &v, &w, &opts.reference())?;
    check_grads(
        got,
        want,
        tolerance(dtype),
        &format!("{what} {shape:?} {dtype:?} {opts:?}"),
    )
}

/// Odd shapes: GQA 1/2/4, sq > sk and sq < sk, batch > 1, seqlens over 256 on both sides
/// (several 64-query and 256-key blocks in both backward passes), head dims 32..256 with
/// head_dim_v != head_dim in some.
fn shapes(rng: &mut TestRng) -> Vec<AttnShape> {
    vec![
        AttnShape::new((2, rng.odd_len(20, 60), rng.odd_len(20, 60), 2, 2, 32, 32)),
        AttnShape::new((1, rng.odd_len(257, 330), rng.odd_len(60, 120), 4, 2, 64, 48)),
        AttnShape::new((1, rng.odd_len(30, 63), rng.odd_len(513, 600), 4, 1, 64, 64)),
        AttnShape::new((1, rng.odd_len(257, 330), rng.odd_len(257, 330), 2, 1, 128, 96)),
        AttnShape::new((1, rng.odd_len(40, 100), rng.odd_len(257, 300), 2, 1, 256, 192)),
    ]
}

#[test]
fn f32_grads_plain_and_causal() -> Result<()> {
    let mut rng = TestRng::fresh("grads_plain_causal");
    for shape in shapes(&mut rng) {
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()), "plain")?;
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()).causal(), "causal")?;
    }
    Ok(())
}

/// Random shapes (odd seqlens up to 400, head dims 32..256, GQA 1/2/4/8) with random options.
#[test]
fn f32_grads_random_shapes_and_options() -> Result<()> {
    let mut rng = TestRng::fresh("grads_random");
    let mut done = 0;
    while done < 12 {
        let shape = AttnShape::random(&mut rng, (1, 400), &[32, 64, 80, 96, 128, 192, 256], &[1, 2, 4, 8]);
        if shape.cost() > 40_000_000 {
            continue;
        }
        let mut opts = Opts::new(shape.scale());
        match rng.range(0, 4) {
            0 => {}
            1 => opts = opts.causal(),
            2 => opts = opts.window(Some(rng.range(0, 200)), Some(rng.range(0, 200))),
            3 => opts = opts.window(Some(rng.range(0, 200)), None),
            _ => opts = opts.window(None, Some(rng.range(0, 200))),
        }
        if rng.coin() {
            opts = Opts {
                scale: 3.0 * opts.scale,
                ..opts
            }
            .softcap(rng.pick(&[1.0, 5.0, 30.0]));
        }
        check(&mut rng, shape, DType::F32, opts, "random")?;
        done += 1;
    }
    Ok(())
}

#[test]
fn f32_grads_windows() -> Result<()> {
    let mut rng = TestRng::fresh("grads_windows");
    for shape in shapes(&mut rng) {
        let (l, r) = (rng.range(0, 150), rng.range(0, 150));
        for opts in [
            Opts::new(shape.scale()).window(Some(l), Some(r)),
            Opts::new(shape.scale()).window(Some(l), None),
            Opts::new(shape.scale()).window(None, Some(r)),
            Opts::new(shape.scale()).window(Some(l), Some(0)),
        ] {
            check(&mut rng, shape, DType::F32, opts, "window")?;
        }
    }
    Ok(())
}

#[test]
fn f32_grads_softcap() -> Result<()> {
    let mut rng = TestRng::fresh("grads_softcap");
    for shape in shapes(&mut rng) {
        // Scores of a few units, so the cap bends them and the tanh' factor matters.
        let base = Opts::new(3.0 * shape.scale());
        for opts in [
            base.softcap(1.5),
            base.softcap(0.5).causal(),
            base.softcap(4.0).window(Some(rng.range(0, 100)), Some(3)),
        ] {
            check(&mut rng, shape, DType::F32, opts, "softcap")?;
        }
    }
    Ok(())
}

/// dk and dv sum the contributions of every q head of a group.
#[test]
fn f32_grads_gqa() -> Result<()> {
    let mut rng = TestRng::fresh("grads_gqa");
    for (heads, kv_heads) in [(4, 2), (4, 1), (8, 2)] {
        let shape = AttnShape::new((2, rng.odd_len(30, 150), rng.odd_len(30, 300), heads, kv_heads, 64, 64));
        check(&mut rng, shape, DType::F32, Opts::new(shape.scale()), "gqa")?;
        check(
            &mut rng,
            shape,
            DType::F32,
            Opts::new(shape.scale()).causal().softcap(2.0),
            "gqa",
        )?;
    }
    Ok(())
}

#[test]
fn half_precision_grads() -> Result<()> {
    let mut rng = TestRng::fresh("grads_half");
    for dtype in [DType::BF16, DType::F16] {
        for shape in [
            AttnShape::new((2, rng.odd_len(30, 100), rng.odd_len(257, 330), 4, 2, 64, 64)),
            AttnShape::new((1, rng.odd_len(257, 300), rng.odd_len(50, 100), 2, 1, 128, 64)),
        ] {
            check(&mut rng, shape, dtype, Opts::new(shape.scale()), "half")?;
            check(&mut rng, shape, dtype, Opts::new(shape.scale()).causal(), "half")?;
            check(
                &mut rng,
                shape,
                dtype,
                Opts::new(3.0 * shape.scale()).softcap(2.0).window(Some(40), Some(5)),
                "half",
            )?;
        }
    }
    Ok(())
}

#[test]
fn varlen_grads_with_empty_sequences() -> Result<()> {
    let mut rng = TestRng::fresh("grads_varlen");
    // Empty on the q side, on the k side, on both; sq > sk (rows that see nothing); over 256.
    let lens_q = [
        rng.odd_len(1, 40),
        0,
        rng.odd_len(257, 300),
        0,
        rng.odd_len(60, 120),
        rng.odd_len(1, 30),
    ];
    let lens_k = [
        0,
        rng.odd_len(1, 40),
        rng.odd_len(257, 330),
        0,
        rng.odd_len(10, 50),
        rng.odd_len(257, 300),
    ];
    let (cu_q, cu_k) = (cumulative(&lens_q), cumulative(&lens_k));
    let (tq, tk) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
    let (sq, sk, mq, mk) = (
        seqlens_tensor(&cu_q, &CPU)?,
        seqlens_tensor(&cu_k, &CPU)?,
        max_len(&cu_q),
        max_len(&cu_k),
    );
    for (dtype, heads, kv_heads) in [(DType::F32, 4, 2), (DType::F32, 2, 2), (DType::BF16, 4, 1)] {
        let (d, dv) = (64, 32);
        let q = rng.randn((tq, heads, d), dtype, &CPU)?;
        let k = rng.randn((tk, kv_heads, d), dtype, &CPU)?;
        let v = rng.randn((tk, kv_heads, dv), dtype, &CPU)?;
        let w = rng.randn((tq, heads, dv), dtype, &CPU)?;
        for opts in [
            Opts::new(0.125),
            Opts::new(0.125).causal(),
            Opts::new(0.125).window(Some(30), Some(10)),
            Opts::new(0.4).softcap(2.0).causal(),
        ] {
            let got = autograd(
                |q, k, v| opts.builder().forward_varlen(q, k, v, &sq, &sk, mq, mk),
                &q,
                &k,
                &v,
                &w,
            )?;
            let want = attention_grads_ref_varlen(&q, &k, &v, &w, &cu_q, &cu_k, &opts.reference())?;
            let what = format!("varlen q {lens_q:?} k {lens_k:?} h {heads}/{kv_heads} {dtype:?} {opts:?}");
            // Keys of sequence 1 are seen by no query (it has none): their gradients are 0.
            let dk_unseen = to_f64_vec(&got.1.narrow(0, cu_k[1], lens_k[1])?)?;
            assert!(
                dk_unseen.iter().all(|&x| x == 0.0),
                "{what}: keys no query sees must get dk = 0"
            );
            // Queries of sequence 0 see no key: dq = 0.
            assert!(
                to_f64_vec(&got.0.narrow(0, 0, lens_q[0])?)?.iter().all(|&x| x == 0.0),
                "{what}: dq of keyless rows"
            );
            check_grads(got, want, tolerance(dtype), &what)?;
        }
    }
    Ok(())
}

/// Vars of layout (b, h, s, d) transposed to (b, s, h, d) before the op, and an output used
/// through a transpose (a non-contiguous dL/dout): gradients still land in the right places.
#[test]
fn grads_through_non_contiguous_layouts() -> Result<()> {
    let mut rng = TestRng::fresh("grads_non_contiguous");
    let (b, sq, sk, h, hk, d) = (2, rng.odd_len(30, 120), rng.odd_len(257, 300), 4, 2, 32);
    let qt = rng.randn((b, h, sq, d), DType::F32, &CPU)?;
    let kt = rng.randn((b, hk, sk, d), DType::F32, &CPU)?;
    let vt = rng.randn((b, hk, sk, d), DType::F32, &CPU)?;
    // The weights in the transposed (b, h, sq, d) layout of the output.
    let wt = rng.randn((b, h, sq, d), DType::F32, &CPU)?;
    let opts = Opts::new(0.2).causal().softcap(3.0);
    let (qv, kv, vv) = (Var::from_tensor(&qt)?, Var::from_tensor(&kt)?, Var::from_tensor(&vt)?);
    let out = opts
        .builder()
        .forward(&qv.transpose(1, 2)?, &kv.transpose(1, 2)?, &vv.transpose(1, 2)?)?;
    let loss = (out.transpose(1, 2)? * &wt)?.sum_all()?;
    let grads = loss.backward()?;
    let (q, k, v, w) = (
        qt.transpose(1, 2)?,
        kt.transpose(1, 2)?,
        vt.transpose(1, 2)?,
        wt.transpose(1, 2)?,
    );
    let (dq, dk, dv) = attention_grads_ref(&q, &k, &v, &w, &opts.reference())?;
    let what = "transposed vars";
    assert_close(
        grads.get(&qv).unwrap(),
        &dq.transpose(1, 2)?,
        F32_TOL,
        &format!("{what}: dq"),
    )?;
    assert_close(
        grads.get(&kv).unwrap(),
        &dk.transpose(1, 2)?,
        F32_TOL,
        &format!("{what}: dk"),
    )?;
    assert_close(
        grads.get(&vv).unwrap(),
        &dv.transpose(1, 2)?,
        F32_TOL,
        &format!("{what}: dv"),
    )
}

/// Only q is a variable: its gradient is right. (candle's backprop also stores gradients for
/// the constant k and v of a custom op, so their absence is not asserted.)
#[test]
fn grads_for_a_subset_of_inputs() -> Result<()> {
    let mut rng = TestRng::fresh("grads_subset");
    let shape = AttnShape::new((1, 45, 77, 2, 1, 32, 32));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let w = rng.randn(shape.out_shape(), DType::F32, &CPU)?;
    let qv = Var::from_tensor(&q)?;
    let opts = Opts::new(0.2).causal();
    let loss = (opts.builder().forward(qv.as_tensor(), &k, &v)? * &w)?.sum_all()?;
    let grads = loss.backward()?;
    let (dq, _, _) = attention_grads_ref(&q, &k, &v, &w, &opts.reference())?;
    assert_close(grads.get(&qv).unwrap(), &dq, F32_TOL, "dq with constant k, v")
}

/// Two attention calls in one graph keep their own saved LSE: the gradients add up.
#[test]
fn two_calls_in_one_graph() -> Result<()> {
    let mut rng = TestRng::fresh("grads_two_calls");
    let shape = AttnShape::new((2, rng.odd_len(30, 100), rng.odd_len(30, 100), 4, 2, 32, 32));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let (w1, w2) = (
        rng.randn(shape.out_shape(), DType::F32, &CPU)?,
        rng.randn(shape.out_shape(), DType::F32, &CPU)?,
    );
    let (o1, o2) = (
        Opts::new(0.2).causal(),
        Opts::new(0.5).softcap(1.0).window(Some(9), Some(4)),
    );
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let out1 = o1.builder().forward(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let out2 = o2.builder().forward(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
    let loss = ((out1 * &w1)?.sum_all()? + (out2 * &w2)?.sum_all()?)?;
    let grads = loss.backward()?;
    let r1 = attention_grads_ref(&q, &k, &v, &w1, &o1.reference())?;
    let r2 = attention_grads_ref(&q, &k, &v, &w2, &o2.reference())?;
    for (name, x, a, b) in [
        ("dq", &qv, &r1.0, &r2.0),
        ("dk", &kv, &r1.1, &r2.1),
        ("dv", &vv, &r1.2, &r2.2),
    ] {
        assert_close(grads.get(x).unwrap(), &(a + b)?, F32_TOL, &format!("two calls: {name}"))?;
    }
    Ok(())
}

#[test]
fn grads_are_deterministic() -> Result<()> {
    let mut rng = TestRng::fresh("grads_deterministic");
    let shape = AttnShape::new((1, rng.odd_len(257, 300), rng.odd_len(257, 300), 4, 1, 64, 64));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let w = rng.randn(shape.out_shape(), DType::F32, &CPU)?;
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| FlashAttn::new(0.125).causal(true).forward(q, k, v);
    let a = autograd(f, &q, &k, &v, &w)?;
    let b = autograd(f, &q, &k, &v, &w)?;
    assert_identical(&a.0, &b.0, "dq")?;
    assert_identical(&a.1, &b.1, "dk")?;
    assert_identical(&a.2, &b.2, "dv")
}

/// forward_with_lse's LSE is the reference LSE (fixed-length and varlen).
#[test]
fn forward_with_lse_matches_reference_lse() -> Result<()> {
    let mut rng = TestRng::fresh("lse");
    let shape = AttnShape::new((2, rng.odd_len(257, 300), rng.odd_len(100, 200), 4, 2, 64, 64));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    for opts in [
        Opts::new(0.125),
        Opts::new(0.125).causal(),
        Opts::new(0.4).softcap(2.0).window(Some(20), Some(5)),
    ] {
        let (_, lse) = opts.builder().forward_with_lse(&q, &k, &v)?;
        let (_, want) = attention_ref(&q, &k, &v, &opts.reference())?;
        assert_close(&lse, &want, 1e-5, &format!("lse {opts:?}"))?;
    }
    let lens = ([13, 0, 270, 5], [20, 7, 300, 0]);
    let (cu_q, cu_k) = (cumulative(&lens.0), cumulative(&lens.1));
    let q = rng.randn((cu_q[4], 4, 32), DType::F32, &CPU)?;
    let k = rng.randn((cu_k[4], 2, 32), DType::F32, &CPU)?;
    let v = rng.randn((cu_k[4], 2, 32), DType::F32, &CPU)?;
    let (sq, sk) = (seqlens_tensor(&cu_q, &CPU)?, seqlens_tensor(&cu_k, &CPU)?);
    let opts = Opts::new(0.2).causal();
    let (_, lse) = opts.builder().forward_varlen_with_lse(&q, &k, &v, &sq, &sk, 270, 300)?;
    let (_, want) = attention_ref_varlen(&q, &k, &v, &cu_q, &cu_k, &opts.reference())?;
    assert_close(&lse, &want, 1e-5, "varlen lse")
}

// ------------------------------------------------------------------------------------------
// Finite differences
// ------------------------------------------------------------------------------------------

/// Central differences of `loss` (a function of the three flat inputs) with respect to every
/// element of every input: `(loss(x + e) - loss(x - e)) / (x⁺ - x⁻)`, where `round` maps a
/// perturbed value to what the input dtype stores, so the divisor is the step actually taken.
fn central_differences(
    inputs: &[Vec<f64>; 3],
    eps: f64,
    round: impl Fn(f64) -> f64,
    loss: impl Fn(&[Vec<f64>; 3]) -> Result<f64>,
) -> Result<[Vec<f64>; 3]> {
    let mut grads: [Vec<f64>; 3] = Default::default();
    for which in 0..3 {
        for n in 0..inputs[which].len() {
            let x = inputs[which][n];
            let (up, down) = (round(x + eps), round(x - eps));
            let mut plus = inputs.clone();
            plus[which][n] = up;
            let mut minus = inputs.clone();
            minus[which][n] = down;
            grads[which].push((loss(&plus)? - loss(&minus)?) / (up - down));
        }
    }
    Ok(grads)
}

fn tensor(data: &[f64], like: &Tensor, dtype: DType) -> Result<Tensor> {
    Tensor::from_vec(data.to_vec(), like.shape(), &CPU)?.to_dtype(dtype)
}

/// The op's autograd gradients (f32) against central differences of the f64-accumulated loss
/// of the f32 op, on tiny cases: plain, causal + softcap (sq > sk: rows that see nothing),
/// GQA with a window.
#[test]
fn f32_grads_match_finite_differences() -> Result<()> {
    let mut rng = TestRng::fresh("finite_differences");
    for (shape, opts) in [
        (AttnShape::new((1, 5, 7, 2, 2, 8, 6)), Opts::new(0.35)),
        (
            AttnShape::new((2, 7, 5, 2, 1, 8, 8)),
            Opts::new(1.0).causal().softcap(1.5),
        ),
        (
            AttnShape::new((1, 6, 9, 4, 1, 8, 5)),
            Opts::new(0.35).window(Some(3), Some(1)),
        ),
    ] {
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
        let w = rng.randn(shape.out_shape(), DType::F32, &CPU)?;
        let w64 = to_f64_vec(&w)?;
        let fa = opts.builder();
        let loss = |x: &[Vec<f64>; 3]| -> Result<f64> {
            let out = fa.forward(
                &tensor(&x[0], &q, DType::F32)?,
                &tensor(&x[1], &k, DType::F32)?,
                &tensor(&x[2], &v, DType::F32)?,
            )?;
            Ok(to_f64_vec(&out)?.iter().zip(&w64).map(|(o, w)| o * w).sum())
        };
        let inputs = [to_f64_vec(&q)?, to_f64_vec(&k)?, to_f64_vec(&v)?];
        let fd = central_differences(&inputs, 5e-3, |x| x as f32 as f64, loss)?;
        let got = autograd(|q, k, v| fa.forward(q, k, v), &q, &k, &v, &w)?;
        let fd = (
            tensor(&fd[0], &q, DType::F64)?,
            tensor(&fd[1], &k, DType::F64)?,
            tensor(&fd[2], &v, DType::F64)?,
        );
        check_grads(got, fd, 2e-3, &format!("finite differences {shape:?} {opts:?}"))?;
    }
    Ok(())
}

/// The reference's analytic gradients against central differences of the reference forward,
/// all in f64: validates the reference itself (softcap chain rule, GQA sums, masks, varlen).
#[test]
fn reference_grads_match_f64_finite_differences() -> Result<()> {
    let mut rng = TestRng::fresh("reference_finite_differences");
    for (shape, opts) in [
        (AttnShape::new((1, 5, 7, 2, 2, 4, 3)), RefOptions::new(0.5)),
        (
            AttnShape::new((2, 7, 5, 4, 2, 4, 4)),
            RefOptions::new(1.3).causal(true).softcap(1.5),
        ),
        (
            AttnShape::new((1, 6, 9, 4, 1, 5, 3)),
            RefOptions::new(0.5).window(Some(2), Some(1)).softcap(0.7),
        ),
    ] {
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F64, &CPU)?;
        let w = rng.randn(shape.out_shape(), DType::F64, &CPU)?;
        let w64 = to_f64_vec(&w)?;
        let loss = |x: &[Vec<f64>; 3]| -> Result<f64> {
            let (out, _) = attention_ref(
                &tensor(&x[0], &q, DType::F64)?,
                &tensor(&x[1], &k, DType::F64)?,
                &tensor(&x[2], &v, DType::F64)?,
                &opts,
            )?;
            Ok(to_f64_vec(&out)?.iter().zip(&w64).map(|(o, w)| o * w).sum())
        };
        let fd = central_differences(&[to_f64_vec(&q)?, to_f64_vec(&k)?, to_f64_vec(&v)?], 1e-5, |x| x, loss)?;
        let got = attention_grads_ref(&q, &k, &v, &w, &opts)?;
        let fd = (
            tensor(&fd[0], &q, DType::F64)?,
            tensor(&fd[1], &k, DType::F64)?,
            tensor(&fd[2], &v, DType::F64)?,
        );
        check_grads(
            got,
            fd,
            1e-7,
            &format!("reference finite differences {shape:?} {opts:?}"),
        )?;
    }
    // Varlen, with an empty sequence on each side.
    let (cu_q, cu_k) = (cumulative(&[3, 0, 4, 2]), cumulative(&[4, 3, 2, 0]));
    let q = rng.randn((9, 2, 4), DType::F64, &CPU)?;
    let k = rng.randn((9, 1, 4), DType::F64, &CPU)?;
    let v = rng.randn((9, 1, 3), DType::F64, &CPU)?;
    let w = rng.randn((9, 2, 3), DType::F64, &CPU)?;
    let w64 = to_f64_vec(&w)?;
    let opts = RefOptions::new(0.8).causal(true).softcap(2.0);
    let loss = |x: &[Vec<f64>; 3]| -> Result<f64> {
        let (out, _) = attention_ref_varlen(
            &tensor(&x[0], &q, DType::F64)?,
            &tensor(&x[1], &k, DType::F64)?,
            &tensor(&x[2], &v, DType::F64)?,
            &cu_q,
            &cu_k,
            &opts,
        )?;
        Ok(to_f64_vec(&out)?.iter().zip(&w64).map(|(o, w)| o * w).sum())
    };
    let fd = central_differences(&[to_f64_vec(&q)?, to_f64_vec(&k)?, to_f64_vec(&v)?], 1e-5, |x| x, loss)?;
    let got = attention_grads_ref_varlen(&q, &k, &v, &w, &cu_q, &cu_k, &opts)?;
    let fd = (
        tensor(&fd[0], &q, DType::F64)?,
        tensor(&fd[1], &k, DType::F64)?,
        tensor(&fd[2], &v, DType::F64)?,
    );
    check_grads(got, fd, 1e-7, "reference varlen finite differences")
}

// ------------------------------------------------------------------------------------------
// The naive composite
// ------------------------------------------------------------------------------------------

#[test]
fn grads_match_candle_autograd_of_the_composite() -> Result<()> {
    let mut rng = TestRng::fresh("grads_composite");
    let shape = AttnShape::new((2, rng.odd_len(20, 60), rng.odd_len(60, 100), 4, 2, 32, 24));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let w = rng.randn(shape.out_shape(), DType::F32, &CPU)?;
    let scale = shape.scale();
    for causal in [false, true] {
        let op = autograd(
            |q, k, v| FlashAttn::new(scale as f32).causal(causal).forward(q, k, v),
            &q,
            &k,
            &v,
            &w,
        )?;
        let naive = autograd(
            |q, k, v| naive_attention(q, k, v, scale as f32 as f64, causal),
            &q,
            &k,
            &v,
            &w,
        )?;
        check_grads(op, naive, F32_TOL, &format!("op vs composite autograd causal={causal}"))?;
    }
    Ok(())
}

#[test]
fn functional_backward_equals_autograd() -> Result<()> {
    // FlashAttn::backward from (out, lse, dL/dout) runs the op's own backward: bitwise the
    // gradients autograd produces through the op (candle's bookkeeping adds them into zeros,
    // which is exact), and close to the f64 reference.
    let mut rng = TestRng::fresh("functional_backward");
    for opts_causal in [false, true] {
        let shape = AttnShape::new((2, rng.odd_len(1, 150), rng.odd_len(1, 150), 4, 2, 32, 24));
        let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
        let mut o = Opts::new(0.2);
        if opts_causal {
            o.right = Some(0);
        }
        let fa = o.builder();
        let w = rng.randn(
            (shape.batch, shape.seqlen_q, shape.heads, shape.head_dim_v),
            DType::F32,
            &CPU,
        )?;
        let (out, lse) = fa.forward_with_lse(&q, &k, &v)?;
        let got = fa.backward(&q, &k, &v, &out, &lse, &w)?;
        let want = autograd(|q, k, v| fa.forward(q, k, v), &q, &k, &v, &w)?;
        let what = format!("functional backward {shape:?} causal {opts_causal} seed {}", rng.seed());
        assert_identical(&got.0, &want.0, &format!("{what}: dq"))?;
        assert_identical(&got.1, &want.1, &format!("{what}: dk"))?;
        assert_identical(&got.2, &want.2, &format!("{what}: dv"))?;
        let reference = attention_grads_ref(&q, &k, &v, &w, &o.reference())?;
        check_grads(got, reference, F32_TOL, &what)?;
    }
    Ok(())
}

#[test]
fn functional_backward_rejects_mismatched_tensors() -> Result<()> {
    let mut rng = TestRng::fresh("functional_backward_errors");
    let shape = AttnShape::new((1, 9, 11, 4, 2, 32, 32));
    let (q, k, v) = shape.random_qkv(&mut rng, DType::F32, &CPU)?;
    let fa = FlashAttn::new(0.2);
    let (out, lse) = fa.forward_with_lse(&q, &k, &v)?;
    let expect_err = |r: Result<(Tensor, Tensor, Tensor)>, needle: &str, what: &str| match r {
        Ok(_) => panic!("{what}: accepted"),
        Err(e) => assert!(e.to_string().contains(needle), "{what}: {e}"),
    };
    let lse_t = lse.transpose(1, 2)?.contiguous()?; // (batch, seqlen_q, heads)
    expect_err(
        fa.backward(&q, &k, &v, &out, &lse_t, &out),
        "lse must be",
        "lse transposed",
    );
    expect_err(
        fa.backward(&q, &k, &v, &out, &lse.to_dtype(DType::F16)?, &out),
        "lse must be",
        "lse f16",
    );
    expect_err(
        fa.backward(&q, &k, &v, &out.narrow(1, 0, 8)?, &lse, &out),
        "out must be",
        "out short",
    );
    expect_err(
        fa.backward(&q, &k, &v, &out, &lse, &out.to_dtype(DType::BF16)?),
        "grad_out must be",
        "grad_out bf16",
    );
    expect_err(
        fa.backward(&q, &k.narrow(1, 0, 10)?, &v, &out, &lse, &out),
        "shapes do not match",
        "k short",
    );
    Ok(())
}
