//! Fused ops with a backward, for the training path ([`crate::Kernels::Trainable`]):
//!
//! - [`rms_norm`]: `x · rsqrt(mean(x²) + ε) · w`; backward: dx and dw (summed over rows);
//! - [`rope`]: rotary embedding of (tokens, heads, head_dim) by per-token angles; backward: the
//!   rotation by the opposite angles;
//! - [`swiglu`]: `silu(gate) · up`; backward: dgate and dup;
//! - [`embedding`]: rows of the embedding matrix; backward: each row's gradient summed over the
//!   tokens of its id in a fixed order (candle's `index_add` backward of `Embedding` took 8 ms
//!   per micro-batch of the 125m preset on an H100).
//!
//! For training loops that differentiate by hand (the trainer's explicit backward,
//! [`crate::train::Backward::Explicit`]), the same kernels without graph nodes, and the packed
//! forms that let one matmul serve several weights:
//!
//! - [`rms_norm_add`]: a residual add and the next norm in one pass; [`rms_norm_backward`] with
//!   the residual stream's gradient added in the same pass;
//! - [`rope_heads`]: RoPE of some heads of a packed q/k/v projection's rows, read in place;
//!   [`rope_pack_backward`]: dq and dk rotated back and dv, packed into one gradient;
//! - [`swiglu_packed`] / [`swiglu_packed_backward`]: SiLU × up of a packed gate/up output;
//!   [`swiglu_backward`]; [`TokenIndex`], the embedding lookup with its index made ahead;
//! - [`accumulate_weight_grad`]: a weight gradient added to an f32 accumulator, on the GPU by
//!   one cuBLAS GEMM writing f32 in place;
//! - [`cross_entropy_logsumexp`] / [`cross_entropy_backward`]: the loss of rows of logits and
//!   its gradient, read and written in the logits' dtype (f32 inside), so the explicit backward
//!   runs the LM head and the loss over chunks of tokens without an f32 copy of the logits.
//!
//! Each is a candle custom op whose `bwd` applies another op of this module, so a graph through
//! them differentiates like one of plain candle ops, with one or two launches per op instead of
//! the five to ten (each with its own backward) of the composed forms in [`crate::nn`]. Math in
//! f32, one rounding per output, bf16/f16/f32 in and out. The CPU runs plain loops (the tests
//! check them against the composed forms and their autograd gradients); CUDA runs our kernels
//! (kernels/model/train_ops.cu), whose weight gradients are reduced in a fixed order
//! (deterministic).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub(crate) use cuda::{optimizer_step, AdamWStep, OptimTensor};

/// RMSNorm over the last dimension of `x` (.., dim) with gain `w` (dim), in f32 inside.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dim = x.dims().last().copied().unwrap_or(0);
    if w.dims() != [dim] || dim == 0 {
        bail!("flash-llama RMSNorm: weight {:?} for rows of {dim}", w.shape())
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// Rotary embedding of `x` (tokens, heads, head_dim), every head of token t rotated by row t of
/// `cos`/`sin` (tokens, head_dim / 2): pairs `(x_i, x_{i+d/2})`, or `(x_{2i}, x_{2i+1})` if
/// `interleaved`. `cos`/`sin` get no gradient (they are functions of the positions).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (tokens, _, d) = x.dims3()?;
    if d % 2 != 0 || cos.dims() != [tokens, d / 2] || sin.dims() != cos.dims() {
        bail!(
            "flash-llama RoPE: x {:?} needs an even head dim and cos/sin of (tokens, head_dim / 2), got {:?} and {:?}",
            x.shape(),
            cos.shape(),
            sin.shape()
        )
    }
    let op = Rope {
        interleaved,
        inverse: false,
    };
    x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// `silu(gate) · up`, elementwise, for `gate` and `up` of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        bail!(
            "flash-llama SiLU × up: gate {:?} and up {:?} differ in shape",
            gate.shape(),
            up.shape()
        )
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, Swiglu)
}

/// Rows `ids` of `weight` (vocab, dim): (tokens, dim). The ids are on the host (the training
/// batches are made there); the backward's index (tokens sorted by id, cut into chunks) is built
/// from them here, so the GPU backward needs no sort and no atomics.
pub fn embedding(weight: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let (vocab, _) = weight.dims2()?;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("flash-llama embedding: token id {bad} is outside the vocabulary (size {vocab})")
    }
    let index = Arc::new(EmbeddingIndex::new(ids, vocab, weight.device())?);
    weight.contiguous()?.apply_op1(Embedding { index })
}

/// Token ids on the device with the index of the embedding backward (the tokens grouped by id),
/// made ahead of the lookup ([`TokenIndex::embed`]): a training loop that differentiates by
/// hand ([`crate::train::Backward::Explicit`]) prepares its micro-batches before it queues their
/// kernels, so that no upload in the middle of a step waits for the GPU to drain.
pub struct TokenIndex(Arc<EmbeddingIndex>);

impl TokenIndex {
    /// The index of `ids`, each below `vocab`, on `device`.
    pub fn new(ids: &[u32], vocab: usize, device: &Device) -> Result<Self> {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!("flash-llama embedding: token id {bad} is outside the vocabulary (size {vocab})")
        }
        Ok(Self(Arc::new(EmbeddingIndex::new(ids, vocab, device)?)))
    }

    /// The rows of `weight` (vocab, dim) at the ids, (tokens, dim), without a graph node, and
    /// the handle that computes the backward.
    pub fn embed(&self, weight: &Tensor) -> Result<(Tensor, EmbeddingBackward)> {
        let (vocab, _) = weight.dims2()?;
        if vocab != self.0.vocab {
            bail!(
                "flash-llama embedding: a weight of {vocab} rows for token ids indexed over {}",
                self.0.vocab
            )
        }
        let rows = weight
            .contiguous()?
            .apply_op1_no_bwd(&Embedding { index: self.0.clone() })?;
        Ok((rows, EmbeddingBackward(EmbeddingBwd { index: self.0.clone() })))
    }
}

/// The backward of one embedding lookup ([`TokenIndex::embed`]).
pub struct EmbeddingBackward(EmbeddingBwd);

impl EmbeddingBackward {
    /// dy (tokens, dim) → the gradient of the whole weight (vocab, dim).
    pub fn backward(&self, dy: &Tensor) -> Result<Tensor> {
        dy.contiguous()?.apply_op1_no_bwd(&self.0)
    }
}

/// `(x + h, rms_norm(x + h, w))` in one pass (the sum rounded to the dtype first, as two ops
/// would): a residual add and the norm of the next sub-block. No graph node (for the explicit
/// backward, [`crate::train::explicit`]).
pub fn rms_norm_add(x: &Tensor, h: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let dim = x.dims().last().copied().unwrap_or(0);
    if w.dims() != [dim] || dim == 0 || h.shape() != x.shape() {
        bail!(
            "flash-llama add + RMSNorm: x {:?}, residual {:?} and weight {:?}",
            x.shape(),
            h.shape(),
            w.shape()
        )
    }
    let both = x
        .contiguous()?
        .apply_op3_no_bwd(&h.contiguous()?, &w.contiguous()?, &RmsNormAdd { eps: eps as f32 })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// The backward of [`rms_norm`]: (dx, dw) from its input `x`, gain `w` and the gradient `dy` of
/// its output; with `residual`, dx also gets that gradient added (x's gradient through the
/// residual stream, in the same pass). dw is summed over the rows in a fixed order.
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
    residual: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let dim = w.dim(0)?;
    let rows = x.elem_count() / dim;
    if let Some(r) = residual {
        if r.shape() != x.shape() || r.dtype() != x.dtype() {
            bail!(
                "flash-llama RMSNorm backward: residual gradient {:?} {:?} for x {:?} {:?}",
                r.dtype(),
                r.shape(),
                x.dtype(),
                x.shape()
            )
        }
    }
    let op = RmsNormBwd {
        eps: eps as f32,
        residual: residual.map(Tensor::contiguous).transpose()?,
    };
    let both = x.contiguous()?.apply_op3_no_bwd(w, &dy.contiguous()?, &op)?;
    Ok((both.narrow(0, 0, rows)?.reshape(x.shape())?, both.get(rows)?))
}

/// `acc + dyᵀ · x` in f32: a linear layer's weight gradient (dy (tokens, out), x (tokens, in))
/// added to an f32 accumulator (out, in), `None` meaning zeros. On the GPU with 16-bit inputs,
/// one cuBLAS GEMM writes f32 straight into the accumulator (in place: the accumulator must be
/// the caller's own tensor); elsewhere a matmul, a cast and an add.
pub fn accumulate_weight_grad(acc: Option<Tensor>, dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if dy.device().is_cuda() && matches!(dy.dtype(), DType::BF16 | DType::F16) {
        let acc = match acc {
            Some(acc) => acc,
            None => Tensor::zeros((dy.dim(1)?, x.dim(1)?), DType::F32, dy.device())?,
        };
        cuda::weight_grad_into(&acc, dy, x)?;
        return Ok(acc);
    }
    let g = dy.t()?.matmul(x)?.to_dtype(DType::F32)?;
    match acc {
        Some(acc) => acc + g,
        None => Ok(g),
    }
}

/// Per row of `logits` (rows, vocab): its logsumexp and the logit of the row's target
/// (`targets`: (rows,) u32 on the same device; a target outside the vocabulary gives NaN), as
/// (rows, 2) f32. The row's cross-entropy is the first minus the second. No graph node.
pub fn cross_entropy_logsumexp(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    check_cross_entropy(logits, targets, None)?;
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &CrossEntropyLse)
}

/// The gradient of the rows' cross-entropy times `scale` with respect to `logits` (rows,
/// vocab): `scale · (softmax(row) − one_hot(target))`, with the softmax from `lse` ((rows,) f32,
/// the first column of [`cross_entropy_logsumexp`]), in the logits' dtype. No graph node.
pub fn cross_entropy_backward(logits: &Tensor, targets: &Tensor, lse: &Tensor, scale: f64) -> Result<Tensor> {
    check_cross_entropy(logits, targets, Some(lse))?;
    let op = CrossEntropyBwd { scale: scale as f32 };
    logits
        .contiguous()?
        .apply_op3_no_bwd(&targets.contiguous()?, &lse.contiguous()?, &op)
}

fn check_cross_entropy(logits: &Tensor, targets: &Tensor, lse: Option<&Tensor>) -> Result<()> {
    let (rows, vocab) = logits.dims2()?;
    if targets.dims() != [rows] || targets.dtype() != DType::U32 || vocab == 0 {
        bail!(
            "flash-llama cross-entropy: logits {:?} need (rows,) u32 targets, got {:?} {:?}",
            logits.shape(),
            targets.dtype(),
            targets.shape()
        )
    }
    if let Some(lse) = lse {
        if lse.dims() != [rows] || lse.dtype() != DType::F32 {
            bail!(
                "flash-llama cross-entropy backward: logits {:?} need a (rows,) f32 logsumexp, got {:?} {:?}",
                logits.shape(),
                lse.dtype(),
                lse.shape()
            )
        }
    }
    for t in [targets].into_iter().chain(lse) {
        if !t.device().same_device(logits.device()) {
            bail!("flash-llama cross-entropy: the logits and the targets must be on one device")
        }
    }
    Ok(())
}

/// q, k and v of a packed q/k/v projection's output `x` (tokens, (hq + hk + hv) · d), `heads`
/// = [hq, hk, hv]: q and k rotated by RoPE, v copied, in one op: (q, k, v), each (tokens,
/// heads, d) and contiguous (views of one buffer). No graph node.
pub fn rope_unpack(
    x: &Tensor,
    heads: [usize; 3],
    d: usize,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (tokens, width) = x.dims2()?;
    if d % 2 != 0
        || heads.iter().sum::<usize>() * d != width
        || cos.dims() != [tokens, d / 2]
        || sin.dims() != cos.dims()
    {
        bail!(
            "flash-llama RoPE: q/k/v heads {heads:?} of {d} in rows {:?}, cos/sin {:?}",
            x.shape(),
            cos.shape()
        )
    }
    let op = RopeUnpack { heads, d, interleaved };
    let all = x
        .contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)?;
    let block = |start: usize, h: usize| {
        all.narrow(0, start * tokens * d, tokens * h * d)?
            .reshape((tokens, h, d))
    };
    let [hq, hk, hv] = heads;
    Ok((block(0, hq)?, block(hq, hk)?, block(hq + hk, hv)?))
}

/// The backward of RoPE over a packed q/k/v projection ([`rope_heads`] of its q and k heads,
/// v used as it is): the gradient of the projection's output, (tokens, (hq + hk + hv) · d), from
/// attention's dq, dk, dv (tokens · heads · d values each, token-major): dq and dk rotated back,
/// dv copied, into one packed tensor for one matmul.
pub fn rope_pack_backward(
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Result<Tensor> {
    let d = dq.dims().last().copied().unwrap_or(0);
    let tokens = cos.dim(0)?;
    let whole = |t: &Tensor| d > 0 && t.dims().last() == Some(&d) && t.elem_count() % (tokens * d).max(1) == 0;
    if d % 2 != 0 || !whole(dq) || !whole(dk) || !whole(dv) || cos.dims() != [tokens, d / 2] || sin.dims() != cos.dims()
    {
        bail!(
            "flash-llama RoPE backward: dq {:?}, dk {:?}, dv {:?} for cos/sin {:?}",
            dq.shape(),
            dk.shape(),
            dv.shape(),
            cos.shape()
        )
    }
    let op = RopePackBwd {
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        d,
        interleaved,
    };
    dq.contiguous()?
        .apply_op3_no_bwd(&dk.contiguous()?, &dv.contiguous()?, &op)
}

/// `silu(gate) · up` of a packed gate/up tensor (.., 2 · cols), each row gate then up (one
/// matmul's output over the two weights side by side): (.., cols). No graph node.
pub fn swiglu_packed(gate_up: &Tensor) -> Result<Tensor> {
    check_packed(gate_up)?;
    gate_up.contiguous()?.apply_op1_no_bwd(&SwigluPacked)
}

/// The backward of [`swiglu_packed`]: the gradient of the packed gate/up tensor, packed the same way.
pub fn swiglu_packed_backward(gate_up: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check_packed(gate_up)?;
    let (mut want, last) = (gate_up.dims().to_vec(), gate_up.dims().last().copied().unwrap_or(0));
    *want.last_mut().unwrap() = last / 2;
    if dy.dims() != want.as_slice() {
        bail!(
            "flash-llama SiLU × up backward: dy {:?} for a packed gate/up of {:?}",
            dy.shape(),
            gate_up.shape()
        )
    }
    gate_up
        .contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &SwigluPackedBwd)
}

fn check_packed(gate_up: &Tensor) -> Result<()> {
    match gate_up.dims().last() {
        Some(&last) if last % 2 == 0 && last > 0 => Ok(()),
        _ => bail!(
            "flash-llama SiLU × up: a packed gate/up tensor needs an even last dim, got {:?}",
            gate_up.shape()
        ),
    }
}

/// The backward of [`swiglu`]: (dgate, dup).
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = gate
        .contiguous()?
        .apply_op3_no_bwd(&up.contiguous()?, &dy.contiguous()?, &SwigluBwd)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// Tokens per chunk of the embedding backward's partial sums.
const EMBEDDING_CHUNK: usize = 32;

/// The token ids and, for the backward, the tokens grouped by id: `perm` lists the token positions
/// sorted by id (stable), cut into chunks `perm[bounds[k]..bounds[k + 1]]` of at most
/// [`EMBEDDING_CHUNK`] tokens of one id; the chunks of id `v` are `row_chunks[v]..row_chunks[v + 1]`.
struct EmbeddingIndex {
    host_ids: Vec<u32>,
    vocab: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    chunks: usize,
    // Device tensors (u32) of the same, used by the CUDA kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ids: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    perm: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bounds: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    row_chunks: Tensor,
}

impl EmbeddingIndex {
    fn new(ids: &[u32], vocab: usize, device: &Device) -> Result<Self> {
        let mut start = vec![0usize; vocab + 1];
        for &t in ids {
            start[t as usize + 1] += 1;
        }
        for v in 0..vocab {
            start[v + 1] += start[v];
        }
        let mut fill = start.clone();
        let mut perm = vec![0u32; ids.len()];
        for (i, &t) in ids.iter().enumerate() {
            perm[fill[t as usize]] = i as u32;
            fill[t as usize] += 1;
        }
        let mut bounds = vec![0u32];
        let mut row_chunks = vec![0u32; vocab + 1];
        for v in 0..vocab {
            let mut s = start[v];
            while s < start[v + 1] {
                s = (s + EMBEDDING_CHUNK).min(start[v + 1]);
                bounds.push(s as u32);
            }
            row_chunks[v + 1] = (bounds.len() - 1) as u32;
        }
        let chunks = bounds.len() - 1;
        Ok(Self {
            ids: Tensor::new(ids, device)?,
            perm: Tensor::new(perm, device)?,
            bounds: Tensor::new(bounds, device)?,
            row_chunks: Tensor::new(row_chunks, device)?,
            host_ids: ids.to_vec(),
            vocab,
            chunks,
        })
    }
}

struct Embedding {
    index: Arc<EmbeddingIndex>,
}

/// dy (tokens, dim) → dweight (vocab, dim).
struct EmbeddingBwd {
    index: Arc<EmbeddingIndex>,
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "train-embedding"
    }

    fn cpu_fwd(&self, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, dim) = wl.shape().dims2()?;
        let w32 = f32s(w, wl, "embedding")?;
        let ids = &self.index.host_ids;
        let out = ids
            .iter()
            .flat_map(|&t| &w32[t as usize * dim..(t as usize + 1) * dim])
            .copied();
        Ok((storage(w.dtype(), out.collect()), Shape::from((ids.len(), dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, w: &candle_core::CudaStorage, wl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, dim) = wl.shape().dims2()?;
        let out = cuda::embedding((w, wl), &self.index)?;
        Ok((out, Shape::from((self.index.host_ids.len(), dim))))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let bwd = EmbeddingBwd {
            index: self.index.clone(),
        };
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(&bwd)?))
    }
}

impl CustomOp1 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "train-embedding-bwd"
    }

    fn cpu_fwd(&self, dy: &CpuStorage, dyl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, dim) = dyl.shape().dims2()?;
        let d = f32s(dy, dyl, "embedding backward")?;
        let mut dw = vec![0f64; self.index.vocab * dim];
        for (&t, row) in self.index.host_ids.iter().zip(d.chunks(dim)) {
            for (acc, &g) in dw[t as usize * dim..].iter_mut().zip(row) {
                *acc += g as f64;
            }
        }
        let dw = dw.into_iter().map(|v| v as f32).collect();
        Ok((storage(dy.dtype(), dw), Shape::from((self.index.vocab, dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dy: &candle_core::CudaStorage, dyl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, dim) = dyl.shape().dims2()?;
        let dw = cuda::embedding_bwd((dy, dyl), &self.index)?;
        Ok((dw, Shape::from((self.index.vocab, dim))))
    }
}

struct RmsNorm {
    eps: f32,
}

/// (x, h, w) → (2, rows, dim): x + h, then its RMSNorm.
struct RmsNormAdd {
    eps: f32,
}

/// (x, w, dy) → (rows + 1, dim): dx's rows (plus `residual`'s, where given), then dw.
struct RmsNormBwd {
    eps: f32,
    residual: Option<Tensor>,
}

/// (.., 2 · cols) packed gate/up → (.., cols).
struct SwigluPacked;

/// (packed gate/up, dy) → the packed gate/up gradient.
struct SwigluPackedBwd;

struct Rope {
    interleaved: bool,
    /// Rotate by the opposite angles (the backward).
    inverse: bool,
}

struct Swiglu;

/// (gate, up, dy) → (2, ..): dgate, then dup.
struct SwigluBwd;

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "train-rms-norm"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "RMSNorm";
        let dtype = same_dtypes(OP, &[x, w])?;
        let (x, w) = (f32s(x, xl, OP)?, f32s(w, wl, OP)?);
        let dim = w.len();
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks(dim).zip(y.chunks_mut(dim)) {
            let r = rstd(xr, self.eps);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(&w) {
                *y = x * r * w;
            }
        }
        Ok((storage(dtype, y), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::rms_norm((x, xl), (w, wl), self.eps)?, xl.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_backward(x, w, dy, self.eps as f64, None)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "train-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        dy: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "RMSNorm backward";
        let dtype = same_dtypes(OP, &[x, w, dy])?;
        let (x, w, dy) = (f32s(x, xl, OP)?, f32s(w, wl, OP)?, f32s(dy, dyl, OP)?);
        let dim = w.len();
        let rows = x.len() / dim;
        let residual = match &self.residual {
            Some(r) => {
                let (s, l) = r.storage_and_layout();
                match &*s {
                    candle_core::Storage::Cpu(c) => f32s(c, l, OP)?,
                    _ => bail!("flash-llama {OP}: the residual gradient is not on the CPU"),
                }
            }
            None => vec![0f32; x.len()],
        };
        // dx rows, then dw; dw summed in f64 in row order.
        let mut out = vec![0f32; x.len() + dim];
        let mut dw = vec![0f64; dim];
        for (((xr, dyr), dxr), res) in x
            .chunks(dim)
            .zip(dy.chunks(dim))
            .zip(out.chunks_mut(dim))
            .zip(residual.chunks(dim))
        {
            let r = rstd(xr, self.eps);
            // dx = r·g − x·r³·mean(g·x), g = dy·w.
            let dot: f64 = xr
                .iter()
                .zip(dyr)
                .zip(&w)
                .map(|((&x, &d), &w)| (d * w * x) as f64)
                .sum();
            let k = r * r * r * (dot / dim as f64) as f32;
            for c in 0..dim {
                dxr[c] = r * dyr[c] * w[c] - k * xr[c] + res[c];
                dw[c] += (dyr[c] * xr[c] * r) as f64;
            }
        }
        for (o, d) in out[rows * dim..].iter_mut().zip(dw) {
            *o = d as f32;
        }
        Ok((storage(dtype, out), Shape::from((rows + 1, dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dim = wl.shape().elem_count();
        let rows = xl.shape().elem_count() / dim;
        let residual = self.residual.as_ref().map(|r| r.storage_and_layout());
        let residual = match &residual {
            Some((s, l)) => match &**s {
                candle_core::Storage::Cuda(c) => Some((c, *l)),
                _ => bail!("flash-llama RMSNorm backward: the residual gradient is not on the GPU"),
            },
            None => None,
        };
        let out = cuda::rms_norm_bwd((x, xl), (w, wl), (dy, dyl), residual, self.eps)?;
        Ok((out, Shape::from((rows + 1, dim))))
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "train-rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "RoPE";
        let dtype = same_dtypes(OP, &[x, cos, sin])?;
        let (tokens, heads, d) = xl.shape().dims3()?;
        let (x, cos, sin) = (f32s(x, xl, OP)?, f32s(cos, cl, OP)?, f32s(sin, sl, OP)?);
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut y = vec![0f32; x.len()];
        let rows = RopeRows {
            tokens,
            heads,
            d,
            interleaved: self.interleaved,
            sign,
        };
        rows.run((&x, heads * d), (&mut y, heads * d), &cos, &sin);
        Ok((storage(dtype, y), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = cuda::rope((x, xl), (cos, cl), (sin, sl), self.interleaved, self.inverse)?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = Rope {
            interleaved: self.interleaved,
            inverse: !self.inverse,
        };
        let dx = dy.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(dx), None, None))
    }
}

impl CustomOp3 for RmsNormAdd {
    fn name(&self) -> &'static str {
        "train-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        h: &CpuStorage,
        hl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "add + RMSNorm";
        let dtype = same_dtypes(OP, &[x, h, w])?;
        let (x, h, w) = (f32s(x, xl, OP)?, f32s(h, hl, OP)?, f32s(w, wl, OP)?);
        let dim = w.len();
        // The sum rounded to the dtype, as a separate add would store it.
        let sum = round_to(dtype, x.iter().zip(&h).map(|(a, b)| a + b).collect());
        let mut out = sum.clone();
        out.resize(2 * sum.len(), 0.0);
        for (xr, yr) in sum.chunks(dim).zip(out[sum.len()..].chunks_mut(dim)) {
            let r = rstd(xr, self.eps);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(&w) {
                *y = x * r * w;
            }
        }
        Ok((storage(dtype, out), pair_shape(xl)))
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
        let out = cuda::rms_norm_add((x, xl), (h, hl), (w, wl), self.eps)?;
        Ok((out, pair_shape(xl)))
    }
}

/// The CPU loop of the RoPE kernel: `heads` heads of `d` per token, read from rows of a given
/// stride and written to rows of another, rotated by `sign` times the angles (0: copied).
struct RopeRows {
    tokens: usize,
    heads: usize,
    d: usize,
    interleaved: bool,
    sign: f32,
}

impl RopeRows {
    fn run(&self, (x, x_stride): (&[f32], usize), (y, y_stride): (&mut [f32], usize), cos: &[f32], sin: &[f32]) {
        let (half, d) = (self.d / 2, self.d);
        for t in 0..self.tokens {
            for h in 0..self.heads {
                let (xr, yr) = (t * x_stride + h * d, t * y_stride + h * d);
                for p in 0..half {
                    let (c1, c2) = match self.interleaved {
                        true => (2 * p, 2 * p + 1),
                        false => (p, p + half),
                    };
                    let (a, b) = (x[xr + c1], x[xr + c2]);
                    if self.sign == 0.0 {
                        (y[yr + c1], y[yr + c2]) = (a, b);
                        continue;
                    }
                    let (c, s) = (cos[t * half + p], self.sign * sin[t * half + p]);
                    y[yr + c1] = a * c - b * s;
                    y[yr + c2] = a * s + b * c;
                }
            }
        }
    }
}

/// (x (tokens, (hq + hk + hv) · d), cos, sin) → q and k rotated, v copied, each a contiguous
/// (tokens, heads, d) block, one after the other (flat).
struct RopeUnpack {
    heads: [usize; 3],
    d: usize,
    interleaved: bool,
}

impl CustomOp3 for RopeUnpack {
    fn name(&self) -> &'static str {
        "train-rope-unpack"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "RoPE";
        let dtype = same_dtypes(OP, &[x, cos, sin])?;
        let (tokens, width) = xl.shape().dims2()?;
        let (x, cos, sin) = (f32s(x, xl, OP)?, f32s(cos, cl, OP)?, f32s(sin, sl, OP)?);
        let d = self.d;
        let mut y = vec![0f32; x.len()];
        let (mut column, mut block) = (0, 0);
        for (heads, sign) in self.heads.into_iter().zip([1.0, 1.0, 0.0]) {
            let rows = RopeRows {
                tokens,
                heads,
                d,
                interleaved: self.interleaved,
                sign,
            };
            rows.run((&x[column * d..], width), (&mut y[block..], heads * d), &cos, &sin);
            column += heads;
            block += tokens * heads * d;
        }
        Ok((storage(dtype, y), Shape::from(x.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = cuda::rope_unpack((x, xl), self.heads, self.d, (cos, cl), (sin, sl), self.interleaved)?;
        Ok((y, Shape::from(xl.shape().elem_count())))
    }
}

/// (dq, dk, dv) → the packed q/k/v gradient (tokens, (hq + hk + hv) · d): dq and dk rotated back
/// by `cos`/`sin`, dv copied.
struct RopePackBwd {
    cos: Tensor,
    sin: Tensor,
    d: usize,
    interleaved: bool,
}

impl CustomOp3 for RopePackBwd {
    fn name(&self) -> &'static str {
        "train-rope-pack-bwd"
    }

    fn cpu_fwd(
        &self,
        dq: &CpuStorage,
        ql: &Layout,
        dk: &CpuStorage,
        kl: &Layout,
        dv: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "RoPE backward";
        let dtype = same_dtypes(OP, &[dq, dk, dv])?;
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            let (s, l) = t.storage_and_layout();
            match &*s {
                candle_core::Storage::Cpu(c) => f32s(c, l, OP),
                _ => bail!("flash-llama {OP}: cos/sin are not on the CPU"),
            }
        };
        let (cos, sin) = (host(&self.cos)?, host(&self.sin)?);
        let (tokens, d) = (self.cos.dim(0)?, self.d);
        let parts = [
            (f32s(dq, ql, OP)?, -1.0),
            (f32s(dk, kl, OP)?, -1.0),
            (f32s(dv, vl, OP)?, 0.0),
        ];
        let width: usize = parts.iter().map(|(x, _)| x.len()).sum::<usize>() / tokens.max(1);
        let mut y = vec![0f32; tokens * width];
        let mut column = 0;
        for (x, sign) in &parts {
            let heads = x.len() / (tokens * d).max(1);
            let rows = RopeRows {
                tokens,
                heads,
                d,
                interleaved: self.interleaved,
                sign: *sign,
            };
            rows.run((x, heads * d), (&mut y[column..], width), &cos, &sin);
            column += heads * d;
        }
        Ok((storage(dtype, y), Shape::from((tokens, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dq: &candle_core::CudaStorage,
        ql: &Layout,
        dk: &candle_core::CudaStorage,
        kl: &Layout,
        dv: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (cs, cl) = self.cos.storage_and_layout();
        let (ss, sl) = self.sin.storage_and_layout();
        let (candle_core::Storage::Cuda(c), candle_core::Storage::Cuda(s)) = (&*cs, &*ss) else {
            bail!("flash-llama RoPE backward: cos/sin are not on the GPU")
        };
        let y = cuda::rope_pack_bwd((dq, ql), (dk, kl), (dv, vl), (c, cl), (s, sl), self.interleaved)?;
        let tokens = cl.dims()[0];
        let width = (ql.shape().elem_count() + kl.shape().elem_count() + vl.shape().elem_count()) / tokens.max(1);
        Ok((y, Shape::from((tokens, width))))
    }
}

/// `dims` with the last one halved (a packed gate/up shape → its SiLU × up's).
fn half_last(dims: &[usize]) -> Shape {
    let mut dims = dims.to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

impl CustomOp1 for SwigluPacked {
    fn name(&self) -> &'static str {
        "train-swiglu-packed"
    }

    fn cpu_fwd(&self, gu: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let gu32 = f32s(gu, l, "SiLU × up")?;
        let cols = l.dims().last().copied().unwrap_or(0) / 2;
        let y = gu32
            .chunks(2 * cols)
            .flat_map(|row| row[..cols].iter().zip(&row[cols..]).map(|(&g, &u)| silu(g) * u))
            .collect();
        Ok((storage(gu.dtype(), y), half_last(l.dims())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, gu: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::swiglu_packed((gu, l))?, half_last(l.dims())))
    }
}

impl CustomOp2 for SwigluPackedBwd {
    fn name(&self) -> &'static str {
        "train-swiglu-packed-bwd"
    }

    fn cpu_fwd(&self, gu: &CpuStorage, gl: &Layout, dy: &CpuStorage, dyl: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "SiLU × up backward";
        let dtype = same_dtypes(OP, &[gu, dy])?;
        let (gu, dy) = (f32s(gu, gl, OP)?, f32s(dy, dyl, OP)?);
        let cols = gl.dims().last().copied().unwrap_or(0) / 2;
        let mut out = vec![0f32; gu.len()];
        for ((row, dyr), outr) in gu.chunks(2 * cols).zip(dy.chunks(cols)).zip(out.chunks_mut(2 * cols)) {
            for c in 0..cols {
                (outr[c], outr[cols + c]) = silu_mul_grads(row[c], row[cols + c], dyr[c]);
            }
        }
        Ok((storage(dtype, out), gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gu: &candle_core::CudaStorage,
        gl: &Layout,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::swiglu_packed_bwd((gu, gl), (dy, dyl))?, gl.shape().clone()))
    }
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// The gradients (dgate, dup) of silu(g) · u for the output gradient d: with s = sigmoid(g),
/// d · u · s · (1 + g · (1 − s)) and d · g · s (the kernels' formula).
fn silu_mul_grads(g: f32, u: f32, d: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + (-g).exp());
    (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
}

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "train-swiglu"
    }

    fn cpu_fwd(&self, g: &CpuStorage, gl: &Layout, u: &CpuStorage, ul: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "SiLU × up";
        let dtype = same_dtypes(OP, &[g, u])?;
        let (g, u) = (f32s(g, gl, OP)?, f32s(u, ul, OP)?);
        let y = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
        Ok((storage(dtype, y), gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::swiglu((g, gl), (u, ul))?, gl.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = swiglu_backward(g, u, dy)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "train-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
        dy: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "SiLU × up backward";
        let dtype = same_dtypes(OP, &[g, u, dy])?;
        let (g, u, dy) = (f32s(g, gl, OP)?, f32s(u, ul, OP)?, f32s(dy, dyl, OP)?);
        let n = g.len();
        let mut out = vec![0f32; 2 * n];
        for i in 0..n {
            (out[i], out[n + i]) = silu_mul_grads(g[i], u[i], dy[i]);
        }
        Ok((storage(dtype, out), pair_shape(gl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::swiglu_bwd((g, gl), (u, ul), (dy, dyl))?, pair_shape(gl)))
    }
}

struct CrossEntropyLse;

struct CrossEntropyBwd {
    scale: f32,
}

/// A contiguous u32 input.
fn u32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((start, end))) => Ok(&v[start..end]),
        _ => bail!("flash-llama {op}: the targets must be contiguous u32"),
    }
}

/// (max, sum of exp(x − max)) of a row, in f32 like the kernel (the sum in f64 here).
fn row_logsumexp(row: &[f32]) -> f32 {
    let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if m == f32::NEG_INFINITY {
        return m;
    }
    let s: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
    m + (s as f32).ln()
}

impl CustomOp2 for CrossEntropyLse {
    fn name(&self) -> &'static str {
        "train-cross-entropy-lse"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, t: &CpuStorage, tl: &Layout) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "cross-entropy";
        let (x, targets) = (f32s(x, xl, OP)?, u32s(t, tl, OP)?);
        let vocab = xl.dims()[1];
        let mut out = Vec::with_capacity(2 * targets.len());
        for (row, &t) in x.chunks(vocab).zip(targets) {
            out.push(row_logsumexp(row));
            out.push(row.get(t as usize).copied().unwrap_or(f32::NAN));
        }
        Ok((CpuStorage::F32(out), Shape::from((targets.len(), 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        t: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::cross_entropy_lse((x, xl), (t, tl))?,
            Shape::from((xl.dims()[0], 2)),
        ))
    }
}

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "train-cross-entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        t: &CpuStorage,
        tl: &Layout,
        lse: &CpuStorage,
        lsel: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "cross-entropy backward";
        let dtype = x.dtype();
        let (x, targets, lse) = (f32s(x, xl, OP)?, u32s(t, tl, OP)?, f32s(lse, lsel, OP)?);
        let vocab = xl.dims()[1];
        let mut dx = Vec::with_capacity(x.len());
        for ((row, &t), &l) in x.chunks(vocab).zip(targets).zip(&lse) {
            dx.extend(row.iter().enumerate().map(|(i, &v)| {
                let one_hot = if i == t as usize { 1.0 } else { 0.0 };
                self.scale * ((v - l).exp() - one_hot)
            }));
        }
        Ok((storage(dtype, dx), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        t: &candle_core::CudaStorage,
        tl: &Layout,
        lse: &candle_core::CudaStorage,
        lsel: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            cuda::cross_entropy_bwd((x, xl), (t, tl), (lse, lsel), self.scale)?,
            xl.shape().clone(),
        ))
    }
}

/// (2, ..) of a layout's shape.
fn pair_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// 1 / sqrt(mean(x²) + eps) of one row, the sum in f64.
fn rstd(row: &[f32], eps: f32) -> f32 {
    let ss: f64 = row.iter().map(|&v| (v * v) as f64).sum();
    1.0 / ((ss / row.len() as f64) as f32 + eps).sqrt()
}

/// The common dtype of the inputs (bf16, f16 or f32).
fn same_dtypes(op: &str, inputs: &[&CpuStorage]) -> Result<DType> {
    let dtype = inputs[0].dtype();
    if let Some(other) = inputs.iter().find(|s| s.dtype() != dtype) {
        bail!("flash-llama {op}: inputs of {dtype:?} and {:?}", other.dtype())
    }
    Ok(dtype)
}

/// A contiguous input as f32 values.
fn f32s(s: &CpuStorage, l: &Layout, op: &str) -> Result<Vec<f32>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!(
            "flash-llama {op}: inputs must be contiguous, got strides {:?}",
            l.stride()
        )
    };
    Ok(match s {
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F32(v) => v[start..end].to_vec(),
        s => bail!("flash-llama {op}: unsupported dtype {:?} (bf16, f16 or f32)", s.dtype()),
    })
}

/// f32 values rounded once to `dtype`.
/// `v` rounded to `dtype` and back (what storing it in that dtype keeps).
fn round_to(dtype: DType, v: Vec<f32>) -> Vec<f32> {
    match dtype {
        DType::BF16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
        DType::F16 => v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect(),
        _ => v,
    }
}

fn storage(dtype: DType, v: Vec<f32>) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}
