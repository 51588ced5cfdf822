//! Launches of kernels/model/train_ops.cu (its own cubin, built by build.rs), through the loader
//! and launch helpers of [`crate::fused`]'s CUDA module, on candle's stream.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
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
/// Rows at most this wide take the fused RMSNorm backward (`kFusedDwMaxDim`: a shared-memory
/// slice of the row per warp).
const FUSED_DW_MAX_DIM: usize = 1536;
/// About how many blocks the fused RMSNorm backward spreads its rows over (two per SM: each
/// holds 48 KiB of shared memory).
const FUSED_DW_BLOCKS: usize = 256;

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
    by_dtype!("RMSNorm", x.0.dtype(), rms_norm_t(x, None, w, eps))
}

/// (2, rows, dim): x + h, then RMSNorm(x + h).
pub(super) fn rms_norm_add(x: Arg, h: Arg, w: Arg, eps: f32) -> Result<CudaStorage> {
    let op = "add + RMSNorm";
    same_dtype(
        op,
        x.0.dtype(),
        &[("the weight", w.0.dtype()), ("the residual", h.0.dtype())],
    )?;
    by_dtype!(op, x.0.dtype(), rms_norm_t(x, Some(h), w, eps))
}

/// RMSNorm(x) (rows, dim), or with `h` the sum x + h and its norm, (2, rows, dim).
fn rms_norm_t<T: CudaDType + DeviceRepr>(x: Arg, h: Option<Arg>, w: Arg, eps: f32) -> Result<CudaStorage> {
    const OP: &str = "RMSNorm";
    let dev = x.0.device.clone();
    let dim = w.1.shape().elem_count();
    let n = x.1.shape().elem_count();
    let rows = n / dim;
    let (xa, wa) = (addr::<T>(x.0, x.1, OP, "x")?, addr::<T>(w.0, w.1, OP, "w")?);
    let ha = match h {
        Some(h) => addr::<T>(h.0, h.1, OP, "the residual")?,
        None => 0,
    };
    let outputs = if h.is_some() { 2 } else { 1 };
    // SAFETY: the kernel writes all n elements of y (and of the sum).
    let mut out = unsafe { dev.alloc::<T>((outputs * n).max(1))? };
    if rows > 0 {
        let func = function_in(CUBIN, &dev, format!("rms_norm_fwd_{}", suffix(x.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        // [sum; y] with a residual, else y alone (the sum pointer unused).
        let (suma, ya) = match h {
            Some(_) => (oa, oa + (n * std::mem::size_of::<T>()) as u64),
            None => (0, oa),
        };
        let (rows_u, dim_i) = (rows as u64, dim as i32);
        let vec = vectors::<T>(&[dim], &[xa, ha, wa, suma, ya]);
        let mut b = stream.launch_builder(&func);
        b.arg(&xa)
            .arg(&ha)
            .arg(&wa)
            .arg(&suma)
            .arg(&ya)
            .arg(&rows_u)
            .arg(&dim_i)
            .arg(&eps)
            .arg(&vec);
        launch(&mut b, rows_cfg(rows), "rms_norm_fwd")?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn rms_norm_bwd(x: Arg, w: Arg, dy: Arg, dres: Option<Arg>, eps: f32) -> Result<CudaStorage> {
    let op = "RMSNorm backward";
    same_dtype(op, x.0.dtype(), &[("the weight", w.0.dtype()), ("dy", dy.0.dtype())])?;
    if let Some(d) = dres {
        same_dtype(op, x.0.dtype(), &[("the residual gradient", d.0.dtype())])?;
    }
    by_dtype!(op, x.0.dtype(), rms_norm_bwd_t(x, w, dy, dres, eps))
}

/// (rows + 1, dim): dx (plus `dres`), then dw. dx and each row's rstd in one kernel; dw as
/// per-chunk partial sums (f32) and their column sum, a fixed order.
fn rms_norm_bwd_t<T: CudaDType + DeviceRepr>(
    x: Arg,
    w: Arg,
    dy: Arg,
    dres: Option<Arg>,
    eps: f32,
) -> Result<CudaStorage> {
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
    let dresa = match dres {
        Some(d) => addr::<T>(d.0, d.1, OP, "the residual gradient")?,
        None => 0,
    };
    let sfx = suffix(x.0.dtype(), OP)?;
    // Rows up to FUSED_DW_MAX_DIM wide: dx and per-block dw partials in one kernel (x and dy read
    // once); wider: dx and each row's rstd, then the dw partials per chunk of rows.
    let fused = dim <= FUSED_DW_MAX_DIM;
    let rows_per_chunk = match fused {
        true => ROW_WARPS * rows.div_ceil(ROW_WARPS * FUSED_DW_BLOCKS).max(1),
        false => rows
            .max(1)
            .div_ceil((DW_BLOCKS / dim.div_ceil(THREADS)).clamp(1, rows.max(1))),
    };
    let chunks = rows.max(1).div_ceil(rows_per_chunk);
    // SAFETY: the kernels write all n + dim elements (dx by rows, dw by the column sum), every
    // rstd and every partial sum before they are read.
    let mut out = unsafe { dev.alloc::<T>(n + dim)? };
    let mut rstd = unsafe { dev.alloc::<f32>(if fused { 1 } else { rows.max(1) })? };
    let mut partial = unsafe { dev.alloc::<f32>(chunks * dim)? };
    let stream = dev.cuda_stream();
    {
        let (outa, _g1) = out.device_ptr_mut(&stream);
        let (ra, _g2) = rstd.device_ptr_mut(&stream);
        let (pa, _g3) = partial.device_ptr_mut(&stream);
        let dwa = outa + (n * std::mem::size_of::<T>()) as u64;
        let (rows_u, dim_i, rpc, chunks_i) = (rows as u64, dim as i32, rows_per_chunk as i32, chunks as i32);
        let vec = vectors::<T>(&[dim], &[xa, wa, dya, dresa, outa]);
        if fused {
            // With no rows, the blocks only zero their partial rows.
            let func = function_in(CUBIN, &dev, format!("rms_norm_bwd_fused_{sfx}"))?;
            let mut b = stream.launch_builder(&func);
            b.arg(&xa)
                .arg(&wa)
                .arg(&dya)
                .arg(&dresa)
                .arg(&outa)
                .arg(&pa)
                .arg(&rows_u)
                .arg(&dim_i)
                .arg(&eps)
                .arg(&rpc)
                .arg(&vec);
            let cfg = LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: ((ROW_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(&mut b, cfg, "rms_norm_bwd_fused")?;
        } else {
            if rows > 0 {
                let func = function_in(CUBIN, &dev, format!("rms_norm_bwd_dx_{sfx}"))?;
                let mut b = stream.launch_builder(&func);
                b.arg(&xa)
                    .arg(&wa)
                    .arg(&dya)
                    .arg(&dresa)
                    .arg(&outa)
                    .arg(&ra)
                    .arg(&rows_u)
                    .arg(&dim_i)
                    .arg(&eps)
                    .arg(&vec);
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
                grid_dim: (dim.div_ceil(THREADS) as u32, chunks as u32, 1),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(&mut b, cfg, "rms_norm_bwd_dw")?;
        }
        let func = function_in(CUBIN, &dev, format!("column_sum_{sfx}"))?;
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&dwa).arg(&chunks_i).arg(&dim_i);
        let cfg = LaunchConfig {
            grid_dim: (dim.div_ceil(32) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(&mut b, cfg, "column_sum")?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn rope(x: Arg, cos: Arg, sin: Arg, interleaved: bool, inverse: bool) -> Result<CudaStorage> {
    same_dtype("RoPE", x.0.dtype(), &[("cos", cos.0.dtype()), ("sin", sin.0.dtype())])?;
    let (_, heads, d) = x.1.shape().dims3()?;
    let sign = if inverse { -1.0 } else { 1.0 };
    by_dtype!("RoPE", x.0.dtype(), rope_t(x, heads, d, cos, sin, interleaved, sign))
}

/// q, k and v of a packed q/k/v projection's output x (tokens, (hq + hk + hv) · d): q and k
/// rotated, v copied, each into its own contiguous (tokens, heads, d) block of one buffer.
pub(super) fn rope_unpack(
    x: Arg,
    heads: [usize; 3],
    d: usize,
    cos: Arg,
    sin: Arg,
    interleaved: bool,
) -> Result<CudaStorage> {
    same_dtype("RoPE", x.0.dtype(), &[("cos", cos.0.dtype()), ("sin", sin.0.dtype())])?;
    by_dtype!("RoPE", x.0.dtype(), rope_unpack_t(x, heads, d, cos, sin, interleaved))
}

fn rope_unpack_t<T: CudaDType + DeviceRepr>(
    x: Arg,
    heads: [usize; 3],
    d: usize,
    cos: Arg,
    sin: Arg,
    interleaved: bool,
) -> Result<CudaStorage> {
    const OP: &str = "RoPE";
    let dev = x.0.device.clone();
    let (tokens, width) = x.1.shape().dims2()?;
    let xa = addr::<T>(x.0, x.1, OP, "x")?;
    let (ca, sa) = (addr::<T>(cos.0, cos.1, OP, "cos")?, addr::<T>(sin.0, sin.1, OP, "sin")?);
    let n = tokens * width;
    // SAFETY: the three launches write every element of the three blocks (d is even).
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    let stream = dev.cuda_stream();
    let (ya, _guard) = y.device_ptr_mut(&stream);
    let size = std::mem::size_of::<T>() as u64;
    let (mut column, mut block) = (0, 0);
    for (h, sign) in heads.into_iter().zip([1.0, 1.0, 0.0]) {
        let from = (xa + (column * d) as u64 * size, width);
        let to = (ya + block as u64 * size, h * d);
        rope_launch(&dev, x.0.dtype(), from, (ca, sa), to, tokens, h, d, interleaved, sign)?;
        column += h;
        block += tokens * h * d;
    }
    drop(_guard);
    Ok(T::wrap_cuda_slice(y, dev))
}

/// RoPE of x (tokens, heads, d), contiguous, by `sign` times the angles.
fn rope_t<T: CudaDType + DeviceRepr>(
    x: Arg,
    heads: usize,
    d: usize,
    cos: Arg,
    sin: Arg,
    interleaved: bool,
    sign: f32,
) -> Result<CudaStorage> {
    const OP: &str = "RoPE";
    let dev = x.0.device.clone();
    let tokens = x.1.shape().dims().first().copied().unwrap_or(0);
    let xa = addr::<T>(x.0, x.1, OP, "x")?;
    let (ca, sa) = (addr::<T>(cos.0, cos.1, OP, "cos")?, addr::<T>(sin.0, sin.1, OP, "sin")?);
    let n = tokens * heads * d;
    // SAFETY: the kernel writes every pair of every head, so all n elements (d is even).
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    let stream = dev.cuda_stream();
    let (ya, _guard) = y.device_ptr_mut(&stream);
    let (from, to) = ((xa, heads * d), (ya, heads * d));
    rope_launch(
        &dev,
        x.0.dtype(),
        from,
        (ca, sa),
        to,
        tokens,
        heads,
        d,
        interleaved,
        sign,
    )?;
    drop(_guard);
    Ok(T::wrap_cuda_slice(y, dev))
}

/// The gradient of a packed q/k/v projection's output (tokens, (hq + hk + hv) · d) from
/// attention's dq, dk, dv ((.., heads, d) each, contiguous): dq and dk rotated back, dv copied,
/// each into its columns of every row.
pub(super) fn rope_pack_bwd(dq: Arg, dk: Arg, dv: Arg, cos: Arg, sin: Arg, interleaved: bool) -> Result<CudaStorage> {
    let op = "RoPE backward";
    same_dtype(
        op,
        dq.0.dtype(),
        &[
            ("dk", dk.0.dtype()),
            ("dv", dv.0.dtype()),
            ("cos", cos.0.dtype()),
            ("sin", sin.0.dtype()),
        ],
    )?;
    by_dtype!(op, dq.0.dtype(), rope_pack_bwd_t(dq, dk, dv, cos, sin, interleaved))
}

fn rope_pack_bwd_t<T: CudaDType + DeviceRepr>(
    dq: Arg,
    dk: Arg,
    dv: Arg,
    cos: Arg,
    sin: Arg,
    interleaved: bool,
) -> Result<CudaStorage> {
    const OP: &str = "RoPE backward";
    let dev = dq.0.device.clone();
    let dims = dq.1.shape().dims();
    let d = dims.last().copied().unwrap_or(0);
    let heads_of = |l: &Layout| l.shape().elem_count() / (d.max(1) * cos.1.shape().dims()[0].max(1));
    let tokens = cos.1.shape().dims()[0];
    let (hq, hk, hv) = (heads_of(dq.1), heads_of(dk.1), heads_of(dv.1));
    let width = (hq + hk + hv) * d;
    let (ca, sa) = (addr::<T>(cos.0, cos.1, OP, "cos")?, addr::<T>(sin.0, sin.1, OP, "sin")?);
    let n = tokens * width;
    // SAFETY: the three launches write every column of every row.
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    let stream = dev.cuda_stream();
    let (ya, _guard) = y.device_ptr_mut(&stream);
    let size = std::mem::size_of::<T>() as u64;
    let mut column = 0;
    for (x, heads, sign, what) in [(dq, hq, -1.0, "dq"), (dk, hk, -1.0, "dk"), (dv, hv, 0.0, "dv")] {
        let xa = addr::<T>(x.0, x.1, OP, what)?;
        let at = ya + (column * d) as u64 * size;
        rope_launch(
            &dev,
            dq.0.dtype(),
            (xa, heads * d),
            (ca, sa),
            (at, width),
            tokens,
            heads,
            d,
            interleaved,
            sign,
        )?;
        column += heads;
    }
    drop(_guard);
    Ok(T::wrap_cuda_slice(y, dev))
}

/// One launch of the rope kernel: `heads` heads of `d` per token from (address, row stride) to
/// (address, row stride), strides in elements; sign 1, -1 (inverse) or 0 (copy).
#[allow(clippy::too_many_arguments)]
fn rope_launch(
    dev: &candle_core::cuda_backend::CudaDevice,
    dtype: candle_core::DType,
    (xa, x_stride): (u64, usize),
    (ca, sa): (u64, u64),
    (ya, y_stride): (u64, usize),
    tokens: usize,
    heads: usize,
    d: usize,
    interleaved: bool,
    sign: f32,
) -> Result<()> {
    let n = tokens * heads * d;
    if n == 0 {
        return Ok(());
    }
    let func = function_in(CUBIN, dev, format!("rope_{}", suffix(dtype, "RoPE")?))?;
    let stream = dev.cuda_stream();
    // 16 bytes of first halves and of second halves per load: not interleaved, every stride,
    // half row and address aligned to it.
    let per_vector = 16 / dtype.size_in_bytes();
    let aligned =
        [d / 2, x_stride, y_stride].iter().all(|c| c % per_vector == 0) && [xa, ya, ca, sa].iter().all(|a| a % 16 == 0);
    let vec = (!interleaved && aligned) as i32;
    let (xs, ys) = (x_stride as u64, y_stride as u64);
    let (t, h, d, il) = (tokens as i32, heads as i32, d as i32, interleaved as i32);
    let mut b = stream.launch_builder(&func);
    b.arg(&xa)
        .arg(&xs)
        .arg(&ca)
        .arg(&sa)
        .arg(&ya)
        .arg(&ys)
        .arg(&t)
        .arg(&h)
        .arg(&d)
        .arg(&il)
        .arg(&sign)
        .arg(&vec);
    let per_thread = if vec != 0 { per_vector } else { 1 };
    launch(&mut b, grid(n / 2 / per_thread), "rope")
}

pub(super) fn swiglu(g: Arg, u: Arg) -> Result<CudaStorage> {
    same_dtype("SiLU × up", g.0.dtype(), &[("up", u.0.dtype())])?;
    by_dtype!("SiLU × up", g.0.dtype(), swiglu_t(g, Some(u)))
}

/// SiLU × up of a packed gate/up tensor (.., 2 · cols): (.., cols).
pub(super) fn swiglu_packed(gu: Arg) -> Result<CudaStorage> {
    by_dtype!("SiLU × up", gu.0.dtype(), swiglu_t(gu, None))
}

/// Row pointers of the gate and up values: `g` and `u` (rows of their last dim), or with `u`
/// `None` the two halves of each row of `g`. Returns (gate, up, rows, cols, row stride).
fn gate_up_rows<T: CudaDType>(g: Arg, u: Option<Arg>, op: &str) -> Result<(u64, u64, usize, usize, usize)> {
    let last = g.1.shape().dims().last().copied().unwrap_or(1).max(1);
    let rows = g.1.shape().elem_count() / last;
    let ga = addr::<T>(g.0, g.1, op, "gate")?;
    Ok(match u {
        Some(u) => (ga, addr::<T>(u.0, u.1, op, "up")?, rows, last, last),
        None => (
            ga,
            ga + (last / 2 * std::mem::size_of::<T>()) as u64,
            rows,
            last / 2,
            last,
        ),
    })
}

/// Whether 16-byte loads fit: every count of elements a multiple of a vector, every address
/// 16-byte aligned.
fn vectors<T>(counts: &[usize], addrs: &[u64]) -> i32 {
    let v = 16 / std::mem::size_of::<T>();
    (counts.iter().all(|c| c % v == 0) && addrs.iter().all(|a| a % 16 == 0)) as i32
}

fn swiglu_t<T: CudaDType + DeviceRepr>(g: Arg, u: Option<Arg>) -> Result<CudaStorage> {
    const OP: &str = "SiLU × up";
    let dev = g.0.device.clone();
    let (ga, ua, rows, cols, stride) = gate_up_rows::<T>(g, u, OP)?;
    let n = rows * cols;
    // SAFETY: the kernel writes all n elements.
    let mut y = unsafe { dev.alloc::<T>(n.max(1))? };
    if n > 0 {
        let func = function_in(CUBIN, &dev, format!("swiglu_fwd_{}", suffix(g.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (ya, _guard) = y.device_ptr_mut(&stream);
        let vec = vectors::<T>(&[cols, stride], &[ga, ua, ya]);
        let (rows_u, cols_i, stride_u) = (rows as u64, cols as i32, stride as u64);
        let mut b = stream.launch_builder(&func);
        b.arg(&ga)
            .arg(&ua)
            .arg(&ya)
            .arg(&rows_u)
            .arg(&cols_i)
            .arg(&stride_u)
            .arg(&vec);
        let per_thread = if vec != 0 { 16 / std::mem::size_of::<T>() } else { 1 };
        launch(&mut b, grid(n / per_thread), "swiglu_fwd")?;
    }
    Ok(T::wrap_cuda_slice(y, dev))
}

pub(super) fn swiglu_bwd(g: Arg, u: Arg, dy: Arg) -> Result<CudaStorage> {
    let op = "SiLU × up backward";
    same_dtype(op, g.0.dtype(), &[("up", u.0.dtype()), ("dy", dy.0.dtype())])?;
    by_dtype!(op, g.0.dtype(), swiglu_bwd_t(g, Some(u), dy))
}

/// The gradient of a packed gate/up tensor (.., 2 · cols) from dy (.., cols), packed the same way.
pub(super) fn swiglu_packed_bwd(gu: Arg, dy: Arg) -> Result<CudaStorage> {
    let op = "SiLU × up backward";
    same_dtype(op, gu.0.dtype(), &[("dy", dy.0.dtype())])?;
    by_dtype!(op, gu.0.dtype(), swiglu_bwd_t(gu, None, dy))
}

/// [dgate; dup] stacked (2, ..) for separate gate and up, or one packed gradient like `g` when
/// `u` is `None`.
fn swiglu_bwd_t<T: CudaDType + DeviceRepr>(g: Arg, u: Option<Arg>, dy: Arg) -> Result<CudaStorage> {
    const OP: &str = "SiLU × up backward";
    let dev = g.0.device.clone();
    let (ga, ua, rows, cols, in_stride) = gate_up_rows::<T>(g, u, OP)?;
    let n = rows * cols;
    let da = addr::<T>(dy.0, dy.1, OP, "dy")?;
    // SAFETY: the kernel writes all 2n elements (dgate and dup).
    let mut out = unsafe { dev.alloc::<T>(2 * n.max(1))? };
    if n > 0 {
        let func = function_in(CUBIN, &dev, format!("swiglu_bwd_{}", suffix(g.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        let size = std::mem::size_of::<T>() as u64;
        // Stacked: dup after all of dgate; packed: each row's dup after its dgate.
        let (dua, out_stride) = match u {
            Some(_) => (oa + n as u64 * size, cols),
            None => (oa + cols as u64 * size, 2 * cols),
        };
        let vec = vectors::<T>(&[cols, in_stride, out_stride], &[ga, ua, da, oa, dua]);
        let (rows_u, cols_i, in_u, out_u) = (rows as u64, cols as i32, in_stride as u64, out_stride as u64);
        let mut b = stream.launch_builder(&func);
        b.arg(&ga)
            .arg(&ua)
            .arg(&da)
            .arg(&oa)
            .arg(&dua)
            .arg(&rows_u)
            .arg(&cols_i)
            .arg(&in_u)
            .arg(&out_u)
            .arg(&vec);
        let per_thread = if vec != 0 { 16 / std::mem::size_of::<T>() } else { 1 };
        launch(&mut b, grid(n / per_thread), "swiglu_bwd")?;
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

/// `blocks` blocks of `THREADS` along x (≤ 2³¹ − 1): one per row of the cross-entropy kernels,
/// one per chunk of the optimizer's.
fn blocks_cfg(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// (rows, 2) f32: each row's logsumexp and its target's logit.
pub(super) fn cross_entropy_lse(x: Arg, t: Arg) -> Result<CudaStorage> {
    by_dtype!("cross-entropy", x.0.dtype(), cross_entropy_lse_t(x, t))
}

fn cross_entropy_lse_t<T: CudaDType + DeviceRepr>(x: Arg, t: Arg) -> Result<CudaStorage> {
    const OP: &str = "cross-entropy";
    let dev = x.0.device.clone();
    let (rows, vocab) = (x.1.dims()[0], x.1.dims()[1]);
    let xa = addr::<T>(x.0, x.1, OP, "the logits")?;
    let ta = addr::<u32>(t.0, t.1, OP, "the targets")?;
    // SAFETY: the kernel writes both values of every row.
    let mut out = unsafe { dev.alloc::<f32>((2 * rows).max(1))? };
    if rows > 0 {
        let func = function_in(CUBIN, &dev, format!("ce_logsumexp_{}", suffix(x.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        let vocab_i = vocab as i32;
        let mut b = stream.launch_builder(&func);
        b.arg(&xa).arg(&ta).arg(&oa).arg(&vocab_i);
        launch(&mut b, blocks_cfg(rows), "ce_logsumexp")?;
    }
    Ok(f32::wrap_cuda_slice(out, dev))
}

/// `scale · (softmax(row) − one_hot(target))` in the logits' dtype.
pub(super) fn cross_entropy_bwd(x: Arg, t: Arg, lse: Arg, scale: f32) -> Result<CudaStorage> {
    by_dtype!(
        "cross-entropy backward",
        x.0.dtype(),
        cross_entropy_bwd_t(x, t, lse, scale)
    )
}

fn cross_entropy_bwd_t<T: CudaDType + DeviceRepr>(x: Arg, t: Arg, lse: Arg, scale: f32) -> Result<CudaStorage> {
    const OP: &str = "cross-entropy backward";
    let dev = x.0.device.clone();
    let (rows, vocab) = (x.1.dims()[0], x.1.dims()[1]);
    let xa = addr::<T>(x.0, x.1, OP, "the logits")?;
    let ta = addr::<u32>(t.0, t.1, OP, "the targets")?;
    let la = addr::<f32>(lse.0, lse.1, OP, "the logsumexp")?;
    // SAFETY: the kernel writes every element.
    let mut dx = unsafe { dev.alloc::<T>((rows * vocab).max(1))? };
    if rows > 0 {
        let func = function_in(CUBIN, &dev, format!("ce_backward_{}", suffix(x.0.dtype(), OP)?))?;
        let stream = dev.cuda_stream();
        let (da, _guard) = dx.device_ptr_mut(&stream);
        let vocab_i = vocab as i32;
        let mut b = stream.launch_builder(&func);
        b.arg(&xa).arg(&ta).arg(&la).arg(&da).arg(&vocab_i).arg(&scale);
        launch(&mut b, blocks_cfg(rows), "ce_backward")?;
    }
    Ok(T::wrap_cuda_slice(dx, dev))
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

/// The scalars of one optimizer step ([`crate::train::optim::AdamW::update`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWStep {
    /// The global gradient norm's limit; 0 never clips.
    pub clip: f32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `1 - lr * weight_decay` for the decayed parameters (matrices).
    pub matrix_decay: f32,
    pub correction1: f32,
    pub correction2: f32,
}

/// One tensor of the optimizer step: the f32 parameter (updated in place), its gradient, its
/// moments (updated in place), whether weight decay applies, and optionally where its 16-bit
/// copy lives (a bf16 or f16 tensor, contiguous, and the element offset of the parameter's
/// values in it), which the step writes with the new values.
pub(crate) struct OptimTensor<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    pub decayed: bool,
    pub copy: Option<(&'a Tensor, usize)>,
}

/// Elements per chunk of the multi-tensor kernels (`kOptimChunk`-sized blocks of work; one
/// block each).
const OPTIM_CHUNK: usize = 32 * 1024;

/// The whole optimizer step on the GPU (kernels/model/train_ops.cu, "The optimizer step"): the
/// global gradient norm, the clip scale and AdamW over every tensor in three launches, queued
/// on candle's stream without waiting. Nothing changes when a gradient or `loss` (an f32 scalar)
/// is not finite. Returns [norm, clip scale, 1 if skipped] (f32, on the GPU).
pub(crate) fn optimizer_step(tensors: &[OptimTensor], loss: &Tensor, step: AdamWStep) -> Result<Tensor> {
    const OP: &str = "AdamW";
    // The table of chunks: six u64 words each, OptimChunk's layout (p, g, m, v, copy or 0,
    // len | flags << 32).
    let mut table: Vec<u64> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let n = t.param.elem_count();
        for (what, x) in [("gradient", t.grad), ("m", t.m), ("v", t.v)] {
            if x.elem_count() != n || x.dtype() != candle_core::DType::F32 || !x.device().same_device(loss.device()) {
                candle_core::bail!(
                    "flash-llama {OP}: tensor {i}'s {what} is {:?} {:?}, the parameter F32 {:?} on the loss's GPU",
                    x.dtype(),
                    x.shape(),
                    t.param.shape()
                )
            }
        }
        if t.param.dtype() != candle_core::DType::F32 || !t.param.device().same_device(loss.device()) {
            candle_core::bail!(
                "flash-llama {OP}: parameter {i} must be F32 on the loss's GPU, got {:?}",
                t.param.dtype()
            )
        }
        // The tensors are read and written through their addresses, outside candle's locks: the
        // parameters and moments are the optimizer's own, touched by nothing else during the
        // step, every tensor outlives the launches (the table is uploaded, and the kernels are
        // ordered on candle's one stream after every kernel that read them).
        let address = |x: &Tensor, what: &str| -> Result<u64> {
            let (s, l) = x.storage_and_layout();
            match &*s {
                candle_core::Storage::Cuda(c) => addr::<f32>(c, l, OP, what),
                _ => candle_core::bail!("flash-llama {OP}: the {what} is not on the GPU"),
            }
        };
        let (pa, ga) = (address(t.param, "parameter")?, address(t.grad, "gradient")?);
        let (ma, va) = (address(t.m, "m")?, address(t.v, "v")?);
        let bytes = 4 * n as u64;
        let disjoint = |a: u64, b: u64| a + bytes <= b || b + bytes <= a;
        if n > 0 && !(disjoint(pa, ma) && disjoint(pa, va) && disjoint(ma, va) && disjoint(pa, ga)) {
            candle_core::bail!("flash-llama {OP}: tensor {i}'s parameter, gradient and moments must not overlap")
        }
        // The copy: 16-bit, contiguous, holding n values from its offset, apart from the rest.
        let (copy_a, copy_f16) = match t.copy {
            None => (0, false),
            Some((copy, offset)) => {
                let (s, l) = copy.storage_and_layout();
                let base = match (&*s, copy.dtype()) {
                    (candle_core::Storage::Cuda(c), candle_core::DType::BF16) => addr::<half::bf16>(c, l, OP, "copy")?,
                    (candle_core::Storage::Cuda(c), candle_core::DType::F16) => addr::<half::f16>(c, l, OP, "copy")?,
                    _ => candle_core::bail!(
                        "flash-llama {OP}: tensor {i}'s copy must be a bf16 or f16 GPU tensor, got {:?}",
                        copy.dtype()
                    ),
                };
                if !l.is_contiguous() || offset + n > copy.elem_count() {
                    candle_core::bail!(
                        "flash-llama {OP}: tensor {i}'s copy ({n} values from {offset}) does not fit {:?}",
                        copy.shape()
                    )
                }
                let a = base + 2 * offset as u64;
                if n > 0
                    && ![pa, ga, ma, va]
                        .iter()
                        .all(|&x| a + 2 * n as u64 <= x || x + bytes <= a)
                {
                    candle_core::bail!(
                        "flash-llama {OP}: tensor {i}'s copy overlaps its parameter, gradient or moments"
                    )
                }
                (a, copy.dtype() == candle_core::DType::F16)
            }
        };
        let flags = u64::from(t.decayed) | (u64::from(copy_f16) << 1);
        for start in (0..n).step_by(OPTIM_CHUNK) {
            let len = OPTIM_CHUNK.min(n - start) as u64;
            let off = 4 * start as u64;
            let copy_off = if copy_a == 0 { 0 } else { copy_a + 2 * start as u64 };
            table.extend([pa + off, ga + off, ma + off, va + off, copy_off, len | (flags << 32)]);
        }
    }
    let loss = loss.to_dtype(candle_core::DType::F32)?;
    if loss.elem_count() != 1 {
        candle_core::bail!("flash-llama {OP}: the loss must be one value, got {:?}", loss.shape())
    }
    loss.apply_op1_no_bwd(&OptimizerStep { table, step })
}

/// [`optimizer_step`]'s launches, as an op on the loss (which the clip kernel reads) whose
/// output is the step's statistics.
struct OptimizerStep {
    table: Vec<u64>,
    step: AdamWStep,
}

impl candle_core::CustomOp1 for OptimizerStep {
    fn name(&self) -> &'static str {
        "flash-llama-adamw"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("flash-llama AdamW: the fused step runs on the GPU only")
    }

    fn cuda_fwd(&self, loss: &CudaStorage, l: &Layout) -> Result<(CudaStorage, candle_core::Shape)> {
        let dev = loss.device.clone();
        let stream = dev.cuda_stream();
        let loss_a = addr::<f32>(loss, l, "AdamW", "loss")?;
        let chunks = self.table.len() / 6;
        let chunks_u = chunks as u32;
        // SAFETY: the kernels write every element (partials: one per chunk, stats: 3).
        let mut partials = unsafe { dev.alloc::<f32>(chunks.max(1))? };
        let mut stats = unsafe { dev.alloc::<f32>(3)? };
        let table = stream
            .clone_htod(&self.table)
            .map_err(|e| err("AdamW chunk table", e))?;
        let (ta, _t) = table.device_ptr(&stream);
        let (pa, _p) = partials.device_ptr_mut(&stream);
        let (sa, _s) = stats.device_ptr_mut(&stream);
        if chunks > 0 {
            let func = function_in(CUBIN, &dev, "optim_grad_sq_sums".to_string())?;
            let mut b = stream.launch_builder(&func);
            b.arg(&ta).arg(&pa);
            launch(&mut b, blocks_cfg(chunks), "optim_grad_sq_sums")?;
        }
        let func = function_in(CUBIN, &dev, "optim_clip".to_string())?;
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&chunks_u).arg(&loss_a).arg(&self.step.clip).arg(&sa);
        launch(&mut b, blocks_cfg(1), "optim_clip")?;
        if chunks > 0 {
            let s = self.step;
            let func = function_in(CUBIN, &dev, "optim_adamw".to_string())?;
            let mut b = stream.launch_builder(&func);
            b.arg(&ta).arg(&sa).arg(&s.lr).arg(&s.beta1).arg(&s.beta2).arg(&s.eps);
            b.arg(&s.matrix_decay).arg(&s.correction1).arg(&s.correction2);
            launch(&mut b, blocks_cfg(chunks), "optim_adamw")?;
        }
        drop((_t, _p, _s));
        Ok((f32::wrap_cuda_slice(stats, dev), candle_core::Shape::from(3)))
    }
}

/// `acc += dyᵀ · x` in place: acc (n, k) f32, dy (t, n) and x (t, k) in one 16-bit dtype with
/// contiguous rows (any row stride: the halves of a packed gradient are fine). One cuBLAS GEMM
/// on candle's handle (so on its stream), bf16/f16 products summed in f32 and added to acc in f32:
/// a linear layer's weight gradient accumulated over the micro-batches of a step without a 16-bit
/// copy of it or a cast.
pub(crate) fn weight_grad_into(acc: &Tensor, dy: &Tensor, x: &Tensor) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::{result::gemm_ex, sys};
    const OP: &str = "weight gradient";
    let (t, n) = dy.dims2()?;
    let (tx, k) = x.dims2()?;
    if tx != t || acc.dims() != [n, k] || acc.dtype() != candle_core::DType::F32 || x.dtype() != dy.dtype() {
        candle_core::bail!(
            "flash-llama {OP}: acc {:?} {:?} += dyᵀ {:?} {:?} · x {:?} {:?}",
            acc.dtype(),
            acc.shape(),
            dy.dtype(),
            dy.shape(),
            x.dtype(),
            x.shape()
        )
    }
    let data_type = match dy.dtype() {
        candle_core::DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        candle_core::DType::F16 => sys::cudaDataType::CUDA_R_16F,
        other => candle_core::bail!("flash-llama {OP}: 16-bit inputs only, got {other:?}"),
    };
    // Row-major operands with unit column stride; the row stride becomes cuBLAS's leading dim.
    let rows = |t: &Tensor, what: &str| -> Result<(u64, i32, candle_core::cuda_backend::CudaDevice)> {
        let (s, l) = t.storage_and_layout();
        let candle_core::Storage::Cuda(c) = &*s else {
            candle_core::bail!("flash-llama {OP}: {what} is not on the GPU")
        };
        let stride = l.stride();
        if stride.len() != 2 || (stride[1] != 1 && l.dims()[1] > 1) {
            candle_core::bail!("flash-llama {OP}: {what} needs contiguous rows, got strides {stride:?}")
        }
        let stream = c.device.cuda_stream();
        let size = t.dtype().size_in_bytes() as u64;
        let base = match t.dtype() {
            candle_core::DType::F32 => c.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
            candle_core::DType::BF16 => c.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
            _ => c.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        };
        Ok((
            base + l.start_offset() as u64 * size,
            stride[0].max(1) as i32,
            c.device.clone(),
        ))
    };
    let (acca, ldc, dev) = rows(acc, "acc")?;
    if ldc as usize != k {
        candle_core::bail!("flash-llama {OP}: acc must be contiguous")
    }
    let (dya, ldb, _) = rows(dy, "dy")?;
    let (xa, lda, _) = rows(x, "x")?;
    if t == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    // Column-major: accᵀ (k × n) += xᵀ (k × t) · dy (t × n), i.e. A = x as stored (op N),
    // B = dy as stored transposed (op T).
    let blas = dev.cublas_handle();
    let (alpha, beta) = (1f32, 1f32);
    // SAFETY: the three addresses are live allocations of candle's (held through the tensors
    // for the call; the GEMM is queued on candle's stream after every kernel that wrote them),
    // with the shapes and leading dims checked above; acc is the caller's own accumulator, read
    // and written by nothing else meanwhile.
    unsafe {
        gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_T,
            k as i32,
            n as i32,
            t as i32,
            &alpha as *const f32 as *const _,
            xa as *const _,
            data_type,
            lda,
            dya as *const _,
            data_type,
            ldb,
            &beta as *const f32 as *const _,
            acca as *mut _,
            sys::cudaDataType::CUDA_R_32F,
            ldc,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("flash-llama {OP}: cuBLAS: {e:?}")))
}
