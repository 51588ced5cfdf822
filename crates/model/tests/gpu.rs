//! GPU tests of flash-llama's fused inference kernels (kernels/model/fused.cu): each op against
//! the composed candle ops it replaces, on fresh random inputs with odd sizes, and whole models
//! (every family, and a GGUF file with interleaved RoPE) with `Kernels::Fused` against
//! `Kernels::Composed` on the GPU. Needs the `cuda` feature and a Hopper GPU; built by
//! scripts/gpu-pack.sh and run by scripts/gpu-run.sh.

mod common;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use common::{abs_sum, hf_model, mixed_steps, rel_diff, tokens, Family, VOCAB};
use flash_llama::fused::{
    add_rms_norm, argmax_rows, argmax_rows_into, decode_prologue, linear_rows, linear_rows_fits, linear_vector,
    linear_vector_add_norm, linear_vector_add_norm_fits, linear_vector_add_norm_swiglu,
    linear_vector_add_norm_swiglu_fits, linear_vector_fits, rope_angles, rope_store, silu_mul, store_e4m3, CacheStore,
    MappedTokens, PrologueInputs,
};
use flash_llama::loader::{load_gguf, load_hf_dir};
use flash_llama::nn::{rope_angles_per_head, rope_per_head, RmsNorm};
use flash_llama::sampling::argmax;
use flash_llama::{generate, Batcher, Flow, GenerateOptions, Kernels, Llama, Request, SamplingParams};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

/// Tolerance of one kernel against the composed ops: a couple of roundings of the dtype.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

fn randn(shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, dev).unwrap().to_dtype(dtype).unwrap()
}

#[test]
fn add_rms_norm_matches_composed() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        // 16-byte vectors (2048, 576, 5000 for 16-bit types), element by element (odd lengths,
        // rows over 8192, and x starting one element past an aligned address).
        for (rows, dim, offset) in [
            (1, 2048, 0),
            (7, 301, 0),
            (33, 576, 0),
            (3, 1, 0),
            (130, 5000, 0),
            (2, 9000, 0),
            (3, 2048, 1),
        ] {
            let x = randn(&[rows * dim + offset], dtype, &dev)
                .narrow(0, offset, rows * dim)?
                .reshape((rows, dim))?;
            let h = randn(&[rows, dim], dtype, &dev);
            let w = (randn(&[dim], dtype, &dev) * 0.2)?.affine(1.0, 1.0)?;
            let (res, normed) = add_rms_norm(&x, &h, &w, 1e-5)?;
            let res_ref = (&x + &h)?;
            let normed_ref = RmsNorm::new(w.clone(), 1e-5, Kernels::Composed).forward(&res_ref)?;
            assert_eq!(res.dims(), &[rows, dim]);
            assert_eq!(normed.dims(), &[rows, dim]);
            let (dr, dn) = (rel_diff(&res, &res_ref), rel_diff(&normed, &normed_ref));
            println!("add_rms_norm {dtype:?} {rows}x{dim}: residual {dr:.2e}, normed {dn:.2e}");
            assert!(
                dr <= tol(dtype) / 4.0,
                "{dtype:?} {rows}x{dim}: residual differs by {dr}"
            );
            assert!(dn <= tol(dtype), "{dtype:?} {rows}x{dim}: normed differs by {dn}");
        }
    }
    Ok(())
}

#[test]
fn silu_mul_matches_composed() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        for (rows, inter) in [(1, 8192), (5, 333), (70, 1536), (2, 1)] {
            let y = (randn(&[rows, 2 * inter], dtype, &dev) * 3.0)?;
            let got = silu_mul(&y)?;
            let (g, u) = (y.narrow(D::Minus1, 0, inter)?, y.narrow(D::Minus1, inter, inter)?);
            let want = (g.silu()? * u)?;
            let d = rel_diff(&got, &want);
            println!("silu_mul {dtype:?} {rows}x{inter}: {d:.2e}");
            assert_eq!(got.dims(), &[rows, inter]);
            assert!(d <= tol(dtype), "{dtype:?} {rows}x{inter}: differs by {d}");
        }
    }
    Ok(())
}

#[test]
fn rope_store_matches_rope_and_copy() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        for interleaved in [false, true] {
            // (tokens, heads, head_dim, cached heads, cache rows)
            for (tokens, heads, d, cached, cache_rows) in [(1, 48, 64, 16, 640), (4, 7, 24, 3, 13), (37, 5, 2, 5, 40)] {
                let y = randn(&[tokens, heads, d], dtype, &dev);
                let angles = Tensor::rand(-4f32, 4.0, (tokens, heads, d / 2), &dev)?;
                let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
                let want = rope_per_head(&y, &cos, &sin, interleaved)?;
                // Distinct rows in scrambled order.
                let rows: Vec<u32> = (0..tokens).map(|t| ((t * 7 + 3) % cache_rows) as u32).collect();
                let rows_t = Tensor::new(rows.clone(), &dev)?;
                let kv = Tensor::zeros((cache_rows, cached, d), dtype, &dev)?;
                let got = y.copy()?;
                rope_store(
                    &got,
                    &cos,
                    &sin,
                    interleaved,
                    Some(CacheStore::Rows { kv: &kv, rows: &rows_t }),
                )?;
                let d_y = rel_diff(&got, &want);
                let stored = kv.index_select(&rows_t, 0)?;
                let d_kv = rel_diff(&stored, &want.narrow(1, heads - cached, cached)?);
                // Every other cache row stays zero.
                let untouched: Vec<u32> = (0..cache_rows as u32).filter(|r| !rows.contains(r)).collect();
                let rest = kv.index_select(&Tensor::new(untouched, &dev)?, 0)?;
                let rest_max = rest
                    .to_dtype(DType::F32)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                println!(
                    "rope_store {dtype:?} interleaved {interleaved} {tokens}x{heads}x{d} (cache {cached} heads): y {d_y:.2e}, cache {d_kv:.2e}"
                );
                assert!(d_y <= tol(dtype), "{dtype:?} {tokens}x{heads}x{d}: y differs by {d_y}");
                assert!(
                    d_kv <= tol(dtype),
                    "{dtype:?} {tokens}x{heads}x{d}: cache differs by {d_kv}"
                );
                assert_eq!(rest_max, 0.0, "rows that were not written changed");
                // Without a cache: the rotation alone.
                let alone = y.copy()?;
                rope_store(&alone, &cos, &sin, interleaved, None)?;
                assert_eq!(rel_diff(&alone, &got), 0.0);
            }
        }
    }
    Ok(())
}

/// The batch-1 decode projections' kernel against an f64 reference of x · wᵀ + bias: odd output
/// counts, k from one 16-byte vector to past a lane's unrolled stride, x a view into a larger
/// tensor (as the model's normed rows are), with and without a bias.
#[test]
fn linear_vector_matches_matmul() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        let vec = 16 / dtype.size_in_bytes();
        for (n, k) in [
            (1usize, vec),
            (7, 576),
            (3072, 2048),
            (130, 8200 - 8200 % vec + vec),
            (33, 4096 + vec),
        ] {
            // x: the second row of a (2, k) tensor, as add + RMSNorm's output.
            let both = randn(&[2, 1, k], dtype, &dev);
            let x = both.get(1)?;
            let w = (randn(&[n, k], dtype, &dev) * 0.05)?.to_dtype(dtype)?;
            let bias = randn(&[n], dtype, &dev);
            assert!(linear_vector_fits(&x, &w));
            for with_bias in [false, true] {
                let got = linear_vector(&x, &w, with_bias.then_some(&bias))?;
                assert_eq!(got.dims(), [1, n]);
                let got = got.to_dtype(DType::F64)?;
                let (x64, w64) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?);
                let mut want = x64.matmul(&w64.t()?)?;
                if with_bias {
                    want = want.broadcast_add(&bias.to_dtype(DType::F64)?)?;
                }
                let max_abs = |t: &Tensor| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>();
                let (err, scale) = (max_abs(&(&got - &want)?)?, max_abs(&want)?.max(1e-3));
                assert!(
                    err.is_finite() && err / scale <= tol(dtype) as f64 / 2.0,
                    "{dtype:?} n {n} k {k} bias {with_bias}: {err:e} of {scale:e}"
                );
            }
        }
    }
    // Shapes it does not take: the model falls back to candle's matmul, a direct call errs.
    let x = Tensor::zeros((1, 64), DType::BF16, &dev)?;
    let w = Tensor::zeros((5, 64), DType::BF16, &dev)?;
    let two = Tensor::zeros((2, 64), DType::BF16, &dev)?;
    let odd_k = Tensor::zeros((1, 60), DType::BF16, &dev)?;
    let odd_w = Tensor::zeros((5, 60), DType::BF16, &dev)?;
    let offset = Tensor::zeros((66,), DType::BF16, &dev)?
        .narrow(0, 2, 64)?
        .reshape((1, 64))?;
    let strided = Tensor::zeros((64, 2), DType::BF16, &dev)?.narrow(1, 0, 1)?.t()?;
    let f16_w = Tensor::zeros((5, 64), DType::F16, &dev)?;
    let cpu = Tensor::zeros((1, 64), DType::BF16, &Device::Cpu)?;
    for (what, x, w) in [
        ("rows", &two, &w),
        ("k", &odd_k, &odd_w),
        ("alignment", &offset, &w),
        ("strides", &strided, &w),
        ("dtype", &x, &f16_w),
        ("shared k", &x, &odd_w),
    ] {
        assert!(!linear_vector_fits(x, w), "{what}");
        assert!(linear_vector(x, w, None).is_err(), "{what}");
    }
    assert!(linear_vector(&cpu, &w, None).unwrap_err().to_string().contains("CUDA"));
    let bad_bias = Tensor::zeros(4, DType::BF16, &dev)?;
    assert!(linear_vector(&x, &w, Some(&bad_bias))
        .unwrap_err()
        .to_string()
        .contains("bias"));
    Ok(())
}

/// The batched decode projections' tensor-core kernel against an f64 reference of x · wᵀ + bias:
/// every tile count (2-64 tokens, none a whole tile but 8, 16 and 64), output counts that leave a
/// partial block of 64, k from one chunk of 64 to 8192 (unsplit, and split over clusters of 2-8
/// CTAs), x a view into a larger tensor, with and without a bias.
#[test]
fn linear_rows_matches_matmul() -> Result<()> {
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        for (m, n, k) in [
            (2usize, 64usize, 64usize),
            (3, 7, 576),
            (8, 3072, 2048),
            (9, 2048, 2048),
            (16, 130, 8192),
            (17, 5003, 192),
            (31, 2048, 8192),
            (33, 16384, 2048),
            (47, 2049, 960),
            (64, 3072, 2048),
        ] {
            // x: rows 1.. of a (m + 1, k) tensor, as a view the model could pass.
            let x = randn(&[m + 1, k], dtype, &dev).narrow(0, 1, m)?;
            let w = (randn(&[n, k], dtype, &dev) * 0.05)?.to_dtype(dtype)?;
            let bias = randn(&[n], dtype, &dev);
            assert!(linear_rows_fits(&x, &w), "{m} {n} {k}");
            for with_bias in [false, true] {
                let got = linear_rows(&x, &w, with_bias.then_some(&bias))?;
                assert_eq!(got.dims(), [m, n]);
                let got = got.to_dtype(DType::F64)?;
                let (x64, w64) = (x.to_dtype(DType::F64)?, w.to_dtype(DType::F64)?);
                let mut want = x64.matmul(&w64.t()?)?;
                if with_bias {
                    want = want.broadcast_add(&bias.to_dtype(DType::F64)?)?;
                }
                // Row by row: every token's outputs within a rounding of its own scale.
                for row in 0..m {
                    let (g, w_) = (got.get(row)?, want.get(row)?);
                    let max_abs = |t: &Tensor| t.abs()?.max(0)?.to_scalar::<f64>();
                    let (err, scale) = (max_abs(&(&g - &w_)?)?, max_abs(&w_)?.max(1e-3));
                    assert!(
                        err.is_finite() && err / scale <= tol(dtype) as f64 / 2.0,
                        "{dtype:?} m {m} n {n} k {k} bias {with_bias} row {row}: {err:e} of {scale:e}"
                    );
                }
            }
        }
    }
    // Shapes it does not take: the model falls back to candle's matmul, a direct call errs.
    let x = Tensor::zeros((4, 128), DType::BF16, &dev)?;
    let w = Tensor::zeros((5, 128), DType::BF16, &dev)?;
    let one = Tensor::zeros((1, 128), DType::BF16, &dev)?;
    let many = Tensor::zeros((65, 128), DType::BF16, &dev)?;
    let odd_k = Tensor::zeros((4, 96), DType::BF16, &dev)?;
    let odd_w = Tensor::zeros((5, 96), DType::BF16, &dev)?;
    let offset = Tensor::zeros((4 * 128 + 2,), DType::BF16, &dev)?
        .narrow(0, 2, 4 * 128)?
        .reshape((4, 128))?;
    let strided = Tensor::zeros((128, 4), DType::BF16, &dev)?.t()?;
    let f16_w = Tensor::zeros((5, 128), DType::F16, &dev)?;
    let (x32, w32) = (x.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?);
    let cpu = Tensor::zeros((4, 128), DType::BF16, &Device::Cpu)?;
    let cpu_w = Tensor::zeros((5, 128), DType::BF16, &Device::Cpu)?;
    for (what, x, w) in [
        ("one row", &one, &w),
        ("65 rows", &many, &w),
        ("k of 96", &odd_k, &odd_w),
        ("alignment", &offset, &w),
        ("strides", &strided, &w),
        ("dtypes", &x, &f16_w),
        ("f32", &x32, &w32),
        ("shared k", &x, &odd_w),
        ("cpu", &cpu, &cpu_w),
    ] {
        assert!(!linear_rows_fits(x, w), "{what}");
        let e = linear_rows(x, w, None).unwrap_err().to_string();
        assert!(e.contains("linear_rows"), "{what}: {e}");
    }
    let bad_bias = Tensor::zeros(4, DType::BF16, &dev)?;
    assert!(linear_rows(&x, &w, Some(&bad_bias))
        .unwrap_err()
        .to_string()
        .contains("bias"));
    Ok(())
}

/// Two small `linear_rows` calls for compute-sanitizer (memcheck, racecheck): one CTA per row
/// block, and a cluster of CTAs summing over distributed shared memory; a partial row block and
/// token tile in both.
#[test]
fn linear_rows_small_for_sanitizer() -> Result<()> {
    let dev = gpu();
    for (m, n, k) in [(3usize, 200usize, 128usize), (11, 130, 1024)] {
        let x = randn(&[m, k], DType::BF16, &dev);
        let w = (randn(&[n, k], DType::BF16, &dev) * 0.05)?.to_dtype(DType::BF16)?;
        let got = linear_rows(&x, &w, None)?.to_dtype(DType::F64)?;
        let want = x.to_dtype(DType::F64)?.matmul(&w.to_dtype(DType::F64)?.t()?)?;
        let err = (&got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        assert!(
            err.is_finite() && err <= 1e-2 * scale,
            "m {m} n {n} k {k}: {err:e} of {scale:e}"
        );
    }
    Ok(())
}

/// The add + RMSNorm form of `linear_vector` gives the results of the two launches it replaces
/// (the same device code runs in the prologue): the residual's bits, and the projection to the
/// last place, as it sums in another order; for every dtype, odd sizes, with and without a bias;
/// and it refuses what it does not cover.
#[test]
fn fused_linear_vector_inputs_match_the_two_launches() -> Result<()> {
    let dev = gpu();
    let to_f32s = |t: &Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>() };
    // The spacing of the element type's values relative to their magnitude (one unit in the last
    // place, at most).
    let last_place = |dtype: DType| match dtype {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        _ => 2f32.powi(-20),
    };
    for dtype in DTYPES {
        let vec = 16 / dtype.size_in_bytes();
        let max_norm = 256 * 4 * vec;
        for (n, k) in [
            (1usize, vec),
            (7, 576),
            (3072, 2048),
            (130, max_norm),
            (33, 1000 - 1000 % vec),
        ] {
            let w = (randn(&[n, k], dtype, &dev) * 0.05)?.to_dtype(dtype)?;
            let bias = randn(&[n], dtype, &dev);
            // add + RMSNorm: x and h (1, k), the norm's weight around 1.
            let (x, h) = (randn(&[1, k], dtype, &dev), randn(&[1, k], dtype, &dev));
            let norm_w = randn(&[k], DType::F32, &dev).affine(0.1, 1.0)?.to_dtype(dtype)?;
            assert!(linear_vector_add_norm_fits(&x, &h, &norm_w, &w), "{dtype:?} {k}");
            for with_bias in [false, true] {
                let b = with_bias.then_some(&bias);
                let (sum, got) = linear_vector_add_norm(&x, &h, &norm_w, 1e-5, &w, b)?;
                let (want_sum, normed) = add_rms_norm(&x, &h, &norm_w, 1e-5)?;
                let want = linear_vector(&normed, &w, b)?;
                assert_eq!((sum.dims(), got.dims()), ([1, k].as_slice(), [1, n].as_slice()));
                assert_eq!(bits(&sum)?, bits(&want_sum)?, "residual {dtype:?} n {n} k {k}");
                // The add + RMSNorm form sums each output's row in one warp, the plain form in
                // two warps (four over rows of 8 KB or more, `linear_vector_long`): the same f32
                // products in another order, so the two agree to one unit in the last place of
                // the element type (plus the f32 sums' reordering, 1e-5 of the largest output)
                // rather than bit for bit; a wrong staged input would be off by far more.
                let (g, e) = (to_f32s(&got)?, to_f32s(&want)?);
                let largest = e.iter().fold(0f32, |m, x| m.max(x.abs()));
                let worst = g
                    .iter()
                    .zip(&e)
                    .map(|(a, b)| (a - b).abs() / (a.abs().max(b.abs()) * last_place(dtype) + 1e-5 * largest))
                    .fold(0f32, f32::max);
                assert!(
                    g.iter().chain(&e).all(|x| x.is_finite()) && worst <= 1.0,
                    "norm input {dtype:?} n {n} k {k} bias {with_bias}: {worst} of the allowed difference"
                );
                // And the result is the projection (not only the same as another kernel).
                let ref64 = normed.to_dtype(DType::F64)?.matmul(&w.to_dtype(DType::F64)?.t()?)?;
                let ref64 = match b {
                    Some(b) => ref64.broadcast_add(&b.to_dtype(DType::F64)?)?,
                    None => ref64,
                };
                let max_abs = |t: &Tensor| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>();
                let err = max_abs(&(got.to_dtype(DType::F64)? - &ref64)?)?;
                let scale = max_abs(&ref64)?.max(1e-3);
                assert!(
                    err.is_finite() && err / scale <= tol(dtype) as f64 / 2.0,
                    "{dtype:?} n {n} k {k}: {err:e}"
                );
            }
        }
    }
    // What they do not take: the model keeps the separate launches, a direct call errs.
    let w = Tensor::zeros((5, 64), DType::BF16, &dev)?;
    let x = Tensor::zeros((1, 64), DType::BF16, &dev)?;
    let norm_w = Tensor::ones(64, DType::BF16, &dev)?;
    let long_w = Tensor::zeros((3, 8192 + 8), DType::BF16, &dev)?;
    let long = Tensor::zeros((1, 8192 + 8), DType::BF16, &dev)?;
    let long_norm = Tensor::ones(8192 + 8, DType::BF16, &dev)?;
    let short_norm = Tensor::ones(63, DType::BF16, &dev)?;
    let h_f16 = Tensor::zeros((1, 64), DType::F16, &dev)?;
    let offset = Tensor::zeros((66,), DType::BF16, &dev)?
        .narrow(0, 2, 64)?
        .reshape((1, 64))?;
    for (what, x, h, nw, w) in [
        ("row length", &long, &long, &long_norm, &long_w),
        ("norm weight", &x, &x, &short_norm, &w),
        ("dtype", &x, &h_f16, &norm_w, &w),
        ("alignment", &x, &offset, &norm_w, &w),
    ] {
        assert!(!linear_vector_add_norm_fits(x, h, nw, w), "{what}");
        assert!(linear_vector_add_norm(x, h, nw, 1e-5, w, None).is_err(), "{what}");
    }
    let cpu = Tensor::zeros((1, 64), DType::BF16, &Device::Cpu)?;
    let err = linear_vector_add_norm(&cpu, &cpu, &norm_w, 1e-5, &w, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("CUDA"), "{err}");
    let bad_bias = Tensor::zeros(4, DType::BF16, &dev)?;
    let err = linear_vector_add_norm(&x, &x, &norm_w, 1e-5, &w, Some(&bad_bias))
        .unwrap_err()
        .to_string();
    assert!(err.contains("bias"), "{err}");
    Ok(())
}

/// The gate/up launch with the SwiGLU output gives the bits of the gate/up launch followed by
/// `silu_mul` (the residual too), and silu(g) · u of an f64 reference; odd index counts (warps
/// past the last index) included; what it does not take is refused.
#[test]
fn swiglu_output_matches_the_gate_up_launch_then_silu_mul() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        let vec = 16 / dtype.size_in_bytes();
        for (inter, k) in [
            (1usize, vec),
            (7, 576),
            (8192, 2048),
            (130, 256 * 4 * vec),
            (33, 1000 - 1000 % vec),
        ] {
            let w = (randn(&[2 * inter, k], dtype, &dev) * 0.05)?.to_dtype(dtype)?;
            let (x, h) = (randn(&[1, k], dtype, &dev), randn(&[1, k], dtype, &dev));
            let norm_w = randn(&[k], DType::F32, &dev).affine(0.1, 1.0)?.to_dtype(dtype)?;
            assert!(linear_vector_add_norm_swiglu_fits(&x, &h, &norm_w, &w), "{dtype:?} {k}");
            let (sum, act) = linear_vector_add_norm_swiglu(&x, &h, &norm_w, 1e-5, &w)?;
            let (want_sum, gate_up) = linear_vector_add_norm(&x, &h, &norm_w, 1e-5, &w, None)?;
            let want = silu_mul(&gate_up)?;
            assert_eq!((sum.dims(), act.dims()), ([1, k].as_slice(), [1, inter].as_slice()));
            assert_eq!(bits(&sum)?, bits(&want_sum)?, "residual {dtype:?} inter {inter} k {k}");
            assert_eq!(bits(&act)?, bits(&want)?, "SwiGLU {dtype:?} inter {inter} k {k}");
            // And silu(g) · u itself, against f64 from the same normed input.
            let (_, normed) = add_rms_norm(&x, &h, &norm_w, 1e-5)?;
            let y = normed.to_dtype(DType::F64)?.matmul(&w.to_dtype(DType::F64)?.t()?)?;
            let (g, u) = (y.narrow(1, 0, inter)?, y.narrow(1, inter, inter)?);
            let ref64 = ((&g / (g.neg()?.exp()? + 1.0)?)? * u)?;
            let max_abs = |t: &Tensor| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>();
            let err = max_abs(&(act.to_dtype(DType::F64)? - &ref64)?)?;
            let scale = max_abs(&ref64)?.max(1e-3);
            assert!(
                err.is_finite() && err / scale <= tol(dtype) as f64,
                "{dtype:?} inter {inter} k {k}: {err:e}"
            );
        }
    }
    let x = Tensor::zeros((1, 64), DType::BF16, &dev)?;
    let norm_w = Tensor::ones(64, DType::BF16, &dev)?;
    let odd_rows = Tensor::zeros((5, 64), DType::BF16, &dev)?;
    let short_rows = Tensor::zeros((4, 56), DType::BF16, &dev)?;
    let f16_w = Tensor::zeros((4, 64), DType::F16, &dev)?;
    for (what, w) in [("odd rows", &odd_rows), ("k", &short_rows), ("dtype", &f16_w)] {
        assert!(!linear_vector_add_norm_swiglu_fits(&x, &x, &norm_w, w), "{what}");
        let err = linear_vector_add_norm_swiglu(&x, &x, &norm_w, 1e-5, w)
            .unwrap_err()
            .to_string();
        assert!(err.contains("SwiGLU"), "{what}: {err}");
    }
    Ok(())
}

/// The device's greedy choice equals the host's `argmax` on the same rows: random logits, planted
/// ties (the first wins), NaNs (never chosen), rows of NaN or -inf only.
#[test]
fn argmax_rows_matches_the_host_argmax() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        for cols in [1usize, 7, 513, 49_152, 128_257] {
            let mut x: Vec<Vec<f32>> = randn(&[6, cols], DType::F32, &Device::Cpu).to_vec2()?;
            if cols > 1 {
                // Row 1: two equal maxima, the later one planted first in memory order too.
                x[1][cols - 1] = 100.0;
                x[1][cols / 2] = 100.0;
                // Row 2: NaNs, the first element among them.
                for c in (0..cols).step_by(3) {
                    x[2][c] = f32::NAN;
                }
            }
            if cols > 10 {
                // Row 0: two equal maxima side by side (one 16-byte chunk of 16-bit values).
                x[0][9] = 100.0;
                x[0][10] = 100.0;
            }
            if cols > 8200 {
                // Row 0: two equal maxima at the starts of two of the kernel's chunks (4,096
                // 16-bit or 2,048 f32 values each; the row's own first chunk and a later one).
                x[0][4096] = 200.0;
                x[0][8192] = 200.0;
                // Row 5: the largest value the row's very last one (the last, partial chunk).
                x[5][cols - 1] = 300.0;
            }
            x[3].fill(f32::NAN);
            x[4].fill(f32::NEG_INFINITY);
            x[5][0] = f32::NAN;
            let host = Tensor::new(x, &Device::Cpu)?.to_dtype(dtype)?;
            let want: Vec<u32> = host
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
                .iter()
                .map(|r| argmax(r))
                .collect();
            // Poisoned output memory would show: every row is written.
            let got: Vec<u32> = argmax_rows(&host.to_device(&dev)?)?.to_vec1()?;
            assert_eq!(got, want, "{dtype:?} cols {cols}");
            if cols > 1 {
                assert_eq!(want[1], (cols / 2) as u32, "the first of two maxima");
            }
            if cols > 8200 {
                assert_eq!(want[0], 4096, "the first of two maxima in different chunks");
                assert_eq!(want[5], (cols - 1) as u32, "the maximum at the row's end");
            } else if cols > 10 {
                assert_eq!(want[0], 9, "the first of two adjacent maxima");
            }
        }
    }
    let cpu = Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?;
    assert!(argmax_rows(&cpu).unwrap_err().to_string().contains("CUDA"));
    let flat = Tensor::zeros(8, DType::F32, &dev)?;
    assert!(argmax_rows(&flat).is_err());
    let ints = Tensor::zeros((2, 8), DType::U32, &dev)?;
    assert!(argmax_rows(&ints).unwrap_err().to_string().contains("dtype"));
    let strided = Tensor::zeros((8, 2), DType::F32, &dev)?.t()?;
    assert!(argmax_rows(&strided).unwrap_err().to_string().contains("contiguous"));
    let empty = Tensor::zeros((2, 0), DType::F32, &dev)?;
    assert!(argmax_rows(&empty).is_err());
    Ok(())
}

/// `argmax_rows_into` writes each row's choice over a poisoned output and, with counts, adds one
/// to each; its outputs must be (rows,) u32 contiguous.
#[test]
fn argmax_rows_into_writes_the_tokens_and_advances_the_counts() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        let logits = randn(&[3, 5_003], dtype, &dev);
        let want: Vec<u32> = argmax_rows(&logits)?.to_vec1()?;
        let out = Tensor::new(&[7_777u32, 7_777, 7_777], &dev)?;
        let counts = Tensor::new(&[5u32, 0, 10], &dev)?;
        // The tokens also straight to the host: twice, so both slots are written (counts 6, 1,
        // 11, then 7, 2, 12), each read back by the counts it leaves.
        let mapped = MappedTokens::new(dev.as_cuda_device()?, 3)?;
        argmax_rows_into(&logits, &out, Some(&counts), Some(&mapped))?;
        assert_eq!(out.to_vec1::<u32>()?, want, "{dtype:?}");
        assert_eq!(counts.to_vec1::<u32>()?, [6, 1, 11], "{dtype:?}");
        assert_eq!(mapped.wait(&[6, 1, 11])?, want, "{dtype:?} on the host");
        let other = randn(&[3, 5_003], dtype, &dev);
        let want_other: Vec<u32> = argmax_rows(&other)?.to_vec1()?;
        argmax_rows_into(&other, &out, Some(&counts), Some(&mapped))?;
        assert_eq!(
            mapped.wait(&[7, 2, 12])?,
            want_other,
            "{dtype:?} on the host, the other slot"
        );
        assert_eq!(mapped.wait(&[6, 1, 11])?, want, "{dtype:?}: the first slot kept");
        assert_eq!(counts.to_vec1::<u32>()?, [7, 2, 12], "{dtype:?}");
        counts.slice_set(&Tensor::new(&[6u32, 1, 11], &dev)?, 0, 0)?;
        let out = Tensor::new(&[7_777u32, 7_777, 7_777], &dev)?;
        argmax_rows_into(&logits, &out, None, None)?;
        assert_eq!(out.to_vec1::<u32>()?, want, "{dtype:?} without counts");
        assert_eq!(counts.to_vec1::<u32>()?, [6, 1, 11], "the counts untouched");
    }
    let logits = randn(&[3, 64], DType::F32, &dev);
    let short = Tensor::zeros(2, DType::U32, &dev)?;
    assert!(argmax_rows_into(&logits, &short, None, None)
        .unwrap_err()
        .to_string()
        .contains("(3,)"));
    let floats = Tensor::zeros(3, DType::F32, &dev)?;
    assert!(argmax_rows_into(&logits, &floats, None, None).is_err());
    let strided = Tensor::zeros((3, 2), DType::U32, &dev)?.i((.., 1))?;
    assert!(argmax_rows_into(&logits, &strided, None, None).is_err());
    let out = Tensor::zeros(3, DType::U32, &dev)?;
    assert!(argmax_rows_into(&logits, &out, Some(&short), None).is_err());
    // Strided logits: refused, as by argmax_rows.
    let strided_logits = randn(&[64, 3], DType::F32, &dev).t()?;
    assert!(argmax_rows_into(&strided_logits, &out, None, None)
        .unwrap_err()
        .to_string()
        .contains("contiguous"));
    // Host-mapped tokens need the counts and as many rows.
    let counts = Tensor::zeros(3, DType::U32, &dev)?;
    let two = MappedTokens::new(dev.as_cuda_device()?, 2)?;
    assert!(argmax_rows_into(&logits, &out, Some(&counts), Some(&two))
        .unwrap_err()
        .to_string()
        .contains("2 rows"));
    let three = MappedTokens::new(dev.as_cuda_device()?, 3)?;
    assert!(argmax_rows_into(&logits, &out, None, Some(&three)).is_err());
    assert!(three.wait(&[1, 1]).is_err(), "counts for the wrong number of rows");
    // Counts no step has written: an error once the stream is idle, not a hang.
    assert!(three.wait(&[1_000, 1_000, 1_000]).is_err());
    Ok(())
}

/// The one-launch rotary tables against the host's f64 cos and sin of the same f32 angle
/// (position × frequency rounded to f32, as the kernel and the composed ops form it), and against
/// the composed ops on the GPU where the angle is within ±π: positions from 0 to 2^17,
/// frequencies of a Llama-3 table and one of 1.
#[test]
fn rope_angles_match_the_composed_ops() -> Result<()> {
    let dev = gpu();
    let positions: Vec<u32> = vec![0, 1, 2, 511, 4_095, 65_537, 131_071, 3];
    let (heads, half) = (5usize, 32usize);
    let inv: Vec<f32> = (0..heads * half)
        .map(|i| {
            if i % half == 0 {
                1.0
            } else {
                500_000f32.powf(-((i % half) as f32) / half as f32)
            }
        })
        .collect();
    let pos_t = Tensor::new(positions.as_slice(), &dev)?;
    let inv_t = Tensor::from_vec(inv.clone(), (heads, half), &dev)?;
    let (cos_c, sin_c) = rope_angles_per_head(&pos_t, &inv_t)?;
    for dtype in DTYPES {
        let (cos, sin) = rope_angles(&pos_t, &inv_t, dtype)?;
        assert_eq!(cos.dims(), [positions.len(), heads, half]);
        let ulp = match dtype {
            DType::F32 => 3e-7,
            DType::F16 => 1e-3,
            _ => 8e-3,
        };
        for (what, got, composed, f) in [
            ("cos", &cos, &cos_c, f64::cos as fn(f64) -> f64),
            ("sin", &sin, &sin_c, f64::sin),
        ] {
            let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let composed: Vec<f32> = composed
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            for (i, (&g, &c)) in got.iter().zip(&composed).enumerate() {
                let angle = positions[i / (heads * half)] as f32 * inv[i % (heads * half)];
                let want = f(angle as f64);
                assert!(
                    ((g as f64) - want).abs() <= ulp,
                    "{dtype:?} {what}[{i}]: {g} against {want} (angle {angle})"
                );
                // The composed ops' own cos and sin are candle's kernels: compared where any
                // implementation of them is accurate.
                if angle.abs() <= std::f32::consts::PI {
                    assert!(
                        (g - c).abs() <= 2.0 * ulp as f32,
                        "{dtype:?} {what}[{i}]: {g} against the composed {c}"
                    );
                }
            }
        }
    }
    let cpu = Tensor::new(&[1u32], &Device::Cpu)?;
    assert!(rope_angles(&cpu, &inv_t, DType::BF16)
        .unwrap_err()
        .to_string()
        .contains("CUDA"));
    let floats = Tensor::new(&[1f32], &dev)?;
    assert!(rope_angles(&floats, &inv_t, DType::BF16).is_err());
    let matrix = Tensor::zeros((2, 2), DType::U32, &dev)?;
    assert!(rope_angles(&matrix, &inv_t, DType::BF16).is_err());
    assert!(rope_angles(&pos_t, &inv_t.to_dtype(DType::BF16)?, DType::BF16).is_err());
    Ok(())
}

/// The bits of a tensor's elements, for exact comparisons: u32 as they are, floats through
/// their f32 values (exact for 16-bit floats, so equal bits stay equal and different ones
/// different).
fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U32 => t.to_vec1()?,
        _ => t
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    })
}

#[test]
fn decode_prologue_matches_the_composed_ops() -> Result<()> {
    let dev = gpu();
    // (rows, vocab, hidden, per-head tables): candle's rmsnorm takes 1024 threads from 1024
    // columns and 32 below, so both block sizes, and odd widths, are covered.
    for (rows, vocab, hidden, heads, half) in [
        (1usize, 1000usize, 2048usize, 5usize, 32usize),
        (3, 517, 576, 3, 16),
        (2, 64, 1000, 1, 8),
        (5, 300, 4096, 6, 64),
    ] {
        for dtype in DTYPES {
            let embed = randn(&[vocab, hidden], dtype, &dev).affine(3.0, 0.5)?;
            let weight = randn(&[hidden], dtype, &dev);
            let eps = 1e-5;
            let ids: Vec<u32> = (0..rows).map(|r| ((r * 7919 + 13) % vocab) as u32).collect();
            let lens: Vec<u32> = (0..rows).map(|r| (r * 977 + 5) as u32).collect();
            let slots: Vec<u32> = (0..rows).map(|r| (r * 4096) as u32).collect();
            let inv: Vec<f32> = (0..heads * half)
                .map(|i| 500_000f32.powf(-((i % half) as f32) / half as f32))
                .collect();
            let (ids_t, lens_t, slots_t) = (
                Tensor::new(ids.as_slice(), &dev)?,
                Tensor::new(lens.as_slice(), &dev)?,
                Tensor::new(slots.as_slice(), &dev)?,
            );
            let inv_t = Tensor::from_vec(inv, (heads, half), &dev)?;
            for slot_starts in [Some(&slots_t), None] {
                let out = decode_prologue(&PrologueInputs {
                    ids: &ids_t,
                    lens: &lens_t,
                    slot_starts,
                    inv_freq: &inv_t,
                    embed: &embed,
                    norm_weight: &weight,
                    eps,
                })?;
                let what = format!("{dtype:?} rows {rows} hidden {hidden}");
                let plus_one: Vec<u32> = lens.iter().map(|l| l + 1).collect();
                assert_eq!(out.seqlens.to_vec1::<u32>()?, plus_one, "{what}: key counts");
                match (slot_starts, &out.cache_rows) {
                    (Some(_), Some(r)) => {
                        let want: Vec<u32> = lens.iter().zip(&slots).map(|(l, s)| l + s).collect();
                        assert_eq!(r.to_vec1::<u32>()?, want, "{what}: cache rows");
                    }
                    (None, None) => {}
                    _ => panic!("{what}: cache rows given without slot starts, or missing"),
                }
                let (cos, sin) = rope_angles(&lens_t, &inv_t, dtype)?;
                assert_eq!(out.cos.dims(), [rows, heads, half]);
                assert_eq!(bits(&out.cos)?, bits(&cos)?, "{what}: cos");
                assert_eq!(bits(&out.sin)?, bits(&sin)?, "{what}: sin");
                let x = embed.index_select(&ids_t, 0)?;
                assert_eq!(bits(&out.x)?, bits(&x)?, "{what}: embedding rows");
                let normed = candle_nn::ops::rms_norm(&x, &weight, eps as f32)?;
                assert_eq!(bits(&out.normed)?, bits(&normed)?, "{what}: RMSNorm");
                // And against f64, so that the two cannot agree on a wrong value.
                let x64: Vec<Vec<f64>> = x.to_dtype(DType::F64)?.to_vec2()?;
                let w64: Vec<f64> = weight.to_dtype(DType::F64)?.to_vec1()?;
                let got: Vec<Vec<f32>> = out.normed.to_dtype(DType::F32)?.to_vec2()?;
                for (r, row) in x64.iter().enumerate() {
                    let scale = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + eps).sqrt();
                    for c in 0..hidden {
                        let want = row[c] * scale * w64[c];
                        let g = got[r][c] as f64;
                        assert!(
                            (g - want).abs() <= 2.0 * tol(dtype) as f64 * want.abs().max(1.0),
                            "{what}: normed[{r}][{c}] {g} against {want}"
                        );
                    }
                }
            }
        }
    }
    // An id past the vocabulary reads as a row of NaN, not as memory past the table.
    let embed = randn(&[10, 64], DType::BF16, &dev);
    let weight = randn(&[64], DType::BF16, &dev);
    let inv_t = Tensor::new(&[1f32, 0.5], &dev)?;
    let lens_t = Tensor::new(&[3u32, 4], &dev)?;
    let ids_t = Tensor::new(&[2u32, 10], &dev)?;
    let inputs = PrologueInputs {
        ids: &ids_t,
        lens: &lens_t,
        slot_starts: None,
        inv_freq: &inv_t,
        embed: &embed,
        norm_weight: &weight,
        eps: 1e-6,
    };
    let out = decode_prologue(&inputs)?;
    let x: Vec<Vec<f32>> = out.x.to_dtype(DType::F32)?.to_vec2()?;
    let normed: Vec<Vec<f32>> = out.normed.to_dtype(DType::F32)?.to_vec2()?;
    assert!(x[0].iter().chain(&normed[0]).all(|v| v.is_finite()));
    assert!(
        x[1].iter().chain(&normed[1]).all(|v| v.is_nan()),
        "an id past the vocabulary"
    );
    // Bad inputs are refused.
    let bad_ids = Tensor::new(&[1f32, 2.0], &dev)?;
    let short_lens = Tensor::new(&[1u32], &dev)?;
    let f16_weight = weight.to_dtype(DType::F16)?;
    let short_weight = randn(&[63], DType::BF16, &dev);
    let bf16_freq = inv_t.to_dtype(DType::BF16)?;
    let cpu_embed = embed.to_device(&Device::Cpu)?;
    let strided = randn(&[64, 10], DType::BF16, &dev).t()?;
    let no_ids = Tensor::zeros(0, DType::U32, &dev)?;
    for (what, case) in [
        (
            "f32 ids",
            PrologueInputs {
                ids: &bad_ids,
                ..inputs
            },
        ),
        (
            "fewer counts than ids",
            PrologueInputs {
                lens: &short_lens,
                ..inputs
            },
        ),
        (
            "an f16 norm weight",
            PrologueInputs {
                norm_weight: &f16_weight,
                ..inputs
            },
        ),
        (
            "a short norm weight",
            PrologueInputs {
                norm_weight: &short_weight,
                ..inputs
            },
        ),
        (
            "bf16 frequencies",
            PrologueInputs {
                inv_freq: &bf16_freq,
                ..inputs
            },
        ),
        (
            "a CPU embedding",
            PrologueInputs {
                embed: &cpu_embed,
                ..inputs
            },
        ),
        (
            "a strided embedding",
            PrologueInputs {
                embed: &strided,
                ..inputs
            },
        ),
        (
            "no rows",
            PrologueInputs {
                ids: &no_ids,
                lens: &no_ids,
                ..inputs
            },
        ),
    ] {
        assert!(decode_prologue(&case).is_err(), "{what} must be refused");
    }
    Ok(())
}

/// Greedy tokens one step at a time on the host (`step` and `argmax`), each sequence ending at
/// a stop token or after `max_tokens`: what `generate` must produce.
fn greedy_on_the_host(model: &Llama, prompts: &[Vec<u32>], max_tokens: usize, stop: &[u32]) -> Vec<Vec<u32>> {
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let mut cache = model.new_cache(prompts.len(), longest + max_tokens).unwrap();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut inputs = prompts.to_vec();
    while inputs.iter().any(|i| !i.is_empty()) {
        let logits: Vec<Vec<f32>> = model.step(&inputs, &mut cache).unwrap().to_vec2().unwrap();
        for (i, input) in inputs.iter_mut().enumerate() {
            if input.is_empty() {
                continue;
            }
            let token = argmax(&logits[i]);
            out[i].push(token);
            let done = stop.contains(&token) || out[i].len() >= max_tokens;
            *input = if done { Vec::new() } else { vec![token] };
        }
    }
    out
}

/// A CUDA device with cudarc's per-tensor event tracking off, as the examples make it: what the
/// CUDA-graph decode needs (event waits cannot be captured).
fn gpu_untracked() -> Device {
    let dev = gpu();
    // SAFETY: every tensor of the tests that use it lives and is used on candle's one stream.
    unsafe { dev.as_cuda_device().unwrap().disable_event_tracking() };
    dev
}

/// Feeds `tokens[i]` (what a graph decode produced after `prompts[i]`) through the eager steps
/// (`Llama::step`, a fresh cache) and checks that each token is the argmax of the eager logits up
/// to two roundings of the dtype of the logits' spread (the eager decode reads the cache through
/// the varlen kernel, the graph through the kvcache kernel, so near-ties may go either way).
/// Returns how many tokens are the eager argmax exactly.
fn assert_follows_the_eager_steps(model: &Llama, prompts: &[Vec<u32>], tokens: &[Vec<u32>], what: &str) -> usize {
    assert_follows_the_eager_steps_of(model, prompts, tokens, what, model.dtype())
}

/// [`assert_follows_the_eager_steps`] with the eager steps over a cache of `cache_dtype`.
fn assert_follows_the_eager_steps_of(
    model: &Llama,
    prompts: &[Vec<u32>],
    tokens: &[Vec<u32>],
    what: &str,
    cache_dtype: DType,
) -> usize {
    let longest = prompts
        .iter()
        .zip(tokens)
        .map(|(p, t)| p.len() + t.len())
        .max()
        .unwrap();
    let mut cache = model.new_cache_of(prompts.len(), longest, cache_dtype).unwrap();
    let mut inputs = prompts.to_vec();
    let (mut exact, mut worst) = (0, 0f32);
    for n in 0..tokens.iter().map(Vec::len).max().unwrap() {
        let logits: Vec<Vec<f32>> = model.step(&inputs, &mut cache).unwrap().to_vec2().unwrap();
        for (i, row) in logits.iter().enumerate() {
            let Some(&token) = tokens[i].get(n) else {
                inputs[i].clear();
                continue;
            };
            assert!(row.iter().all(|x| x.is_finite()), "{what}: step {n}: non-finite logits");
            let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let spread = best - row.iter().copied().fold(f32::INFINITY, f32::min);
            let gap = (best - row[token as usize]) / spread;
            worst = worst.max(gap);
            assert!(
                gap <= 2.0 * tol(model.dtype()),
                "{what}: step {n}, sequence {i}: the graph chose {token}, {gap:.3e} of the spread under the eager argmax {}",
                argmax(row)
            );
            exact += (argmax(row) == token) as usize;
            inputs[i] = vec![token];
        }
    }
    let total: usize = tokens.iter().map(Vec::len).sum();
    println!("{what}: {exact}/{total} tokens the eager argmax, worst gap {worst:.2e} of the spread");
    exact
}

/// `generate`'s CUDA-graph decode (one step captured, then replayed; attention through
/// `flash_attn_with_kvcache` over strided views of the cache with the lengths on the device)
/// against the eager steps fed the graph's own tokens ([`assert_follows_the_eager_steps`]), and
/// at least 90% of the tokens the eager argmax exactly. Prompts of different lengths (5, 9, 70, so the sequences sit at different positions),
/// batches of 3, 1 and 67 sequences, d8 and d64 heads, bf16 and f16; a stop token that ends one sequence mid-batch leaves
/// the others' tokens unchanged.
#[test]
fn cuda_graph_decode_follows_the_eager_steps() {
    let dev = gpu_untracked();
    let max_tokens = 24;
    for family in [Family::Llama, Family::WideHeads] {
        let dir = hf_model(family);
        for dtype in [DType::BF16, DType::F16] {
            let model = load_hf_dir(&dir, dtype, &dev, Kernels::Fused).unwrap();
            let opts = GenerateOptions {
                max_tokens,
                sampling: SamplingParams::default(),
                stop_tokens: vec![],
                kv_cache_dtype: None,
                cuda_graphs: true,
            };
            // Batch 67: 67 sequences × 2 kv heads are more decode CTAs than an H100 or H200 has
            // SMs, past flash-attn3's own choice of its decode kernel, which the d64 model asks
            // for over short caches (flash_llama's DECODE_KERNEL_MAX_KEYS). Prompts of 3 to 98
            // tokens (the test model's context is 128).
            let past_one_wave: Vec<Vec<u32>> = (0..67).map(|i| tokens(3 + 5 * (i % 20), 10 + i as u32)).collect();
            for prompts in [
                vec![tokens(5, 1), tokens(9, 2), tokens(70, 3)],
                vec![tokens(33, 4)],
                past_one_wave,
            ] {
                let what = format!("{family:?} {dtype:?} batch {}", prompts.len());
                let mut streamed = vec![Vec::new(); prompts.len()];
                let g = generate(&model, &prompts, &opts, |i, t| {
                    streamed[i].push(t);
                    Ok(Flow::Continue)
                })
                .unwrap();
                assert_eq!(
                    g.tokens, streamed,
                    "{what}: streamed tokens differ from the returned ones"
                );
                assert!(g.tokens.iter().all(|t| t.len() == max_tokens), "{what}: {:?}", g.tokens);
                assert_eq!(g.step_ends_secs.len(), max_tokens, "{what}: one step end per token");
                let exact = assert_follows_the_eager_steps(&model, &prompts, &g.tokens, &what);
                let total = max_tokens * prompts.len();
                assert!(
                    exact * 10 >= total * 9,
                    "{what}: only {exact} of {total} tokens are the eager argmax"
                );
                // The caller ends the first sequence at its 6th token: its tokens stop there,
                // the others' are unchanged.
                if prompts.len() > 1 {
                    let mut first = 0;
                    let s = generate(&model, &prompts, &opts, |i, _| {
                        first += (i == 0) as usize;
                        Ok(if i == 0 && first == 6 {
                            Flow::Stop
                        } else {
                            Flow::Continue
                        })
                    })
                    .unwrap();
                    assert_eq!(s.tokens[0], g.tokens[0][..6], "{what}: the stopped sequence");
                    assert_eq!(s.tokens[1..], g.tokens[1..], "{what}: the sequences that went on");
                }
            }
        }
    }
}

/// The continuous batcher with CUDA graphs (`Batcher::cuda_graphs`): requests joining at
/// different steps (graphs of 1, 2 and 4 rows, empty slots among the rows, the slot of a finished
/// request taken by a newcomer, steps with a prompt going in run eagerly), each request's greedy
/// tokens following the eager steps of that request alone ([`assert_follows_the_eager_steps`]);
/// over a contiguous cache and over a paged one (pages of 16, shuffled by the requests' comings
/// and goings; the graphs' empty slots write into the cache's scratch page).
#[test]
fn batcher_cuda_graphs_follow_the_eager_steps() {
    let dev = gpu_untracked();
    let dir = hf_model(Family::WideHeads);
    for (dtype, paged) in [
        (DType::BF16, false),
        (DType::F16, false),
        (DType::BF16, true),
        (DType::F16, true),
    ] {
        let model = load_hf_dir(&dir, dtype, &dev, Kernels::Fused).unwrap();
        let cache = match paged {
            true => model.new_paged_cache(4, 40, 16, 128, dtype).unwrap(),
            false => model.new_cache_of(4, 128, dtype).unwrap(),
        };
        let mut batcher = Batcher::with_cache(&model, cache).unwrap().cuda_graphs(true);
        // (step to join at, prompt, max_tokens)
        let requests: Vec<(usize, Vec<u32>, usize)> = vec![
            (0, tokens(7, 1), 20),
            (2, tokens(30, 2), 12),
            (5, tokens(5, 3), 16),
            (5, tokens(12, 4), 10),
            (9, tokens(3, 5), 14),
            (9, tokens(40, 6), 6),
        ];
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let mut waiting: Vec<usize> = (0..requests.len()).collect();
        let mut step = 0;
        while !waiting.is_empty() || batcher.running() > 0 {
            while let Some(&r) = waiting.first() {
                if requests[r].0 > step || batcher.free_slots() == 0 {
                    break;
                }
                let request = Request {
                    prompt: requests[r].1.clone(),
                    max_tokens: requests[r].2,
                    sampling: SamplingParams::default(),
                    stop_tokens: vec![],
                };
                batcher.join(r as u64, request).unwrap();
                waiting.remove(0);
            }
            for e in batcher.step().unwrap() {
                got[e.id as usize].push(e.token);
            }
            step += 1;
            assert!(step < 200, "the batch does not drain");
        }
        for (r, (_, _, max_tokens)) in requests.iter().enumerate() {
            assert_eq!(got[r].len(), *max_tokens, "{dtype:?} paged {paged}: request {r}");
        }
        assert_eq!(
            batcher.cuda_graph_rows(),
            vec![1, 2, 4],
            "{dtype:?} paged {paged}: the decode steps captured"
        );
        let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.1.clone()).collect();
        let what = format!("batcher with graphs, {dtype:?}, paged {paged}");
        let exact = assert_follows_the_eager_steps(&model, &prompts, &got, &what);
        let total: usize = got.iter().map(Vec::len).sum();
        assert!(
            exact * 10 >= total * 9,
            "{what}: only {exact} of {total} tokens are the eager argmax"
        );
    }
}

/// The continuous batcher with CUDA graphs over an fp8 cache, contiguous and paged (pages of 16):
/// requests that all join at the first step (one prefill fixes the scales, as the eager
/// reference's does), then graph replays; each request's greedy tokens follow the eager steps
/// over an fp8 cache ([`assert_follows_the_eager_steps_of`]).
#[test]
fn batcher_cuda_graphs_over_an_fp8_cache() {
    let dev = gpu_untracked();
    let dir = hf_model(Family::WideHeads);
    let model = load_hf_dir(&dir, DType::BF16, &dev, Kernels::Fused).unwrap();
    for paged in [false, true] {
        batcher_over_an_fp8_cache(&model, paged);
    }
}

fn batcher_over_an_fp8_cache(model: &Llama, paged: bool) {
    let cache = match paged {
        true => model.new_paged_cache(4, 40, 16, 128, DType::F8E4M3).unwrap(),
        false => model.new_cache_of(4, 128, DType::F8E4M3).unwrap(),
    };
    let mut batcher = Batcher::with_cache(model, cache).unwrap().cuda_graphs(true);
    let requests: Vec<(Vec<u32>, usize)> = vec![(tokens(7, 1), 20), (tokens(30, 2), 12), (tokens(5, 3), 16)];
    for (r, (prompt, max_tokens)) in requests.iter().enumerate() {
        let request = Request {
            prompt: prompt.clone(),
            max_tokens: *max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
        };
        batcher.join(r as u64, request).unwrap();
    }
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let mut steps = 0;
    while batcher.running() > 0 {
        for e in batcher.step().unwrap() {
            got[e.id as usize].push(e.token);
        }
        steps += 1;
        assert!(steps < 100, "the batch does not drain");
    }
    for (r, (_, max_tokens)) in requests.iter().enumerate() {
        assert_eq!(got[r].len(), *max_tokens, "paged {paged}: request {r}");
    }
    // Three sequences in slots 0-2: four rows; two left, then one.
    assert_eq!(
        batcher.cuda_graph_rows(),
        vec![1, 4],
        "paged {paged}: the decode steps captured"
    );
    let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.0.clone()).collect();
    let what = &format!("batcher with graphs over an fp8 cache, paged {paged}");
    let exact = assert_follows_the_eager_steps_of(model, &prompts, &got, what, DType::F8E4M3);
    let total: usize = got.iter().map(Vec::len).sum();
    assert!(
        exact * 10 >= total * 9,
        "{what}: only {exact} of {total} tokens are the eager argmax"
    );
}

/// `generate`'s greedy decoding on the GPU (tokens chosen on the device, the next step queued
/// before the host reads them) gives the host loop's tokens: a batch of prompts of different
/// lengths, without stop tokens and with one that ends a sequence mid-batch (its queued step's
/// row is then dropped), and batch 1.
#[test]
fn greedy_generation_on_the_gpu_equals_host_sampling() {
    let dir = hf_model(Family::Llama);
    for dtype in [DType::BF16, DType::F16] {
        let model = load_hf_dir(&dir, dtype, &gpu(), Kernels::Fused).unwrap();
        let prompts = vec![tokens(5, 1), tokens(9, 2), tokens(70, 3)];
        let run = |prompts: &[Vec<u32>], stop: Vec<u32>| {
            let opts = GenerateOptions {
                max_tokens: 12,
                sampling: SamplingParams::default(),
                stop_tokens: stop,
                kv_cache_dtype: None,
                // The eager steps (see cuda_graph_decode_follows_the_eager_steps for the graph).
                cuda_graphs: false,
            };
            let mut streamed = vec![Vec::new(); prompts.len()];
            let g = generate(&model, prompts, &opts, |i, t| {
                streamed[i].push(t);
                Ok(Flow::Continue)
            })
            .unwrap();
            assert_eq!(g.tokens, streamed, "streamed tokens differ from the returned ones");
            g
        };
        let want = greedy_on_the_host(&model, &prompts, 12, &[]);
        let got = run(&prompts, Vec::new());
        assert_eq!(got.tokens, want, "{dtype:?}, no stop tokens");
        assert_eq!(got.decode_tokens, 3 * 11);
        assert!(got.decode_wait_secs >= 0.0 && got.decode_wait_secs <= got.decode_secs);
        // A stop token (one the second sequence produces) that ends it while another goes on.
        let (stop, want_stopped) = want[1]
            .iter()
            .map(|&stop| (stop, greedy_on_the_host(&model, &prompts, 12, &[stop])))
            .find(|(_, w)| w.iter().any(|seq| seq.len() > w[1].len()))
            .expect("a token that stops the second sequence before another");
        assert_eq!(want_stopped[1].last(), Some(&stop));
        assert_eq!(
            run(&prompts, vec![stop]).tokens,
            want_stopped,
            "{dtype:?}, stop token {stop}"
        );
        assert_eq!(run(&prompts[2..], Vec::new()).tokens, want[2..], "{dtype:?}, batch 1");
        println!("greedy on the GPU {dtype:?}: {:?}", want);
    }
}

#[test]
fn fused_ops_reject_what_they_do_not_cover() -> Result<()> {
    let dev = gpu();
    let cpu = Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?;
    let w = Tensor::ones(8, DType::F32, &Device::Cpu)?;
    let err = add_rms_norm(&cpu, &cpu, &w, 1e-5).unwrap_err().to_string();
    assert!(err.contains("CUDA"), "{err}");
    let err = silu_mul(&cpu).unwrap_err().to_string();
    assert!(err.contains("CUDA"), "{err}");
    let odd = Tensor::zeros((2, 7), DType::BF16, &dev)?;
    let err = silu_mul(&odd).unwrap_err().to_string();
    assert!(err.contains("even"), "{err}");
    let ints = Tensor::zeros((2, 8), DType::U32, &dev)?;
    let err = silu_mul(&ints).unwrap_err().to_string();
    assert!(err.contains("dtype"), "{err}");
    let x = Tensor::zeros((2, 8), DType::BF16, &dev)?;
    let err = add_rms_norm(&x, &x, &Tensor::ones(7, DType::BF16, &dev)?, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight"), "{err}");
    let err = add_rms_norm(&x, &x.t()?, &Tensor::ones(8, DType::BF16, &dev)?, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shape"), "{err}");
    let strided = Tensor::zeros((8, 2), DType::BF16, &dev)?.t()?;
    let err = add_rms_norm(&strided, &strided, &Tensor::ones(8, DType::BF16, &dev)?, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("contiguous"), "{err}");
    let mixed = Tensor::ones(8, DType::F16, &dev)?;
    let err = add_rms_norm(&x, &x, &mixed, 1e-5).unwrap_err().to_string();
    assert!(err.contains("F16"), "{err}");
    let y = Tensor::zeros((2, 3, 8), DType::BF16, &dev)?;
    let cs = Tensor::zeros((2, 3, 3), DType::BF16, &dev)?;
    let err = rope_store(&y, &cs, &cs, false, None).unwrap_err().to_string();
    assert!(err.contains("cos/sin"), "{err}");
    let cs = Tensor::zeros((2, 3, 4), DType::BF16, &dev)?;
    let kv = Tensor::zeros((4, 4, 8), DType::BF16, &dev)?;
    let rows = Tensor::new(&[0u32, 1], &dev)?;
    let err = rope_store(&y, &cs, &cs, false, Some(CacheStore::Rows { kv: &kv, rows: &rows }))
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not fit"), "{err}");
    Ok(())
}

/// Prefill of prompts of different lengths (varlen), then decode steps with one sequence
/// sitting out a step; the logits of every step.
fn run(model: &Llama) -> Vec<Tensor> {
    let mut cache = model.new_cache(3, 96).unwrap();
    let mut out = vec![model
        .step(&[tokens(5, 1), tokens(9, 2), tokens(70, 3)], &mut cache)
        .unwrap()];
    for step in 0..4u32 {
        let mut next: Vec<Vec<u32>> = (0..3).map(|i| vec![(step * 5 + i * 11 + 1) % VOCAB as u32]).collect();
        if step == 2 {
            next[1].clear();
        }
        out.push(model.step(&next, &mut cache).unwrap());
    }
    let ids = Tensor::new(vec![tokens(12, 4), tokens(12, 5)], model.device()).unwrap();
    out.push(model.forward(&ids).unwrap().flatten_to(1).unwrap());
    out
}

/// Loads one test model in a dtype with a kernel set, on the GPU.
type Loader = dyn Fn(DType, Kernels) -> Llama;

/// The fused kernels change nothing but rounding: whole models on the GPU give the composed
/// logits within bf16/f16 tolerance (prefill, decode through the cache, full forward).
#[test]
fn fused_model_matches_composed_on_the_gpu() {
    let gguf_dir = common::temp_dir("gpu-gguf");
    let gguf = gguf_dir.join("tiny.gguf");
    common::write_gguf(&gguf);
    let mut cases: Vec<(String, Box<Loader>)> = Vec::new();
    for family in Family::ALL {
        let dir = hf_model(family);
        cases.push((
            format!("{family:?}"),
            Box::new(move |dt, k| load_hf_dir(&dir, dt, &gpu(), k).unwrap()),
        ));
    }
    cases.push((
        "GGUF (interleaved RoPE)".into(),
        Box::new(move |dt, k| load_gguf(&gguf, dt, &gpu(), k).unwrap()),
    ));
    for (name, load) in &cases {
        for dtype in [DType::BF16, DType::F16] {
            let composed = run(&load(dtype, Kernels::Composed));
            let fused = run(&load(dtype, Kernels::Fused));
            for (step, (f, c)) in fused.iter().zip(&composed).enumerate() {
                let d = rel_diff(f, c);
                let limit = if dtype == DType::BF16 { 0.05 } else { 0.01 };
                println!("model {name} {dtype:?} step {step}: fused vs composed {d:.2e}");
                assert!(
                    d <= limit,
                    "{name} {dtype:?} step {step}: fused differs from composed by {d}"
                );
            }
            // Sequence 1 sat out step 3: its row is zero in both.
            assert_eq!(abs_sum(&fused[3].i(1).unwrap()), 0.0);
        }
    }
}

/// The e4m3 store of the fused RoPE + KV store: the rotated k and v heads times their factor,
/// saturated and cast, land in the k and v planes at each token's row, bit for bit as candle's
/// clamp and cast of the same values (the CPU path's quantization); other rows stay zero.
#[test]
fn rope_store_e4m3_matches_clamp_and_cast() -> Result<()> {
    let dev = gpu();
    for dtype in DTYPES {
        for interleaved in [false, true] {
            // (tokens, q heads, kv heads, head_dim, cache rows)
            for (tokens, h, hk, d, cache_rows) in [(1, 8, 2, 64, 40), (5, 6, 3, 128, 11), (33, 2, 1, 64, 71)] {
                let heads = h + 2 * hk;
                let y = randn(&[tokens, heads, d], dtype, &dev);
                let angles = Tensor::rand(-4f32, 4.0, (tokens, heads, d / 2), &dev)?;
                let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
                let rows: Vec<u32> = (0..tokens).map(|t| ((t * 7 + 3) % cache_rows) as u32).collect();
                let rows_t = Tensor::new(rows.clone(), &dev)?;
                // Distinct rows (7 and the row count coprime). Factors from 0.5 to 300: the largest saturate many values at 448.
                let quant: Vec<f32> = (0..2 * hk)
                    .map(|i| 0.5 * 600f32.powf(i as f32 / (2 * hk - 1).max(1) as f32))
                    .collect();
                let quant = Tensor::new(quant, &dev)?;
                let kv = Tensor::zeros((2, cache_rows, hk, d), DType::F8E4M3, &dev)?;
                let got = y.copy()?;
                rope_store(
                    &got,
                    &cos,
                    &sin,
                    interleaved,
                    Some(CacheStore::E4m3 {
                        kv: &kv,
                        rows: &rows_t,
                        quant: &quant,
                    }),
                )?;
                let alone = y.copy()?;
                rope_store(&alone, &cos, &sin, interleaved, None)?;
                assert_eq!(rel_diff(&got, &alone), 0.0, "y is rotated as without a store");
                let rotated = got.clone();
                let want = rotated
                    .narrow(1, h, 2 * hk)?
                    .to_dtype(DType::F32)?
                    .broadcast_mul(&quant.reshape((1, 2 * hk, 1))?)?
                    .clamp(-448f32, 448f32)?
                    .to_device(&Device::Cpu)?
                    .to_dtype(DType::F8E4M3)?;
                // (On the host: candle's CUDA casts have no f8e4m3 kernels.)
                let bits = |t: &Tensor| -> Result<Vec<f32>> {
                    t.to_device(&Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1()
                };
                for (plane, name) in [(0, "k"), (1, "v")] {
                    let stored = kv
                        .get(plane)?
                        .to_device(&Device::Cpu)?
                        .index_select(&rows_t.to_device(&Device::Cpu)?, 0)?;
                    assert_eq!(
                        bits(&stored)?,
                        bits(&want.narrow(1, plane * hk, hk)?)?,
                        "{dtype:?} {tokens}x{heads}x{d} {name} plane"
                    );
                    let untouched: Vec<u32> = (0..cache_rows as u32).filter(|r| !rows.contains(r)).collect();
                    let rest = kv
                        .get(plane)?
                        .to_device(&Device::Cpu)?
                        .index_select(&Tensor::new(untouched, &Device::Cpu)?, 0)?;
                    assert_eq!(
                        abs_sum(&rest.to_dtype(DType::F32)?),
                        0.0,
                        "rows that were not written changed"
                    );
                }
                // The store without rotation (an fp8 cache's first write) of the rotated values:
                // the same bytes.
                let kv2 = Tensor::zeros((2, cache_rows, hk, d), DType::F8E4M3, &dev)?;
                store_e4m3(&got.narrow(1, h, 2 * hk)?, &kv2, &rows_t, &quant)?;
                assert_eq!(bits(&kv2)?, bits(&kv)?, "{dtype:?} {tokens}x{heads}x{d}: store_e4m3");
                let saturated = bits(&want)?.iter().filter(|v| v.abs() == 448.0).count();
                assert!(saturated > 0, "the case saturates some values");
                println!("rope_store e4m3 {dtype:?} interleaved {interleaved} {tokens}x{heads}x{d}: bit-equal ({saturated} saturated)");
            }
        }
    }
    Ok(())
}

/// An fp8 KV cache on the GPU (the `_tv` kvcache kernels, the fused e4m3 store): every step
/// after the prefill follows the bf16 cache within e4m3's rounding (the prefill, which attends
/// to the fresh keys, equals it), with sequences taking different numbers of tokens or none;
/// and `generate`'s greedy loop on the device gives the host loop's tokens over an fp8 cache.
#[test]
fn fp8_cache_follows_the_bf16_cache_on_the_gpu() {
    let dir = hf_model(Family::WideHeads);
    for kernels in [Kernels::Fused, Kernels::Composed] {
        let model = load_hf_dir(&dir, DType::BF16, &gpu(), kernels).unwrap();
        let mut exact = model.new_cache(4, 96).unwrap();
        let mut fp8 = model.new_cache_of(4, 96, DType::F8E4M3).unwrap();
        let steps = mixed_steps(70);
        for (n, step) in steps.iter().enumerate() {
            let want = model.step(step, &mut exact).unwrap();
            let got = model.step(step, &mut fp8).unwrap();
            let d = rel_diff(&got, &want);
            println!("{kernels:?} step {n}: fp8 cache vs bf16 cache {d:.2e}");
            if n == 0 {
                assert_eq!(d, 0.0, "{kernels:?}: the prefill does not read the cache");
            } else {
                assert!(d > 0.0 && d < 0.15, "{kernels:?} step {n}: fp8 cache differs by {d}");
            }
            for (i, t) in step.iter().enumerate() {
                if t.is_empty() {
                    assert_eq!(abs_sum(&got.i(i).unwrap()), 0.0, "step {n}: sequence {i} sat out");
                }
            }
        }
    }
    let model = load_hf_dir(&dir, DType::BF16, &gpu(), Kernels::Fused).unwrap();
    let prompts = vec![tokens(5, 1), tokens(9, 2), tokens(70, 3)];
    let opts = GenerateOptions {
        max_tokens: 12,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        kv_cache_dtype: Some(DType::F8E4M3),
        cuda_graphs: false,
    };
    let on_device = generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue))
        .unwrap()
        .tokens;
    // The host loop over an fp8 cache.
    let mut cache = model.new_cache_of(3, 70 + 12, DType::F8E4M3).unwrap();
    let mut inputs = prompts.clone();
    let mut on_host = vec![Vec::new(); 3];
    for _ in 0..12 {
        let logits: Vec<Vec<f32>> = model.step(&inputs, &mut cache).unwrap().to_vec2().unwrap();
        for i in 0..3 {
            let t = argmax(&logits[i]);
            on_host[i].push(t);
            inputs[i] = vec![t];
        }
    }
    assert_eq!(on_device, on_host);
}

/// `generate`'s CUDA-graph decode over an fp8 cache (the prefill eager, which fixes the scales;
/// then each step's fused RoPE + e4m3 store, q quantized on the device and the `_tv` kvcache call,
/// captured once and replayed) against the eager steps over an fp8 cache fed the graph's tokens:
/// each token within two roundings of the eager argmax, and at least 90% of them exactly (the
/// captured calls split their keys, the eager ones do not).
#[test]
fn fp8_cache_graph_decode_follows_the_eager_steps() {
    let dev = gpu_untracked();
    let dir = hf_model(Family::WideHeads);
    let model = load_hf_dir(&dir, DType::BF16, &dev, Kernels::Fused).unwrap();
    let max_tokens = 16;
    let opts = GenerateOptions {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        kv_cache_dtype: Some(DType::F8E4M3),
        cuda_graphs: true,
    };
    // The graph applies once the prefill fixed the scales, not before.
    let mut cache = model.new_cache_of(1, 40, DType::F8E4M3).unwrap();
    assert!(
        !model.decodes_through_cuda_graphs(&cache),
        "an fp8 cache before its first write"
    );
    model.step(&[tokens(5, 9)], &mut cache).unwrap();
    assert!(
        model.decodes_through_cuda_graphs(&cache),
        "an fp8 cache after the prefill"
    );
    for prompts in [vec![tokens(5, 1), tokens(9, 2), tokens(70, 3)], vec![tokens(33, 4)]] {
        let what = format!("fp8 cache, graph decode, batch {}", prompts.len());
        let g = generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue)).unwrap();
        assert!(g.tokens.iter().all(|t| t.len() == max_tokens), "{what}: {:?}", g.tokens);
        let exact = assert_follows_the_eager_steps_of(&model, &prompts, &g.tokens, &what, DType::F8E4M3);
        let total = max_tokens * prompts.len();
        assert!(
            exact * 10 >= total * 9,
            "{what}: only {exact} of {total} tokens are the eager argmax"
        );
    }
}

/// The paged KV cache on the GPU (flash_attn_with_kvcache's paged kernels, the e4m3 store into
/// pages, the 16-bit planes' strided copies): every step follows the contiguous cache of the same
/// dtype within bf16 rounding (the contiguous bf16 cache decodes through the varlen kernel, the
/// paged one through the kvcache kernel), with steps of mixed token counts and pages handed out
/// in no sequence's order.
#[test]
fn paged_cache_follows_the_contiguous_cache_on_the_gpu() {
    let dir = hf_model(Family::WideHeads);
    for kernels in [Kernels::Fused, Kernels::Composed] {
        let model = load_hf_dir(&dir, DType::BF16, &gpu(), kernels).unwrap();
        for dtype in [DType::BF16, DType::F8E4M3] {
            let mut contiguous = model.new_cache_of(3, 128, dtype).unwrap();
            let mut paged = model.new_paged_cache(3, 20, 16, 128, dtype).unwrap();
            let steps: Vec<Vec<Vec<u32>>> = vec![
                vec![tokens(20, 1), tokens(3, 2), tokens(70, 3)],
                vec![tokens(1, 4), tokens(14, 5), vec![]],
                (0..3).map(|i| tokens(1, 10 + i)).collect(),
                vec![tokens(2, 20), tokens(1, 21), tokens(16, 22)],
            ];
            for (n, step) in steps.iter().enumerate() {
                let want = model.step(step, &mut contiguous).unwrap();
                let got = model.step(step, &mut paged).unwrap();
                let d = rel_diff(&got, &want);
                println!("{kernels:?} {dtype:?} step {n}: paged vs contiguous {d:.2e}");
                assert!(d < 0.05, "{kernels:?} {dtype:?} step {n}: paged differs by {d}");
                for (i, t) in step.iter().enumerate() {
                    if t.is_empty() {
                        assert_eq!(abs_sum(&got.i(i).unwrap()), 0.0, "step {n}: sequence {i} sat out");
                    }
                }
            }
        }
    }
}

/// The walk-order facts of `token` in `logits` (f64): how many tokens are ahead of it, the mass
/// ahead of it, and the top-k mass, for checking that a draw lies in the kept set.
fn kept_set_facts(logits: &[f32], temperature: f32, top_k: u32, token: usize) -> (usize, f64, f64) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) / temperature as f64).exp())
        .collect();
    let ahead = |i: usize| w[i] > w[token] || (w[i] == w[token] && i < token);
    let count = (0..w.len()).filter(|&i| ahead(i)).count();
    let mass: f64 = (0..w.len()).filter(|&i| ahead(i)).map(|i| w[i]).sum();
    let mut sorted = w.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = if top_k == 0 {
        w.len()
    } else {
        (top_k as usize).min(w.len())
    };
    (count, mass, sorted[..k].iter().sum())
}

/// Token sampling on the GPU (`sample_rows`, kernels/model/sampling.cu) against its CPU copy on
/// the same logits and parameters: vocabularies of 128,256 and 1,001, f32 and bf16 logits,
/// greedy, temperature, top-k, top-p and both, fresh random logits; the tokens agree (the same
/// sums in f64 in the same order; the exponentials differ by ulps, which may move a draw across
/// a boundary: at most 1%), greedy rows are the argmax, and every
/// GPU token lies in the kept set (checked in f64, with 1e-4 of slack at the top-p edge).
#[test]
fn sample_rows_on_the_gpu_follows_the_cpu() -> Result<()> {
    use flash_llama::sampling::{sample_rows, RowSampling};
    let (mut same, mut total) = (0usize, 0usize);
    for (vocab, rows) in [(128_256usize, 12usize), (1_001, 40)] {
        for dtype in [DType::F32, DType::BF16] {
            // Logits spread like a model's: a few strong candidates over a long tail.
            let logits = (randn(&[rows, vocab], DType::F32, &Device::Cpu) * 2.5)?.to_dtype(dtype)?;
            let host = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let specs = [
                (0.0, 0, 1.0),
                (0.8, 0, 1.0),
                (1.0, 50, 1.0),
                (1.0, 0, 0.9),
                (0.7, 40, 0.8),
                (1.2, 1, 0.5),
            ];
            for (s, &(t, k, p)) in specs.iter().enumerate() {
                let params: Vec<RowSampling> = (0..rows)
                    .map(|r| {
                        let sp = SamplingParams {
                            temperature: t,
                            top_k: k,
                            top_p: p,
                            seed: 17 + r as u64,
                            ..SamplingParams::default()
                        };
                        RowSampling::new(&sp, (s * 31 + r) as u64).unwrap()
                    })
                    .collect();
                let on_gpu = sample_rows(&logits.to_device(&gpu())?, &params)?.to_vec1::<u32>()?;
                let on_cpu = sample_rows(&logits, &params)?.to_vec1::<u32>()?;
                for r in 0..rows {
                    let token = on_gpu[r] as usize;
                    total += 1;
                    same += usize::from(on_gpu[r] == on_cpu[r]);
                    if t <= 0.0 || k == 1 {
                        assert_eq!(on_gpu[r], argmax(&host[r]), "greedy row {r} ({vocab}, {dtype:?})");
                        continue;
                    }
                    let (count, mass, top_k_mass) = kept_set_facts(&host[r], t as f32, k as u32, token);
                    assert!(
                        k == 0 || count < k,
                        "({t}, {k}, {p}) row {r}: token {token} has {count} tokens ahead"
                    );
                    assert!(
                        p >= 1.0 || mass < p * top_k_mass * (1.0 + 1e-4),
                        "({t}, {k}, {p}) row {r}: token {token} has mass {mass} ahead of {top_k_mass}"
                    );
                }
            }
        }
    }
    assert!(same * 100 >= total * 99, "GPU and CPU draws agree in {same} of {total}");
    println!("sample_rows: GPU = CPU in {same} of {total} draws");
    Ok(())
}

/// The GPU's draws follow the kept distribution (tests/common/sampling.rs, the CPU test's check):
/// 40 logits with clear gaps, 6,000 draws per setting, every kept token within 5 standard
/// deviations of its probability, no other token drawn.
#[test]
fn sample_rows_on_the_gpu_draws_the_kept_distribution() -> Result<()> {
    common::sampling::draws_follow_the_kept_distribution(&gpu())
}

/// Sampled generation through the CUDA-graph decode (the step replayed, `sample_rows` after each
/// replay): the graph's tokens fed through the eager steps (`Llama::step`, a fresh cache), where
/// each step draws with the same per-sequence parameters and token number; at least 90% of the
/// tokens are the eager draw (the graph reads the cache through the kvcache kernel, the eager
/// step through the varlen kernel, so a draw near a boundary of the kept distribution may move),
/// and the same seed gives the same tokens again. bf16 and f16, batch 3, prompts of 5, 9 and 33.
#[test]
#[allow(clippy::needless_range_loop)] // n is the token number of each draw as well as an index
fn sampled_graph_decode_follows_the_eager_draws() {
    use flash_llama::sampling::{sample_rows, RowSampling};
    let dev = gpu_untracked();
    let dir = hf_model(Family::Llama);
    let prompts = vec![tokens(5, 1), tokens(9, 2), tokens(33, 3)];
    let sampling = SamplingParams {
        temperature: 1.2,
        top_k: 50,
        top_p: 0.95,
        seed: 11,
        ..SamplingParams::default()
    };
    let max_tokens = 24;
    for dtype in [DType::BF16, DType::F16] {
        let model = load_hf_dir(&dir, dtype, &dev, Kernels::Fused).unwrap();
        let opts = GenerateOptions {
            max_tokens,
            sampling: sampling.clone(),
            stop_tokens: vec![],
            kv_cache_dtype: None,
            cuda_graphs: true,
        };
        let run = || {
            generate(&model, &prompts, &opts, |_, _| Ok(Flow::Continue))
                .unwrap()
                .tokens
        };
        let graph = run();
        assert!(graph.iter().all(|t| t.len() == max_tokens), "{dtype:?}: {graph:?}");
        assert_eq!(graph, run(), "{dtype:?}: the same seed gave other tokens");
        let mut cache = model.new_cache(prompts.len(), 33 + max_tokens).unwrap();
        let mut inputs = prompts.clone();
        let mut same = 0;
        for n in 0..max_tokens {
            let logits = model.step(&inputs, &mut cache).unwrap();
            let rows: Vec<RowSampling> = (0..prompts.len())
                .map(|i| {
                    let params = SamplingParams {
                        seed: sampling.seed + i as u64,
                        ..sampling.clone()
                    };
                    RowSampling::new(&params, n as u64).unwrap()
                })
                .collect();
            let drawn = sample_rows(&logits, &rows).unwrap().to_vec1::<u32>().unwrap();
            for (i, &d) in drawn.iter().enumerate() {
                same += (d == graph[i][n]) as usize;
                inputs[i] = vec![graph[i][n]];
            }
        }
        let total = max_tokens * prompts.len();
        println!("{dtype:?}: {same}/{total} graph tokens are the eager draw");
        assert!(
            same * 10 >= total * 9,
            "{dtype:?}: only {same} of {total} graph tokens are the eager draw"
        );
    }
}

/// Sampled generation on the GPU (tokens drawn on the device, the next step queued before the
/// host reads them): the same seed gives the same tokens, a batch's rows differ from greedy
/// decoding and from another seed, a stop token ends its sequence where it is drawn, and a
/// repeat penalty (host sampler) runs.
#[test]
fn sampled_generation_on_the_gpu_is_reproducible() {
    let dir = hf_model(Family::Llama);
    let model = load_hf_dir(&dir, DType::BF16, &gpu(), Kernels::Fused).unwrap();
    let prompts = vec![tokens(5, 1), tokens(9, 2), tokens(33, 3)];
    let run_with = |sampling: SamplingParams, stop_tokens: Vec<u32>| {
        let opts = GenerateOptions {
            max_tokens: 24,
            sampling,
            stop_tokens,
            kv_cache_dtype: None,
            cuda_graphs: true,
        };
        let mut streamed = vec![Vec::new(); prompts.len()];
        let g = generate(&model, &prompts, &opts, |i, t| {
            streamed[i].push(t);
            Ok(Flow::Continue)
        })
        .unwrap();
        assert_eq!(g.tokens, streamed, "streamed tokens differ from the returned ones");
        g.tokens
    };
    let run = |sampling: SamplingParams| run_with(sampling, vec![]);
    let sampled = SamplingParams {
        temperature: 1.5,
        top_p: 0.95,
        seed: 5,
        ..SamplingParams::default()
    };
    let a = run(sampled.clone());
    assert_eq!(a, run(sampled.clone()), "the same seed gave other tokens");
    assert!(a.iter().all(|s| s.len() == 24));
    assert_ne!(
        a,
        run(SamplingParams::default()),
        "sampling at temperature 1.5 gave the greedy tokens"
    );
    assert_ne!(
        a,
        run(SamplingParams {
            seed: 6,
            ..sampled.clone()
        }),
        "another seed gave the same tokens"
    );
    // A stop token met by the second sequence mid-way: it ends there, with the same tokens up
    // to it (its draws depend on its seed and token index only); the others run on.
    let stop = a[1][10];
    let first_at = a[1].iter().position(|&t| t == stop).unwrap();
    let stopped = run_with(sampled.clone(), vec![stop]);
    assert_eq!(stopped[1], a[1][..=first_at], "the stopped sequence");
    for (i, s) in stopped.iter().enumerate() {
        assert!(s.len() == 24 || s.last() == Some(&stop), "sequence {i}: {s:?}");
    }
    let penalised = run(SamplingParams {
        repeat_penalty: 1.3,
        ..sampled
    });
    assert!(penalised.iter().all(|s| s.len() == 24));
}
