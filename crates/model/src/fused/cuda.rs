//! Launches of kernels/model/fused.cu: the cubin built by build.rs, loaded once per device
//! through candle's cudarc, launched on candle's stream.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, DeviceId};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::{StoreTarget, VectorInput, VectorOutput};

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fused.cubin"));

/// Threads of the add + RMSNorm blocks (`kNormThreads`), one block per row.
const NORM_THREADS: u32 = 256;
/// Threads of the argmax blocks (`kArgmaxThreads`), each over one chunk of a row.
const ARGMAX_THREADS: u32 = 256;
/// Bytes of a row each argmax block reads (`argmax_chunk<T>()` elements: kArgmaxThreads threads
/// × kArgmaxLoads 16-byte loads).
const ARGMAX_CHUNK_BYTES: usize = ARGMAX_THREADS as usize * 2 * 16;
/// Warps (outputs) per block of `linear_vector` (`kMatvecWarps`).
const MATVEC_WARPS: u32 = 8;
/// Warps per output of the plain `linear_vector` (`kMatvecSplit`); the add + norm forms keep one.
const MATVEC_SPLIT: u32 = 2;
/// Warps per output of `linear_vector_long` (`kMatvecLongSplit`), which the plain projection takes
/// from rows of `MATVEC_LONG_MIN_BYTES` on (the down projection).
const MATVEC_LONG_SPLIT: u32 = 4;
const MATVEC_LONG_MIN_BYTES: usize = 8192;
/// Threads per block of the elementwise kernels (grid-stride loops).
const THREADS: u32 = 256;

/// Calls `$f::<T>($args)` for the element type of `$dtype` (bf16, f16 or f32); any other dtype
/// is an error naming `$op`. Shared by the launches here and in `train_ops`.
macro_rules! by_dtype {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            d => candle_core::bail!("flash-llama {}: unsupported dtype {d:?} (bf16, f16 or f32)", $op),
        }
    };
}
pub(crate) use by_dtype;

pub(crate) fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("flash-llama: {what}: {e:?}"))
}

/// The kernel `name` (e.g. `silu_mul_bf16`) of fused.cu on `dev`.
fn function(dev: &CudaDevice, name: String) -> Result<CudaFunction> {
    function_in(CUBIN, dev, name)
}

/// A loaded cubin's key: the device and the cubin's address (one entry per embedded cubin).
type CubinKey = (DeviceId, usize);

/// The kernel `name` of `cubin` (one of the cubins build.rs embeds) on `dev`, loading the cubin
/// on first use.
pub(crate) fn function_in(cubin: &'static [u8], dev: &CudaDevice, name: String) -> Result<CudaFunction> {
    let key: CubinKey = (dev.id(), cubin.as_ptr() as usize);
    static FUNCS: OnceLock<Mutex<HashMap<(CubinKey, String), CudaFunction>>> = OnceLock::new();
    let mut funcs = FUNCS.get_or_init(Default::default).lock().unwrap();
    if let Some(f) = funcs.get(&(key, name.clone())) {
        return Ok(f.clone());
    }
    // One module per device and cubin: load it with the first function, then look the others up in it.
    static MODULES: OnceLock<Mutex<HashMap<CubinKey, std::sync::Arc<CudaModule>>>> = OnceLock::new();
    let module = {
        let mut modules = MODULES.get_or_init(Default::default).lock().unwrap();
        match modules.get(&key) {
            Some(m) => m.clone(),
            None => {
                let ctx = dev.cuda_stream().context().clone();
                let m = ctx.load_module(Ptx::from_binary(cubin.to_vec())).map_err(|e| {
                    err(
                        "could not load the sm_90a fused kernels (they need a Hopper GPU: H100/H200)",
                        e,
                    )
                })?;
                modules.insert(key, m.clone());
                m
            }
        }
    };
    let f = module.load_function(&name).map_err(|e| err(&name, e))?;
    funcs.insert((key, name), f.clone());
    Ok(f)
}

/// The kernel suffix of a dtype.
pub(crate) fn suffix(dtype: DType, op: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        d => bail!("flash-llama {op}: unsupported dtype {d:?} (bf16, f16 or f32)"),
    })
}

/// The device address of a contiguous input's first element (its guard dropped at once: every
/// launch is on candle's one stream, as in flash-attn3).
pub(crate) fn addr<T: CudaDType>(s: &CudaStorage, l: &Layout, op: &str, what: &str) -> Result<u64> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!(
            "flash-llama {op}: {what} must be contiguous, got strides {:?}",
            l.stride()
        )
    };
    let stream = s.device.cuda_stream();
    let (ptr, _) = s.as_cuda_slice::<T>()?.device_ptr(&stream);
    Ok(ptr + (start * std::mem::size_of::<T>()) as u64)
}

/// [`addr`] for an e4m3 tensor (bytes; candle's CudaDType does not cover F8E4M3).
fn addr_e4m3(s: &CudaStorage, l: &Layout, op: &str, what: &str) -> Result<u64> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!(
            "flash-llama {op}: {what} must be contiguous, got strides {:?}",
            l.stride()
        )
    };
    let candle_core::cuda_backend::CudaStorageSlice::F8E4M3(slice) = &s.slice else {
        bail!("flash-llama {op}: {what} must be f8e4m3, got {:?}", s.dtype())
    };
    let stream = s.device.cuda_stream();
    let (ptr, _) = slice.device_ptr(&stream);
    Ok(ptr + start as u64)
}

/// The CUDA storage of a tensor that an op holds besides its inputs (a cache, a bias, an index),
/// checked to be on `dev`, the GPU of the op's inputs. `what` names it in the errors.
pub(crate) fn held_on<'a>(storage: &'a Storage, dev: &CudaDevice, op: &str, what: &str) -> Result<&'a CudaStorage> {
    let Storage::Cuda(s) = storage else {
        bail!("flash-llama {op}: {what} must be on the GPU")
    };
    if s.device.id() != dev.id() {
        bail!("flash-llama {op}: {what} must be on the input's GPU")
    }
    Ok(s)
}

/// A grid of at most 8 blocks per SM-ish for grid-stride loops over `n` elements.
pub(crate) fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 4096) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn same_dtype(op: &str, dtype: DType, others: &[(&str, DType)]) -> Result<()> {
    for (what, d) in others {
        if *d != dtype {
            bail!("flash-llama {op}: {what} is {d:?}, the input {dtype:?}")
        }
    }
    Ok(())
}

pub(super) fn add_rms_norm(
    x: (&CudaStorage, &Layout),
    h: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    same_dtype(
        "add + RMSNorm",
        dtype,
        &[("h", h.0.dtype()), ("the weight", w.0.dtype())],
    )?;
    by_dtype!("add + RMSNorm", dtype, add_rms_norm_t(x, h, w, eps))
}

fn add_rms_norm_t<T: CudaDType + DeviceRepr>(
    x: (&CudaStorage, &Layout),
    h: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    const OP: &str = "add + RMSNorm";
    let dev = x.0.device.clone();
    let n = x.1.shape().elem_count();
    let dim = x.1.dims().last().copied().unwrap_or(0);
    let (xa, ha, wa) = (
        addr::<T>(x.0, x.1, OP, "x")?,
        addr::<T>(h.0, h.1, OP, "h")?,
        addr::<T>(w.0, w.1, OP, "w")?,
    );
    // SAFETY: the kernel writes all 2n elements: the residual, then the normed rows.
    let mut out = unsafe { dev.alloc::<T>(2 * n.max(1))? };
    if n == 0 {
        return Ok(T::wrap_cuda_slice(out, dev));
    }
    let func = function(&dev, format!("add_rms_norm_{}", suffix(x.0.dtype(), OP)?))?;
    let stream = dev.cuda_stream();
    {
        let (res, _guard) = out.device_ptr_mut(&stream);
        let normed = res + (n * std::mem::size_of::<T>()) as u64;
        let cfg = LaunchConfig {
            grid_dim: ((n / dim) as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let dim = dim as i32;
        let mut b = stream.launch_builder(&func);
        b.arg(&xa).arg(&ha).arg(&wa).arg(&res).arg(&normed).arg(&dim).arg(&eps);
        // SAFETY: contiguous inputs of n (x, h) and dim (w) elements, an output of 2n.
        unsafe { b.launch(cfg) }.map_err(|e| err("add_rms_norm launch", e))?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn silu_mul(y: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    by_dtype!("SiLU × up", y.0.dtype(), silu_mul_t(y))
}

fn silu_mul_t<T: CudaDType + DeviceRepr>(y: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    const OP: &str = "SiLU × up";
    let dev = y.0.device.clone();
    let inter = y.1.dims().last().copied().unwrap_or(0) / 2;
    let n = y.1.shape().elem_count() / 2;
    let ya = addr::<T>(y.0, y.1, OP, "the gate/up output")?;
    // SAFETY: the kernel writes all n elements.
    let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
    if n == 0 {
        return Ok(T::wrap_cuda_slice(out, dev));
    }
    let func = function(&dev, format!("silu_mul_{}", suffix(y.0.dtype(), OP)?))?;
    let stream = dev.cuda_stream();
    {
        let (oa, _guard) = out.device_ptr_mut(&stream);
        let (rows, inter) = ((n / inter) as u64, inter as i32);
        let mut b = stream.launch_builder(&func);
        b.arg(&ya).arg(&oa).arg(&rows).arg(&inter);
        // SAFETY: a contiguous input of 2n elements, an output of n.
        unsafe { b.launch(grid(n)) }.map_err(|e| err("silu_mul launch", e))?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

pub(super) fn rope_angles(
    positions: (&CudaStorage, &Layout),
    inv_freq: (&CudaStorage, &Layout),
    dtype: DType,
) -> Result<CudaStorage> {
    by_dtype!("rotary angles", dtype, rope_angles_t(positions, inv_freq, dtype))
}

/// cos then sin, n elements each, in one buffer.
fn rope_angles_t<T: CudaDType + DeviceRepr>(
    positions: (&CudaStorage, &Layout),
    inv_freq: (&CudaStorage, &Layout),
    dtype: DType,
) -> Result<CudaStorage> {
    const OP: &str = "rotary angles";
    let dev = positions.0.device.clone();
    let tokens = positions.1.shape().elem_count();
    let per_token = inv_freq.1.shape().elem_count();
    let n = tokens * per_token;
    let pa = addr::<u32>(positions.0, positions.1, OP, "the positions")?;
    let fa = addr::<f32>(inv_freq.0, inv_freq.1, OP, "the frequencies")?;
    // SAFETY: the kernel writes all 2n elements.
    let mut out = unsafe { dev.alloc::<T>((2 * n).max(1))? };
    if n > 0 {
        let func = function(&dev, format!("rope_angles_{}", suffix(dtype, OP)?))?;
        let stream = dev.cuda_stream();
        let (ca, _guard) = out.device_ptr_mut(&stream);
        let sa = ca + (n * std::mem::size_of::<T>()) as u64;
        let (tokens, per_token) = (tokens as i32, per_token as i32);
        let mut b = stream.launch_builder(&func);
        b.arg(&pa).arg(&fa).arg(&ca).arg(&sa).arg(&tokens).arg(&per_token);
        // SAFETY: contiguous positions (tokens) and frequencies (per_token); an output of 2n.
        unsafe { b.launch(grid(n)) }.map_err(|e| err("rope_angles launch", e))?;
    }
    Ok(T::wrap_cuda_slice(out, dev))
}

/// [`super::decode_prologue`]'s launch: two blocks per row (the tables; the lookup and norm),
/// 32 threads below 1024 columns and 1024 from there (candle's rmsnorm block size, whose
/// arithmetic the kernel repeats). The inputs' dtypes, shapes and devices are checked by the
/// caller.
pub(super) fn decode_prologue(inputs: &super::PrologueInputs, out: &super::DecodePrologue) -> Result<()> {
    by_dtype!("decode prologue", inputs.embed.dtype(), decode_prologue_t(inputs, out))
}

fn decode_prologue_t<T: CudaDType + DeviceRepr>(
    inputs: &super::PrologueInputs,
    out: &super::DecodePrologue,
) -> Result<()> {
    const OP: &str = "decode prologue";
    let dtype = inputs.embed.dtype();
    let dev = inputs.embed.device().as_cuda_device()?.clone();
    let (vocab, hidden) = inputs.embed.dims2()?;
    let rows = inputs.ids.dims1()?;
    let per_token = inputs.inv_freq.elem_count();
    // Read locks on every tensor for the launch.
    let u32_of = |t: &Tensor, what: &str| -> Result<u64> {
        let g = t.storage_and_layout();
        held_addr::<u32>((&g.0, g.1), &dev, DType::U32, OP, what)
    };
    let t_of = |t: &Tensor, what: &str| -> Result<u64> {
        let g = t.storage_and_layout();
        held_addr::<T>((&g.0, g.1), &dev, dtype, OP, what)
    };
    let ids = u32_of(inputs.ids, "the token ids")?;
    let lens = u32_of(inputs.lens, "the key counts")?;
    let slots = match inputs.slot_starts {
        Some(t) => u32_of(t, "the slot starts")?,
        None => 0,
    };
    let inv_freq = {
        let g = inputs.inv_freq.storage_and_layout();
        held_addr::<f32>((&g.0, g.1), &dev, DType::F32, OP, "the frequencies")?
    };
    let embed = t_of(inputs.embed, "the embedding")?;
    let norm_w = t_of(inputs.norm_weight, "the norm's weight")?;
    let seqlens = u32_of(&out.seqlens, "the key counts + 1")?;
    let cache_rows = match &out.cache_rows {
        Some(t) => u32_of(t, "the cache rows")?,
        None => 0,
    };
    let (cos, sin) = (t_of(&out.cos, "cos")?, t_of(&out.sin, "sin")?);
    let (x, normed) = (t_of(&out.x, "x")?, t_of(&out.normed, "the normed x")?);
    let func = function(&dev, format!("decode_prologue_{}", suffix(dtype, OP)?))?;
    let stream = dev.cuda_stream();
    let (hidden_i, per_token_i, vocab_u, eps) = (hidden as i32, per_token as i32, vocab as u32, inputs.eps as f32);
    let mut b = stream.launch_builder(&func);
    b.arg(&ids)
        .arg(&lens)
        .arg(&slots)
        .arg(&inv_freq)
        .arg(&embed)
        .arg(&norm_w);
    b.arg(&seqlens)
        .arg(&cache_rows)
        .arg(&cos)
        .arg(&sin)
        .arg(&x)
        .arg(&normed);
    b.arg(&hidden_i).arg(&per_token_i).arg(&vocab_u).arg(&eps);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 2, 1),
        block_dim: (if hidden < 1024 { 32 } else { 1024 }, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: contiguous tensors of the shapes the caller checked; each block writes its row of
    // every output.
    unsafe { b.launch(cfg) }.map_err(|e| err("decode_prologue launch", e))?;
    Ok(())
}

pub(super) fn linear_vector(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    input: &VectorInput,
    output: VectorOutput,
    bias: Option<&Tensor>,
) -> Result<CudaStorage> {
    by_dtype!("linear", x.0.dtype(), linear_vector_t(x, w, input, output, bias))
}

/// The device address of a tensor an op holds besides its inputs (its storage under a read lock).
pub(super) fn held_addr<T: CudaDType>(
    (storage, layout): (&Storage, &Layout),
    dev: &CudaDevice,
    dtype: DType,
    op: &str,
    what: &str,
) -> Result<u64> {
    let s = held_on(storage, dev, op, what)?;
    same_dtype(op, dtype, &[(what, s.dtype())])?;
    addr::<T>(s, layout, op, what)
}

fn linear_vector_t<T: CudaDType + DeviceRepr>(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    input: &VectorInput,
    output: VectorOutput,
    bias: Option<&Tensor>,
) -> Result<CudaStorage> {
    const OP: &str = "linear";
    let dtype = x.0.dtype();
    same_dtype(OP, dtype, &[("the weight", w.0.dtype())])?;
    let dev = x.0.device.clone();
    let n = output.outputs(w.1.dims()[0]);
    let k = w.1.dims()[1];
    let (xa, wa) = (addr::<T>(x.0, x.1, OP, "x")?, addr::<T>(w.0, w.1, OP, "the weight")?);
    // The bias and an add + norm's h and weight: read locks on their storage for the launch (as
    // rope_store's cache).
    let bias_g = bias.map(|b| b.storage_and_layout());
    let ba = match &bias_g {
        None => 0u64,
        Some((storage, layout)) => held_addr::<T>((storage, layout), &dev, dtype, OP, "the bias")?,
    };
    let norm_g = match input {
        VectorInput::AddNorm { h, norm_w, .. } => Some((h.storage_and_layout(), norm_w.storage_and_layout())),
        _ => None,
    };
    if (xa | wa) % 16 != 0 {
        bail!("flash-llama {OP}: x and the weight must start on 16 bytes")
    }
    // The residual of an add + norm comes first in the output.
    let res_len = match input {
        VectorInput::AddNorm { .. } => k,
        _ => 0,
    };
    let stream = dev.cuda_stream();
    // Captured into a CUDA graph, the output's allocation must not stand between the kernel
    // before and this launch (`OverlapInCapture`).
    let capture = OverlapInCapture::detach(&stream)?;
    // SAFETY: the kernel writes all res_len + n elements.
    let mut out = unsafe { dev.alloc::<T>((res_len + n).max(1))? };
    if let Some(capture) = capture {
        capture.attach(&stream)?;
    }
    if n == 0 {
        return Ok(T::wrap_cuda_slice(out, dev));
    }
    let long_rows = k * std::mem::size_of::<T>() >= MATVEC_LONG_MIN_BYTES;
    let kernel = match (input, output) {
        (VectorInput::Plain, VectorOutput::Plain) if long_rows => "linear_vector_long",
        (VectorInput::Plain, VectorOutput::Plain) => "linear_vector",
        (VectorInput::AddNorm { .. }, VectorOutput::Plain) => "linear_vector_add_norm",
        (VectorInput::AddNorm { .. }, VectorOutput::SwiGlu) => "linear_vector_add_norm_swiglu",
        (VectorInput::Plain, VectorOutput::SwiGlu) => {
            bail!("flash-llama {OP}: the SwiGLU output needs the add + RMSNorm input")
        }
    };
    let func = function(&dev, format!("{kernel}_{}", suffix(dtype, OP)?))?;
    {
        let (res, _guard) = out.device_ptr_mut(&stream);
        let ya = res + (res_len * std::mem::size_of::<T>()) as u64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(MATVEC_WARPS as usize) as u32, 1, 1),
            block_dim: match input {
                VectorInput::AddNorm { .. } => (MATVEC_WARPS * 32, 1, 1),
                VectorInput::Plain if long_rows => (MATVEC_WARPS * MATVEC_LONG_SPLIT * 32, 1, 1),
                VectorInput::Plain => (MATVEC_WARPS * MATVEC_SPLIT * 32, 1, 1),
            },
            // The normed row, staged (its size checked by `linear_vector_add_norm_fits`).
            shared_mem_bytes: match input {
                VectorInput::Plain => 0,
                VectorInput::AddNorm { .. } => (k * std::mem::size_of::<T>()) as u32,
            },
        };
        let (n_i, k_i) = (n as i32, k as i32);
        let mut args = vec![arg(&xa)];
        let (ha, norm_wa, eps);
        if let (VectorInput::AddNorm { eps: e, .. }, Some((h_g, nw_g))) = (input, &norm_g) {
            ha = held_addr::<T>((&h_g.0, h_g.1), &dev, dtype, OP, "h")?;
            norm_wa = held_addr::<T>((&nw_g.0, nw_g.1), &dev, dtype, OP, "the norm weight")?;
            eps = *e;
            args.extend([arg(&ha), arg(&norm_wa), arg(&eps), arg(&res)]);
        }
        match output {
            VectorOutput::Plain => args.extend([arg(&wa), arg(&ba), arg(&ya), arg(&n_i), arg(&k_i)]),
            VectorOutput::SwiGlu => args.extend([arg(&wa), arg(&ya), arg(&n_i), arg(&k_i)]),
        }
        // SAFETY: the arguments of the kernel's signature, in order (kernels/model/fused.cu):
        // contiguous x (k) and w (n x k; 2n x k and no bias for the SwiGLU output), 16-byte
        // aligned with k a whole number of 16-byte vectors (checked by `linear_vector` and its
        // fused forms, with h and the norm weight of k); a bias of n if any; an output of
        // res_len + n. The kernel reads only the weights before its `griddepcontrol.wait`.
        unsafe { launch_overlapping(&stream, &func, cfg, None, &mut args) }?;
    }
    drop((bias_g, norm_g));
    Ok(T::wrap_cuda_slice(out, dev))
}

/// The programmatic edge of an overlapping launch inside a stream capture.
///
/// Eagerly, a [`launch_overlapping`] kernel's blocks start while the kernel before it drains.
/// Captured into a CUDA graph (crate::decode_graph), the launch gets a programmatic edge only from
/// the nodes it depends on that are kernels, and in a decode step those are not kernels: the
/// capture records candle's stream-ordered allocations and frees as graph memory nodes, so the
/// projection's output allocation (and any free of a tensor dropped since the kernel before) sits
/// between the two kernels, and the edge from it is an ordinary one. Traced inside the replayed
/// step (scripts/gpu_decode_timeline.py), each projection then started only after the kernel
/// before had ended.
///
/// So, while the stream is capturing, the launch's dependencies are set by hand:
/// [`OverlapInCapture::detach`] clears the stream's capture dependencies, so that the output's
/// allocation becomes a root of the graph (its memory is then not shared with buffers freed
/// earlier in the step: a few KB at batch 1); [`OverlapInCapture::attach`] makes the launch depend
/// on that allocation and on the nodes the stream depended on before, with each kernel among them
/// through a programmatic edge from its programmatic port. A free among them is passed over to
/// the node before it and left a leaf of the graph: its buffer's last reader was queued before
/// it, so before this launch. Graph memory nodes' edges cannot be removed once captured
/// (CUDA_ERROR_NOT_SUPPORTED), hence this at capture time rather than a rewrite of the graph.
pub(super) struct OverlapInCapture {
    before: Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>,
}

fn capture_err(what: &str, r: sys::CUresult) -> Result<()> {
    r.result()
        .map_err(|e| err(&format!("capturing an overlapping launch: {what}"), e))
}

/// The stream's capture dependencies and their edge data; `None` if it is not capturing.
fn capture_dependencies(stream: &CudaStream) -> Result<Option<Vec<(sys::CUgraphNode, sys::CUgraphEdgeData)>>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut nodes, mut data, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
    // SAFETY: the out-pointers are valid; the arrays returned stay valid until the next call on
    // the stream, and are copied at once.
    capture_err("capture info", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu_stream(),
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut nodes,
            &mut data,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    let mut deps = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: n entries; the edge data may be null (all default edges).
        let node = unsafe { *nodes.add(i) };
        let edge = if data.is_null() {
            plain_edge()
        } else {
            unsafe { *data.add(i) }
        };
        deps.push((node, edge));
    }
    Ok(Some(deps))
}

fn plain_edge() -> sys::CUgraphEdgeData {
    sys::CUgraphEdgeData {
        from_port: 0,
        to_port: 0,
        type_: 0,
        reserved: [0; 5],
    }
}

fn set_capture_dependencies(stream: &CudaStream, deps: &[(sys::CUgraphNode, sys::CUgraphEdgeData)]) -> Result<()> {
    let mut nodes: Vec<sys::CUgraphNode> = deps.iter().map(|d| d.0).collect();
    let data: Vec<sys::CUgraphEdgeData> = deps.iter().map(|d| d.1).collect();
    // SAFETY: arrays of deps.len() entries, nodes of the graph being captured.
    capture_err("setting the capture dependencies", unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(
            stream.cu_stream(),
            nodes.as_mut_ptr(),
            data.as_ptr(),
            nodes.len(),
            sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32,
        )
    })
}

impl OverlapInCapture {
    /// While `stream` is capturing: remembers its capture dependencies and clears them, so that
    /// the next node captured (the output's allocation) is a root. `None` otherwise.
    pub(super) fn detach(stream: &CudaStream) -> Result<Option<Self>> {
        let Some(before) = capture_dependencies(stream)? else {
            return Ok(None);
        };
        set_capture_dependencies(stream, &[])?;
        Ok(Some(Self { before }))
    }

    /// Sets the next launch's dependencies: what was captured since [`OverlapInCapture::detach`]
    /// (the allocation) and the nodes before it, kernels through programmatic edges.
    pub(super) fn attach(self, stream: &CudaStream) -> Result<()> {
        let mut deps = capture_dependencies(stream)?.unwrap_or_default();
        let mut pending = self.before;
        while let Some((node, edge)) = pending.pop() {
            // A node reached twice (two frees after the same kernel) is one dependency.
            if deps.iter().any(|d| d.0 == node) {
                continue;
            }
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of the graph being captured.
            capture_err("node type", unsafe { sys::cuGraphNodeGetType(node, &mut kind) })?;
            match kind {
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => deps.push((
                    node,
                    sys::CUgraphEdgeData {
                        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                        to_port: 0,
                        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                        reserved: [0; 5],
                    },
                )),
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => {
                    let mut n = 0usize;
                    // SAFETY: asks for the count, then fills n entries.
                    capture_err("node dependencies", unsafe {
                        sys::cuGraphNodeGetDependencies_v2(node, std::ptr::null_mut(), std::ptr::null_mut(), &mut n)
                    })?;
                    let mut nodes = vec![std::ptr::null_mut(); n];
                    let mut data = vec![plain_edge(); n];
                    capture_err("node dependencies", unsafe {
                        sys::cuGraphNodeGetDependencies_v2(node, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n)
                    })?;
                    pending.extend(nodes.into_iter().zip(data).take(n));
                }
                _ => deps.push((node, edge)),
            }
        }
        set_capture_dependencies(stream, &deps)
    }
}

/// A kernel argument for [`launch_overlapping`]: the address of its value.
pub(super) fn arg<T>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

/// Launches `func` on `stream` as a programmatic dependent launch (sm_90): its blocks may start
/// before the kernel queued before it has finished, as soon as that kernel's blocks have all
/// started and let it (or have finished). Used for the projections of a decode step
/// (`linear_vector`, `linear_rows`) and the RoPE + KV store after them: each block requests its
/// first weights (if any), which no kernel writes, while the kernel before drains, then waits
/// (`griddepcontrol.wait`) until the earlier kernels are done before it reads its input or writes
/// anything (kernels/model/fused.cu, linear_rows.cu). With `cluster_x`, the grid is one of
/// thread-block clusters of that many CTAs along x. Captured into a CUDA graph, the launch keeps
/// the same edge where the node before it is a kernel ([`OverlapInCapture`]). cudarc's launch
/// builder has no launch attributes, hence the driver call.
///
/// # Safety
/// `args` must be the kernel's arguments, each the address of a value of the parameter's type,
/// all alive until the call returns; the kernel must not touch memory that earlier kernels write
/// before its `griddepcontrol.wait`.
pub(super) unsafe fn launch_overlapping(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    cluster_x: Option<u32>,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| err("binding the CUDA context", e))?;
    // Plain C structs and unions, all-zero valid; the fields set are the ones the ids select.
    let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
    attrs[0].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[0].value.programmaticStreamSerializationAllowed = 1;
    if let Some(x) = cluster_x {
        attrs[1].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[1].value.clusterDim.x = x;
        attrs[1].value.clusterDim.y = 1;
        attrs[1].value.clusterDim.z = 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: if cluster_x.is_some() { 2 } else { 1 },
    };
    sys::cuLaunchKernelEx(&config, func.cu_function(), args.as_mut_ptr(), std::ptr::null_mut())
        .result()
        .map_err(|e| err("overlapping launch", e))
}

pub(super) fn argmax_rows(x: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let dev = x.0.device.clone();
    let rows = x.1.shape().dims2()?.0;
    // SAFETY: the kernels write one index per row.
    let mut out = unsafe { dev.alloc::<u32>(rows.max(1))? };
    if rows > 0 {
        let stream = dev.cuda_stream();
        let (oa, _guard) = out.device_ptr_mut(&stream);
        by_dtype!("argmax", x.0.dtype(), argmax_rows_t(x, oa, 0, None))?;
    }
    Ok(u32::wrap_cuda_slice(out, dev))
}

/// [`argmax_rows`] into `out` (rows,) u32 on the logits' GPU; with `bump` (rows,) u32, also
/// `bump += 1` (shapes and dtypes checked by the caller).
pub(super) fn argmax_rows_into(
    x: (&CudaStorage, &Layout),
    out: &Tensor,
    bump: Option<&Tensor>,
    host: Option<&MappedTokens>,
) -> Result<()> {
    const OP: &str = "argmax";
    let dev = x.0.device.clone();
    let out_g = out.storage_and_layout();
    let oa = held_addr::<u32>((&out_g.0, out_g.1), &dev, DType::U32, OP, "the output")?;
    let bump_g = bump.map(|b| b.storage_and_layout());
    let ba = match &bump_g {
        Some((s, l)) => held_addr::<u32>((s, l), &dev, DType::U32, OP, "the counts")?,
        None => 0,
    };
    let rows = x.1.shape().dims2()?.0;
    let host = match host {
        None => None,
        Some(h) if h.rows == rows && h.device == dev.id() && ba != 0 => Some((h.device_ptr, rows)),
        Some(h) => bail!(
            "flash-llama {OP}: host-mapped tokens for {} rows need the counts and {rows} rows on their GPU",
            h.rows
        ),
    };
    if rows > 0 {
        by_dtype!("argmax", x.0.dtype(), argmax_rows_t(x, oa, ba, host))?;
    }
    drop((out_g, bump_g));
    Ok(())
}

/// The two argmax launches (kernels/model/fused.cu): each row's chunks, then one warp per row
/// choosing among them into `oa`, adding 1 to `ba`'s entry unless `ba` is 0, and with `host`
/// ([`MappedTokens`]'s device address and rows) writing each token there too.
fn argmax_rows_t<T: CudaDType + DeviceRepr>(
    x: (&CudaStorage, &Layout),
    oa: u64,
    ba: u64,
    host: Option<(u64, usize)>,
) -> Result<()> {
    const OP: &str = "argmax";
    let dev = x.0.device.clone();
    let (rows, cols) = x.1.shape().dims2()?;
    let xa = addr::<T>(x.0, x.1, OP, "the logits")?;
    let chunks = cols.div_ceil(ARGMAX_CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    // Each chunk's best value (f32) and index (u32).
    // SAFETY: the first kernel writes all rows × chunks of both halves before the second reads.
    let mut parts = unsafe { dev.alloc::<u32>(2 * rows * chunks)? };
    let stream = dev.cuda_stream();
    let (pa, _guard) = parts.device_ptr_mut(&stream);
    let at_a = pa + (rows * chunks * 4) as u64;
    let (cols_i, chunks_i) = (cols as i32, chunks as i32);
    let chunk_fn = function(&dev, format!("argmax_chunks_{}", suffix(x.0.dtype(), OP)?))?;
    let finish_fn = function(&dev, "argmax_finish".to_string())?;
    // The chunks' grid has a row per block index y (at most 65,535 a launch).
    for r0 in (0..rows).step_by(65_535) {
        let n = (rows - r0).min(65_535);
        let (xr, pr, ar) = (
            xa + (r0 * cols * std::mem::size_of::<T>()) as u64,
            pa + (r0 * chunks * 4) as u64,
            at_a + (r0 * chunks * 4) as u64,
        );
        let (or, br) = (oa + (r0 * 4) as u64, if ba == 0 { 0 } else { ba + (r0 * 4) as u64 });
        let mut b = stream.launch_builder(&chunk_fn);
        b.arg(&xr).arg(&pr).arg(&ar).arg(&cols_i);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, n as u32, 1),
            block_dim: (ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a contiguous input of n x cols elements from row r0; parts of 2 x n x chunks.
        unsafe { b.launch(cfg) }.map_err(|e| err("argmax_chunks launch", e))?;
        let (ha, host_rows) = match host {
            // (token, count) pairs: 8 bytes a row.
            Some((a, rows)) => (a + (r0 * 8) as u64, rows as i32),
            None => (0u64, 0i32),
        };
        let mut b = stream.launch_builder(&finish_fn);
        b.arg(&pr)
            .arg(&ar)
            .arg(&chunks_i)
            .arg(&or)
            .arg(&br)
            .arg(&ha)
            .arg(&host_rows);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the parts written above; an output (and counts, if any) of n from row r0; the
        // mapped host buffer, if any, holds two slots of `host_rows` pairs (checked by the caller).
        unsafe { b.launch(cfg) }.map_err(|e| err("argmax_finish launch", e))?;
    }
    Ok(())
}

pub(super) fn rope_store(
    y: (&mut CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    interleaved: bool,
    store: Option<&StoreTarget>,
) -> Result<()> {
    by_dtype!(
        "RoPE + KV store",
        y.0.dtype(),
        rope_store_t(y, cos, sin, interleaved, store)
    )
}

fn rope_store_t<T: CudaDType + DeviceRepr>(
    y: (&mut CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    interleaved: bool,
    store: Option<&StoreTarget>,
) -> Result<()> {
    const OP: &str = "RoPE + KV store";
    let dtype = y.0.dtype();
    same_dtype(OP, dtype, &[("cos", cos.0.dtype()), ("sin", sin.0.dtype())])?;
    let (tokens, heads, d) = y.1.shape().dims3()?;
    let n = tokens * heads * d / 2;
    if n == 0 {
        return Ok(());
    }
    let dev = y.0.device.clone();
    let stream = dev.cuda_stream();
    let (ca, sa) = (addr::<T>(cos.0, cos.1, OP, "cos")?, addr::<T>(sin.0, sin.1, OP, "sin")?);
    let Some((start, _)) = y.1.contiguous_offsets() else {
        bail!("flash-llama {OP}: y must be contiguous, got strides {:?}", y.1.stride())
    };
    // The cache, its rows (and an e4m3 cache's factors): read locks on their storage; the kernel
    // writes the cache through them. KvCache is not Clone and `Llama::step` holds it mutably, so
    // nothing else touches the cache while the launch is queued, and every launch is on candle's
    // one stream.
    let (kv, rows, quant) = match store {
        None => (None, None, None),
        Some(StoreTarget::Rows { kv, rows }) => (Some(kv), Some(rows), None),
        Some(StoreTarget::E4m3 { kv, rows, quant }) => (Some(kv), Some(rows), Some(quant)),
    };
    let kv_g = kv.map(|t| t.storage_and_layout());
    let rows_g = rows.map(|t| t.storage_and_layout());
    let quant_g = quant.map(|t| t.storage_and_layout());
    let rows_a = match &rows_g {
        None => 0u64,
        Some((s, l)) => addr::<u32>(held_on(s, &dev, OP, "the cache rows")?, l, OP, "rows")?,
    };
    let name = match quant_g {
        None => "rope_store",
        Some(_) => "rope_store_e4m3",
    };
    let func = function(&dev, format!("{name}_{}", suffix(dtype, OP)?))?;
    let slice = T::as_cuda_slice_mut(y.0)?;
    let (ya, _guard) = slice.device_ptr_mut(&stream);
    let ya = ya + (start * std::mem::size_of::<T>()) as u64;
    let (tokens_i, heads_i, d_i, interleaved) = (tokens as i32, heads as i32, d as i32, interleaved as i32);
    let mut args = vec![
        arg(&ya),
        arg(&ca),
        arg(&sa),
        arg(&tokens_i),
        arg(&heads_i),
        arg(&d_i),
        arg(&interleaved),
        arg(&rows_a),
    ];
    // The store's own arguments (see kernels/model/fused.cu: StoreRows, StoreE4m3).
    let (cache_a, row_stride, first, plane, kv_heads, quant_a);
    match (&kv_g, &quant_g) {
        (None, _) => {
            (cache_a, row_stride, first) = (0u64, 0i64, heads as i32);
            args.extend([arg(&cache_a), arg(&row_stride), arg(&first)]);
        }
        (Some((kv_s, kv_l)), None) => {
            cache_a = held_addr::<T>((kv_s, kv_l), &dev, dtype, OP, "the cache")?;
            let cached = kv_l.dims()[1];
            (row_stride, first) = ((cached * d) as i64, (heads - cached) as i32);
            args.extend([arg(&cache_a), arg(&row_stride), arg(&first)]);
        }
        (Some((kv_s, kv_l)), Some((q_s, q_l))) => {
            let kv_s = held_on(kv_s, &dev, OP, "the cache")?;
            let q_s = held_on(q_s, &dev, OP, "the quant factors")?;
            // (2, rows, kv_heads, d), checked by the caller.
            let dims = kv_l.dims();
            cache_a = addr_e4m3(kv_s, kv_l, OP, "the cache")?;
            plane = (dims[1] * dims[2] * dims[3]) as i64;
            kv_heads = dims[2] as i32;
            quant_a = addr::<f32>(q_s, q_l, OP, "the quant factors")?;
            args.extend([arg(&cache_a), arg(&plane), arg(&kv_heads), arg(&quant_a)]);
        }
    }
    // An overlapping launch: its blocks start while the projection before drains, and wait for it
    // before they touch anything (kernels/model/fused.cu). Captured, the edge from that
    // projection is made programmatic by hand (`OverlapInCapture`; nothing is allocated here).
    if let Some(capture) = OverlapInCapture::detach(&stream)? {
        capture.attach(&stream)?;
    }
    // SAFETY: the arguments of the kernel's signature, in order; y, cos, sin checked contiguous
    // with their shapes by the caller; the cache rows are the model's own (each below the cache's
    // row count), the cache contiguous. The kernel touches memory only after its wait.
    unsafe { launch_overlapping(&stream, &func, grid(n), None, &mut args) }?;
    drop((kv_g, rows_g, quant_g));
    Ok(())
}

pub(super) fn store_e4m3(
    kv: (&mut CudaStorage, &Layout),
    x: (&CudaStorage, &Layout),
    rows: &Tensor,
    quant: &Tensor,
) -> Result<()> {
    by_dtype!("e4m3 KV store", x.0.dtype(), store_e4m3_t(kv, x, rows, quant))
}

fn store_e4m3_t<T: CudaDType + DeviceRepr>(
    kv: (&mut CudaStorage, &Layout),
    x: (&CudaStorage, &Layout),
    rows: &Tensor,
    quant: &Tensor,
) -> Result<()> {
    const OP: &str = "e4m3 KV store";
    let (tokens, heads, d) = x.1.shape().dims3()?;
    let n = tokens * heads * d / 2;
    if n == 0 {
        return Ok(());
    }
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let xa = addr::<T>(x.0, x.1, OP, "the new keys")?;
    // Shapes checked by the caller: kv (2, rows, kv_heads, d).
    let dims = kv.1.dims().to_vec();
    let cache_a = addr_e4m3(kv.0, kv.1, OP, "the cache")?;
    let (rows_g, quant_g) = (rows.storage_and_layout(), quant.storage_and_layout());
    let rows_a = addr::<u32>(held_on(&rows_g.0, &dev, OP, "the cache rows")?, rows_g.1, OP, "rows")?;
    let quant_a = addr::<f32>(
        held_on(&quant_g.0, &dev, OP, "the quant factors")?,
        quant_g.1,
        OP,
        "the quant factors",
    )?;
    let plane = (dims[1] * dims[2] * dims[3]) as i64;
    let (tokens_i, d_i, kv_heads) = (tokens as i32, d as i32, dims[2] as i32);
    let func = function(&dev, format!("store_e4m3_{}", suffix(x.0.dtype(), OP)?))?;
    let mut b = stream.launch_builder(&func);
    b.arg(&xa)
        .arg(&tokens_i)
        .arg(&d_i)
        .arg(&rows_a)
        .arg(&cache_a)
        .arg(&plane)
        .arg(&kv_heads)
        .arg(&quant_a);
    // SAFETY: x contiguous (tokens, 2 kv_heads, d), the cache (2, rows, kv_heads, d) contiguous,
    // each of `rows` below its row count (the model's own), quant (2 kv_heads,) f32.
    unsafe { b.launch(grid(n)) }.map_err(|e| err("store_e4m3 launch", e))?;
    drop((rows_g, quant_g));
    Ok(())
}

/// Copies of a few u32 (a step's chosen tokens) from the device to the host that do not wait for
/// the work queued after them: the copy goes into page-locked memory, queued on candle's stream
/// and followed by an event, and [`TokenReadback::wait`] waits for that event only. (candle's
/// `to_device` waits for the whole stream, so a step queued behind the copy would be waited for
/// too.) The event is ours: cudarc records the page-locked buffer's own event only when it
/// tracks several streams, which candle's one stream is not.
pub(crate) struct TokenReadback {
    host: PinnedHostSlice<u32>,
    copied: CudaEvent,
    len: usize,
}

impl TokenReadback {
    /// Room for up to `capacity` tokens.
    pub(crate) fn new(dev: &CudaDevice, capacity: usize) -> Result<Self> {
        let ctx = dev.cuda_stream().context().clone();
        // SAFETY: nothing reads the buffer before a copy has filled it (`wait` reads `len` elements
        // of the last copy only).
        let host = unsafe { ctx.alloc_pinned_with_flags::<u32>(capacity.max(1), 0) }
            .map_err(|e| err("page-locked buffer for the chosen tokens", e))?;
        let copied = ctx
            .new_event(None)
            .map_err(|e| err("an event for the chosen tokens", e))?;
        Ok(Self { host, copied, len: 0 })
    }

    /// Queues the copy of `tokens` (a contiguous u32 tensor on this buffer's GPU).
    pub(crate) fn start(&mut self, tokens: &Tensor) -> Result<()> {
        let (storage, layout) = tokens.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            bail!("flash-llama: reading back tokens of a tensor that is not on the GPU")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("flash-llama: reading back tokens of a strided tensor")
        };
        if end - start > self.host.len() {
            bail!(
                "flash-llama: {} tokens to read back into room for {}",
                end - start,
                self.host.len()
            )
        }
        let stream = cs.device.cuda_stream();
        let view = cs.as_cuda_slice::<u32>()?.slice(start..end);
        // Into a sub-slice of exactly the view's length: a copy into the whole buffer would
        // copy the buffer's length. As a plain slice, cudarc queues the copy without syncing
        // (the memory is page-locked, so the driver copies asynchronously).
        let host = self
            .host
            .as_mut_slice()
            .map_err(|e| err("the buffer for the chosen tokens", e))?;
        stream
            .memcpy_dtoh(&view, &mut host[..end - start])
            .map_err(|e| err("copying the chosen tokens to the host", e))?;
        self.copied
            .record(&stream)
            .map_err(|e| err("marking the copy of the chosen tokens", e))?;
        self.len = end - start;
        Ok(())
    }

    /// Waits for the copy queued by the last [`TokenReadback::start`] and returns its tokens.
    pub(crate) fn wait(&self) -> Result<Vec<u32>> {
        self.copied
            .synchronize()
            .map_err(|e| err("waiting for the chosen tokens", e))?;
        let host = self.host.as_slice().map_err(|e| err("reading the chosen tokens", e))?;
        Ok(host[..self.len].to_vec())
    }
}

/// A greedy decode graph's chosen tokens, written by the argmax itself into page-locked host
/// memory that the device addresses directly (`CU_MEMHOSTALLOC_DEVICEMAP`), so that two replays
/// of the graph follow each other with no copy between them (kernels/model/fused.cu,
/// `choose_among_chunks`). Two slots of `rows` (token, count) pairs; a step writes the slot of
/// its new counts' parity, and [`MappedTokens::wait`] spins until the counts it expects show.
pub struct MappedTokens {
    host: *mut u32,
    device_ptr: u64,
    rows: usize,
    device: DeviceId,
    stream: std::sync::Arc<CudaStream>,
}

// SAFETY: the buffer is plain page-locked memory owned by this value; the device writes it only
// through kernels queued on `stream`, and the host reads it with volatile loads.
unsafe impl Send for MappedTokens {}
unsafe impl Sync for MappedTokens {}

/// How long [`MappedTokens::wait`] waits for a step before it reports an error instead of
/// hanging (a decode step takes well under a second).
const MAPPED_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl MappedTokens {
    /// Room for the tokens of `rows` sequences, on `dev`.
    pub fn new(dev: &CudaDevice, rows: usize) -> Result<Self> {
        use candle_core::cuda_backend::cudarc::driver::result;
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| err("host-mapped tokens: binding the context", e))?;
        let len = 2 * 2 * rows.max(1);
        // SAFETY: a fresh allocation of `len` u32, zeroed below before the device sees it.
        let host = unsafe { result::malloc_host(len * 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| err("host-mapped tokens: page-locked allocation", e))? as *mut u32;
        // Count 0 is never a step's (a step leaves each count at 1 or more).
        // SAFETY: `host` holds `len` u32.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let mut device_ptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP in the current context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host as *mut _, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: allocated above, not handed out.
            unsafe { result::free_host(host as *mut _) }.ok();
            return Err(err("host-mapped tokens: the device address", e));
        }
        Ok(Self {
            host,
            device_ptr,
            rows,
            device: dev.id(),
            stream,
        })
    }

    /// Each row's token of the step that left row `r` holding `counts[r]` keys, once the device
    /// has written it. An error (not a hang) if the stream fails or goes idle without it, or
    /// after two minutes.
    pub fn wait(&self, counts: &[u32]) -> Result<Vec<u32>> {
        if counts.len() != self.rows {
            bail!(
                "flash-llama: waiting for {} host-mapped tokens of {} rows",
                counts.len(),
                self.rows
            )
        }
        let entry = |row: usize, count: u32| -> *const u32 {
            // SAFETY (of the callers' reads): within the 2 x rows pairs allocated in `new`.
            unsafe { self.host.add(2 * ((count as usize & 1) * self.rows + row)) }
        };
        // SAFETY: aligned u32 reads inside the buffer, volatile because the device writes them.
        let arrived =
            || (0..self.rows).all(|r| unsafe { std::ptr::read_volatile(entry(r, counts[r]).add(1)) } == counts[r]);
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        while !arrived() {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                // The stream idle (or failed) with a count missing: it will never show.
                // SAFETY: a query of candle's live stream.
                let state = unsafe { sys::cuStreamQuery(self.stream.cu_stream()) };
                match state {
                    sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    sys::CUresult::CUDA_SUCCESS if arrived() => break,
                    sys::CUresult::CUDA_SUCCESS => {
                        bail!("flash-llama: the decode step ended without writing its tokens (counts {counts:?})")
                    }
                    e => return Err(err("waiting for the step's tokens", e)),
                }
                if start.elapsed() > MAPPED_WAIT {
                    bail!("flash-llama: no tokens from the decode step after {MAPPED_WAIT:?}")
                }
            }
            std::hint::spin_loop();
        }
        // The tokens were written before the counts (a system fence between them on the device).
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: as above.
        Ok((0..self.rows)
            .map(|r| unsafe { std::ptr::read_volatile(entry(r, counts[r])) })
            .collect())
    }
}

impl Drop for MappedTokens {
    fn drop(&mut self) {
        use candle_core::cuda_backend::cudarc::driver::result;
        // Nothing queued may still write the buffer once it is freed.
        let _ = self.stream.synchronize();
        // SAFETY: allocated in `new` with malloc_host, freed once.
        let _ = unsafe { result::free_host(self.host as *mut _) };
    }
}
