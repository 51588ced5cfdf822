//! GPU tests of flash-llama's fused inference kernels (kernels/model/fused.cu): each op against
//! the composed candle ops it replaces, on fresh random inputs with odd sizes, and whole models
//! (every family, and a GGUF file with interleaved RoPE) with `Kernels::Fused` against
//! `Kernels::Composed` on the GPU. Needs the `cuda` feature and a Hopper GPU; built by
//! scripts/gpu-pack.sh and run by scripts/gpu-run.sh.

mod common;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use common::{abs_sum, hf_model, rel_diff, Family, VOCAB};
use flash_llama::fused::{add_rms_norm, rope_store, silu_mul, CacheStore};
use flash_llama::loader::{load_gguf, load_hf_dir};
use flash_llama::nn::{rope_per_head, RmsNorm};
use flash_llama::{Kernels, Llama};

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
                    Some(CacheStore { kv: &kv, rows: &rows_t }),
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
    let err = rope_store(&y, &cs, &cs, false, Some(CacheStore { kv: &kv, rows: &rows }))
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not fit"), "{err}");
    Ok(())
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + salt * 13 + 3) % VOCAB as u32).collect()
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
