//! The CUDA path. The Hopper kernels are not in yet: every GPU call returns a clear error
//! instead of silently running somewhere else.

use candle_core::{bail, CudaStorage, Layout, Result};

use crate::params::{AttnParams, Dims, Varlen};

/// Runs the forward on the GPU; returns the output and the LSE.
pub(crate) fn forward(
    _dims: &Dims,
    _params: AttnParams,
    _varlen: Option<&Varlen>,
    _q: (&CudaStorage, &Layout),
    _k: (&CudaStorage, &Layout),
    _v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    bail!("flash-attn3: attention is not implemented on the GPU yet (the Hopper kernels are in progress); run on the CPU")
}
