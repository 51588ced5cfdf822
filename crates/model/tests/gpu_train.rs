//! GPU tests of flash-llama's training ops (kernels/model/train_ops.cu): forward and gradients
//! of each op against the composed candle ops (in f32 on the same input values, through
//! candle's autograd) on CUDA, bf16/f16/f32, odd sizes; and the CUDA kernels against the CPU
//! loops of the same ops. Needs the `cuda` feature and a Hopper GPU.

mod common;
mod train_ops_common;

use candle_core::{DType, Device, Result, Tensor, Var};
use flash_llama::train_ops;
use train_ops_common::{randn, rel_diff};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

/// A rounding or two of the dtype (bf16 ~1e-2 relative).
const CASES: [(DType, f32); 3] = [(DType::BF16, 2e-2), (DType::F16, 4e-3), (DType::F32, 1e-5)];

#[test]
fn rms_norm_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rms_norm(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn rope_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rope(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn swiglu_matches_composed_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::swiglu(&gpu(), dtype, tol)?;
    }
    Ok(())
}

#[test]
fn embedding_matches_candle_nn_on_the_gpu() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::embedding(&gpu(), dtype, tol)?;
    }
    Ok(())
}

/// Output and input gradients of `f` on CUDA and on the CPU, same inputs, same output gradient.
fn cuda_vs_cpu(what: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>, tol: f32) -> Result<()> {
    let r = randn(inputs[0].dims(), DType::F32, &Device::Cpu);
    let run = |dev: &Device| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(dev)?))
            .collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let grads = (y.to_dtype(DType::F32)? * r.to_device(dev)?)?.sum_all()?.backward()?;
        let g = vars
            .iter()
            .map(|v| grads.get(v).unwrap().to_device(&Device::Cpu))
            .collect::<Result<_>>()?;
        Ok((y.to_device(&Device::Cpu)?, g))
    };
    let (y, g) = run(&gpu())?;
    let (y_cpu, g_cpu) = run(&Device::Cpu)?;
    let d = rel_diff(&y, &y_cpu);
    let dg: Vec<f32> = g.iter().zip(&g_cpu).map(|(a, b)| rel_diff(a, b)).collect();
    eprintln!("{what}: CUDA vs CPU forward {d:.2e}, gradients {dg:?}");
    assert!(d <= tol && dg.iter().all(|&d| d <= tol), "{what}: CUDA and CPU differ");
    Ok(())
}

#[test]
fn kernels_match_the_cpu_loops() -> Result<()> {
    let cpu = Device::Cpu;
    for (dtype, tol) in CASES {
        let x = randn(&[257, 768], dtype, &cpu);
        let w = randn(&[768], dtype, &cpu);
        cuda_vs_cpu(
            &format!("RMSNorm {dtype:?}"),
            &[x, w],
            |t| train_ops::rms_norm(&t[0], &t[1], 1e-5),
            tol,
        )?;
        let x = randn(&[129, 3, 64], dtype, &cpu);
        let cos = randn(&[129, 32], dtype, &cpu);
        let sin = randn(&[129, 32], dtype, &cpu);
        for interleaved in [false, true] {
            cuda_vs_cpu(
                &format!("RoPE interleaved {interleaved} {dtype:?}"),
                std::slice::from_ref(&x),
                |t| {
                    let dev = t[0].device();
                    train_ops::rope(&t[0], &cos.to_device(dev)?, &sin.to_device(dev)?, interleaved)
                },
                tol,
            )?;
        }
        let (g, u) = (randn(&[131, 345], dtype, &cpu), randn(&[131, 345], dtype, &cpu));
        cuda_vs_cpu(
            &format!("SiLU × up {dtype:?}"),
            &[g, u],
            |t| train_ops::swiglu(&t[0], &t[1]),
            tol,
        )?;
    }
    Ok(())
}
