//! The training ops (`flash_llama::train_ops`, CPU loops) against the composed candle ops:
//! forward and autograd gradients in f32 (tight), and in bf16/f16 (a rounding or two).

mod common;
mod train_ops_common;

use candle_core::{DType, Device, Result};

const CASES: [(DType, f32); 3] = [(DType::F32, 2e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)];

#[test]
fn rms_norm_matches_composed() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rms_norm(&Device::Cpu, dtype, tol)?;
    }
    Ok(())
}

#[test]
fn rope_matches_composed() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::rope(&Device::Cpu, dtype, tol)?;
    }
    Ok(())
}

#[test]
fn swiglu_matches_composed() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::swiglu(&Device::Cpu, dtype, tol)?;
    }
    Ok(())
}

#[test]
fn embedding_matches_candle_nn() -> Result<()> {
    for (dtype, tol) in CASES {
        train_ops_common::embedding(&Device::Cpu, dtype, tol)?;
    }
    Ok(())
}

#[test]
fn cross_entropy_matches_an_f64_reference() -> Result<()> {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        train_ops_common::cross_entropy(&Device::Cpu, dtype)?;
    }
    Ok(())
}
