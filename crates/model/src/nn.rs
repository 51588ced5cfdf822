//! RMSNorm and rotary embeddings written as compositions of candle ops.
//!
//! candle-nn's fused `rms_norm` and `rope` kernels are faster but have no backward pass; the
//! compositions here differentiate like any other candle graph, so the same model code serves
//! inference and training; they are the reference. [`Kernels::Trainable`] switches to our fused
//! ops with a backward ([`crate::train_ops`]) for training, [`Kernels::Fused`] to the fused
//! forward-only kernels for inference.

use candle_core::{DType, Module, Result, Tensor, D};

/// Which implementation of RMSNorm and RoPE the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Plain candle ops: differentiable, and the reference the other two must match.
    #[default]
    Composed,
    /// Differentiable fused ops with backward kernels ([`crate::train_ops`]: RMSNorm, RoPE,
    /// SiLU × up, the embedding lookup), CPU loops or CUDA kernels; weights as in `Composed`.
    /// The training path.
    Trainable,
    /// Forward only: candle-nn's fused RMSNorm and RoPE kernels, q/k/v and gate/up weights
    /// concatenated at load; on the GPU also our own fused kernels ([`crate::fused`]: add +
    /// RMSNorm, SiLU × up, RoPE + KV-cache store).
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

    /// The per-channel scale (dim).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl RmsNorm {
    /// `(x + h, self.forward(x + h))`: a residual update and the normalised input of the next
    /// sub-block. With [`Kernels::Fused`] on the GPU one kernel does both
    /// ([`crate::fused::add_rms_norm`]); otherwise candle's add, then the norm.
    pub fn add_forward(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.kernels == Kernels::Fused && x.device().is_cuda() {
            return crate::fused::add_rms_norm(x, h, &self.weight, self.eps);
        }
        let sum = (x + h)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.kernels {
            Kernels::Fused => return candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32),
            Kernels::Trainable => return crate::train_ops::rms_norm(x, &self.weight, self.eps),
            Kernels::Composed => {}
        }
        // Accumulate in f32 at least, whatever the run dtype: bf16 sums of squares lose too many
        // bits (f64 stays f64: the tests' reference).
        let dtype = x.dtype();
        let xf = match dtype {
            DType::F64 => x.clone(),
            _ => x.to_dtype(DType::F32)?,
        };
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
    if kernels == Kernels::Trainable {
        return crate::train_ops::rope(x, &cos, &sin, interleaved);
    }
    if kernels == Kernels::Fused {
        // Token t is "batch" t of the fused kernel with its own table row: x as
        // (tokens, heads, 1, d), cos/sin as (tokens, 1, d/2). No transposes, one launch.
        let x4 = x.contiguous()?.reshape((tokens, heads, 1, d))?;
        let cos = cos.contiguous()?.reshape((tokens, 1, half))?;
        let sin = sin.contiguous()?.reshape((tokens, 1, half))?;
        return fused_rope(&x4, &cos, &sin, interleaved)?.reshape((tokens, heads, d));
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

/// candle-nn's fused RoPE on x (b, h, t, d) with per-batch tables (b, t, d/2).
fn fused_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    if interleaved {
        candle_nn::rotary_emb::rope_i(x, cos, sin)
    } else {
        candle_nn::rotary_emb::rope(x, cos, sin)
    }
}

/// Fused RoPE over every head of `x` (tokens, heads, head_dim) at once, each (token, head) with
/// its own angles: `cos`/`sin` are (tokens, heads, head_dim / 2). Heads whose angles are 0
/// (cos 1, sin 0) come out unchanged, which is how the values of a fused q/k/v projection
/// ride along with q and k in one launch. Forward only.
pub fn rope_per_head(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (tokens, heads, d) = x.dims3()?;
    // Token t is "batch" t of the kernel, its heads the "sequence" of its table.
    let x4 = x.contiguous()?.reshape((tokens, 1, heads, d))?;
    fused_rope(&x4, &cos.contiguous()?, &sin.contiguous()?, interleaved)?.reshape((tokens, heads, d))
}

/// cos and sin (tokens, heads, head_dim / 2) of `positions × inv_freq_heads`, where
/// `inv_freq_heads` is (heads, head_dim / 2); computed in f32.
pub fn rope_angles_per_head(positions: &Tensor, inv_freq_heads: &Tensor) -> Result<(Tensor, Tensor)> {
    let angles = positions
        .to_dtype(DType::F32)?
        .reshape(((), 1, 1))?
        .broadcast_mul(&inv_freq_heads.unsqueeze(0)?)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// cos and sin (tokens, head_dim / 2) of `positions × inv_freq`, computed in f32.
pub fn rope_angles(positions: &Tensor, inv_freq: &Tensor) -> Result<(Tensor, Tensor)> {
    let angles = positions
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_mul(&inv_freq.unsqueeze(0)?)?;
    Ok((angles.cos()?, angles.sin()?))
}
