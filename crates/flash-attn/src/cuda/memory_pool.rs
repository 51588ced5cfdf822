//! The device's default memory pool, which candle's allocations come from (cudarc allocates with
//! `cuMemAllocAsync` where the device has pools): its release threshold.
//!
//! CUDA's default threshold is 0: at every stream, event or context synchronisation the pool hands
//! all the memory freed since back to the driver, and the next allocations map it again. A call
//! right after a synchronisation then pays that mapping before its first kernel starts: on an
//! H200, 60-170 µs per fp8 or bf16 attention call of the benchmark grid (its output, the fp8 V^T
//! and split-KV buffers), up to two thirds of a 512-token call's time (docs/benchmarks.md,
//! session 56).
//! PyTorch's caching allocator never hands memory back on its own; `retain_freed_memory` makes the
//! pool behave the same.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(candle_core::Error::Msg(format!("flash-attn3: {what}: {e:?}"))),
    }
}

/// The default memory pool of `dev`'s GPU.
fn default_pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    super::bind_context(dev)?;
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut pool = std::ptr::null_mut();
    // SAFETY: a plain driver query with a valid device handle and an out-pointer to a local.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device)
    })?;
    Ok(pool)
}

/// Sets the pool's release threshold to the maximum: freed memory stays in the pool for later
/// allocations of this process until it exits (or `cuMemPoolTrimTo`).
pub(crate) fn retain_freed_memory(dev: &CudaDevice) -> Result<()> {
    let pool = default_pool(dev)?;
    let mut keep = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the attribute's value is a u64 that outlives the call.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, &mut keep as *mut u64 as *mut std::ffi::c_void)
    })
}

/// The pool's release threshold in bytes.
pub(crate) fn release_threshold(dev: &CudaDevice) -> Result<u64> {
    let pool = default_pool(dev)?;
    let mut value = 0u64;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: the attribute's value is a u64 that outlives the call.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, &mut value as *mut u64 as *mut std::ffi::c_void)
    })?;
    Ok(value)
}
