//! GPU tests (run on the GPU machine through scripts/gpu-run.sh). Placeholder until the
//! Hopper forward kernel lands: checks that the CUDA device works and that the op reports
//! a clear error instead of falling back to the CPU.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};

#[test]
fn gpu_forward_reports_not_implemented() -> candle_core::Result<()> {
    let dev = Device::new_cuda(0)?;
    let q = Tensor::zeros((1, 8, 2, 64), DType::BF16, &dev)?;
    let err = flash_attn3::flash_attn(&q, &q, &q, 0.125, false).unwrap_err();
    assert!(err.to_string().contains("not implemented on the GPU"), "{err}");
    Ok(())
}
