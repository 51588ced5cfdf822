//! FlashAttention-3 for candle.
//!
//! Exact attention as a candle custom op, with a forward and a backward on every device:
//! Hopper kernels under the `cuda` feature and a tiled, multi-threaded CPU path that never
//! materialises the seqlen_q × seqlen_k score matrix.
//!
//! The free functions have the signatures of `candle-flash-attn`, so switching is one import:
//!
//! ```
//! use candle_core::{Device, DType, Tensor};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! // (batch, seqlen, heads, head_dim); k and v may have fewer heads (GQA).
//! let q = Tensor::randn(0f32, 1., (1, 7, 4, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 9, 2, 64), &dev)?;
//! let v = Tensor::randn(0f32, 1., (1, 9, 2, 64), &dev)?;
//! let out = flash_attn3::flash_attn(&q, &k, &v, 0.125, true)?;
//! assert_eq!(out.dims(), &[1, 7, 4, 64]);
//!
//! // The builder adds softcap and the log-sum-exp.
//! let (out, lse) = flash_attn3::FlashAttn::new(0.125).causal(true).softcap(30.0).forward_with_lse(&q, &k, &v)?;
//! assert_eq!(lse.dims(), &[1, 4, 7]);
//! # Ok(()) }
//! ```
//!
//! Semantics, shared by every device:
//! - q is (batch, seqlen_q, heads, head_dim), k and v are (batch, seqlen_k, kv_heads, head_dim)
//!   and (batch, seqlen_k, kv_heads, head_dim_v); `heads % kv_heads == 0` (GQA/MQA).
//!   Varlen calls pack sequences as (total_tokens, heads, head_dim) with cumulative u32 lengths.
//! - Causal and window masks are aligned bottom-right: query `i` sits on key `i + seqlen_k - seqlen_q`.
//!   A window `(left, right)` lets it see keys `[diag - left, diag + right]`; `None` is unbounded and
//!   causal is `(None, Some(0))`.
//! - Softcap maps a scaled score `s` to `cap * tanh(s / cap)` before the softmax.
//! - The LSE is f32, natural log, (batch, heads, seqlen_q) or (heads, total_q) for varlen calls.
//!   A query that sees no key gets a zero output row and an LSE of `-inf`.
//! - The output has the input's dtype. Gradients flow to q, k and v (summed over each GQA group)
//!   through candle's autograd, or come straight from [`FlashAttn::backward`] given the output,
//!   the LSE and the output's gradient.
//! - On the GPU, calls with few query tiles (decoding) split each tile's keys over several SMs
//!   ([`FlashAttn::num_splits`]); the result is the same up to rounding.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod descale;
pub mod fp8;
pub mod kvcache;
mod op;
mod params;

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use descale::{Descales, Fp8Call};
pub use kvcache::{flash_attn_with_kvcache, KvCacheAttn};
use op::FlashAttnFwd;
use params::{AttnParams, Dims, Offsets, Varlen};
pub use params::{Tuning, MAX_HEAD_DIM};

/// Keeps the memory that candle frees on a CUDA `device` in the device's memory pool across
/// synchronisations, as PyTorch's caching allocator does; a no-op on other devices.
///
/// candle allocates from the GPU's default stream-ordered memory pool, whose release threshold
/// is 0: every synchronisation (a `to_vec`, a sampled token copied to the host) hands the memory
/// freed since back to the driver, and the next allocations map it again. An attention call right
/// after a synchronisation then waits for that before its first kernel: on an H200, 60-170 µs per
/// call of the benchmark grid, up to two thirds of a 512-token call's time. After this, freed
/// memory stays reserved for this process's later allocations until it exits.
///
/// A process-wide setting of the GPU (every user of its default pool keeps freed memory): call it
/// once where the program picks its device. flash-llama's examples do.
pub fn retain_freed_device_memory(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::memory_pool::retain_freed_memory(dev),
        _ => Ok(()),
    }
}

/// The release threshold of a CUDA `device`'s default memory pool in bytes (`u64::MAX` after
/// [`retain_freed_device_memory`], 0 by CUDA's default); `None` on other devices.
pub fn device_memory_release_threshold(device: &Device) -> Result<Option<u64>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::memory_pool::release_threshold(dev).map(Some),
        _ => Ok(None),
    }
}

/// Multi-head attention with `softmax(q·kᵀ · softmax_scale) · v`, causal or not.
///
/// q: (batch, seqlen_q, heads, head_dim); k: (batch, seqlen_k, kv_heads, head_dim);
/// v: (batch, seqlen_k, kv_heads, head_dim_v). Returns (batch, seqlen_q, heads, head_dim_v).
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    FlashAttn::new(softmax_scale).causal(causal).forward(q, k, v)
}

/// Attention restricted to a sliding window around each query's diagonal:
/// keys `[diag - window_size_left, diag + window_size_right]`, `None` meaning unbounded.
/// `(None, Some(0))` is causal attention.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .forward(q, k, v)
}

/// Attention over packed sequences of different lengths.
///
/// q: (total_q, heads, head_dim); k: (total_k, kv_heads, head_dim); v: (total_k, kv_heads, head_dim_v).
/// `seqlens_q`/`seqlens_k` are u32 tensors of batch + 1 cumulative offsets into the packed dimension;
/// `max_seqlen_*` bound every sequence's length.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale).causal(causal).forward_varlen(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
}

/// [`flash_attn_varlen`] with a sliding window in place of the causal flag.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale)
        .window(window_size_left, window_size_right)
        .forward_varlen(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
}

/// Cumulative sequence offsets of a varlen call that the caller knows on the host: validated
/// and uploaded once, then given to any number of calls
/// ([`FlashAttn::forward_varlen_offsets`], [`flash_attn_varlen_offsets`]).
///
/// The `Tensor` arguments of [`flash_attn_varlen`] are read back to the host to be validated,
/// a blocking device-to-host copy per tensor and call on the GPU; these are not. The host copy
/// and the device tensor cannot disagree: both are made here from the same slice and the type
/// is immutable. Cloning shares them.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let dev = Device::Cpu;
/// // Two sequences of 3 and 5 tokens, packed: (8, heads, head_dim).
/// let cu = flash_attn3::SeqOffsets::new(&[0, 3, 8], &dev)?;
/// assert_eq!((cu.batch(), cu.total(), cu.max_len()), (2, 8, 5));
/// let q = Tensor::randn(0f32, 1., (8, 4, 64), &dev)?;
/// let k = Tensor::randn(0f32, 1., (8, 2, 64), &dev)?;
/// let out = flash_attn3::FlashAttn::new(0.125).causal(true).forward_varlen_offsets(&q, &k, &k, &cu, &cu, 5, 5)?;
/// assert_eq!(out.dims(), &[8, 4, 64]);
/// assert!(flash_attn3::SeqOffsets::new(&[0, 5, 3], &dev).is_err()); // decreasing
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SeqOffsets {
    host: Arc<[u32]>,
    tensor: Tensor,
}

impl SeqOffsets {
    /// `offsets`: batch + 1 cumulative lengths, starting at 0 and non-decreasing; uploaded to
    /// `device` as a u32 tensor. Whether they fit a call (the packed length, the declared
    /// maximum, the other side's batch) is checked by each call, on the host.
    pub fn new(offsets: &[u32], device: &Device) -> Result<Self> {
        params::check_offsets_shape("the offsets", offsets)?;
        Ok(Self {
            host: offsets.into(),
            tensor: Tensor::new(offsets, device)?,
        })
    }

    /// The offsets of sequences of the given lengths: `[0, l0, l0 + l1, ...]`.
    pub fn from_lengths(lengths: impl IntoIterator<Item = usize>, device: &Device) -> Result<Self> {
        let mut cu = vec![0u32];
        for len in lengths {
            let next = (cu[cu.len() - 1] as usize)
                .checked_add(len)
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| candle_core::Error::Msg("flash-attn3: cumulative lengths overflow u32".into()))?;
            cu.push(next);
        }
        Self::new(&cu, device)
    }

    /// The offsets, as given.
    pub fn as_slice(&self) -> &[u32] {
        &self.host
    }

    /// The same offsets as a rank-1 u32 tensor on the device (what [`flash_attn_varlen`] takes).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.host.len() - 1
    }

    /// Packed tokens: the last offset.
    pub fn total(&self) -> usize {
        self.host[self.host.len() - 1] as usize
    }

    /// The longest sequence.
    pub fn max_len(&self) -> usize {
        self.host.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0)
    }
}

/// [`flash_attn_varlen`] with offsets known on the host ([`SeqOffsets`]): no device-to-host
/// copy to validate them.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_offsets(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &SeqOffsets,
    seqlens_k: &SeqOffsets,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    FlashAttn::new(softmax_scale).causal(causal).forward_varlen_offsets(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )
}

/// An attention call with every option: scale, causal mask, sliding window, softcap, LSE.
///
/// `causal(true)` and `window(l, r)` combine: the causal mask caps the right window at 0.
/// Each setter replaces its own earlier value, so `causal(false)` undoes `causal(true)`.
/// Two builders are equal when their attention options (and split count) are equal; the
/// `deterministic` flag only affects the backward and is not compared.
#[derive(Debug, Clone)]
pub struct FlashAttn {
    softmax_scale: f32,
    causal: bool,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: Option<f32>,
    deterministic: bool,
    num_splits: usize,
    tuning: Tuning,
    descales: Descales,
    out_dtype: Option<DType>,
    sinks: Option<Tensor>,
}

impl FlashAttn {
    /// Plain attention scaled by `softmax_scale` (usually `1 / sqrt(head_dim)`).
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            causal: false,
            window_left: None,
            window_right: None,
            softcap: None,
            deterministic: false,
            num_splits: 0,
            tuning: Tuning::default(),
            descales: Descales::default(),
            out_dtype: None,
            sinks: None,
        }
    }

    /// Masks keys after each query's diagonal (bottom-right aligned when seqlen_q != seqlen_k).
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Restricts each query to keys `[diag - left, diag + right]`; `None` is unbounded.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_left = left;
        self.window_right = right;
        self
    }

    /// Caps scaled scores smoothly: `s -> cap * tanh(s / cap)` (Gemma 2, Grok).
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Makes the GPU backward bitwise reproducible: dQ is summed over key blocks in a fixed order
    /// (slightly slower). The CPU backward is always deterministic; the forward is unaffected.
    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Split-KV on the GPU forward: each query tile's keys are cut into `num_splits` shares that
    /// run on separate SMs, and a small kernel merges the partial results. This fills the GPU
    /// when batch × heads × query tiles is far below its SM count, as in decoding with a long KV
    /// cache. 0 (the default) chooses per call from the GPU's SM count and the shapes; 1 never
    /// splits; larger values are capped at 128 and at the number of key blocks. The output equals
    /// the unsplit one up to rounding. The CPU path and the backward ignore it.
    pub fn num_splits(mut self, num_splits: usize) -> Self {
        self.num_splits = num_splits;
        self
    }

    /// Learnable attention sinks (gpt-oss): `sinks` (heads,), one logit per q head (in the units
    /// of a scaled score, any float dtype) that joins every query row's softmax denominator and
    /// never the output: row i of head h is `Σ_j exp(s_ij) v_j / (Σ_j exp(s_ij) + exp(sinks[h]))`.
    /// A row that sees no key gives 0. The LSE includes the sink. On every path (fixed, varlen,
    /// kvcache, split-KV; CPU and GPU) and differentiable: `loss.backward()` gives the sinks their
    /// gradient (and dq, dk, dv as usual) when `sinks` is a variable or depends on one. The
    /// builder's equality does not compare sinks.
    pub fn sinks(mut self, sinks: &Tensor) -> Self {
        self.sinks = Some(sinks.clone());
        self
    }

    /// How the GPU forward schedules the call ([`Tuning`]): for benchmarks and comparisons; the
    /// defaults choose per call. Invalid values are an error at the call.
    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// FP8 (e4m3) inputs: the f32 factors that turn q, k and v back into the values they stand
    /// for (x = e4m3 · descale); `None` means 1.0. Shapes (batch may be 1, shared by every
    /// sequence): q (batch, kv_heads) as in FA3, (batch, heads), or per block of
    /// [`fp8::Q_BLOCK_ROWS`] queries (batch, heads, ceil(seqlen_q / 64)); k (batch, kv_heads) or
    /// per block of [`fp8::K_BLOCK_ROWS`] keys (batch, kv_heads, ceil(seqlen_k / 128)); v
    /// (batch, kv_heads). Per-block forms need fixed-length inputs. [`fp8::quantize`] returns
    /// descales in these shapes. Descales on inputs that are not `F8E4M3` are an error.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use flash_attn3::fp8::{quantize, Granularity};
    /// # fn main() -> candle_core::Result<()> {
    /// let dev = Device::Cpu;
    /// let x = Tensor::randn(0f32, 1., (1, 100, 2, 64), &dev)?;
    /// let (q, k, v) = (quantize(&x, Granularity::Block(64))?, quantize(&x, Granularity::Block(128))?, quantize(&x, Granularity::Head)?);
    /// let out = flash_attn3::FlashAttn::new(0.125)
    ///     .descale(Some(&q.descale), Some(&k.descale), Some(&v.descale))
    ///     .forward(&q.data, &k.data, &v.data)?;
    /// assert_eq!(out.dtype(), DType::BF16);
    /// # Ok(()) }
    /// ```
    pub fn descale(mut self, q: Option<&Tensor>, k: Option<&Tensor>, v: Option<&Tensor>) -> Self {
        self.descales = Descales {
            q: q.cloned(),
            k: k.cloned(),
            v: v.cloned(),
        };
        self
    }

    /// The output dtype of an FP8 call: bf16 (the default) or f16. Other inputs give their own
    /// dtype; asking them for another is an error.
    pub fn out_dtype(mut self, dtype: DType) -> Self {
        self.out_dtype = Some(dtype);
        self
    }

    /// The options as the kernels see them: causal is a right window of 0.
    fn attn_params(&self) -> AttnParams {
        AttnParams {
            softmax_scale: self.softmax_scale,
            window_left: self.window_left,
            window_right: if self.causal { Some(0) } else { self.window_right },
            softcap: self.softcap,
            num_splits: self.num_splits,
            tuning: self.tuning,
        }
    }

    fn params(&self) -> Result<AttnParams> {
        let params = self.attn_params();
        params.validate()?;
        Ok(params)
    }

    /// The attention output, (batch, seqlen_q, heads, head_dim_v).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q, k, v)?.0)
    }

    /// The output and the f32 log-sum-exp of each query row, (batch, heads, seqlen_q).
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let params = self.params()?;
        let dims = params::check_fixed(q, k, v)?;
        self.run(params, q, k, v, dims, None)
    }

    /// The varlen form of [`FlashAttn::forward`]; see [`flash_attn_varlen`] for the layout.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Tensor> {
        Ok(self
            .forward_varlen_with_lse(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?
            .0)
    }

    /// The varlen output and its LSE, (heads, total_q).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<(Tensor, Tensor)> {
        let params = self.params()?;
        let (dims, varlen) = params::check_varlen(
            q,
            k,
            v,
            Offsets::Device(seqlens_q),
            Offsets::Device(seqlens_k),
            max_seqlen_q,
            max_seqlen_k,
        )?;
        self.run(params, q, k, v, dims, Some(varlen))
    }

    /// The gradients (dq, dk, dv) of a fixed-length call without candle's autograd: from the
    /// call's inputs, its `out` and `lse` (from [`FlashAttn::forward_with_lse`] with the same
    /// options) and the gradient of the loss with respect to `out`. The forward is not
    /// recomputed. This is what `loss.backward()` runs for this op, minus candle's gradient
    /// bookkeeping (a ones tensor for the root, each gradient added into zeros), for custom
    /// training loops and for timing the backward alone. `.deterministic(true)` applies.
    ///
    /// Errors: `out` / `grad_out` not of shape (batch, seqlen_q, heads, head_dim_v) in q's dtype,
    /// `lse` not an f32 (batch, heads, seqlen_q) tensor, tensors on different devices, and
    /// everything [`FlashAttn::forward`] rejects.
    pub fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let params = self.params()?;
        let dims = params::check_fixed(q, k, v)?;
        if q.dtype() == DType::F8E4M3 {
            candle_core::bail!("flash-attn3: fp8 attention has no backward (FA3 has none either); run the call in bf16 to train through it")
        }
        let out_shape = [dims.batch, dims.seqlen_q, dims.heads, dims.head_dim_v];
        for (name, t) in [("out", out), ("grad_out", grad_out)] {
            if t.dims() != out_shape || t.dtype() != q.dtype() || !t.device().same_device(q.device()) {
                candle_core::bail!(
                    "flash-attn3: backward: {name} must be a {:?} tensor of shape {out_shape:?} on q's device, got {:?} {:?}",
                    q.dtype(),
                    t.dtype(),
                    t.dims()
                )
            }
        }
        let lse_shape = [dims.batch, dims.heads, dims.seqlen_q];
        if lse.dims() != lse_shape || lse.dtype() != candle_core::DType::F32 || !lse.device().same_device(q.device()) {
            candle_core::bail!(
                "flash-attn3: backward: lse must be an F32 tensor of shape {lse_shape:?} (batch, heads, seqlen_q) on q's device, got {:?} {:?}",
                lse.dtype(),
                lse.dims()
            )
        }
        op::backward_grads(params, dims, None, self.deterministic, (q, k, v), out, grad_out, lse)
    }

    /// [`FlashAttn::forward_varlen`] with offsets known on the host: validated there, so the
    /// call never waits for the GPU (the tensor forms read their offsets back to check them).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_offsets(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &SeqOffsets,
        seqlens_k: &SeqOffsets,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Tensor> {
        Ok(self
            .forward_varlen_offsets_with_lse(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?
            .0)
    }

    /// [`FlashAttn::forward_varlen_offsets`] with the LSE, (heads, total_q).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_varlen_offsets_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &SeqOffsets,
        seqlens_k: &SeqOffsets,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<(Tensor, Tensor)> {
        let params = self.params()?;
        let (dims, varlen) = params::check_varlen(
            q,
            k,
            v,
            Offsets::Host(seqlens_q),
            Offsets::Host(seqlens_k),
            max_seqlen_q,
            max_seqlen_k,
        )?;
        self.run(params, q, k, v, dims, Some(varlen))
    }
}

impl PartialEq for FlashAttn {
    fn eq(&self, other: &Self) -> bool {
        self.attn_params() == other.attn_params()
    }
}

impl FlashAttn {
    /// The fp8 description of a call with these inputs: `None` for 16- and 32-bit inputs, which
    /// take neither descales nor another output dtype.
    pub(crate) fn fp8_call(&self, q: &Tensor, dims: &Dims, varlen: bool) -> Result<Option<Fp8Call>> {
        if q.dtype() == DType::F8E4M3 {
            return Ok(Some(Fp8Call::new(
                &self.descales,
                self.out_dtype,
                dims,
                varlen,
                q.device(),
            )?));
        }
        let d = &self.descales;
        if d.q.is_some() || d.k.is_some() || d.v.is_some() {
            candle_core::bail!("flash-attn3: descales apply to F8E4M3 inputs only, got {:?}", q.dtype())
        }
        match self.out_dtype {
            Some(dt) if dt != q.dtype() => candle_core::bail!(
                "flash-attn3: out_dtype {dt:?} applies to F8E4M3 inputs only; {:?} inputs give {:?}",
                q.dtype(),
                q.dtype()
            ),
            _ => Ok(None),
        }
    }

    /// Applies the forward op and hands back the LSE it kept for its backward. FP8 inputs on the
    /// CPU are dequantised (exactly, into f32) and run through the f32 path.
    fn run(
        &self,
        params: AttnParams,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        dims: Dims,
        varlen: Option<Varlen>,
    ) -> Result<(Tensor, Tensor)> {
        let fp8 = self.fp8_call(q, &dims, varlen.is_some())?;
        if let (Some(call), Device::Cpu) = (&fp8, q.device()) {
            let (cu_q, cu_k) = op::cumulative_lengths(&dims, varlen.as_ref());
            let (q, k, v) = call.dequantize((q, k, v), &dims, &cu_q, &cu_k)?;
            let (out, lse) = self.apply(params, &q, &k, &v, dims, varlen, None)?;
            return Ok((out.to_dtype(call.out_dtype)?, lse));
        }
        self.apply(params, q, k, v, dims, varlen, fp8)
    }

    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        params: AttnParams,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        dims: Dims,
        varlen: Option<Varlen>,
        fp8: Option<Fp8Call>,
    ) -> Result<(Tensor, Tensor)> {
        let is_varlen = varlen.is_some();
        let sinks = self.sinks_f32(q, dims.heads)?;
        let mut op = FlashAttnFwd::new(params, dims, varlen);
        op.deterministic = self.deterministic;
        op.fp8 = fp8;
        op.sinks = sinks.clone();
        let lse = op.lse.clone();
        let out = q.apply_op3(k, v, op)?;
        let lse = match lse.get() {
            Some(lse) => lse.clone(),
            None => candle_core::bail!("flash-attn3: the forward pass returned without its LSE"),
        };
        match sinks {
            // The sinks' gradient path: an identity op on the output (op::SinkGrad).
            Some(s) if s.track_op() => {
                let grad_path = op::SinkGrad {
                    lse: lse.clone(),
                    varlen: is_varlen,
                };
                Ok((out.apply_op2(&s, grad_path)?, lse))
            }
            _ => Ok((out, lse)),
        }
    }

    /// The sinks as the kernels read them: f32, contiguous, (heads,) on q's device (the
    /// conversion keeps the autograd graph, so gradients reach the caller's tensor).
    pub(crate) fn sinks_f32(&self, q: &Tensor, heads: usize) -> Result<Option<Tensor>> {
        let Some(s) = &self.sinks else { return Ok(None) };
        if s.dims() != [heads] || !s.device().same_device(q.device()) || !s.dtype().is_float() {
            candle_core::bail!(
                "flash-attn3: sinks must be a float tensor of shape [{}] (one logit per q head) on q's device, got {:?} {:?} on {:?}",
                heads,
                s.dtype(),
                s.dims(),
                s.device().location()
            )
        }
        Ok(Some(s.to_dtype(DType::F32)?.contiguous()?))
    }
}
