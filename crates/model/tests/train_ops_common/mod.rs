//! Checks of flash-llama's training ops (`flash_llama::train_ops`) against the composed candle
//! ops they replace, forward and gradients, shared by the CPU tests (tests/train_ops.rs) and the
//! GPU tests (tests/gpu_train.rs). The reference is the composed form in f64 on the same input
//! values (the op's inputs cast to f64), differentiated by candle's autograd; the loss is
//! `sum(y · r)` for a fixed random `r`, so the op's backward sees a random output gradient.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use flash_llama::nn::{apply_rope, RmsNorm};
use flash_llama::{train_ops, Kernels};

pub use crate::common::rel_diff;

pub fn randn(shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, dev).unwrap().to_dtype(dtype).unwrap()
}

/// Forward and the gradients of `inputs` of `f` (ours, in `dtype`) and `reference` (composed, in
/// f64 on the same values); panics naming `what` when one differs by more than `tol`.
fn check(
    what: &str,
    inputs: &[Tensor],
    ours: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    tol: f32,
) -> Result<()> {
    // Every op's output has the shape of its first input.
    let r = Tensor::randn(0f32, 1.0, inputs[0].shape(), inputs[0].device())?;
    let run = |xs: Vec<Tensor>, f: &dyn Fn(&[Tensor]) -> Result<Tensor>| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Var> = xs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let grads = (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;
        let g = vars.iter().map(|v| grads.get(v).unwrap().clone()).collect();
        Ok((y, g))
    };
    let (y, g) = run(inputs.to_vec(), &ours)?;
    let f64_inputs = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let (y_ref, g_ref) = run(f64_inputs, &reference)?;
    let d = rel_diff(&y, &y_ref);
    let dg: Vec<f32> = g.iter().zip(&g_ref).map(|(g, r)| rel_diff(g, r)).collect();
    eprintln!("{what}: forward {d:.2e}, gradients {dg:?}");
    assert!(d <= tol, "{what}: forward differs by {d} (tol {tol})");
    assert_eq!(y.dtype(), inputs[0].dtype(), "{what}: output dtype");
    for (i, ((g, g_ref), d)) in g.iter().zip(&g_ref).zip(dg).enumerate() {
        assert_eq!(g.dtype(), inputs[i].dtype(), "{what}: dtype of gradient {i}");
        assert_eq!(g.shape(), g_ref.shape(), "{what}: shape of gradient {i}");
        assert!(d <= tol, "{what}: gradient {i} differs by {d} (tol {tol})");
    }
    Ok(())
}

/// RMSNorm over rows of odd sizes and ranks: forward, dx and dw.
pub fn rms_norm(dev: &Device, dtype: DType, tol: f32) -> Result<()> {
    for shape in [vec![7, 37], vec![5, 3, 19], vec![1, 768], vec![130, 301], vec![2, 1]] {
        let dim = *shape.last().unwrap();
        let x = randn(&shape, dtype, dev);
        let w = (randn(&[dim], DType::F32, dev) * 0.2)?
            .affine(1.0, 1.0)?
            .to_dtype(dtype)?;
        check(
            &format!("RMSNorm {shape:?} {dtype:?}"),
            &[x, w],
            |t| train_ops::rms_norm(&t[0], &t[1], 1e-5),
            |t| RmsNorm::new(t[1].clone(), 1e-5, Kernels::Composed).forward(&t[0]),
            tol,
        )?;
    }
    Ok(())
}

/// RoPE, half-split and interleaved, odd token and head counts: forward and dx.
pub fn rope(dev: &Device, dtype: DType, tol: f32) -> Result<()> {
    for (tokens, heads, d) in [(7, 3, 10), (1, 1, 2), (33, 5, 64), (130, 2, 128)] {
        for interleaved in [false, true] {
            let x = randn(&[tokens, heads, d], dtype, dev);
            let angles = (Tensor::rand(0f32, 6.3, (tokens, d / 2), dev)?).to_dtype(DType::F32)?;
            let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
            let (cos, sin) = (&cos, &sin);
            check(
                &format!("RoPE ({tokens}, {heads}, {d}) interleaved {interleaved} {dtype:?}"),
                &[x],
                |t| train_ops::rope(&t[0], cos, sin, interleaved),
                |t| {
                    let (c, s) = (cos.to_dtype(DType::F64)?, sin.to_dtype(DType::F64)?);
                    apply_rope(&t[0], &c, &s, interleaved, Kernels::Composed)
                },
                tol,
            )?;
        }
    }
    Ok(())
}

/// SiLU(gate) × up: forward, dgate and dup.
pub fn swiglu(dev: &Device, dtype: DType, tol: f32) -> Result<()> {
    for shape in [vec![7, 37], vec![3, 5, 11], vec![64, 3456], vec![1]] {
        let (g, u) = (randn(&shape, dtype, dev), randn(&shape, dtype, dev));
        check(
            &format!("SiLU × up {shape:?} {dtype:?}"),
            &[g, u],
            |t| train_ops::swiglu(&t[0], &t[1]),
            |t| t[0].silu()? * &t[1],
            tol,
        )?;
    }
    Ok(())
}

/// Embedding lookup, ids repeated and some absent: forward and dweight against candle-nn's
/// `Embedding` (index_select, index_add backward) in f64.
pub fn embedding(dev: &Device, dtype: DType, tol: f32) -> Result<()> {
    for (vocab, dim, tokens) in [(11, 7, 40), (264, 768, 333), (5, 300, 1)] {
        // Skewed ids (id 1 far more often than the others, ids near vocab never).
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|i| {
                if i % 3 == 0 {
                    1
                } else {
                    (i * 7 + 3) % (vocab as u32 - 1).max(1)
                }
            })
            .collect();
        let w = randn(&[vocab, dim], dtype, dev);
        let ids_t = Tensor::new(ids.as_slice(), dev)?;
        let r = randn(&[tokens, dim], DType::F32, dev);
        let ids = &ids;
        let run = |w: Tensor, ours: bool| -> Result<(Tensor, Tensor)> {
            let v = Var::from_tensor(&w)?;
            let y = match ours {
                true => train_ops::embedding(v.as_tensor(), ids)?,
                false => candle_nn::Embedding::new(v.as_tensor().clone(), dim).forward(&ids_t)?,
            };
            let grads = (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;
            Ok((y, grads.get(&v).unwrap().clone()))
        };
        let (y, g) = run(w.clone(), true)?;
        let (y_ref, g_ref) = run(w.to_dtype(DType::F64)?, false)?;
        let (d, dg) = (rel_diff(&y, &y_ref), rel_diff(&g, &g_ref));
        eprintln!("embedding ({vocab}, {dim}) x {tokens} {dtype:?}: forward {d:.2e}, gradient {dg:.2e}");
        assert!(d == 0.0, "embedding: forward differs by {d}");
        assert_eq!((g.dtype(), g.dims()), (dtype, &[vocab, dim][..]));
        assert!(dg <= tol, "embedding: gradient differs by {dg} (tol {tol})");
    }
    Ok(())
}

/// The cross-entropy ops (`cross_entropy_logsumexp`, `cross_entropy_backward`) against an f64
/// reference on the host of the same (rounded) logits: rows of an odd vocabulary (and a
/// 50,257-entry one), logits spread over ±8 with one large outlier per row, fresh random targets,
/// one target outside the vocabulary (its loss must be NaN, every other row finite). The
/// logsumexp within `1e-5` relative (f32 inside), the target logit exact; the gradient, from the
/// f32 logsumexp it is given, within one rounding of `dtype` of each entry plus a few f32 ulps
/// of the softmax.
pub fn cross_entropy(dev: &Device, dtype: DType) -> Result<()> {
    for (rows, vocab) in [(37usize, 264usize), (5, 50_257), (3, 1)] {
        let mut logits = (Tensor::randn(0f32, 4.0, (rows, vocab), &Device::Cpu)?).to_vec2::<f32>()?;
        for (r, row) in logits.iter_mut().enumerate() {
            let i = (r * 7919) % vocab;
            row[i] += 30.0;
        }
        let logits = Tensor::new(logits, &Device::Cpu)?.to_dtype(dtype)?;
        let mut targets: Vec<u32> = (0..rows).map(|r| ((r * 104_729 + 17) % vocab) as u32).collect();
        targets[rows - 1] = vocab as u32; // outside: NaN
        let host: Vec<Vec<f64>> = logits.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let (x, t) = (logits.to_device(dev)?, Tensor::new(targets.as_slice(), dev)?);
        let stats = train_ops::cross_entropy_logsumexp(&x, &t)?.to_vec2::<f32>()?;
        let scale = 0.37;
        let lse = Tensor::new(stats.iter().map(|s| s[0]).collect::<Vec<f32>>(), dev)?;
        let grad = train_ops::cross_entropy_backward(&x, &t, &lse, scale)?;
        assert_eq!(grad.dtype(), dtype, "cross-entropy gradient dtype");
        let grad = grad.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        for r in 0..rows {
            let m = host[r].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse_ref = m + host[r].iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let (lse, target) = (stats[r][0] as f64, stats[r][1] as f64);
            assert!(
                (lse - lse_ref).abs() <= 1e-5 * lse_ref.abs().max(1.0),
                "{dtype:?} {rows}x{vocab}, row {r}: logsumexp {lse}, f64 {lse_ref}"
            );
            let t = targets[r] as usize;
            if t >= vocab {
                assert!(
                    target.is_nan(),
                    "{dtype:?}: a target outside the vocabulary gave {target}"
                );
            } else {
                assert_eq!(target, host[r][t], "{dtype:?} row {r}: target logit");
            }
            // Half a unit in the last place, relative, and half the smallest subnormal (f16's
            // subnormals are 2^-24 apart).
            let (unit, tiny) = match dtype {
                DType::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
                DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
                _ => (2f64.powi(-24), 2f64.powi(-150)),
            };
            for (i, &g) in grad[r].iter().enumerate() {
                // The softmax from the f32 logsumexp the backward was given (its own rounding,
                // up to 2e-6 of a logsumexp near 30, is the forward's, checked above).
                let arg = host[r][i] - lse;
                let p = arg.exp();
                let want = scale * (p - if i == t { 1.0 } else { 0.0 });
                // The softmax in f32 (the exponent's rounding, |arg| · 2^-24, and a few ulps of
                // exp), then p − one_hot and the product by scale in f32 (half an f32 ulp each),
                // and one rounding to the dtype.
                let softmax = (arg.abs() + 8.0) * 2f64.powi(-23) * scale * p;
                let bound = (unit + 2f64.powi(-23)) * want.abs() + softmax + tiny;
                assert!(
                    (g - want).abs() <= bound,
                    "{dtype:?} {rows}x{vocab}, row {r}, entry {i}: gradient {g}, f64 {want}"
                );
            }
        }
    }
    Ok(())
}
