//! [`Communicator`] over NCCL: one rank per GPU, collectives on candle's stream of the rank's
//! device, so they are ordered with the rank's kernels without any extra synchronisation.
//! Sums started with [`Communicator::start_all_reduce_sum`] run on a second stream through a
//! second handle of the group, so they overlap the rank's later kernels.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
use candle_core::cuda_backend::{cudarc, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor};

use super::Communicator;

fn nccl_err(what: &str, e: cudarc::nccl::result::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL {what} failed: {e:?}"))
}

/// The token that names one group: made once (by rank 0, or by the thread that spawns the
/// ranks) and handed to every rank before [`NcclCommunicator::new`].
#[derive(Debug, Clone, Copy)]
pub struct NcclId(Id);

impl NcclId {
    pub fn new() -> Result<Self> {
        Id::new().map(NcclId).map_err(|e| {
            nccl_err(
                "ncclGetUniqueId (is libnccl.so.2 on the library path? PyTorch's wheel nvidia-nccl has it)",
                e,
            )
        })
    }

    /// The id as 256 hex digits, to hand to rank processes (environment, command line, file).
    pub fn to_hex(&self) -> String {
        self.0.internal().iter().map(|&b| format!("{:02x}", b as u8)).collect()
    }

    /// The id written by [`NcclId::to_hex`].
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| hex.get(i..i + 2).and_then(|d| u8::from_str_radix(d, 16).ok()))
            .collect::<Option<_>>()
            .unwrap_or_default();
        let Ok(internal) = <[u8; 128]>::try_from(bytes) else {
            bail!("an NCCL id is 256 hex digits, got {hex:?}")
        };
        Ok(NcclId(Id::uninit(internal.map(|b| b as std::ffi::c_char))))
    }
}

/// One rank of an NCCL group, on candle's stream of its GPU.
pub struct NcclCommunicator {
    /// NCCL allows a communicator to be used from any thread but not from two at once: the
    /// mutex serialises the calls, which makes the handle `Send + Sync` (a model holding it can
    /// move between threads, as the server's models do).
    comm: Mutex<Comm>,
    device: CudaDevice,
    /// The started sums' handle of the group, made by the first
    /// [`Communicator::start_all_reduce_sum`].
    background: Mutex<Option<Background>>,
}

/// A second handle of the group on a stream of its own: collectives there run beside the
/// rank's kernels on candle's stream. A second handle rather than the first on a second stream,
/// so that the two streams' collectives never share one handle's ordering.
struct Background {
    comm: Comm,
    stream: Arc<CudaStream>,
    /// The started sums' inputs, kept until [`Communicator::finish_all_reduces`]: a tensor
    /// dropped earlier would return its memory to candle's stream while NCCL may still read it.
    inputs: Vec<Tensor>,
}

// SAFETY: the raw communicator inside `Comm` is only used under the mutex, one call at a time,
// which is what NCCL requires of multi-threaded use; the stream it holds is `Send + Sync`.
unsafe impl Send for NcclCommunicator {}
unsafe impl Sync for NcclCommunicator {}

impl NcclCommunicator {
    /// Joins the group `id` as `rank` of `world_size` on `device` (a CUDA device). Blocks until
    /// every rank has joined, so the ranks must call it concurrently.
    pub fn new(device: &Device, rank: usize, world_size: usize, id: NcclId) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            bail!("NcclCommunicator::new: {device:?} is not a CUDA device")
        };
        if rank >= world_size {
            bail!("NcclCommunicator::new: rank {rank} of a group of {world_size}")
        }
        let comm =
            Comm::from_rank(dev.cuda_stream(), rank, world_size, id.0).map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Self {
            comm: Mutex::new(comm),
            device: dev.clone(),
            background: Mutex::new(None),
        })
    }

    /// The background handle, made at the first call: rank 0 draws a new group id and sends it
    /// to the others through the first handle (a collective: every rank gets here at the same
    /// point of its sequence of collectives), then every rank joins it on a new stream.
    fn background(&self) -> Result<MutexGuard<'_, Option<Background>>> {
        let mut background = self.background.lock().unwrap();
        if background.is_some() {
            return Ok(background);
        }
        let comm = self.comm.lock().unwrap();
        let (rank, world) = (comm.rank(), comm.world_size());
        let main = self.device.cuda_stream();
        let id_bytes: Vec<u8> = match rank {
            0 => NcclId::new()?.0.internal().iter().map(|&b| b as u8).collect(),
            _ => vec![0; 128],
        };
        let mut on_device = main.clone_htod(&id_bytes).map_err(candle_core::Error::wrap)?;
        comm.broadcast_in_place(&mut on_device, 0)
            .map_err(|e| nccl_err("ncclBroadcast of the background group's id", e))?;
        let id_bytes = main.clone_dtoh(&on_device).map_err(candle_core::Error::wrap)?;
        let internal: [u8; 128] = id_bytes.try_into().expect("128 bytes were broadcast");
        let id = Id::uninit(internal.map(|b| b as std::ffi::c_char));
        let stream = main.context().new_stream().map_err(candle_core::Error::wrap)?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| nccl_err("ncclCommInitRank (background handle)", e))?;
        *background = Some(Background {
            comm,
            stream,
            inputs: Vec::new(),
        });
        Ok(background)
    }
}

/// Queues one NCCL group of sums of `inputs` (contiguous, of type `T`) into new buffers on the
/// background stream; NCCL fuses a group's collectives into one launch.
fn start_sums<T>(background: &Background, device: &CudaDevice, inputs: &[Tensor]) -> Result<Vec<Tensor>>
where
    T: candle_core::cuda_backend::CudaDType + cudarc::nccl::safe::NcclType + cudarc::driver::DeviceRepr,
{
    let storages: Vec<_> = inputs.iter().map(|t| t.storage_and_layout()).collect();
    // SAFETY: every element is written by its sum before anything reads it (readers wait for
    // the background stream, through `finish_all_reduces` or the buffers' write events).
    let mut outputs: Vec<CudaSlice<T>> = inputs
        .iter()
        .map(|t| unsafe { device.alloc::<T>(t.elem_count()) })
        .collect::<Result<_>>()?;
    // The sums start after everything queued so far on candle's stream: the inputs' last
    // writes, and the outputs' allocation from candle's stream-ordered pool.
    background
        .stream
        .join(&device.cuda_stream())
        .map_err(candle_core::Error::wrap)?;
    {
        let mut group = background.comm.group();
        for ((storage, layout), out) in storages.iter().zip(outputs.iter_mut()) {
            let Storage::Cuda(storage) = &**storage else {
                bail!("NCCL all-reduce of a tensor that is not on the rank's GPU")
            };
            let start = layout.start_offset();
            let src = storage.as_cuda_slice::<T>()?.slice(start..start + out.len());
            group
                .all_reduce(src, out.slice_mut(..), &ReduceOp::Sum)
                .map_err(|e| nccl_err("ncclAllReduce", e))?;
        }
        // Dropping the group ends it (ncclGroupEnd), which launches the sums.
    }
    Ok(outputs
        .into_iter()
        .zip(inputs)
        .map(|(out, t)| {
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, device.clone()));
            Tensor::from_storage(storage, t.shape().clone(), BackpropOp::none(), false)
        })
        .collect())
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.comm.lock().unwrap().rank()
    }

    fn world_size(&self) -> usize {
        self.comm.lock().unwrap().world_size()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Collective::AllReduceSum)
    }

    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Collective::RingShift)
    }

    fn start_all_reduce_sum(&self, tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        if self.world_size() == 1 || tensors.is_empty() {
            return Ok(tensors.to_vec());
        }
        let dtype = super::one_dtype("start_all_reduce_sum", tensors)?;
        let inputs: Vec<Tensor> = tensors.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
        let mut guard = self.background()?;
        let background = guard.as_mut().expect("made by background()");
        let sums = match dtype {
            DType::F32 => start_sums::<f32>(background, &self.device, &inputs)?,
            DType::BF16 => start_sums::<half::bf16>(background, &self.device, &inputs)?,
            DType::F16 => start_sums::<half::f16>(background, &self.device, &inputs)?,
            d => bail!("NCCL all-reduce: unsupported dtype {d:?} (f32, bf16 or f16)"),
        };
        background.inputs.extend(inputs);
        Ok(sums)
    }

    fn finish_all_reduces(&self) -> Result<()> {
        let mut guard = self.background.lock().unwrap();
        if let Some(background) = guard.as_mut() {
            self.device
                .cuda_stream()
                .join(&background.stream)
                .map_err(candle_core::Error::wrap)?;
            // Freed on candle's stream, which now waits for the sums that read them.
            background.inputs.clear();
        }
        Ok(())
    }
}

impl NcclCommunicator {
    fn run(&self, t: &Tensor, kind: Collective) -> Result<Tensor> {
        let comm = self.comm.lock().unwrap();
        if comm.world_size() == 1 {
            return Ok(t.clone());
        }
        t.contiguous()?.apply_op1_no_bwd(&CollectiveOp { comm: &comm, kind })
    }
}

/// What a [`CollectiveOp`] does.
#[derive(Debug, Clone, Copy)]
enum Collective {
    /// ncclAllReduce(sum).
    AllReduceSum,
    /// ncclSend to the next rank and ncclRecv from the previous one, in one NCCL group (so that
    /// neither blocks the other).
    RingShift,
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduceSum => "NCCL all-reduce",
            Collective::RingShift => "NCCL ring shift",
        }
    }
}

/// A collective of a contiguous tensor into a new one, as a candle op so that the result is an
/// ordinary tensor on the same device.
struct CollectiveOp<'a> {
    comm: &'a Comm,
    kind: Collective,
}

impl CollectiveOp<'_> {
    fn run<T>(&self, storage: &CudaStorage, layout: &Layout) -> Result<CudaStorage>
    where
        T: candle_core::cuda_backend::CudaDType + cudarc::nccl::safe::NcclType + cudarc::driver::DeviceRepr,
    {
        let dev: CudaDevice = storage.device().clone();
        let n = layout.shape().elem_count();
        let start = layout.start_offset();
        let src = storage.as_cuda_slice::<T>()?.slice(start..start + n);
        // SAFETY: every element is written by the collective before anything reads it.
        let mut dst = unsafe { dev.alloc::<T>(n) }?;
        match self.kind {
            Collective::AllReduceSum => {
                self.comm
                    .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                    .map_err(|e| nccl_err("ncclAllReduce", e))?;
            }
            Collective::RingShift => {
                let (rank, world) = (self.comm.rank(), self.comm.world_size());
                let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
                let sent = self.comm.send(&src, next as i32).map_err(|e| nccl_err("ncclSend", e));
                let received = self
                    .comm
                    .recv(&mut dst, prev as i32)
                    .map_err(|e| nccl_err("ncclRecv", e));
                group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
                sent?;
                received?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for CollectiveOp<'_> {
    fn name(&self) -> &'static str {
        match self.kind {
            Collective::AllReduceSum => "nccl-all-reduce-sum",
            Collective::RingShift => "nccl-ring-shift",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!(
            "{} of a CPU tensor: move it to the rank's GPU (or use LocalGroup on the CPU)",
            self.kind.name()
        )
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.kind.name();
        if !layout.is_contiguous() {
            bail!("{what}: the tensor must be contiguous")
        }
        let out = match storage.dtype() {
            DType::F32 => self.run::<f32>(storage, layout)?,
            DType::BF16 => self.run::<half::bf16>(storage, layout)?,
            DType::F16 => self.run::<half::f16>(storage, layout)?,
            d => bail!("{what}: unsupported dtype {d:?} (f32, bf16 or f16)"),
        };
        Ok((out, layout.shape().clone()))
    }
}
