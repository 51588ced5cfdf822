//! The FP8 (e4m3) forward's host side: the V transpose pre-pass, the descale pointers, and the
//! kernel variants (kernels/flash_fwd/, `FwdTraits::kFp8`; docs/kernels/forward-fp8.md). The
//! launch itself is the 16-bit forward's (`forward_t` in forward.rs) with these pieces plugged in.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, CudaStorage, Layout, Result, Storage, Tensor};

use super::{device_addr, geometry, input_ptr, kernel, launch_with_params, vt_fill_counts};
use crate::descale::Fp8Call;
use crate::params::Dims;

/// Keys per column block of V^T in shared memory (one 128-byte swizzled row, one TMA box;
/// `FwdTraits::kVtColBlocks`).
pub(super) const VT_COL_KEYS: usize = 128;

/// Keys per pipeline stage of the fp8 kernel for a (padded) head dim, whether the call is uneven
/// (causal, windows, varlen) and its longest key sequence (`FwdTraits::kBlockN`): 128, or 256 at
/// d128 (the consumer without intra-warpgroup overlap, kernels/flash_fwd/mainloop.cuh
/// consumer_serial) from [`LONG_KEYS`] keys, [`LONG_KEYS_UNEVEN`] for uneven calls, without the
/// in-kernel V transpose (whose transposer moves 128-key blocks). H200, same call against the
/// 128-key kernel (docs/kernels/forward-fp8.md, version 10): unmasked 512 / 1k +7 / +8%; causal
/// 1k 0.97x, 2k +1.5%, 4k-16k +4..+8%.
/// `tuned`: [`crate::Tuning::fp8_d128_block_n`].
pub(super) fn block_n(
    head_dim: usize,
    transpose_v: bool,
    uneven: bool,
    seqlen_k: usize,
    tuned: Option<usize>,
) -> usize {
    let long = if uneven { LONG_KEYS_UNEVEN } else { LONG_KEYS };
    match (head_dim, transpose_v, tuned) {
        (128, false, Some(keys)) => keys,
        (128, false, None) if seqlen_k >= long => 256,
        _ => 128,
    }
}

/// Keys from which d128 runs on 256-key blocks ([`block_n`]); uneven calls from the second.
const LONG_KEYS: usize = 512;
const LONG_KEYS_UNEVEN: usize = 2048;

/// Mirror of `fa3::Fp8PrepassParams` (kernels/flash_fwd/params.cuh); also `FwdParams::vt_src`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct PrepassParams {
    v: u64,
    vt: u64,
    cu_k: u64,
    v_token_stride: i64,
    v_head_stride: i64,
    v_batch_stride: i64,
    seqlen_k: i32,
    keys_padded: i32,
    head_dim_v: i32,
    kv_heads: i32,
}

// SAFETY: a plain #[repr(C)] POD that matches the kernel's parameter struct byte for byte.
unsafe impl DeviceRepr for PrepassParams {}

/// Keys per CTA of the pre-pass (`fa3::prepass_keys`: 16 KiB of V or less) and its threads.
fn prepass_keys(head_dim_v: usize) -> usize {
    if head_dim_v > 128 {
        64
    } else {
        128
    }
}
const PREPASS_THREADS: u32 = 128;

/// V^T as the fp8 kernels read it: (sequences, kv heads, head_dim_v, keys_padded) e4m3, each
/// sequence from row 0 of its own slab (varlen calls too), keys permuted inside groups of 16.
pub(super) struct TransposedV {
    pub vt: CudaSlice<u8>,
    pub keys_padded: usize,
    /// Set when the forward kernel writes `vt` itself ([`VtWriter::ForwardKernel`]).
    pub fill: Option<VtFill>,
}

/// What the forward kernel needs to write V^T itself (kernels/flash_fwd/fp8_vt_fill.cuh):
/// `FwdParams::vt_src`, `vt_done` (the device address of `pairs` counts of units written, the count
/// of units claimed and the count of CTAs done: zero at launch, and zero again after it),
/// `vt_units_per_pair`.
pub(super) struct VtFill {
    pub src: PrepassParams,
    pub done: u64,
    /// The counts' own zeroed allocation, where the thread's buffer was too small during a CUDA
    /// graph capture (`vt_fill_counts`); kept alive until the launch is queued.
    pub _own_counts: Option<CudaSlice<i32>>,
    pub units_per_pair: usize,
    pub pairs: usize,
}

/// Keys per unit of the in-kernel V^T writer (`FwdTraits::kVtFillUnitKeys`).
pub(super) const VT_FILL_KEYS: usize = 128;

/// Head-dim rows of a V^T TMA box and of the writer's unit (`FwdTraits::kVtBoxRows`, at most 128:
/// d256's V^T blocks load as two boxes, and its writer takes two units per 128 keys).
pub(super) fn vt_box_rows(head_dim: usize) -> usize {
    head_dim.min(128)
}

/// Who writes V^T for an fp8 call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VtWriter {
    /// The pre-pass, a kernel of its own before the forward's (fp8_prepass.cuh).
    PrePass,
    /// Two producer warps of the forward kernel itself, under the attention (fp8_vt_fill.cuh).
    ForwardKernel,
}

impl VtWriter {
    /// The forward kernel (every fp8 kernel with the pre-pass's layout has the writer,
    /// `FwdTraits::kVtFill`), unless `tuned` ([`crate::Tuning::fp8_vt_in_kernel`]) says otherwise.
    pub fn pick(tuned: Option<bool>) -> Self {
        match tuned {
            Some(false) => Self::PrePass,
            Some(true) | None => Self::ForwardKernel,
        }
    }
}

/// V^T for an fp8 call on candle's stream: the pre-pass launched (kernels/flash_fwd/fp8_prepass.cuh),
/// or the buffers and parameters the forward kernel fills it with. `cu_k`: the varlen offsets'
/// device address, 0 for fixed-length calls; `kernel_head_dim`: the forward kernel's (padded) head
/// dim.
pub(super) fn transpose_v(
    dev: &CudaDevice,
    dims: &Dims,
    v: (&CudaStorage, &Layout),
    cu_k: u64,
    writer: VtWriter,
    kernel_head_dim: usize,
) -> Result<TransposedV> {
    let stream = dev.cuda_stream();
    let (_, [token_stride, head_stride, batch_stride]) = geometry(v.1);
    let (v_addr, _v_sync) = input_ptr(v.0, v.1, &stream)?;
    // 16-byte loads of V rows.
    let batched = dims.batch > 1 && cu_k == 0;
    let strides_ok =
        token_stride % 16 == 0 && (dims.kv_heads == 1 || head_stride % 16 == 0) && (!batched || batch_stride % 16 == 0);
    if v_addr % 16 != 0 || !strides_ok {
        bail!(
            "flash-attn3: fp8 v must start at a 16-byte aligned address with token/head/batch strides that are multiples of 16 elements, got element strides {:?}; call .contiguous() first",
            v.1.stride()
        )
    }
    let keys_padded = dims.seqlen_k.div_ceil(16) * 16;
    let len = dims.batch * dims.kv_heads * dims.head_dim_v * keys_padded;
    // SAFETY: the pre-pass or the forward kernel writes every byte (zeros past each sequence's
    // end) before the forward kernel reads it.
    let mut vt = unsafe { dev.alloc::<u8>(len)? };
    let fill = {
        let (vt_ptr, _vt_sync) = vt.device_ptr_mut(&stream);
        let p = PrepassParams {
            v: v_addr,
            vt: vt_ptr,
            cu_k,
            v_token_stride: token_stride as i64,
            v_head_stride: head_stride as i64,
            v_batch_stride: batch_stride as i64,
            seqlen_k: dims.seqlen_k as i32,
            keys_padded: keys_padded as i32,
            head_dim_v: dims.head_dim_v as i32,
            kv_heads: dims.kv_heads as i32,
        };
        if writer == VtWriter::ForwardKernel {
            let pairs = dims.batch * dims.kv_heads;
            // The pairs' counts, the claims and the CTAs done.
            let (done, _own_counts) = match vt_fill_counts(dev, pairs + 2)? {
                Some(addr) => (addr, None),
                None => {
                    let own = dev.alloc_zeros::<i32>(pairs + 2)?;
                    let addr = own.device_ptr(&stream).0;
                    (addr, Some(own))
                }
            };
            Some(VtFill {
                src: p,
                done,
                _own_counts,
                // Key units of each unit of head-dim rows (fp8_vt_fill.cuh vt_fill_unit).
                units_per_pair: keys_padded.div_ceil(VT_FILL_KEYS)
                    * dims.head_dim_v.div_ceil(vt_box_rows(kernel_head_dim)),
                pairs,
            })
        } else {
            let cfg = LaunchConfig {
                grid_dim: (
                    keys_padded.div_ceil(prepass_keys(dims.head_dim_v)) as u32,
                    dims.kv_heads as u32,
                    dims.batch as u32,
                ),
                block_dim: (PREPASS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let name = "flash_fwd_fp8_transpose_v";
            let func = kernel(dev, name, 0)?;
            // SAFETY: v and vt are alive (guards held) until the launch is queued; the grid covers
            // exactly vt's (sequence, kv head, key block) slabs.
            unsafe { launch_with_params(&stream, &func, name, cfg, &p) }?;
            None
        }
    };
    Ok(TransposedV { vt, keys_padded, fill })
}

/// The device addresses of an fp8 call's descales (0 where absent: the kernel reads 1.0) and their
/// strides; the storages stay borrowed (alive) while this lives.
pub(super) struct DescalePtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    /// Elements between two sequences' descales (0: one for all).
    pub q_batch_stride: i32,
    pub k_batch_stride: i32,
    pub v_batch_stride: i32,
    /// q's descales are one per kv head.
    pub q_per_kv_head: i32,
    _keep: [Option<Tensor>; 3],
}

impl DescalePtrs {
    pub fn new(dev: &CudaDevice, call: &Fp8Call) -> Result<Self> {
        let stream = dev.cuda_stream();
        let addr = |t: Option<&Tensor>| -> Result<u64> {
            let Some(t) = t else { return Ok(0) };
            let (storage, layout) = t.storage_and_layout();
            match &*storage {
                Storage::Cuda(cs) if cs.device.id() == dev.id() => {
                    Ok(device_addr(cs.as_cuda_slice::<f32>()?, &stream, layout))
                }
                _ => bail!("flash-attn3: the fp8 descales must be on the GPU of q"),
            }
        };
        let stride = |t: Option<&Tensor>| -> Result<i32> {
            i32::try_from(Fp8Call::batch_stride(t))
                .map_err(|_| candle_core::Error::Msg("flash-attn3: fp8 descales too large".into()))
        };
        let (q, k, v) = (
            call.q_descale.as_ref(),
            call.k_descale.as_ref(),
            call.v_descale.as_ref(),
        );
        Ok(Self {
            q: addr(q)?,
            k: addr(k)?,
            v: addr(v)?,
            q_batch_stride: stride(q)?,
            k_batch_stride: stride(k)?,
            v_batch_stride: stride(v)?,
            q_per_kv_head: call.q_per_kv_head as i32,
            _keep: [q.cloned(), k.cloned(), v.cloned()],
        })
    }
}
