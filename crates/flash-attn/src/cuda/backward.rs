//! The GPU backward: kernels/flash_bwd/ (preprocess, the FA3-style main kernel, postprocess),
//! compiled by build.rs into a second cubin that is embedded here and loaded once per device.
//!
//! Three launches on candle's stream, no host synchronisation:
//! 1. preprocess: D = rowsum(dO ∘ O) and LSE · log2(e) into padded per-head f32 vectors (the f32 dQ
//!    accumulator is zeroed on the stream before);
//! 2. main: one CTA per (key block, kv head, sequence) computes dK and dV of its keys over every
//!    query head of the GQA group and adds dS·K into the dQ accumulator;
//! 3. postprocess: dQ = scale · accumulator, in the output dtype.
//!
//! The gradients go into one flat buffer (dq, dk, dv, each contiguous), the op's output.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::{bf16, f16};

use super::{
    attention_smem, bind_context, check_tma_head_dims, device_addr, geometry, launch_with_params, load_kernel,
    offsets_addr, optional_ptr_mut, tensor_map, TmaDesc,
};
use crate::params::{AttnParams, Dims, Varlen};

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flash_bwd.cubin"));

/// Threads of the main kernel: one producer and two consumer warpgroups.
const THREADS: u32 = 384;
/// Query rows per preprocess CTA, also the granularity of the padded per-row vectors
/// (`kRowPad` in kernels/flash_bwd/params.cuh).
const ROW_PAD: usize = 128;

/// Mirror of `fa3::BwdParams` (kernels/flash_bwd/params.cuh), field for field.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BwdParams {
    tma_q: TmaDesc,
    tma_k: TmaDesc,
    tma_v: TmaDesc,
    tma_do: TmaDesc,
    out: u64,
    dout: u64,
    lse: u64,
    lse_log2: u64,
    dpsum: u64,
    dq_accum: u64,
    dq_semaphore: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    cu_q: u64,
    cu_k: u64,
    lse_head_stride: i64,
    lse_batch_stride: i64,
    padded_rows: i64,
    seqlen_q: i32,
    seqlen_k: i32,
    batch: i32,
    heads: i32,
    kv_heads: i32,
    group: i32,
    head_dim: i32,
    head_dim_v: i32,
    head_dim_padded: i32,
    block_m: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    softcap_pre: f32,
    scale: f32,
    num_m_blocks: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for BwdParams {}

/// What the forward left for the backward: its output, the incoming gradient and the LSE.
pub(crate) struct SavedForBackward<'a> {
    pub out: &'a Tensor,
    pub grad_out: &'a Tensor,
    pub lse: &'a Tensor,
    pub deterministic: bool,
}

/// One compiled instantiation of the main kernel (`fa3::BwdTraits`).
struct Variant {
    head_dim: usize,
    /// Query rows per block streamed past the CTA.
    block_m: usize,
    /// Keys per CTA: two consumer warpgroups of 64 keys, or (head dim 256) 64 keys whose head
    /// dim the two split.
    block_n: usize,
}

impl Variant {
    fn pick(head_dim: usize, head_dim_v: usize) -> Result<Self> {
        check_tma_head_dims("backward", head_dim, head_dim_v)?;
        Ok(match head_dim.max(head_dim_v) {
            0..=64 => Self {
                head_dim: 64,
                block_m: 128,
                block_n: 128,
            },
            65..=128 => Self {
                head_dim: 128,
                block_m: 64,
                block_n: 128,
            },
            _ => Self {
                head_dim: 256,
                block_m: 64,
                block_n: 64,
            },
        })
    }

    fn kernel_name(&self, dtype: DType) -> &'static str {
        match (self.head_dim, dtype == DType::BF16) {
            (64, true) => "flash_bwd_d64_bf16",
            (64, false) => "flash_bwd_d64_f16",
            (128, true) => "flash_bwd_d128_bf16",
            (128, false) => "flash_bwd_d128_f16",
            (_, true) => "flash_bwd_d256_bf16",
            (_, false) => "flash_bwd_d256_f16",
        }
    }
}

/// The kernel `name` of the backward cubin on `dev`.
fn kernel(dev: &CudaDevice, name: &'static str, smem: usize) -> Result<CudaFunction> {
    load_kernel(dev, CUBIN, " backward", name, smem)
}

/// Checks one of the backward's saved inputs: dtype, on the GPU, contiguous.
fn check_saved(t: &Tensor, name: &str, dtype: DType) -> Result<()> {
    if t.dtype() != dtype {
        bail!(
            "flash-attn3: backward: {name} has dtype {:?}, expected {dtype:?}",
            t.dtype()
        )
    }
    if !t.device().is_cuda() {
        bail!("flash-attn3: backward: {name} is not on the GPU")
    }
    if !t.is_contiguous() {
        bail!("flash-attn3: backward: {name} must be contiguous")
    }
    Ok(())
}

/// Runs the backward on the GPU; returns dq, dk and dv flattened into one buffer of q's dtype.
pub(crate) fn backward(
    dims: &Dims,
    params: AttnParams,
    varlen: Option<&Varlen>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    saved: &SavedForBackward,
) -> Result<CudaStorage> {
    match q.0.dtype() {
        DType::BF16 => backward_t::<bf16>(dims, params, varlen, q, k, v, saved),
        DType::F16 => backward_t::<f16>(dims, params, varlen, q, k, v, saved),
        dt => bail!("flash-attn3: the GPU backward supports bf16 and f16, got {dt:?}; convert with .to_dtype(DType::BF16) or run on the CPU"),
    }
}

fn backward_t<T: CudaDType + DeviceRepr>(
    dims: &Dims,
    params: AttnParams,
    varlen: Option<&Varlen>,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    saved: &SavedForBackward,
) -> Result<CudaStorage> {
    let dtype = q.0.dtype();
    let dev = q.0.device.clone();
    if !(k.0.device.id() == dev.id() && v.0.device.id() == dev.id()) {
        bail!("flash-attn3: q, k and v must be on the same GPU")
    }
    bind_context(&dev)?;
    let variant = Variant::pick(dims.head_dim, dims.head_dim_v)?;
    let stream = dev.cuda_stream();

    check_saved(saved.out, "the forward output", dtype)?;
    check_saved(saved.grad_out, "the output gradient", dtype)?;
    check_saved(saved.lse, "the LSE", DType::F32)?;
    let (out_s, out_l) = saved.out.storage_and_layout();
    let (dout_s, dout_l) = saved.grad_out.storage_and_layout();
    let (lse_s, lse_l) = saved.lse.storage_and_layout();
    let (Storage::Cuda(out_c), Storage::Cuda(dout_c), Storage::Cuda(lse_c)) = (&*out_s, &*dout_s, &*lse_s) else {
        bail!("flash-attn3: backward tensors are not all on the GPU")
    };
    for (name, c) in [("out", out_c), ("grad_out", dout_c), ("lse", lse_c)] {
        if c.device.id() != dev.id() {
            bail!("flash-attn3: backward: {name} is on another GPU than q")
        }
    }

    let (qs, ks, vs) = (T::as_cuda_slice(q.0)?, T::as_cuda_slice(k.0)?, T::as_cuda_slice(v.0)?);
    let (outs, douts, lses) = (
        T::as_cuda_slice(out_c)?,
        T::as_cuda_slice(dout_c)?,
        lse_c.as_cuda_slice::<f32>()?,
    );
    let (q_sizes, q_strides) = geometry(q.1);
    let (k_sizes, k_strides) = geometry(k.1);
    let (v_sizes, v_strides) = geometry(v.1);
    let (do_sizes, do_strides) = geometry(dout_l);
    let bm = variant.block_m;
    let tma_q = tensor_map(
        "q",
        dtype,
        device_addr(qs, &stream, q.1),
        dims.head_dim,
        q_sizes,
        q_strides,
        bm,
    )?;
    let tma_k = tensor_map(
        "k",
        dtype,
        device_addr(ks, &stream, k.1),
        dims.head_dim,
        k_sizes,
        k_strides,
        variant.block_n,
    )?;
    let tma_v = tensor_map(
        "v",
        dtype,
        device_addr(vs, &stream, v.1),
        dims.head_dim_v,
        v_sizes,
        v_strides,
        variant.block_n,
    )?;
    let tma_do = tensor_map(
        "grad_out",
        dtype,
        device_addr(douts, &stream, dout_l),
        dims.head_dim_v,
        do_sizes,
        do_strides,
        bm,
    )?;

    let num_m_blocks = dims.seqlen_q.div_ceil(bm);
    let num_n_blocks = dims.seqlen_k.div_ceil(variant.block_n);
    let padded_rows = (dims.total_q / ROW_PAD + dims.batch + 1) * ROW_PAD;
    if dims.heads * padded_rows > i32::MAX as usize || dims.batch * dims.heads * num_m_blocks > i32::MAX as usize {
        bail!("flash-attn3: backward problem too large for one launch")
    }

    let (nq, nk) = (
        dims.total_q * dims.heads * dims.head_dim,
        dims.total_k * dims.kv_heads * dims.head_dim,
    );
    let nv = dims.total_k * dims.kv_heads * dims.head_dim_v;
    // SAFETY: the kernels write every element: dq (postprocess, every row of every sequence),
    // dk and dv (the main kernel, every key of every sequence, zeros for keys no query sees).
    let mut grads = unsafe { dev.alloc::<T>(nq + nk + nv)? };
    // SAFETY: the preprocess writes every slot the main kernel reads (pad rows included).
    let mut lse_log2 = unsafe { dev.alloc::<f32>(dims.heads * padded_rows)? };
    let mut dpsum = unsafe { dev.alloc::<f32>(dims.heads * padded_rows)? };
    // The dQ accumulator, zeroed on the stream: (heads, padded rows, padded head dim) in the blocked
    // order of `dq_accum_offset` (kernels/flash_bwd/params.cuh).
    let mut dq_accum = dev.alloc_zeros::<f32>(dims.heads * padded_rows * variant.head_dim)?;
    // Zeroed on candle's stream, in order before the launch; freed in stream order after it.
    let mut semaphore = match saved.deterministic {
        true => Some(dev.alloc_zeros::<i32>(dims.batch * dims.heads * num_m_blocks)?),
        false => None,
    };

    // Varlen offsets: the caller's u32 device tensors when contiguous, else a fresh upload.
    let mut uploads = Vec::new();
    let mut cu_addr = |t: Option<&Tensor>, host: &[usize]| -> Result<u64> {
        let guard = t.map(|t| t.storage_and_layout());
        offsets_addr(
            &dev,
            &stream,
            guard.as_ref().map(|(s, l)| (&**s, *l)),
            host,
            &mut uploads,
        )
    };
    let cu_q = cu_addr(varlen.map(|v| &v.seqlens_q), varlen.map_or(&[][..], |v| &v.cu_q))?;
    let cu_k = cu_addr(varlen.map(|v| &v.seqlens_k), varlen.map_or(&[][..], |v| &v.cu_k))?;

    let window = |w: Option<usize>| w.map_or(-1, |w| w.min(1 << 30) as i32);
    let scale = params.softmax_scale;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Logits in log2 units: s · scale · log2(e), or with a softcap cap · tanh(s · scale / cap) · log2(e).
    // A zero scale makes every logit 0 (the uniform softmax) with or without the softcap.
    let (scale_log2, softcap_pre) = match params.softcap {
        _ if scale == 0.0 => (0.0, 0.0),
        Some(cap) => (cap * LOG2E, scale / cap),
        None => (scale * LOG2E, 0.0),
    };
    let (lse_head_stride, lse_batch_stride) = match varlen {
        Some(_) => (dims.total_q as i64, 0),
        None => (dims.seqlen_q as i64, (dims.heads * dims.seqlen_q) as i64),
    };
    let bf16 = dtype == DType::BF16;
    let name = variant.kernel_name(dtype);
    let smem = attention_smem(name)?;
    let main = kernel(&dev, name, smem)?;
    let (pre_name, post_name) = match bf16 {
        true => ("flash_bwd_preprocess_bf16", "flash_bwd_postprocess_bf16"),
        false => ("flash_bwd_preprocess_f16", "flash_bwd_postprocess_f16"),
    };
    let pre = kernel(&dev, pre_name, 0)?;
    let post = kernel(&dev, post_name, 0)?;
    {
        let (grads_ptr, _grads_sync) = grads.device_ptr_mut(&stream);
        let (lse_log2_ptr, _l2_sync) = lse_log2.device_ptr_mut(&stream);
        let (dpsum_ptr, _dp_sync) = dpsum.device_ptr_mut(&stream);
        let (acc_ptr, _acc_sync) = dq_accum.device_ptr_mut(&stream);
        let (sem_ptr, _sem_sync) = optional_ptr_mut(&mut semaphore, &stream);
        let _guards = (
            qs.device_ptr(&stream),
            ks.device_ptr(&stream),
            vs.device_ptr(&stream),
            lses.device_ptr(&stream),
        );
        let elem = std::mem::size_of::<T>() as u64;
        let p = BwdParams {
            tma_q,
            tma_k,
            tma_v,
            tma_do,
            out: device_addr(outs, &stream, out_l),
            dout: device_addr(douts, &stream, dout_l),
            lse: device_addr(lses, &stream, lse_l),
            lse_log2: lse_log2_ptr,
            dpsum: dpsum_ptr,
            dq_accum: acc_ptr,
            dq_semaphore: sem_ptr,
            dq: grads_ptr,
            dk: grads_ptr + nq as u64 * elem,
            dv: grads_ptr + (nq + nk) as u64 * elem,
            cu_q,
            cu_k,
            lse_head_stride,
            lse_batch_stride,
            padded_rows: padded_rows as i64,
            seqlen_q: dims.seqlen_q as i32,
            seqlen_k: dims.seqlen_k as i32,
            batch: dims.batch as i32,
            heads: dims.heads as i32,
            kv_heads: dims.kv_heads as i32,
            group: dims.group() as i32,
            head_dim: dims.head_dim as i32,
            head_dim_v: dims.head_dim_v as i32,
            head_dim_padded: variant.head_dim as i32,
            block_m: bm as i32,
            window_left: window(params.window_left),
            window_right: window(params.window_right),
            scale_log2,
            softcap_pre,
            scale,
            num_m_blocks: num_m_blocks as i32,
        };
        // The preprocess and postprocess: a 256-thread block per (128-row block, head, sequence).
        let rows_cfg = LaunchConfig {
            grid_dim: (
                dims.seqlen_q.div_ceil(ROW_PAD) as u32,
                dims.heads as u32,
                dims.batch as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let main_cfg = LaunchConfig {
            grid_dim: (num_n_blocks as u32, dims.kv_heads as u32, dims.batch as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the params describe live device buffers whose guards are held until after the
        // launches are queued on candle's stream.
        unsafe {
            launch_with_params(&stream, &pre, pre_name, rows_cfg, &p)?;
            launch_with_params(&stream, &main, name, main_cfg, &p)?;
            launch_with_params(&stream, &post, post_name, rows_cfg, &p)?;
        }
    }
    // Scratch buffers and uploads are freed in stream order after the kernels.
    drop((lse_log2, dpsum, dq_accum, semaphore, uploads));
    Ok(T::wrap_cuda_slice(grads, dev))
}

#[cfg(test)]
mod tests {
    use super::{attention_smem, Variant};
    use candle_core::DType;

    /// Every backward kernel the host can pick has its shared memory in the build's table
    /// (kernels/smem_table.cpp) within a CTA's 227 KiB.
    #[test]
    fn every_picked_kernel_has_its_shared_memory_from_the_build() {
        for d in [32, 64, 96, 128, 192, 256] {
            let v = Variant::pick(d, d).unwrap();
            for dtype in [DType::BF16, DType::F16] {
                let name = v.kernel_name(dtype);
                let smem = attention_smem(name).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(smem > 1024 && smem <= 227 * 1024, "{name}: {smem} bytes");
            }
        }
    }
}
