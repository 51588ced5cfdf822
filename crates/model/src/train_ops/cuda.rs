//! Launches of kernels/model/train_ops.cu (its own cubin, built by build.rs), through the loader
//! and launch helpers of [`crate::fused`]'s CUDA module, on candle's stream.

use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDType;
use candle_core::{backend::BackendStorage, CudaStorage, Layout, Result, Tensor};

use super::EmbeddingIndex;
use crate::fused::cuda::{addr, by_dtype, err, function_in, grid, held_on, same_dtype, suffix};

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/train_ops.cubin"));

/// Warps (rows) per block of the row kernels (`kRowWarps`).
const ROW_WARPS: usize = 8;
/// Threads per block of the column kernels (`kThreads`).
const THREADS: usize = 256;
/// About how many blocks the dw partial sums are spread over (a few per SM).
const DW_BLOCKS: usize = 1024;

type Arg<'a> = (&'a CudaStorage, &'a Layout);

fn launch(b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs, cfg: LaunchConfig, name: &str) -> Result<()> {
    // SAFETY: every caller passes contiguous inputs of the element counts its kernel reads and
    // outputs of the counts it writes (shapes checked by the public functions of train_ops).
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| err(name, e))
}

fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROW_WARPS) as u32, 1, 1),
        block_dim: ((ROW_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn rms_norm(x: Arg, w: Arg, eps: f32) -> Result<CudaStorage> {
    same_dtype("RMSNorm", x.0.dtype(), &[("the weight", w.0.dtype())])?;
    by_dtype!("RMSNorm", x.0.dtype(), rms_norm_t(x, w, eps))
}

fn rms_norm_t<T: CudaDType + DeviceRepr>(x: Arg, w: Arg, eps: f32) -> Result<CudaStorage> {
    const OP: &str = "RMSNorm";
    let dev = x.0.device.clone();
    let dim = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let rows = n / dim;
    let (xa, wa) = (addr::<T>(x.0, x.1, OP, "x")?, addr::<T>(w.0, w.1, OP, "w")?);
    // SAFETY: the kernel writes all n elements.
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    if rows > 0 {
        let func = function_in(CUBIN, &dev, format!("rms_norm_fwd_{}", suffix(x.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (ya, _guard) = y.device_ptr_mut(&stream);
        let (rows_u, dim_i) = (rows as u64, dim as i32);
        let mut b = stream.launch_builder(&func);
        b.arg(&xa).arg(&wa).arg(&ya).arg(&rows_u).arg(&dim_i).arg(&eps);
        launch(&mut b, rows_cfg(rows), "rms_norm_fwd")?;
    }
    Ok(T::wrap_cuda_slice(y, dev))
}

pub(super) fn rms_norm_bwd(x: Arg, w: Arg, dy: Arg, eps: f32) -> Result<CudaStorage> {
    let op = "RMSNorm backward";
    same_dtype(op, x.0.dtype(), &[("the weight", w.0.dtype()), ("dy", dy.0.dtype())])?;
    by_dtype!(op, x.0.dtype(), rms_norm_bwd_t(x, w, dy, eps))
}

/// (rows + 1, dim): dx, then dw. dx and each row's rstd in one kernel; dw as per-chunk partial
/// sums (f32) and their column sum, a fixed order.
fn rms_norm_bwd_t<T: CudaDType + DeviceRepr>(x: Arg, w: Arg, dy: Arg, eps: f32) -> Result<CudaStorage> {
    const OP: &str = "RMSNorm backward";
    let dev = x.0.device.clone();
    let dim = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let rows = n / dim;
    let (xa, wa, dya) = (
        addr::<T>(x.0, x.1, OP, "x")?,
        addr::<T>(w.0, w.1, OP, "w")?,
        addr::<T>(dy.0, dy.1, OP, "dy")?,
    );
    let sfx = suffix(x.0.dtype(), OP)?;
    let col_blocks = dim.div_ceil(THREADS);
    let chunks = (DW_BLOCKS / col_blocks).clamp(1, rows.max(1));
    let rows_per_chunk = rows.max(1).div_ceil(chunks);
    let chunks = rows.max(1).div_ceil(rows_per_chunk);
    // SAFETY: the kernels write all n + dim elements (dx by rows, dw by the column sum), every
    // rstd and every partial sum before they are read.
    let mut out = unsafe { dev.alloc::<T>(n + dim)? };
    let mut rstd = unsafe { dev.alloc::<f32>(rows.max(1))? };
    let mut partial = unsafe { dev.alloc::<f32>(chunks * dim)? };
    let stream = dev.cuda_stream();
    {
        let (outa, _g1) = out.device_ptr_mut(&stream);
        let (ra, _g2) = rstd.device_ptr_mut(&stream);
        let (pa, _g3) = partial.device_ptr_mut(&stream);
        let dwa = outa + (n * std::mem::size_of::<T>()) as u64;
        let (rows_u, dim_i, rpc, chunks_i) = (rows as u64, dim as i32, rows_per_chunk as i32, chunks as i32);
        if rows > 0 {
            let func = function_in(CUBIN, &dev, format!("rms_norm_bwd_dx_{sfx}"))?;
            let mut b = stream.launch_builder(&func);
            b.arg(&xa)
                .arg(&wa)
                .arg(&dya)
                .arg(&outa)
                .arg(&ra)
                .arg(&rows_u)
                .arg(&dim_i)
                .arg(&eps);
            launch(&mut b, rows_cfg(rows), "rms_norm_bwd_dx")?;
        }
        let func = function_in(CUBIN, &dev, format!("rms_norm_bwd_dw_{sfx}"))?;
        let mut b = stream.launch_builder(&func);
        b.arg(&xa)
            .arg(&dya)
            .arg(&ra)
            .arg(&pa)
            .arg(&rows_u)
            .arg(&dim_i)
            .arg(&rpc);
        let cfg = LaunchConfig {
            grid_dim: (col_blocks as u32, chunks as u32, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(&mut b, cfg, "rms_norm_bwd_dw")?;
        let func = function_in(CUBIN, &dev, format!("column_sum_{sfx}"))?;
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&dwa).arg(&chunks_i).arg(&dim_i);
        let cfg = LaunchConfig {
            grid_dim: (col_blocks as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(&mut b, cfg, "column_sum")?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn rope(x: Arg, cos: Arg, sin: Arg, interleaved: bool, inverse: bool) -> Result<CudaStorage> {
    same_dtype("RoPE", x.0.dtype(), &[("cos", cos.0.dtype()), ("sin", sin.0.dtype())])?;
    by_dtype!("RoPE", x.0.dtype(), rope_t(x, cos, sin, interleaved, inverse))
}

fn rope_t<T: CudaDType + DeviceRepr>(
    x: Arg,
    cos: Arg,
    sin: Arg,
    interleaved: bool,
    inverse: bool,
) -> Result<CudaStorage> {
    const OP: &str = "RoPE";
    let dev = x.0.device.clone();
    let (tokens, heads, d) = x.1.shape().dims3()?;
    let n = tokens * heads * d;
    let (xa, ca, sa) = (
        addr::<T>(x.0, x.1, OP, "x")?,
        addr::<T>(cos.0, cos.1, OP, "cos")?,
        addr::<T>(sin.0, sin.1, OP, "sin")?,
    );
    // SAFETY: the kernel writes every pair, so all n elements (d is even).
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    if n > 0 {
        let func = function_in(CUBIN, &dev, format!("rope_{}", suffix(x.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (ya, _guard) = y.device_ptr_mut(&stream);
        let (t, h, d, il) = (tokens as i32, heads as i32, d as i32, interleaved as i32);
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        let mut b = stream.launch_builder(&func);
        b.arg(&xa)
            .arg(&ca)
            .arg(&sa)
            .arg(&ya)
            .arg(&t)
            .arg(&h)
            .arg(&d)
            .arg(&il)
            .arg(&sign);
        launch(&mut b, grid(n / 2), "rope")?;
    }
    Ok(T::wrap_cuda_slice(y, dev))
}

pub(super) fn swiglu(g: Arg, u: Arg) -> Result<CudaStorage> {
    same_dtype("SiLU × up", g.0.dtype(), &[("up", u.0.dtype())])?;
    by_dtype!("SiLU × up", g.0.dtype(), swiglu_t(g, u))
}

fn swiglu_t<T: CudaDType + DeviceRepr>(g: Arg, u: Arg) -> Result<CudaStorage> {
    const OP: &str = "SiLU × up";
    let dev = g.0.device.clone();
    let n = g.1.shape().elem_count();
    let (ga, ua) = (addr::<T>(g.0, g.1, OP, "gate")?, addr::<T>(u.0, u.1, OP, "up")?);
    // SAFETY: the kernel writes all n elements.
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    if n > 0 {
        let func = function_in(CUBIN, &dev, format!("swiglu_fwd_{}", suffix(g.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (ya, _guard) = y.device_ptr_mut(&stream);
        let n_u = n as u64;
        let mut b = stream.launch_builder(&func);
        b.arg(&ga).arg(&ua).arg(&ya).arg(&n_u);
        launch(&mut b, grid(n), "swiglu_fwd")?;
    }
    Ok(T::wrap_cuda_slice(y, dev))
}

pub(super) fn swiglu_bwd(g: Arg, u: Arg, dy: Arg) -> Result<CudaStorage> {
    let op = "SiLU × up backward";
    same_dtype(op, g.0.dtype(), &[("up", u.0.dtype()), ("dy", dy.0.dtype())])?;
    by_dtype!(op, g.0.dtype(), swiglu_bwd_t(g, u, dy))
}

fn swiglu_bwd_t<T: CudaDType + DeviceRepr>(g: Arg, u: Arg, dy: Arg) -> Result<CudaStorage> {
    const OP: &str = "SiLU × up backward";
    let dev = g.0.device.clone();
    let n = g.1.shape().elem_count();
    let (ga, ua, da) = (
        addr::<T>(g.0, g.1, OP, "gate")?,
        addr::<T>(u.0, u.1, OP, "up")?,
        addr::<T>(dy.0, dy.1, OP, "dy")?,
    );
    // SAFETY: the kernel writes all 2n elements (dgate, then dup).
    let mut out = unsafe { dev.alloc::<T>(2 * n.max(1))? };
    if n > 0 {
        let func = function_in(CUBIN, &dev, format!("swiglu_bwd_{}", suffix(g.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        let n_u = n as u64;
        let mut b = stream.launch_builder(&func);
        b.arg(&ga).arg(&ua).arg(&da).arg(&oa).arg(&n_u);
        launch(&mut b, grid(n), "swiglu_bwd")?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

/// The device address of one of the embedding index's u32 tensors (alive as long as the op that
/// holds the index; every launch is on candle's one stream).
fn index_addr(t: &Tensor, dev: &candle_core::cuda_backend::CudaDevice) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    addr::<u32>(
        held_on(&s, dev, "embedding", "the token index")?,
        l,
        "embedding",
        "the token index",
    )
}

pub(super) fn embedding(w: Arg, index: &EmbeddingIndex) -> Result<CudaStorage> {
    by_dtype!("embedding", w.0.dtype(), embedding_t(w, index))
}

fn embedding_t<T: CudaDType + DeviceRepr>(w: Arg, index: &EmbeddingIndex) -> Result<CudaStorage> {
    const OP: &str = "embedding";
    let dev = w.0.device.clone();
    let (_, dim) = w.1.shape().dims2()?;
    let n = index.host_ids.len() * dim;
    let wa = addr::<T>(w.0, w.1, OP, "the weight")?;
    // SAFETY: the kernel writes all n elements.
    let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
    if n > 0 {
        let ids = index_addr(&index.ids, &dev)?;
        let func = function_in(CUBIN, &dev, format!("embedding_fwd_{}", suffix(w.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        let (tokens, dim_i) = (index.host_ids.len() as u64, dim as i32);
        let mut b = stream.launch_builder(&func);
        b.arg(&wa).arg(&ids).arg(&oa).arg(&tokens).arg(&dim_i);
        launch(&mut b, grid(n), "embedding_fwd")?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn embedding_bwd(dy: Arg, index: &EmbeddingIndex) -> Result<CudaStorage> {
    by_dtype!("embedding backward", dy.0.dtype(), embedding_bwd_t(dy, index))
}

/// (vocab, dim): per-chunk partial sums (f32), then each row's chunks summed in order.
fn embedding_bwd_t<T: CudaDType + DeviceRepr>(dy: Arg, index: &EmbeddingIndex) -> Result<CudaStorage> {
    const OP: &str = "embedding backward";
    let dev = dy.0.device.clone();
    let (_, dim) = dy.1.shape().dims2()?;
    let (vocab, chunks) = (index.vocab, index.chunks);
    let dya = addr::<T>(dy.0, dy.1, OP, "dy")?;
    let sfx = suffix(dy.0.dtype(), OP)?;
    // SAFETY: the rows kernel writes all vocab × dim elements (zeros for absent ids), from
    // partial sums the first kernel writes before.
    let mut dw = unsafe { dev.alloc::<T>((vocab * dim).max(1))? };
    let mut partial = unsafe { dev.alloc::<f32>((chunks * dim).max(1))? };
    if vocab * dim == 0 {
        return Ok(T::wrap_cuda_slice(dw, dev));
    }
    let stream = dev.cuda_stream();
    {
        let (dwa, _g1) = dw.device_ptr_mut(&stream);
        let (pa, _g2) = partial.device_ptr_mut(&stream);
        let dim_i = dim as i32;
        let col_blocks = dim.div_ceil(THREADS) as u32;
        // Rows (chunks or vocab ids) along x: more than the 65535 blocks y allows.
        let cfg = |rows: usize| LaunchConfig {
            grid_dim: (rows as u32, col_blocks, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        if chunks > 0 {
            let (perm, bounds) = (index_addr(&index.perm, &dev)?, index_addr(&index.bounds, &dev)?);
            let func = function_in(CUBIN, &dev, format!("embedding_bwd_partial_{sfx}"))?;
            let mut b = stream.launch_builder(&func);
            b.arg(&dya).arg(&perm).arg(&bounds).arg(&pa).arg(&dim_i);
            launch(&mut b, cfg(chunks), "embedding_bwd_partial")?;
        }
        let row_chunks = index_addr(&index.row_chunks, &dev)?;
        let func = function_in(CUBIN, &dev, format!("embedding_bwd_rows_{sfx}"))?;
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&row_chunks).arg(&dwa).arg(&dim_i);
        launch(&mut b, cfg(vocab), "embedding_bwd_rows")?;
    }
    Ok(T::wrap_cuda_slice(dw, dev))
}

/// The scalars of one AdamW update ([`crate::train::optim::AdamW::update`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWStep {
    pub grad_scale: f32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `1 - lr * weight_decay`, or 1 where the parameter is not decayed.
    pub decay: f32,
    pub correction1: f32,
    pub correction2: f32,
}

/// One AdamW update of `param` (f32, updated in place) from `grad`, with the moments `m` and `v`
/// (f32, updated in place): one kernel over the four tensors. All contiguous, of one size.
pub(crate) fn adamw(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor, step: AdamWStep) -> Result<()> {
    const OP: &str = "AdamW";
    let n = param.elem_count();
    for (what, t) in [("gradient", grad), ("m", m), ("v", v)] {
        if t.elem_count() != n || t.dtype() != candle_core::DType::F32 || !t.device().same_device(param.device()) {
            candle_core::bail!(
                "flash-llama {OP}: the {what} is {:?} {:?}, the parameter F32 {:?} on its device",
                t.dtype(),
                t.shape(),
                param.shape()
            )
        }
    }
    // The gradient and moments are read and written through their addresses, outside candle's
    // locks (only the parameter's storage is locked, by `inplace_op1`): the moments are the
    // optimizer's own tensors, touched by nothing else during the step, the tensors outlive the
    // launch, and every access is ordered on candle's one stream. Holding read guards across
    // `inplace_op1` instead could deadlock if a tensor shared the parameter's storage.
    let address = |t: &Tensor, what: &str| -> Result<u64> {
        let (s, l) = t.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => addr::<f32>(c, l, OP, what),
            _ => candle_core::bail!("flash-llama {OP}: the {what} is not on the GPU"),
        }
    };
    let pa = address(param, "parameter")?;
    let (ga, ma, va) = (address(grad, "gradient")?, address(m, "m")?, address(v, "v")?);
    let bytes = 4 * n as u64;
    let disjoint = |a: u64, b: u64| a + bytes <= b || b + bytes <= a;
    if n > 0 && !(disjoint(pa, ma) && disjoint(pa, va) && disjoint(ma, va) && disjoint(pa, ga)) {
        candle_core::bail!("flash-llama {OP}: the parameter, gradient and moments must not overlap")
    }
    param.inplace_op1(&AdamWKernel { ga, ma, va, n, step })
}

struct AdamWKernel {
    ga: u64,
    ma: u64,
    va: u64,
    n: usize,
    step: AdamWStep,
}

impl candle_core::InplaceOp1 for AdamWKernel {
    fn name(&self) -> &'static str {
        "flash-llama-adamw"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("flash-llama AdamW: the fused update runs on the GPU only")
    }

    fn cuda_fwd(&self, p: &mut CudaStorage, l: &Layout) -> Result<()> {
        let pa = addr::<f32>(p, l, "AdamW", "parameter")?;
        if self.n == 0 {
            return Ok(());
        }
        let dev = p.device.clone();
        let func = function_in(CUBIN, &dev, "adamw_f32".to_string())?;
        let stream = dev.cuda_stream();
        let s = self.step;
        let n = self.n as u64;
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&self.ga).arg(&self.ma).arg(&self.va).arg(&n);
        b.arg(&s.grad_scale).arg(&s.lr).arg(&s.beta1).arg(&s.beta2).arg(&s.eps);
        b.arg(&s.decay).arg(&s.correction1).arg(&s.correction2);
        launch(&mut b, grid(self.n), "adamw_f32")
    }
}
