//! What the inference examples (generate, serve) share: the device, the compute dtype and the
//! KV cache's dtype.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// The GPU unless `cpu` (or no GPU / no `cuda` feature), with cudarc's per-allocation events off
/// and freed memory kept in the GPU's memory pool.
pub fn device(cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    // Device::cuda_if_available is the CPU unless built with the cuda feature and a GPU exists.
    let dev = without_event_tracking(Device::cuda_if_available(0)?)?;
    retain_freed_memory(&dev)?;
    Ok(dev)
}

/// Keeps freed GPU memory in the device's pool across synchronisations (each step's sampled
/// token copied to the host is one), so that the next step's allocations need not map it again
/// (flash_attn3::retain_freed_device_memory). FLASH_LLAMA_POOL_RELEASE=1 keeps CUDA's default
/// (for comparison).
pub fn retain_freed_memory(dev: &Device) -> Result<()> {
    if std::env::var("FLASH_LLAMA_POOL_RELEASE").as_deref() != Ok("1") {
        flash_attn3::retain_freed_device_memory(dev)?;
    }
    Ok(())
}

/// `dev` with cudarc's per-allocation events off (see below).
fn without_event_tracking(dev: Device) -> Result<Device> {
    // cudarc gives every allocation a read and a write event (created with it, destroyed with
    // it) to order its uses across streams: four driver calls per candle op that this program
    // never needs, since all of its work (candle's kernels and copies, cuBLAS, flash-attn3 and
    // flash-llama's kernels) is queued on the device's one stream. FLASH_LLAMA_EVENT_TRACKING=1
    // keeps them (for comparison).
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        if std::env::var("FLASH_LLAMA_EVENT_TRACKING").as_deref() != Ok("1") {
            // SAFETY: one stream only (above), so no use needs ordering against another stream.
            unsafe { d.disable_event_tracking() };
        }
    }
    Ok(dev)
}

/// `--dtype`: f32, bf16 or f16; by default bf16 on the GPU (flash-attn3's kernels take bf16/f16
/// only), f32 on the CPU.
pub fn inference_dtype(arg: Option<&str>, device: &Device) -> Result<DType> {
    Ok(match arg {
        None if device.is_cuda() => DType::BF16,
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        Some(other) => bail!("unsupported --dtype {other}: use f32, bf16 or f16"),
    })
}

/// `--kv-cache-dtype`: `model` (the compute dtype `model`) or `fp8` (e4m3 with a scale per layer
/// and kv head, half the bytes of bf16; flash-llama's `KvCache`).
pub fn kv_cache_dtype(arg: &str, model: DType) -> Result<DType> {
    Ok(match arg {
        "model" => model,
        "fp8" => DType::F8E4M3,
        other => bail!("unsupported --kv-cache-dtype {other}: use model or fp8"),
    })
}

/// `--tp N` (tensor parallelism over GPUs 0..N, one process each): in the launcher, starts the
/// rank processes, waits for them and returns `None`; in a rank process, its GPU and its handle
/// of the NCCL group.
#[cfg(feature = "nccl")]
#[allow(dead_code)] // generate's, not serve's
pub fn tensor_parallel_rank(world: usize) -> Result<Option<(Device, flash_llama::parallel::Group)>> {
    use flash_llama::parallel::launch;
    if launch::rank_from_env()?.is_none() {
        launch::launch_gpu_ranks(world)?;
        return Ok(None);
    }
    let (_, device, comm) = launch::join_gpu_group(world)?;
    let device = without_event_tracking(device)?;
    retain_freed_memory(&device)?;
    Ok(Some((device, std::sync::Arc::new(comm))))
}

#[cfg(not(feature = "nccl"))]
#[allow(dead_code)] // generate's, not serve's
pub fn tensor_parallel_rank(world: usize) -> Result<Option<(Device, flash_llama::parallel::Group)>> {
    bail!("--tp {world} needs NCCL: build with `--features nccl`")
}
