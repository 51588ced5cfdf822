//! The CUDA path: launches of our Hopper (sm_90a) kernels (kernels/ at the workspace root).
//!
//! build.rs compiles kernels/ into cubins that are embedded and loaded once per device through
//! candle's cudarc. This module holds what every launch shares: loading a kernel, the TMA
//! descriptors encoded straight over the caller's storage (any batch/sequence/head strides, no
//! copies), device addresses, the CUDA context and the dynamic scheduler's counters. Each launch
//! has its own file: the forward and its split-KV combine (forward.rs), its fp8 pieces (fp8.rs),
//! the KV-cache calls (kvcache.rs) and their single-query decode kernel (decode.rs), the backward
//! (backward.rs), the fp8 quantizer (quantize.rs), and the device memory pool's release threshold
//! (memory_pool.rs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

mod backward;
mod decode;
mod forward;
mod fp8;
pub(crate) mod kvcache;
pub(crate) mod memory_pool;
pub(crate) mod quantize;
pub(crate) use backward::{backward, SavedForBackward};
pub(crate) use forward::{forward, FwdExtras};

static CUBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flash_fwd.cubin"));

/// Each forward and backward attention kernel's dynamic shared memory in bytes, from the layouts
/// the kernels are compiled with (kernels/smem_table.cpp, compiled and run by build.rs).
mod smem_table {
    include!(concat!(env!("OUT_DIR"), "/smem_table.rs"));
}

/// The dynamic shared memory to launch the attention kernel `name` (a forward or backward main
/// kernel) with: its `SharedStorage` and the slack to align it, as the build measured them.
fn attention_smem(name: &str) -> Result<usize> {
    match smem_table::kernel_smem_bytes(name) {
        Some(bytes) => Ok(bytes),
        None => bail!("flash-attn3: internal error: no shared-memory size for kernel {name} (kernels/smem_table.cpp)"),
    }
}

/// Query rows per consumer warpgroup (wgmma's M), and of each box of the epilogue's O store.
const WG_ROWS: usize = 64;

/// The opaque 128-byte CUtensorMap (`fa3::TmaDesc`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaDesc([u64; 16]);

/// The device address of the calling thread's dynamic-scheduler counters on this device (two
/// i32, zeroed once; every launch leaves them zero).
///
/// One pair per (device, thread), not per device: candle queues a thread's work on that thread's
/// own stream (CUDA's per-thread default stream), so launches from two threads on one device may
/// run at the same time, and two grids claiming tiles from one counter would skip and repeat
/// tiles. Launches of one thread run in stream order and share its pair. The pairs are never
/// freed (8 bytes per thread that ever attends): a CUDA graph captured with one keeps its address.
///
/// Made by the thread's first forward call on the device, whether or not it needs them: a buffer
/// allocated while the stream is captured into a CUDA graph would be the graph's memory, freed
/// with it under later calls. (A captured call may need them where its eager warm-up did not:
/// captured calls split short caches, eager ones do not.) So a thread's first call on a device
/// must not be a captured one: that is an error.
fn tile_counter(dev: &CudaDevice) -> Result<u64> {
    static COUNTERS: OnceLock<ThreadBuffers> = OnceLock::new();
    match thread_buffer(&COUNTERS, dev, 2, 2)? {
        Some(addr) => Ok(addr),
        None => bail!(
            "flash-attn3: this thread's first attention call on this device is being captured into a CUDA graph; run one call eagerly first on the same thread (it sets up the scheduler counters)"
        ),
    }
}

/// The device address of the calling thread's fp8 V^T writer counts on this device, at least
/// `len` i32 (kernels/flash_fwd/fp8_vt_fill.cuh: a count of units written per (sequence, kv head),
/// the count of units claimed, the count of CTAs done), zeroed when made; every launch leaves them
/// zero (the last CTA to finish clears them), so no memset per call. One buffer per (device,
/// thread), as [`tile_counter`]'s, grown (a fresh zeroed one) when a call has more pairs than any
/// before it on this thread; the old one is freed in stream order, after the launches that use it.
///
/// A call captured into a CUDA graph that needs a larger buffer than the thread's gets a zeroed
/// allocation of its own (`None` here: the caller allocates it in the capture, where the graph
/// owns it), so that the thread's buffer is never graph memory.
fn vt_fill_counts(dev: &CudaDevice, len: usize) -> Result<Option<u64>> {
    static COUNTS: OnceLock<ThreadBuffers> = OnceLock::new();
    thread_buffer(&COUNTS, dev, len, len.next_power_of_two().max(64))
}

/// Zeroed i32 buffers that kernels leave zeroed, one per (device, thread) ([`tile_counter`] says why).
type ThreadBuffers = Mutex<HashMap<(DeviceId, std::thread::ThreadId), CudaSlice<i32>>>;

/// The device address of the calling thread's buffer in `buffers` on `dev`, of at least `len` i32:
/// the one it has, or a fresh zeroed one of `alloc_len` that replaces it (the old one freed in
/// stream order). `None` where a fresh one is needed while the stream is captured into a CUDA
/// graph: allocated there, it would be the graph's memory.
fn thread_buffer(
    buffers: &OnceLock<ThreadBuffers>,
    dev: &CudaDevice,
    len: usize,
    alloc_len: usize,
) -> Result<Option<u64>> {
    let mut buffers = buffers.get_or_init(Default::default).lock().unwrap();
    let stream = dev.cuda_stream();
    let key = (dev.id(), std::thread::current().id());
    if let Some(b) = buffers.get(&key) {
        if b.len() >= len {
            return Ok(Some(b.device_ptr(&stream).0));
        }
    }
    if is_capturing(&stream) {
        return Ok(None);
    }
    let b = dev.alloc_zeros::<i32>(alloc_len)?;
    let addr = b.device_ptr(&stream).0;
    buffers.insert(key, b);
    Ok(Some(addr))
}

/// Makes `dev`'s context the calling thread's current one. cudarc's own calls do this; the TMA
/// descriptors are encoded by a raw driver call, which fails (CUDA_ERROR_INVALID_CONTEXT) on a
/// thread whose first GPU work is an attention call.
fn bind_context(dev: &CudaDevice) -> Result<()> {
    dev.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: binding the CUDA context to this thread: {e:?}")))
}

/// Whether `stream` is being captured into a CUDA graph.
fn is_capturing(stream: &CudaStream) -> bool {
    matches!(
        stream.capture_status(),
        Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    )
}

/// The device's multiprocessor count (the persistent grid size), cached per device.
fn sm_count(dev: &CudaDevice) -> Result<usize> {
    static COUNTS: OnceLock<Mutex<HashMap<DeviceId, usize>>> = OnceLock::new();
    let mut counts = COUNTS.get_or_init(Default::default).lock().unwrap();
    if let Some(&n) = counts.get(&dev.id()) {
        return Ok(n);
    }
    let n = dev
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: multiprocessor count: {e:?}")))?;
    let n = n.max(1) as usize;
    counts.insert(dev.id(), n);
    Ok(n)
}

/// How many CTAs of the kernel `name` (`threads` threads, `smem` bytes of dynamic shared memory)
/// run at once on one SM of `dev` (cuOccupancyMaxActiveBlocksPerMultiprocessor), at least 1;
/// cached per device and kernel.
fn ctas_per_sm(dev: &CudaDevice, func: &CudaFunction, name: &'static str, threads: u32, smem: usize) -> Result<usize> {
    type Cache = Mutex<HashMap<(DeviceId, &'static str), usize>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = (dev.id(), name);
    if let Some(&n) = CACHE.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(n);
    }
    let n = func
        .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name}: occupancy: {e:?}")))?;
    let n = (n as usize).max(1);
    CACHE.get_or_init(Default::default).lock().unwrap().insert(key, n);
    Ok(n)
}

type FuncCache = Mutex<HashMap<(DeviceId, &'static str), CudaFunction>>;
type ModuleCache = Mutex<HashMap<(DeviceId, usize), Arc<CudaModule>>>;

/// The forward kernel `name` on `dev`.
fn kernel(dev: &CudaDevice, name: &'static str, smem: usize) -> Result<CudaFunction> {
    load_kernel(dev, CUBIN, "", name, smem)
}

/// The kernel `name` of the embedded `cubin` on `dev`, loading the cubin into the device's
/// context on first use; `what` names the cubin in the error (" backward" or ""). Kernels that
/// use more than 48 KiB of dynamic shared memory get the attribute that allows it. Kernel names
/// are unique across the cubins, so one cache of functions serves both.
fn load_kernel(
    dev: &CudaDevice,
    cubin: &'static [u8],
    what: &str,
    name: &'static str,
    smem: usize,
) -> Result<CudaFunction> {
    static MODULES: OnceLock<ModuleCache> = OnceLock::new();
    static FUNCS: OnceLock<FuncCache> = OnceLock::new();
    let funcs = FUNCS.get_or_init(Default::default);
    if let Some(f) = funcs.lock().unwrap().get(&(dev.id(), name)) {
        return Ok(f.clone());
    }
    let module = {
        let mut modules = MODULES.get_or_init(Default::default).lock().unwrap();
        let key = (dev.id(), cubin.as_ptr() as usize);
        match modules.get(&key) {
            Some(m) => m.clone(),
            None => {
                let ctx = dev.cuda_stream().context().clone();
                let m = ctx.load_module(Ptx::from_binary(cubin.to_vec())).map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "flash-attn3: could not load the sm_90a{what} kernels ({e:?}); the GPU kernels need a Hopper GPU (H100/H200)"
                    ))
                })?;
                modules.insert(key, m.clone());
                m
            }
        }
    };
    let func = module
        .load_function(name)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name}: {e:?}")))?;
    if smem > 48 * 1024 {
        func.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name}: {smem} bytes of shared memory: {e:?}")))?;
    }
    funcs.lock().unwrap().insert((dev.id(), name), func.clone());
    Ok(func)
}

/// Both head dims must be multiples of 8: TMA moves rows in 16-byte units. `what` names the
/// kernel in the error ("kernel" for the forward, "backward").
fn check_tma_head_dims(what: &str, head_dim: usize, head_dim_v: usize) -> Result<()> {
    for (name, d) in [("q/k", head_dim), ("v", head_dim_v)] {
        if d % 8 != 0 {
            bail!(
                "flash-attn3: the GPU {what} needs head dims that are multiples of 8 (TMA rows of 16 bytes), got {name} head dim {d}"
            )
        }
    }
    Ok(())
}

/// The device address of an optional scratch buffer (0 when absent) and its write guard.
fn optional_ptr_mut<'a, T>(
    buf: &'a mut Option<CudaSlice<T>>,
    stream: &'a Arc<CudaStream>,
) -> (u64, Option<impl Drop + 'a>) {
    match buf.as_mut() {
        Some(b) => {
            let (ptr, sync) = b.device_ptr_mut(stream);
            (ptr, Some(sync))
        }
        None => (0, None),
    }
}

/// Queues `func` on `stream` with its one POD parameter struct `params`; `name` goes into the
/// error.
///
/// # Safety
/// `params` must describe device buffers that stay alive (their guards held, or freed in stream
/// order) until after the launch is queued, and `cfg` must match what the kernel expects.
unsafe fn launch_with_params<P: DeviceRepr>(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    params: &P,
) -> Result<()> {
    let mut launch = stream.launch_builder(func);
    launch.arg(params);
    launch
        .launch(cfg)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name} launch: {e:?}")))?;
    Ok(())
}

/// The driver's launch description of `cfg` on `stream` with `attrs` (cudarc's launch builder has
/// no launch attributes, hence the driver structs).
fn launch_config(stream: &CudaStream, cfg: &LaunchConfig, attrs: &mut [sys::CUlaunchAttribute]) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    }
}

/// The launch attribute of a grid of thread-block clusters of `cluster_x` CTAs along x.
fn cluster_attribute(cluster_x: u32) -> sys::CUlaunchAttribute {
    // SAFETY: a plain C struct and union, all-zero valid; the fields set below are the ones
    // the id selects.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = cluster_x;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

/// The launch attribute of a programmatic dependent launch (sm_90): the kernel's CTAs may start
/// while the kernel queued before it still runs, once that kernel's blocks have all started and
/// executed `griddepcontrol.launch_dependents` (or finished); the kernel waits for the earlier
/// kernels' completion with `griddepcontrol.wait` before it reads what they write.
fn overlap_attribute() -> sys::CUlaunchAttribute {
    // SAFETY: as in cluster_attribute.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    attr
}

/// How many clusters of `cluster_x` CTAs (`threads` threads and `smem` bytes of dynamic shared
/// memory each) of the kernel `name` run at once on `dev` (cuOccupancyMaxActiveClusters: the
/// CTAs of a cluster must fit one GPC together, so this is less than the SMs over `cluster_x`
/// where a GPC's SM count is no multiple of it). Cached per device, kernel and cluster size.
fn max_active_clusters(
    dev: &CudaDevice,
    func: &CudaFunction,
    name: &'static str,
    cluster_x: u32,
    threads: u32,
    smem: u32,
) -> Result<usize> {
    type Cache = Mutex<HashMap<(DeviceId, &'static str, u32), usize>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = (dev.id(), name, cluster_x);
    if let Some(&n) = CACHE.get_or_init(Default::default).lock().unwrap().get(&key) {
        return Ok(n);
    }
    bind_context(dev)?;
    let cfg = LaunchConfig {
        grid_dim: (cluster_x, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: an attribute and a config that describe a launch of `func`; the call only reads them.
    let n = unsafe {
        let mut attrs = [cluster_attribute(cluster_x)];
        let config = launch_config(&dev.cuda_stream(), &cfg, &mut attrs);
        let mut n: std::ffi::c_int = 0;
        match sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) {
            sys::CUresult::CUDA_SUCCESS => n.max(0) as usize,
            e => bail!("flash-attn3: {name}: cuOccupancyMaxActiveClusters({cluster_x}): {e:?}"),
        }
    };
    CACHE.get_or_init(Default::default).lock().unwrap().insert(key, n);
    Ok(n)
}

/// [`launch_with_params`] with the driver's launch attributes: a grid of thread-block clusters of
/// `cluster_x` CTAs along x (sm_90; `cfg.grid_dim.0` a multiple of it), and / or, with
/// `overlaps_previous`, a programmatic dependent launch ([`overlap_attribute`]).
///
/// # Safety
/// As for [`launch_with_params`]; with `overlaps_previous`, the kernel must execute
/// `griddepcontrol.wait` before it touches memory that the kernel before it on the stream reads
/// or writes.
unsafe fn launch_with_attributes<P: DeviceRepr>(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    cluster_x: Option<u32>,
    overlaps_previous: bool,
    params: &P,
) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {name}: binding the CUDA context: {e:?}")))?;
    let mut attrs: Vec<sys::CUlaunchAttribute> = cluster_x
        .map(cluster_attribute)
        .into_iter()
        .chain(overlaps_previous.then(overlap_attribute))
        .collect();
    let config = launch_config(stream, &cfg, &mut attrs);
    let mut args = [params as *const P as *mut std::ffi::c_void];
    match sys::cuLaunchKernelEx(&config, func.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(candle_core::Error::Msg(format!("flash-attn3: {name} launch: {e:?}"))),
    }
}

/// A 4-D TMA map (head_dim, rows, heads, batch) over 16-bit elements at `addr` with element
/// strides `strides` = (row, head, batch), moving boxes of 64 columns x `box_rows` rows in the
/// 128-byte swizzle the wgmma descriptors expect.
#[allow(clippy::too_many_arguments)]
fn tensor_map(
    name: &str,
    dtype: DType,
    addr: u64,
    head_dim: usize,
    sizes: [usize; 3],
    strides: [usize; 3],
    box_rows: usize,
) -> Result<TmaDesc> {
    tensor_map_nd(
        name,
        dtype,
        addr,
        head_dim,
        &sizes,
        &strides,
        &[box_rows as u32, 1, 1],
        64,
    )
}

/// A TMA map of rank 1 + `sizes.len()` (at most 5): head_dim innermost in boxes of `col_elems`
/// columns (128-byte rows: 128B swizzle; 64-byte rows: 64B swizzle, the 16-bit head dim 96 and
/// the fp8 head dim 64 kernels), then the outer dimensions `sizes` with element strides
/// `strides` and box extents `box_outer`. Elements are 16-bit, or bytes for `DType::F8E4M3`.
#[allow(clippy::too_many_arguments)]
fn tensor_map_nd(
    name: &str,
    dtype: DType,
    addr: u64,
    head_dim: usize,
    sizes: &[usize],
    strides: &[usize],
    box_outer: &[u32],
    col_elems: u32,
) -> Result<TmaDesc> {
    let rank = 1 + sizes.len();
    assert!(rank <= 5 && strides.len() == sizes.len() && box_outer.len() == sizes.len());
    if addr % 16 != 0 {
        bail!("flash-attn3: {name} must start at a 16-byte aligned address for TMA (its start offset is not a multiple of 16 bytes)")
    }
    let (dt, elem) = match dtype {
        DType::BF16 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
        DType::F8E4M3 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
        _ => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    };
    let total_bytes = (sizes.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>() + head_dim) * elem;
    let mut gstrides = [0u64; 4];
    for i in 0..sizes.len() {
        let bytes = strides[i] * elem;
        gstrides[i] = if sizes[i] == 1 {
            // The stride of a size-1 dimension never moves the address: any valid value will do.
            (total_bytes as u64).div_ceil(16) * 16
        } else {
            if bytes % 16 != 0 || bytes == 0 {
                bail!(
                    "flash-attn3: {name}'s token/head/batch strides must be non-zero multiples of 16 bytes for TMA, got element strides {strides:?}; call .contiguous() first"
                )
            }
            bytes as u64
        };
    }
    let mut gdim = [1u64; 5];
    let mut boxdim = [1u32; 5];
    gdim[0] = head_dim as u64;
    boxdim[0] = col_elems;
    for i in 0..sizes.len() {
        gdim[i + 1] = sizes[i] as u64;
        boxdim[i + 1] = box_outer[i];
    }
    let estrides = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer argument points at a live array of at least `rank` (or rank - 1) entries.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            rank as u32,
            addr as *mut std::ffi::c_void,
            gdim.as_ptr(),
            gstrides.as_ptr(),
            boxdim.as_ptr(),
            estrides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            match col_elems as usize * elem {
                128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                _ => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            },
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if res != sys::CUresult::CUDA_SUCCESS {
        bail!(
            "flash-attn3: cuTensorMapEncodeTiled failed for {name} ({res:?}): sizes {:?}, byte strides {:?}",
            &gdim[..rank],
            &gstrides[..rank - 1]
        )
    }
    // SAFETY: initialised by the successful call; CUtensorMap is 128 opaque bytes.
    let map = unsafe { map.assume_init() };
    let mut desc = TmaDesc([0; 16]);
    // SAFETY: both are 128 bytes of plain data.
    unsafe {
        std::ptr::copy_nonoverlapping(&map as *const _ as *const u8, desc.0.as_mut_ptr() as *mut u8, 128);
    }
    Ok(desc)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// (rows, heads, batch) sizes and element strides of an input, fixed (b, s, h, d) or varlen (t, h, d).
fn geometry(layout: &Layout) -> ([usize; 3], [usize; 3]) {
    let (d, s) = (layout.dims(), layout.stride());
    if d.len() == 4 {
        ([d[1], d[2], d[0]], [s[1], s[2], s[0]])
    } else {
        ([d[0], d[1], 1], [s[0], s[1], 0])
    }
}

/// The device address of an input (any of the kernels' dtypes) at its layout's start, with the
/// guard that orders the launch after the storage's pending work.
fn input_ptr<'a>(s: &'a CudaStorage, layout: &Layout, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
    fn at<'a, T>(s: &'a CudaSlice<T>, layout: &Layout, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let (ptr, sync) = s.device_ptr(stream);
        (ptr + (layout.start_offset() * std::mem::size_of::<T>()) as u64, sync)
    }
    Ok(match s.dtype() {
        DType::BF16 => at(s.as_cuda_slice::<bf16>()?, layout, stream),
        DType::F16 => at(s.as_cuda_slice::<f16>()?, layout, stream),
        DType::F32 => at(s.as_cuda_slice::<f32>()?, layout, stream),
        DType::U32 => at(s.as_cuda_slice::<u32>()?, layout, stream),
        DType::F8E4M3 => match &s.slice {
            candle_core::cuda_backend::CudaStorageSlice::F8E4M3(x) => at(x, layout, stream),
            _ => bail!("flash-attn3: an F8E4M3 storage without its e4m3 slice"),
        },
        dt => bail!("flash-attn3: the GPU kernels take f32, bf16, f16, f8e4m3 and u32 (index) inputs, got {dt:?}"),
    })
}

/// The device address of a GPU tensor's data at its layout's start (small index and parameter
/// tensors the kernels read; the tensor keeps the memory alive).
pub(crate) fn device_address(t: &candle_core::Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else {
        bail!(
            "flash-attn3: expected a GPU tensor, got one on {:?}",
            t.device().location()
        )
    };
    let stream = cs.device.cuda_stream();
    let (addr, _sync) = input_ptr(cs, layout, &stream)?;
    Ok(addr)
}

/// The device address of a launch's u32 varlen offsets: the caller's tensor (`t`) when it is
/// contiguous on `dev`, else `host` uploaded into a buffer pushed onto `uploads`, which the caller
/// keeps until the launch is queued. None gives 0 (a fixed-length call).
fn offsets_addr(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    t: Option<(&candle_core::Storage, &Layout)>,
    host: &[usize],
    uploads: &mut Vec<CudaSlice<u32>>,
) -> Result<u64> {
    let Some((storage, layout)) = t else { return Ok(0) };
    if let (candle_core::Storage::Cuda(cs), true) = (storage, layout.is_contiguous()) {
        if cs.device.id() == dev.id() {
            return Ok(device_addr(cs.as_cuda_slice::<u32>()?, stream, layout));
        }
    }
    let host: Vec<u32> = host.iter().map(|&x| x as u32).collect();
    let up = stream
        .clone_htod(&host)
        .map_err(|e| candle_core::Error::Msg(format!("flash-attn3: {e:?}")))?;
    let (ptr, _) = up.device_ptr(stream);
    uploads.push(up);
    Ok(ptr)
}

fn device_addr<T>(s: &CudaSlice<T>, stream: &CudaStream, layout: &Layout) -> u64 {
    let (ptr, _sync) = s.device_ptr(stream);
    ptr + (layout.start_offset() * std::mem::size_of::<T>()) as u64
}
