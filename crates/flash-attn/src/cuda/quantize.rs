//! The fp8 quantizer's launch (kernels/fp8/quantize.cu): the GPU side of [`crate::fp8`], giving the
//! same bits as its host math.

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Storage, Tensor};

use super::{input_ptr, launch_with_params, load_kernel};
use crate::fp8::{Granularity, Groups};

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8_quantize.cubin"));

/// `fa3::kQuantizeWarps` warps per CTA, each holding 32 / (head_dim / 8) rows at a time.
const WARPS: u32 = 8;
/// A row in one warp: 32 lanes of 8 values (`fa3::kQuantizeMaxDim`).
const MAX_HEAD_DIM: usize = 256;
/// Sequence positions per CTA when one scale spans the whole sequence (per head, per tensor):
/// enough CTAs to fill the GPU at short sequences, few atomics at long ones.
const CHUNK_ROWS: usize = 64;

/// Rotated per-block groups of at most this many bytes of f32 wait in shared memory between the
/// amax and the store (`staged`), so the rotation runs once: 7 CTAs of 256 threads still fit an
/// SM. Unrotated groups gain nothing from it (their second read comes from L2; measured 0.96-1.0x).
const MAX_STAGED_BYTES: usize = 32 * 1024;

/// `fa3::QuantizeMode`.
const OWN_GROUP: i32 = 0;
const AMAX_ONLY: i32 = 1;
const GIVEN: i32 = 2;

/// Mirror of `fa3::Fp8QuantizeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct QuantizeParams {
    x: u64,
    out: u64,
    amax: u64,
    descale: u64,
    signs: [u64; 4],
    seqlen: i32,
    heads: i32,
    head_dim: i32,
    chunk_rows: i32,
    group_rows: i32,
    blocks: i32,
    hadamard: i32,
    whole_tensor: i32,
    mode: i32,
    staged: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for QuantizeParams {}

/// Whether the kernel takes this head dim: 8 values per lane (16-byte loads of 16-bit input),
/// one row within one warp.
pub(crate) fn supports(head_dim: usize) -> bool {
    head_dim % 8 == 0 && head_dim <= MAX_HEAD_DIM
}

/// Quantizes `x` (on a GPU, `supports(head_dim)`) as `groups` says; `signs`: the rotation's sign
/// words, None for no rotation. Returns the e4m3 data (x's shape) and the f32 descales.
pub(crate) fn run(x: &Tensor, groups: &Groups, signs: Option<&[u64]>) -> Result<(Tensor, Tensor)> {
    let kernel_name = match x.dtype() {
        DType::F32 => "fp8_quantize_f32",
        DType::F16 => "fp8_quantize_f16",
        DType::BF16 => "fp8_quantize_bf16",
        dt => bail!("flash-attn3: fp8 quantize: unsupported dtype {dt:?}"),
    };
    // Contiguous and 16-byte aligned: a view that starts mid-storage is copied.
    let mut x = x.contiguous()?;
    if x.layout().start_offset() * x.dtype().size_in_bytes() % 16 != 0 {
        x = x.copy()?;
    }
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        bail!("flash-attn3: fp8 quantize: expected a GPU tensor")
    };
    let dev: &CudaDevice = &cs.device;
    let stream = dev.cuda_stream();
    let (x_addr, _x_sync) = input_ptr(cs, layout, &stream)?;

    let entries = groups.batch * groups.heads * groups.blocks;
    // SAFETY: the quantize launch writes every element of `out` and every descale entry.
    let mut out = unsafe { dev.alloc_uninit(x.shape(), DType::F8E4M3)? };
    let mut descale = unsafe { dev.alloc::<f32>(entries)? };
    let whole_tensor = groups.granularity == Granularity::Tensor;
    // A CTA holds exactly one group (one launch, no amax buffer) per block, and per head when the
    // whole sequence fits one chunk (a decode step's q: the two-launch path would run the same
    // one CTA per head twice, after a memset). Otherwise each CTA takes CHUNK_ROWS positions of a
    // group, whose amax a first launch gathers into a zeroed buffer.
    let own_group = match groups.granularity {
        Granularity::Block(_) => true,
        Granularity::Head => groups.seqlen <= CHUNK_ROWS,
        Granularity::Tensor => false,
    };
    let mut amax = match own_group {
        true => None,
        false => Some(dev.alloc_zeros::<u32>(if whole_tensor { 1 } else { entries })?),
    };
    {
        let CudaStorageSlice::F8E4M3(out_slice) = &mut out.slice else {
            bail!("flash-attn3: fp8 quantize: candle allocated no e4m3 slice")
        };
        let (out_addr, _out_sync) = out_slice.device_ptr_mut(&stream);
        let (descale_addr, _d_sync) = descale.device_ptr_mut(&stream);
        let (amax_addr, _a_sync) = match &mut amax {
            Some(a) => {
                let (addr, sync) = a.device_ptr_mut(&stream);
                (addr, Some(sync))
            }
            None => (0, None), // unused by the own-group mode
        };
        let mut sign_words = [0u64; 4];
        if let Some(s) = signs {
            sign_words[..s.len()].copy_from_slice(s);
        }
        let chunk_rows = if own_group { groups.rows } else { CHUNK_ROWS };
        let staged_bytes = chunk_rows * groups.head_dim * 4;
        let staged = own_group && signs.is_some() && staged_bytes <= MAX_STAGED_BYTES;
        let mut p = QuantizeParams {
            x: x_addr,
            out: out_addr,
            amax: amax_addr,
            descale: descale_addr,
            signs: sign_words,
            seqlen: groups.seqlen as i32,
            heads: groups.heads as i32,
            head_dim: groups.head_dim as i32,
            chunk_rows: chunk_rows as i32,
            group_rows: groups.rows as i32,
            blocks: groups.blocks as i32,
            hadamard: if signs.is_some() {
                1 << groups.head_dim.trailing_zeros()
            } else {
                0
            },
            whole_tensor: whole_tensor as i32,
            mode: OWN_GROUP,
            staged: staged as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                groups.seqlen.div_ceil(chunk_rows) as u32,
                groups.heads as u32,
                groups.batch as u32,
            ),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: if staged { staged_bytes as u32 } else { 0 },
        };
        let func = load_kernel(dev, CUBIN, " fp8 quantize", kernel_name, 0)?;
        let modes: &[i32] = if own_group { &[OWN_GROUP] } else { &[AMAX_ONLY, GIVEN] };
        for &mode in modes {
            p.mode = mode;
            // SAFETY: every buffer is alive (guards held) until the launches are queued; the grid
            // covers (chunks, heads, batch) of x's (batch, seqlen, heads, head_dim), which the
            // kernel reads with 16-byte loads from a 16-byte aligned start (checked above).
            unsafe { launch_with_params(&stream, &func, kernel_name, cfg, &p) }?;
        }
    }
    let data = Tensor::from_storage(Storage::Cuda(out), x.shape().clone(), BackpropOp::none(), false);
    let descale = Tensor::from_storage(
        Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(descale, dev.clone())),
        groups.descale_dims(),
        BackpropOp::none(),
        false,
    );
    Ok((data, descale))
}
