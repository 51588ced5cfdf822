//! RMSNorm and rotary embeddings written as compositions of candle ops.
//!
//! candle-nn's fused `rms_norm` and `rope` kernels are faster but have no backward pass; the
//! compositions here differentiate like any other candle graph, so the same model code serves
//! inference and training. [`Kernels::Fused`] switches to the fused kernels for inference.

use candle_core::{DType, Module, Result, Tensor, D};

/// Which implementation of RMSNorm and RoPE the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Plain candle ops: differentiable (training) and the reference.
    #[default]
    Composed,
    /// candle-nn's fused kernels: forward only.
    Fused,
}

/// Root-mean-square normalisation over the last dimension, then a learned per-channel scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    kernels: Kernels,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64, kernels: Kernels) -> Self {
        Self { weight, eps, kernels }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.kernels == Kernels::Fused {
            return candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32);
        }
        // Accumulate in f32 whatever the run dtype: bf16 sums of squares lose too many bits.
        let dtype = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let mean_sq = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xf.broadcast_div(&(mean_sq + self.eps)?.sqrt()?)?;
        normed.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }
}

/// Rotary position embedding of `x` (tokens, heads, head_dim) at per-token angles.
///
/// `cos`/`sin` are (tokens, head_dim / 2): the angle of each token and frequency. Each token
/// carries its own position, so sequences at different offsets (a batch whose prompts differ
/// in length, decoding after a prefill) rotate correctly in one call.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool, kernels: Kernels) -> Result<Tensor> {
    let (tokens, heads, d) = x.dims3()?;
    let half = d / 2;
    let cos = cos.to_dtype(x.dtype())?;
    let sin = sin.to_dtype(x.dtype())?;
    if kernels == Kernels::Fused {
        // The fused kernels take (batch, heads, seq, d) and one (seq, d/2) table: put tokens on
        // the sequence axis of a batch of one.
        let xt = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
        let out = if interleaved {
            candle_nn::rotary_emb::rope_i(&xt, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&xt, &cos, &sin)?
        };
        return out.squeeze(0)?.transpose(0, 1)?.contiguous();
    }
    // (tokens, 1, d/2): the same angles for every head.
    let cos = cos.unsqueeze(1)?;
    let sin = sin.unsqueeze(1)?;
    if interleaved {
        // Pairs (x[2i], x[2i+1]).
        let pairs = x.reshape((tokens, heads, half, 2))?;
        let x0 = pairs.narrow(3, 0, 1)?.squeeze(3)?;
        let x1 = pairs.narrow(3, 1, 1)?.squeeze(3)?;
        let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::stack(&[r0, r1], 3)?.reshape((tokens, heads, d))
    } else {
        // Pairs (x[i], x[i + d/2]).
        let x0 = x.narrow(2, 0, half)?;
        let x1 = x.narrow(2, half, half)?;
        let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::cat(&[r0, r1], 2)
    }
}

/// cos and sin (tokens, head_dim / 2) of `positions × inv_freq`, computed in f32.
pub fn rope_angles(positions: &Tensor, inv_freq: &Tensor) -> Result<(Tensor, Tensor)> {
    let angles = positions
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_mul(&inv_freq.unsqueeze(0)?)?;
    Ok((angles.cos()?, angles.sin()?))
}
