//! Fused kernels of the inference path on the GPU (`Kernels::Fused` with CUDA tensors; source in
//! kernels/model/fused.cu). Each replaces two or three candle launches of a decode step:
//!
//! - [`add_rms_norm`]: the residual add and the next RMSNorm (`x + h`, then its norm);
//! - [`silu_mul`]: SiLU of the gate half of a fused gate/up output times its up half;
//! - [`rope_store`]: RoPE over a fused q/k/v output, in place, with its k and v heads stored
//!   into the KV cache in the same pass;
//! - [`linear_vector`]: a linear layer over the one row of a batch-1 decode step (a
//!   matrix-vector product that reads the weights at full bandwidth, one launch with about half
//!   cuBLAS's host cost);
//! - [`linear_vector_add_norm`]: the same product with the add + RMSNorm before it (the q/k/v,
//!   gate/up and output head projections) computed inside the launch, by every block while its
//!   first weights load: at batch 1 that op is a few KB, whose own launch costs more than its
//!   work; [`linear_vector_add_norm_swiglu`]: the gate/up form that writes silu(gate) · up, the
//!   down projection's input;
//! - [`linear_rows`]: a linear layer over the 2-64 rows of a batched decode step, on the tensor
//!   cores (wgmma; k split over a cluster of CTAs where the rows alone are few);
//! - [`argmax_rows`]: the greedy choice of each row of logits, on the device, so that a decode
//!   step's next input never has to visit the host (see `generate`).
//!
//! Forward only, CUDA only (bf16, f16, f32; contiguous inputs): anything else is an error. The
//! CPU keeps the composed candle ops, which these kernels must match (arithmetic in f32, one
//! rounding per output; tested against the composed ops on the GPU in `tests/gpu.rs`).

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Tensor,
};

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod linear_rows;
#[cfg(feature = "cuda")]
pub use cuda::MappedTokens;
pub use linear_rows::{linear_rows, linear_rows_fits, LINEAR_ROWS_MAX_TOKENS};

/// `(x + h, rms_norm(x + h) · w)` for `x`, `h` (.., dim) and `w` (dim): the updated residual
/// stream and the normalised input of the next sub-block, in one launch. The sum is rounded to
/// the dtype before it is normalised, as candle's add followed by the norm would.
pub fn add_rms_norm(x: &Tensor, h: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    on_cuda("add + RMSNorm", x)?;
    if x.shape() != h.shape() {
        bail!(
            "flash-llama add + RMSNorm: x {:?} and h {:?} differ in shape",
            x.shape(),
            h.shape()
        )
    }
    let dim = x.dims().last().copied().unwrap_or(0);
    if w.dims() != [dim] || dim == 0 {
        bail!("flash-llama add + RMSNorm: weight {:?} for rows of {dim}", w.shape())
    }
    // One output holding both: (2, ..), residual first.
    let both = x.apply_op3_no_bwd(h, w, &AddRmsNorm { eps: eps as f32 })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// `silu(y[.., :i]) · y[.., i..]` for `y` (.., 2i), the output of a fused gate/up projection:
/// (.., i), in one launch.
pub fn silu_mul(y: &Tensor) -> Result<Tensor> {
    on_cuda("SiLU × up", y)?;
    if y.dims().last().is_none_or(|&n| n % 2 != 0) {
        bail!(
            "flash-llama SiLU × up: the last dim of {:?} must be even (gate, up)",
            y.shape()
        )
    }
    y.apply_op1_no_bwd(&SiluMul)
}

/// The rotary tables of `positions` (tokens,) u32: cos and sin (tokens, ..inv_freq's dims) of
/// `positions[t] × inv_freq`, computed in f32 (`inv_freq` f32, any shape) and cast to `dtype`
/// (bf16, f16 or f32), in one launch: what `nn::rope_angles_per_head` and a cast compute (the same
/// f32 angles; `cosf` / `sinf`), for a decode step's few tokens without their six launches.
pub fn rope_angles(positions: &Tensor, inv_freq: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    on_cuda("rotary angles", positions)?;
    if positions.rank() != 1 || positions.dtype() != DType::U32 || inv_freq.dtype() != DType::F32 {
        bail!(
            "flash-llama rotary angles: positions (tokens,) u32 and f32 frequencies, got {:?} {:?} and {:?}",
            positions.shape(),
            positions.dtype(),
            inv_freq.dtype()
        )
    }
    if !inv_freq.device().same_device(positions.device()) {
        bail!("flash-llama rotary angles: the positions and the frequencies must be on one GPU")
    }
    let both = positions.apply_op2_no_bwd(inv_freq, &RopeAngles { dtype })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// What [`decode_prologue`] reads: a decode step's tokens and key counts and the model's first
/// layer inputs.
#[derive(Clone, Copy)]
pub struct PrologueInputs<'a> {
    /// (rows,) u32: each sequence's last token.
    pub ids: &'a Tensor,
    /// (rows,) u32: the keys each sequence holds before the step (its new token's position).
    pub lens: &'a Tensor,
    /// (rows,) u32: where each sequence's rows start in a contiguous cache; `None` over a paged
    /// cache (its rows come from the host).
    pub slot_starts: Option<&'a Tensor>,
    /// f32, any shape: the rotary frequencies (as [`rope_angles`]).
    pub inv_freq: &'a Tensor,
    /// (vocab, hidden): the embedding table.
    pub embed: &'a Tensor,
    /// (hidden,): the first layer's input RMSNorm weight, and its epsilon.
    pub norm_weight: &'a Tensor,
    pub eps: f64,
}

/// [`decode_prologue`]'s outputs.
pub struct DecodePrologue {
    /// (rows,) u32: lens + 1, the keys each sequence holds after the step.
    pub seqlens: Tensor,
    /// (rows,) u32: lens + slot_starts, each new key's cache row (contiguous caches).
    pub cache_rows: Option<Tensor>,
    /// (rows, ..inv_freq's dims): the rotary tables at positions `lens`, as [`rope_angles`].
    pub cos: Tensor,
    pub sin: Tensor,
    /// (rows, hidden): the embedding rows of `ids` (NaN for an id past the vocabulary) and
    /// their RMSNorm, the bits of candle-nn's `rms_norm` of them.
    pub x: Tensor,
    pub normed: Tensor,
}

/// The first layer's inputs of a decode step in one launch, where five candle kernels did it
/// (the counts + 1, the cache rows, [`rope_angles`], the embedding lookup, candle-nn's
/// `rms_norm`; ~10 µs of a CUDA-graph step at batch 1). CUDA only; every tensor contiguous on
/// one GPU, the embedding and the norm weight of one dtype (bf16, f16 or f32).
pub fn decode_prologue(inputs: &PrologueInputs) -> Result<DecodePrologue> {
    const OP: &str = "flash-llama decode prologue";
    on_cuda("decode prologue", inputs.embed)?;
    let dev = inputs.embed.device();
    let (_, hidden) = inputs.embed.dims2()?;
    let rows = inputs.ids.dims1()?;
    let u32_rows = std::iter::once(("token ids", inputs.ids))
        .chain(std::iter::once(("key counts", inputs.lens)))
        .chain(inputs.slot_starts.map(|s| ("slot starts", s)));
    for (what, t) in u32_rows {
        if t.dims() != [rows] || t.dtype() != DType::U32 {
            bail!(
                "{OP}: the {what} must be ({rows},) u32, got {:?} {:?}",
                t.shape(),
                t.dtype()
            )
        }
    }
    let dtype = inputs.embed.dtype();
    if rows == 0 || hidden == 0 {
        bail!(
            "{OP}: no rows or an empty embedding ({rows} ids, embedding {:?})",
            inputs.embed.shape()
        )
    }
    if inputs.norm_weight.dims() != [hidden] || inputs.norm_weight.dtype() != dtype {
        bail!(
            "{OP}: the norm's weight must be ({hidden},) {dtype:?}, got {:?} {:?}",
            inputs.norm_weight.shape(),
            inputs.norm_weight.dtype()
        )
    }
    if inputs.inv_freq.dtype() != DType::F32 || inputs.inv_freq.elem_count() == 0 {
        bail!(
            "{OP}: the frequencies must be f32, got {:?} {:?}",
            inputs.inv_freq.shape(),
            inputs.inv_freq.dtype()
        )
    }
    let all = [inputs.ids, inputs.lens, inputs.inv_freq, inputs.norm_weight]
        .into_iter()
        .chain(inputs.slot_starts);
    for t in all {
        if !t.device().same_device(dev) {
            bail!("{OP}: every input must be on the embedding's GPU")
        }
    }
    let mut rope_dims = vec![rows];
    rope_dims.extend_from_slice(inputs.inv_freq.dims());
    // SAFETY: the launch writes every element of each (its block's row of each).
    let empty = |dims: &[usize], dtype| unsafe { Tensor::empty(dims, dtype, dev) };
    let out = DecodePrologue {
        seqlens: empty(&[rows], DType::U32)?,
        cache_rows: match inputs.slot_starts {
            Some(_) => Some(empty(&[rows], DType::U32)?),
            None => None,
        },
        cos: empty(&rope_dims, dtype)?,
        sin: empty(&rope_dims, dtype)?,
        x: empty(&[rows, hidden], dtype)?,
        normed: empty(&[rows, hidden], dtype)?,
    };
    #[cfg(feature = "cuda")]
    cuda::decode_prologue(inputs, &out)?;
    Ok(out)
}

/// Whether [`linear_vector`] takes `x` (1, k) and `w` (n, k): CUDA tensors of one dtype (bf16,
/// f16, f32), one row, both contiguous, starting on 16 bytes, with rows of whole 16-byte vectors.
/// Shape checks only, on the host.
pub fn linear_vector_fits(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((rows, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    let dtype = x.dtype();
    x.device().is_cuda()
        && matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        && rows == 1
        && k == wk
        && (k * dtype.size_in_bytes()) % 16 == 0
        && vector_ready(x, dtype, x)
        && vector_ready(w, dtype, x)
}

/// `x · wᵀ (+ bias)` for one row `x` (1, k) and a linear layer's `w` (n, k) (and `bias` (n)):
/// (1, n), in one launch, when [`linear_vector_fits`] holds (an error otherwise). For the
/// projections of a batch-1 decode step, where cuBLAS reads the smaller weights at 1-1.5 TB/s and
/// takes about twice the host time of one of our launches. (With several rows cuBLAS's tiles
/// win on the device: measured for 2, 4 and 8 rows, docs/benchmarks.md.)
pub fn linear_vector(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    on_cuda("linear", x)?;
    if !linear_vector_fits(x, w) {
        bail!(
            "flash-llama linear: x {:?} ({:?}, strides {:?}) and w {:?} ({:?}) need one dtype, one row, a shared k of whole 16-byte vectors and contiguous, 16-byte aligned tensors on one GPU",
            x.shape(),
            x.dtype(),
            x.stride(),
            w.shape(),
            w.dtype()
        )
    }
    check_bias(bias, w.dim(0)?, x)?;
    x.apply_op2_no_bwd(
        w,
        &LinearVector {
            input: VectorInput::Plain,
            output: VectorOutput::Plain,
            bias: bias.cloned(),
        },
    )
}

/// Whether `t` is a contiguous tensor of `dtype` on `x`'s device, starting on 16 bytes.
fn vector_ready(t: &Tensor, dtype: DType, x: &Tensor) -> bool {
    let l = t.layout();
    t.device().same_device(x.device())
        && t.dtype() == dtype
        && l.is_contiguous()
        && (l.start_offset() * dtype.size_in_bytes()) % 16 == 0
}

/// Whether [`linear_vector_add_norm`] takes `x`, `h` (1, k), `norm_w` (k) and `w` (n, k): as
/// [`linear_vector_fits`], with a row that add + RMSNorm's vector path covers (k of at most 256
/// threads × 4 vectors of 16 bytes: 8192 bf16/f16, 4096 f32).
pub fn linear_vector_add_norm_fits(x: &Tensor, h: &Tensor, norm_w: &Tensor, w: &Tensor) -> bool {
    let (Ok((rows, k)), Ok((_, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    let dtype = x.dtype();
    let size = dtype.size_in_bytes();
    x.device().is_cuda()
        && matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        && rows == 1
        && k == wk
        && h.dims() == [1, k]
        && norm_w.dims() == [k]
        && (k * size) % 16 == 0
        && k * size <= 256 * 16 * 4
        && [x, h, norm_w, w].iter().all(|t| vector_ready(t, dtype, x))
}

/// `(x + h, linear_vector(rms_norm(x + h) · norm_w, w, bias))` in one launch: a residual add, the
/// RMSNorm after it and the batch-1 projection that reads the norm (q/k/v, gate/up, the output
/// head). Each block computes the sum and the norm into shared memory while its first weights
/// load, and block 0 writes the sum: the same bits as [`add_rms_norm`] then [`linear_vector`].
/// An error unless [`linear_vector_add_norm_fits`].
pub fn linear_vector_add_norm(
    x: &Tensor,
    h: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    on_cuda("linear (add + RMSNorm input)", x)?;
    if !linear_vector_add_norm_fits(x, h, norm_w, w) {
        bail!(
            "flash-llama linear (add + RMSNorm input): x {:?} ({:?}), h {:?}, norm weight {:?} and w {:?} need one dtype, one row of k (at most 4096 bytes × 16) matching the weight rows, contiguous and 16-byte aligned tensors on one GPU",
            x.shape(),
            x.dtype(),
            h.shape(),
            norm_w.shape(),
            w.shape()
        )
    }
    check_bias(bias, w.dim(0)?, x)?;
    add_norm_launch(x, h, norm_w, eps, w, bias, VectorOutput::Plain)
}

/// The launch of the add + RMSNorm forms (fits checked by the caller): one output holding the
/// residual x + h (k), then the projection's `output` (n, or inter for the SwiGLU form), returned
/// as (1, k) and (1, n).
fn add_norm_launch(
    x: &Tensor,
    h: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
    bias: Option<&Tensor>,
    output: VectorOutput,
) -> Result<(Tensor, Tensor)> {
    let (k, n) = (x.dim(1)?, output.outputs(w.dim(0)?));
    let both = x.apply_op2_no_bwd(
        w,
        &LinearVector {
            input: VectorInput::AddNorm {
                h: h.clone(),
                norm_w: norm_w.clone(),
                eps: eps as f32,
            },
            output,
            bias: bias.cloned(),
        },
    )?;
    Ok((
        both.narrow(0, 0, k)?.reshape((1, k))?,
        both.narrow(0, k, n)?.reshape((1, n))?,
    ))
}

/// Whether [`linear_vector_add_norm_swiglu`] takes `x`, `h` (1, k), `norm_w` (k) and a fused
/// gate/up weight `w` (2 · inter, k): as [`linear_vector_add_norm_fits`], with an even number of
/// weight rows.
pub fn linear_vector_add_norm_swiglu_fits(x: &Tensor, h: &Tensor, norm_w: &Tensor, w: &Tensor) -> bool {
    matches!(w.dims2(), Ok((rows, _)) if rows % 2 == 0) && linear_vector_add_norm_fits(x, h, norm_w, w)
}

/// `(x + h, silu(g) · u)` in one launch, where `(g, u)` are the two halves of
/// `linear_vector(rms_norm(x + h) · norm_w, w)` for a fused gate/up weight `w` (2 · inter, k)
/// (gate rows first): a batch-1 MLP's residual add, norm, gate/up projection and SwiGLU, (1, k)
/// and (1, inter). One warp sums both rows of an index, so the down projection reads its input
/// ready instead of computing SiLU × up in each of its blocks. The same bits as
/// [`linear_vector_add_norm`] then [`silu_mul`]. An error unless
/// [`linear_vector_add_norm_swiglu_fits`].
pub fn linear_vector_add_norm_swiglu(
    x: &Tensor,
    h: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
) -> Result<(Tensor, Tensor)> {
    on_cuda("linear (add + RMSNorm input, SwiGLU output)", x)?;
    if !linear_vector_add_norm_swiglu_fits(x, h, norm_w, w) {
        bail!(
            "flash-llama linear (add + RMSNorm input, SwiGLU output): x {:?} ({:?}), h {:?}, norm weight {:?} and w {:?} need one dtype, one row of k (at most 4096 bytes × 16) matching the weight rows, an even number of weight rows (gate then up), contiguous and 16-byte aligned tensors on one GPU",
            x.shape(),
            x.dtype(),
            h.shape(),
            norm_w.shape(),
            w.shape()
        )
    }
    add_norm_launch(x, h, norm_w, eps, w, None, VectorOutput::SwiGlu)
}

fn check_bias(bias: Option<&Tensor>, n: usize, x: &Tensor) -> Result<()> {
    if let Some(b) = bias {
        if b.dims() != [n] || b.dtype() != x.dtype() || !b.is_contiguous() || !b.device().same_device(x.device()) {
            bail!(
                "flash-llama linear: bias {:?} ({:?}) for {n} outputs of {:?}",
                b.shape(),
                b.dtype(),
                x.dtype()
            )
        }
    }
    Ok(())
}

/// The index of the largest value of each row of `logits` (rows, vocab): (rows,) u32, the first
/// index on ties, NaNs never chosen; as [`crate::sampling::argmax`] on the host.
pub fn argmax_rows(logits: &Tensor) -> Result<Tensor> {
    logit_rows(logits)?;
    logits.apply_op1_no_bwd(&ArgmaxRows)
}

/// The rows of `logits` (rows, vocab) on the GPU, with a vocabulary the argmax takes.
fn logit_rows(logits: &Tensor) -> Result<usize> {
    on_cuda("argmax", logits)?;
    let (rows, vocab) = logits.dims2()?;
    if vocab == 0 || vocab > u32::MAX as usize / 2 {
        bail!("flash-llama argmax: rows of {vocab} logits")
    }
    Ok(rows)
}

/// [`argmax_rows`] written into `out` (rows,) u32, contiguous on the logits' GPU; with `bump`
/// (rows,) u32, contiguous, also `bump += 1` in the same launch: a CUDA-graph decode step's token
/// and key count advanced where the token is chosen, without a copy or an add of their own.
/// With `host` (needs `bump`; as many rows), each token also goes straight to host memory, read
/// by [`MappedTokens::wait`] with the row's new count: a replayed step's tokens reach the host
/// without a copy queued between two replays. `logits` must be contiguous, as for
/// [`argmax_rows`].
#[cfg(feature = "cuda")]
pub fn argmax_rows_into(
    logits: &Tensor,
    out: &Tensor,
    bump: Option<&Tensor>,
    host: Option<&MappedTokens>,
) -> Result<()> {
    let rows = logit_rows(logits)?;
    for (what, t) in std::iter::once(("the output", out)).chain(bump.map(|b| ("the counts", b))) {
        if t.dims() != [rows] || t.dtype() != DType::U32 || !t.is_contiguous() {
            bail!(
                "flash-llama argmax: {what} must be ({rows},) u32 contiguous, got {:?} {:?}",
                t.shape(),
                t.dtype()
            )
        }
    }
    // Strided logits are refused (by the launch's address check), as argmax_rows refuses them.
    let (storage, layout) = logits.storage_and_layout();
    let candle_core::Storage::Cuda(x) = &*storage else {
        return Err(cuda_only("argmax"));
    };
    cuda::argmax_rows_into((x, layout), out, bump, host)
}

/// Where [`rope_store`] puts the rotated k heads and the v heads.
pub enum CacheStore<'a> {
    /// In the model's dtype: `kv` (rows, cached heads, head_dim), contiguous, takes the last
    /// `kv.dim(1)` heads of each token (k then v side by side) in its row `rows[t]`.
    Rows { kv: &'a Tensor, rows: &'a Tensor },
    /// As e4m3: `kv` (2, rows, kv_heads, head_dim) `F8E4M3`, contiguous, a k plane and a v plane;
    /// each of the last 2 · kv_heads heads of a token is multiplied by its factor in `quant`
    /// (2 · kv_heads,) f32 (k heads first) and saturated to ±448 before the cast.
    E4m3 {
        kv: &'a Tensor,
        rows: &'a Tensor,
        quant: &'a Tensor,
    },
}

/// Rotary embedding of `y` (tokens, heads, head_dim), in place, each (token, head) by its own
/// angles `cos`/`sin` (tokens, heads, head_dim / 2) (heads at angle 0 pass unchanged): pairs
/// `(x_i, x_{i+d/2})`, or `(x_{2i}, x_{2i+1})` if `interleaved`. With `store`, the k and v heads
/// of each token (the last heads of a fused q/k/v output) are also written, rotated, to its
/// cache row: one launch for what was a RoPE and a strided copy (and, for an e4m3 cache, the
/// quantization).
pub fn rope_store(y: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool, store: Option<CacheStore>) -> Result<()> {
    on_cuda("RoPE + KV store", y)?;
    let (tokens, heads, d) = y.dims3()?;
    if d % 2 != 0 || cos.dims() != [tokens, heads, d / 2] || sin.dims() != cos.dims() {
        bail!(
            "flash-llama RoPE + KV store: y {:?} needs an even head dim and cos/sin of (tokens, heads, head_dim / 2), got {:?} and {:?}",
            y.shape(),
            cos.shape(),
            sin.shape()
        )
    }
    let store = match store {
        None => None,
        Some(CacheStore::Rows { kv, rows }) => {
            let (_, cached, kd) = kv.dims3()?;
            check_rows(rows, tokens)?;
            if kd != d || cached > heads {
                bail!(
                    "flash-llama RoPE + KV store: the cache {:?} and y {:?} do not fit (head dim, cached heads)",
                    kv.shape(),
                    y.shape()
                )
            }
            Some(StoreTarget::Rows {
                kv: kv.clone(),
                rows: rows.clone(),
            })
        }
        Some(CacheStore::E4m3 { kv, rows, quant }) => {
            check_rows(rows, tokens)?;
            let fits = match *kv.dims() {
                [2, _, kv_heads, kd] => kd == d && 2 * kv_heads <= heads && quant.dims() == [2 * kv_heads],
                _ => false,
            };
            if !fits || kv.dtype() != DType::F8E4M3 || quant.dtype() != DType::F32 || !kv.is_contiguous() {
                bail!(
                    "flash-llama RoPE + KV store: e4m3 cache {:?} ({:?}, 2 planes of (rows, kv_heads, head_dim)) and factors {:?} ({:?}) do not fit y {:?}",
                    kv.shape(),
                    kv.dtype(),
                    quant.shape(),
                    quant.dtype(),
                    y.shape()
                )
            }
            Some(StoreTarget::E4m3 {
                kv: kv.clone(),
                rows: rows.clone(),
                quant: quant.clone(),
            })
        }
    };
    let op = RopeStore { interleaved, store };
    y.inplace_op3(cos, sin, &op)
}

/// Stores `kv_new` (tokens, 2 × kv_heads, head_dim), k heads first, into the e4m3 cache `kv`
/// (2, rows, kv_heads, head_dim) at the rows `rows` (tokens,) u32, each head multiplied by its
/// factor in `quant` (2 × kv_heads,) f32 and saturated: [`rope_store`]'s e4m3 store without the
/// rotation (candle's CUDA casts have no f8e4m3 target).
pub fn store_e4m3(kv_new: &Tensor, kv: &Tensor, rows: &Tensor, quant: &Tensor) -> Result<()> {
    on_cuda("e4m3 KV store", kv_new)?;
    let (tokens, heads, d) = kv_new.dims3()?;
    check_rows(rows, tokens)?;
    let fits = match *kv.dims() {
        [2, _, kv_heads, kd] => kd == d && 2 * kv_heads == heads && quant.dims() == [heads],
        _ => false,
    };
    if !fits || d % 2 != 0 || kv.dtype() != DType::F8E4M3 || quant.dtype() != DType::F32 || !kv.is_contiguous() {
        bail!(
            "flash-llama e4m3 KV store: cache {:?} ({:?}) and factors {:?} ({:?}) do not fit new keys {:?}",
            kv.shape(),
            kv.dtype(),
            quant.shape(),
            quant.dtype(),
            kv_new.shape()
        )
    }
    let kv_new = kv_new.contiguous()?;
    kv.inplace_op2(
        &kv_new,
        &StoreE4m3Op {
            rows: rows.clone(),
            quant: quant.clone(),
        },
    )
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct StoreE4m3Op {
    rows: Tensor,
    quant: Tensor,
}

impl candle_core::InplaceOp2 for StoreE4m3Op {
    fn name(&self) -> &'static str {
        "e4m3-kv-store"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        Err(cuda_only("e4m3 KV store"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        kv: &mut candle_core::CudaStorage,
        kv_l: &Layout,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<()> {
        cuda::store_e4m3((kv, kv_l), (x, x_l), &self.rows, &self.quant)
    }
}

fn check_rows(rows: &Tensor, tokens: usize) -> Result<()> {
    if rows.dims() != [tokens] || rows.dtype() != DType::U32 {
        bail!(
            "flash-llama RoPE + KV store: cache rows {:?} ({:?}) for {tokens} tokens: (tokens,) u32 expected",
            rows.shape(),
            rows.dtype()
        )
    }
    Ok(())
}

/// [`CacheStore`] with the op's own handles on the tensors (sharing the caller's storage,
/// written / read inside the launch).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum StoreTarget {
    Rows { kv: Tensor, rows: Tensor },
    E4m3 { kv: Tensor, rows: Tensor, quant: Tensor },
}

// Without the `cuda` feature the ops exist (their CPU forward is the error) but read no field.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddRmsNorm {
    eps: f32,
}

struct SiluMul;

struct ArgmaxRows;

/// Where [`LinearVector`]'s row comes from (the kernel's `Input` policy, kernels/model/fused.cu).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum VectorInput {
    /// The op's first input, x (1, k).
    Plain,
    /// rms_norm(x + h) · norm_w of the op's first input x (1, k); the output holds x + h first.
    AddNorm { h: Tensor, norm_w: Tensor, eps: f32 },
}

/// What [`LinearVector`] writes (the kernel, kernels/model/fused.cu).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy)]
pub(crate) enum VectorOutput {
    /// The product y (1, n).
    Plain,
    /// silu(y[:n/2]) · y[n/2:] (1, n / 2): `linear_vector_swiglu`.
    SwiGlu,
}

impl VectorOutput {
    /// The outputs of a weight of `rows` rows: a row's product each, or one of a (gate, up) pair
    /// of rows each.
    fn outputs(self, rows: usize) -> usize {
        match self {
            VectorOutput::Plain => rows,
            VectorOutput::SwiGlu => rows / 2,
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct LinearVector {
    input: VectorInput,
    output: VectorOutput,
    /// Shares the caller's storage; read inside the launch.
    bias: Option<Tensor>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RopeStore {
    interleaved: bool,
    store: Option<StoreTarget>,
}

/// Device check up front: the CPU never reaches these kernels.
fn on_cuda(op: &str, x: &Tensor) -> Result<()> {
    match x.device().is_cuda() {
        true => Ok(()),
        false => Err(cuda_only(op)),
    }
}

fn cuda_only(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flash-llama: the fused {op} kernel runs on CUDA tensors only (the CPU uses the composed ops)"
    ))
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(cuda_only("add + RMSNorm"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        // Shapes checked by `add_rms_norm`.
        let out = cuda::add_rms_norm((x, xl), (h, hl), (w, wl), self.eps)?;
        let mut dims = vec![2];
        dims.extend_from_slice(xl.dims());
        Ok((out, Shape::from(dims)))
    }
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(cuda_only("SiLU × up"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, y: &candle_core::CudaStorage, yl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        // The last dim checked even by `silu_mul`.
        let mut dims = yl.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last /= 2;
        }
        let out = cuda::silu_mul((y, yl))?;
        Ok((out, Shape::from(dims)))
    }
}

/// [`rope_angles`]: cos and sin side by side, (2, tokens, ..inv_freq's dims).
struct RopeAngles {
    /// The tables' dtype (read by the CUDA launch only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dtype: DType,
}

impl CustomOp2 for RopeAngles {
    fn name(&self) -> &'static str {
        "rope-angles"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(cuda_only("rotary angles"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        f: &candle_core::CudaStorage,
        fl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        // Dtypes and the positions' rank checked by `rope_angles`.
        let out = cuda::rope_angles((p, pl), (f, fl), self.dtype)?;
        let mut dims = vec![2, pl.dims()[0]];
        dims.extend_from_slice(fl.dims());
        Ok((out, Shape::from(dims)))
    }
}

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(cuda_only("argmax"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        // Rank 2 checked by `argmax_rows`.
        let out = cuda::argmax_rows((x, xl))?;
        Ok((out, Shape::from(xl.dims()[0])))
    }
}

impl CustomOp2 for LinearVector {
    fn name(&self) -> &'static str {
        "linear-vector"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(cuda_only("linear"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        // Shapes, dtypes and alignment checked by `linear_vector` and its fused forms.
        let out = cuda::linear_vector((x, xl), (w, wl), &self.input, self.output, self.bias.as_ref())?;
        let n = self.output.outputs(wl.dims()[0]);
        Ok((
            out,
            match self.input {
                VectorInput::AddNorm { .. } => Shape::from(xl.dims()[1] + n),
                _ => Shape::from((xl.dims()[0], n)),
            },
        ))
    }
}

impl InplaceOp3 for RopeStore {
    fn name(&self) -> &'static str {
        "rope-store"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        Err(cuda_only("RoPE + KV store"))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &mut candle_core::CudaStorage,
        yl: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        // Shapes checked by `rope_store`.
        cuda::rope_store((y, yl), (cos, cl), (sin, sl), self.interleaved, self.store.as_ref())
    }
}
