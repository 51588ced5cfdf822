//! The candle custom ops: [`FlashAttnFwd`] computes the attention output and keeps the
//! log-sum-exp for its own backward; [`FlashAttnBwd`] computes dq, dk and dv from it.
//!
//! Each public call builds a fresh `FlashAttnFwd`, so the LSE slot belongs to exactly one
//! forward pass and `bwd` never recomputes the forward.

use std::sync::{Arc, OnceLock};

use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use crate::cpu;
use crate::descale::Fp8Call;
use crate::params::{AttnParams, Dims, Varlen};

/// The shape of the attention output: q's shape with v's head dim.
fn output_shape(dims: &Dims, varlen: bool) -> Shape {
    if varlen {
        Shape::from((dims.total_q, dims.heads, dims.head_dim_v))
    } else {
        Shape::from((dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v))
    }
}

/// The shape of the LSE: (batch, heads, seqlen_q), or (heads, total_q) for varlen calls.
pub(crate) fn lse_shape(dims: &Dims, varlen: bool) -> Shape {
    if varlen {
        Shape::from((dims.heads, dims.total_q))
    } else {
        Shape::from((dims.batch, dims.heads, dims.seqlen_q))
    }
}

/// Where each sequence starts in the packed token dimension. Fixed-length calls are the
/// special case of equal lengths, so every path handles one layout.
pub(crate) fn cumulative_lengths(dims: &Dims, varlen: Option<&Varlen>) -> (Vec<usize>, Vec<usize>) {
    match varlen {
        Some(v) => (v.cu_q.clone(), v.cu_k.clone()),
        None => (
            (0..=dims.batch).map(|b| b * dims.seqlen_q).collect(),
            (0..=dims.batch).map(|b| b * dims.seqlen_k).collect(),
        ),
    }
}

/// The forward op. `apply_op3` stores it with the output tensor, so its `bwd` finds the
/// LSE that `cpu_fwd`/`cuda_fwd` left in `lse`.
pub(crate) struct FlashAttnFwd {
    pub params: AttnParams,
    pub dims: Dims,
    pub varlen: Option<Varlen>,
    pub lse: Arc<OnceLock<Tensor>>,
    /// The GPU backward sums dQ in a fixed order (bitwise reproducible gradients).
    pub deterministic: bool,
    /// FP8 inputs (GPU): their descales and the output dtype.
    pub fp8: Option<Fp8Call>,
    /// Attention sinks, (heads,) f32 contiguous on q's device.
    pub sinks: Option<Tensor>,
}

impl FlashAttnFwd {
    pub fn new(params: AttnParams, dims: Dims, varlen: Option<Varlen>) -> Self {
        Self {
            params,
            dims,
            varlen,
            lse: Arc::new(OnceLock::new()),
            deterministic: false,
            fp8: None,
            sinks: None,
        }
    }

    fn keep_lse(&self, storage: Storage) {
        let lse = Tensor::from_storage(
            storage,
            lse_shape(&self.dims, self.varlen.is_some()),
            BackpropOp::none(),
            false,
        );
        // A forward runs once per op; a second run (never done by candle) would keep the first LSE.
        let _ = self.lse.set(lse);
    }

    fn saved_lse(&self) -> Result<Tensor> {
        match self.lse.get() {
            Some(lse) => Ok(lse.clone()),
            None => bail!("flash-attn3: backward called before the forward pass stored its LSE"),
        }
    }
}

impl CustomOp3 for FlashAttnFwd {
    fn name(&self) -> &'static str {
        "flash-attn3"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (cu_q, cu_k) = cumulative_lengths(&self.dims, self.varlen.as_ref());
        let sinks = self.sinks.as_ref().map(|s| s.to_vec1::<f32>()).transpose()?;
        let problem = cpu::Problem::new(&self.dims, self.params, &cu_q, &cu_k, self.varlen.is_some())
            .with_sinks(sinks.as_deref());
        let (out, lse) = cpu::forward(&problem, (q, q_l), (k, k_l), (v, v_l))?;
        self.keep_lse(Storage::Cpu(lse));
        Ok((out, output_shape(&self.dims, self.varlen.is_some())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (out, lse) = crate::cuda::forward(
            &self.dims,
            self.params,
            self.varlen.as_ref(),
            (q, q_l),
            (k, k_l),
            (v, v_l),
            &crate::cuda::FwdExtras {
                fp8: self.fp8.as_ref(),
                cache: None,
                sinks: match &self.sinks {
                    Some(s) => crate::cuda::device_address(s)?,
                    None => 0,
                },
                before_launch: None,
            },
        )?;
        self.keep_lse(Storage::Cuda(lse));
        Ok((out, output_shape(&self.dims, self.varlen.is_some())))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if self.fp8.is_some() {
            bail!("flash-attn3: fp8 attention has no backward (FA3 has none either); run the call in bf16 to train through it")
        }
        let (dq, dk, dv) = backward_grads(
            self.params,
            self.dims,
            self.varlen.clone(),
            self.deterministic,
            (q, k, v),
            out,
            grad_out,
            &self.saved_lse()?,
        )?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// dq, dk, dv of one attention call from its output, LSE and the incoming gradient (shapes
/// already checked): one backward op over (q, k, v), its flat output split and reshaped.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_grads(
    params: AttnParams,
    dims: Dims,
    varlen: Option<Varlen>,
    deterministic: bool,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let backward = FlashAttnBwd {
        params,
        dims,
        varlen,
        out: out.clone(),
        grad_out: grad_out.contiguous()?,
        lse: lse.contiguous()?,
        deterministic,
    };
    // One op computes the three gradients into one flat buffer; split it here.
    let packed = q.apply_op3_no_bwd(k, v, &backward)?;
    let (nq, nk, nv) = (q.elem_count(), k.elem_count(), v.elem_count());
    let dq = packed.narrow(0, 0, nq)?.reshape(q.shape())?;
    let dk = packed.narrow(0, nq, nk)?.reshape(k.shape())?;
    let dv = packed.narrow(0, nq + nk, nv)?.reshape(v.shape())?;
    Ok((dq, dk, dv))
}

/// The backward op, applied to (q, k, v). Its output is dq, dk and dv flattened and
/// concatenated (in q's dtype), each in the contiguous layout of its input.
pub(crate) struct FlashAttnBwd {
    pub params: AttnParams,
    pub dims: Dims,
    pub varlen: Option<Varlen>,
    pub out: Tensor,
    pub grad_out: Tensor,
    pub lse: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub deterministic: bool,
}

impl CustomOp3 for FlashAttnBwd {
    fn name(&self) -> &'static str {
        "flash-attn3-backward"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (cu_q, cu_k) = cumulative_lengths(&self.dims, self.varlen.as_ref());
        let problem = cpu::Problem::new(&self.dims, self.params, &cu_q, &cu_k, self.varlen.is_some());
        let (out_s, out_l) = self.out.storage_and_layout();
        let (dout_s, dout_l) = self.grad_out.storage_and_layout();
        let (lse_s, lse_l) = self.lse.storage_and_layout();
        let (Storage::Cpu(out_s), Storage::Cpu(dout_s), Storage::Cpu(lse_s)) = (&*out_s, &*dout_s, &*lse_s) else {
            bail!("flash-attn3: backward tensors are not all on the CPU")
        };
        let grads = cpu::backward(
            &problem,
            (q, q_l),
            (k, k_l),
            (v, v_l),
            (out_s, out_l),
            (dout_s, dout_l),
            (lse_s, lse_l),
        )?;
        let d = &self.dims;
        let len = d.total_q * d.heads * d.head_dim + d.total_k * d.kv_heads * (d.head_dim + d.head_dim_v);
        Ok((grads, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        // The preprocess reads O and dO rows as 16-byte vectors: contiguous, 8-element aligned starts.
        let aligned = |t: &Tensor| -> Result<Tensor> {
            match t.is_contiguous() && t.layout().start_offset() % 8 == 0 {
                true => Ok(t.clone()),
                false => t.force_contiguous(),
            }
        };
        let saved = crate::cuda::SavedForBackward {
            out: &aligned(&self.out)?,
            grad_out: &aligned(&self.grad_out)?,
            lse: &self.lse,
            deterministic: self.deterministic,
        };
        let grads = crate::cuda::backward(
            &self.dims,
            self.params,
            self.varlen.as_ref(),
            (q, q_l),
            (k, k_l),
            (v, v_l),
            &saved,
        )?;
        let d = &self.dims;
        let len = d.total_q * d.heads * d.head_dim + d.total_k * d.kv_heads * (d.head_dim + d.head_dim_v);
        Ok((grads, Shape::from(len)))
    }
}

/// The gradient path of attention sinks (`FlashAttn::sinks`): the identity on the attention
/// output (a copy), whose backward passes the output's gradient through unchanged and gives the
/// sinks theirs. A sink's logit only enlarges the denominators of its head's rows, so
/// d loss / d sink[h] = -Σ_rows exp(sink[h] - lse_row) · (dO_row · O_row), with the forward's LSE
/// (which includes the sink). dq, dk and dv need nothing new: the backward forms P from that LSE.
pub(crate) struct SinkGrad {
    /// The forward's LSE: (batch, heads, seqlen_q), or (heads, total_q) for varlen calls.
    pub lse: Tensor,
    pub varlen: bool,
}

/// SinkGrad's forward on any device: a copy of the attention output (fresh and contiguous).
fn copy_output<S: candle_core::backend::BackendStorage>(out: &S, out_l: &Layout) -> Result<(S, Shape)> {
    if !out_l.is_contiguous() || out_l.start_offset() != 0 {
        bail!("flash-attn3: sinks: the attention output is expected contiguous")
    }
    Ok((out.try_clone(out_l)?, out_l.shape().clone()))
}

impl candle_core::CustomOp2 for SinkGrad {
    fn name(&self) -> &'static str {
        "flash-attn3-sinks"
    }

    fn cpu_fwd(&self, out: &CpuStorage, out_l: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        copy_output(out, out_l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &candle_core::CudaStorage,
        out_l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy_output(out, out_l)
    }

    fn bwd(
        &self,
        out: &Tensor,
        sinks: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        use candle_core::{DType, D};
        let heads = sinks.dim(0)?;
        // D per row: dO · O in f32, laid out like the LSE.
        let rows = (grad.to_dtype(DType::F32)? * out.to_dtype(DType::F32)?)?.sum(D::Minus1)?;
        let (rows, sink) = match self.varlen {
            // (total_q, heads) -> (heads, total_q)
            true => (rows.t()?, sinks.reshape((heads, 1))?),
            // (batch, seqlen_q, heads) -> (batch, heads, seqlen_q)
            false => (rows.transpose(1, 2)?, sinks.reshape((1, heads, 1))?),
        };
        let p_sink = sink.broadcast_sub(&self.lse)?.exp()?;
        let per_row = (p_sink * rows)?.neg()?;
        let dsinks = match self.varlen {
            true => per_row.sum(1)?,
            false => per_row.sum(2)?.sum(0)?,
        };
        Ok((Some(grad.clone()), Some(dsinks)))
    }
}
